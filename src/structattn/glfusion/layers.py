"""How GL-Fusion runs inside the base model's decoder: each decoder layer becomes a
:class:`GraphAwareLayer` that runs base layer -> message passing -> cross-attention when the
pass's :class:`GraphPass` travels with the call, and the base layer alone otherwise."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .graph import GraphBatch

__all__ = ["GLFusionOutput", "GraphAwareLayer", "GraphPass", "inner_model", "make_graph_aware"]


@dataclass
class GLFusionOutput:
    logits: Tensor  # (B, S, vocab) LM logits
    node_logits: Tensor | None = None  # (M, num_node_classes) GNN head, when a graph is given
    loss: Tensor | None = None  # CE(GNN) + w * CE(LM) over whichever labels were given
    lm_loss: Tensor | None = None
    gnn_loss: Tensor | None = None


@dataclass
class GraphPass:
    """One pass's graph, as the decoder layers need it: it travels with every layer call (the
    ``glf_pass`` keyword), so a layer that gradient checkpointing replays with its keywords sees
    the same graph. A prompt pass updates the node tokens at ``slots`` and collects the final
    norm's output (``final_hidden``, for the GNN head); a decoding step (``after_graph`` set)
    only cross-attends from the new text tokens."""

    model: nn.Module  # the GLFusionForCausalLM whose message passing and cross-attention run
    graph: GraphBatch
    slots: Tensor  # (M, 2) (row, column) of each node token; empty while decoding
    attention_mask: Tensor | None = None  # (B, S) of the prompt
    after_graph: Tensor | None = None  # (B,) bool, decoding: the row's new tokens follow a graph
    final_hidden: Tensor | None = None  # (B, S, D) the final norm's output, set during the pass
    #: what each cross-attention layer reads, kept for decoding (the graph does not change
    #: while text is generated): the paper's form projects the node texts' keys and values at
    #: the first new token; the gated form keeps its node states' keys and values from the
    #: prompt pass
    memory: dict[str, tuple[Tensor, Tensor]] | None = None
    #: (B, S) bool, the gated form's prompt pass: the text positions after their graph
    reads: Tensor | None = None

    @property
    def decoding(self) -> bool:
        return self.after_graph is not None

    def keep_final(self, module: nn.Module, args, output: Tensor) -> None:
        """Forward hook of the base's final norm for the length of one pass."""
        self.final_hidden = output

    def message_passing(self, index: int, hidden: Tensor) -> Tensor:
        return self.model._message_passing(index, self, hidden)

    def cross_attention(self, index: int, hidden: Tensor) -> Tensor:
        return self.model._cross_attention(index, self, hidden)


class GraphAwareLayer:
    """A decoder layer of the base that runs GL-Fusion's paths after itself: base layer ->
    message passing -> cross-attention (each where configured for layer ``glf_index``). A base
    layer's class is swapped for ``GraphAware<its class>`` (:func:`make_graph_aware`), so its
    parameters keep their names (LoRA adapters and saved runs are unaffected)."""

    glf_index: int

    def forward(self, *args, glf_pass: GraphPass | None = None, **kwargs):
        output = super().forward(*args, **kwargs)
        if glf_pass is None:
            return output
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = glf_pass.message_passing(self.glf_index, hidden)
        hidden = glf_pass.cross_attention(self.glf_index, hidden)
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden


_GRAPH_AWARE: dict[type, type] = {}


def make_graph_aware(layer: nn.Module, index: int) -> None:
    cls = type(layer)
    if not issubclass(cls, GraphAwareLayer):
        if cls not in _GRAPH_AWARE:
            _GRAPH_AWARE[cls] = type(f"GraphAware{cls.__name__}", (GraphAwareLayer, cls), {})
        layer.__class__ = _GRAPH_AWARE[cls]
    layer.glf_index = index


def mean_ce(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy over labels != -100; an exact, differentiable 0 when every label is
    ignored (instead of the 0/0 NaN of ``F.cross_entropy``)."""
    if not bool((labels != -100).any()):
        return logits.float().sum() * 0.0
    return F.cross_entropy(logits.float(), labels, ignore_index=-100)


def token_ids(ids: int | list[int] | None, device) -> Tensor | None:
    """One token id or a list of them as a long tensor (None stays None)."""
    if ids is None:
        return None
    return torch.tensor([ids] if isinstance(ids, int) else list(ids), dtype=torch.long,
                        device=device)  # fmt: skip


def inner_model(base: nn.Module) -> nn.Module:
    """The ``LlamaForCausalLM`` under any peft wrapper."""
    return base.get_base_model() if hasattr(base, "get_base_model") else base
