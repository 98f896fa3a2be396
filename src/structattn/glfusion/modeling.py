"""GL-Fusion (arXiv 2412.06849): a Llama-architecture causal LM made graph-aware from inside.

The prompt holds node tokens, one per node of the graph. Inside the decoder, after configured
layers, message passing (:class:`NodeMessagePassing`) updates the node tokens' states and
cross-attention carries graph information to the text; a GNN head over the final node-token
states and the LM head form the twin predictor, trained with ``CE(GNN) + CE(LM)``. Two forms
(:data:`~.configuration.VARIANTS`):

* ``gated`` (default): the prompt holds every node's text as plain text instead of node
  tokens (``GraphBatch.text_spans``); the last token of a node's text is its slot. The mask and
  positions are the base LLM's own. Graph information enters through residual writes whose
  output projections start at 0: the node-text encoding added to the slot's input, message
  passing on the slot states (later text reads them through ordinary self-attention), and
  cross-attention from the text after the graph to them (:class:`NodeStateCrossAttention`).
  As initialised, the logits are exactly the base LLM's on the same prompt.
* ``paper``: ``<graph_start> <node> ... <graph_end>``; each ``<node>`` token's input embedding
  is its node text's pooled encoding through a learned projection, node tokens share one
  position, the structure-aware mask lets node tokens see the text before the graph and each
  other, text after the graph attends to them, and cross-attention
  (:class:`GraphTextCrossAttention`) reads the node texts' token encodings.

The base model's weights are untouched: the GL-Fusion modules live beside it (``glf_*`` names,
outside the base, so LoRA's module matching never reaches them). Each decoder layer becomes a
:class:`GraphAwareLayer` (its class is swapped for a subclass; parameter names are unchanged)
whose forward runs base layer -> message passing -> cross-attention when the pass's
:class:`GraphPass` comes with it, and the base layer alone otherwise. With no graph, outputs
are exactly the base model's.

One method per purpose: :meth:`~GLFusionForCausalLM.forward` is the training pass (losses, the
transformers contract), :meth:`~GLFusionForCausalLM.node_logits` the GNN head,
:meth:`~GLFusionForCausalLM.score_labels` the LM head over label names,
:meth:`~GLFusionForCausalLM.predict` both heads and their ensemble, and
:meth:`~GLFusionForCausalLM.generate` continues a prompt on a key/value cache.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from .configuration import GRAPH_TOKENS, GLFusionConfig
from .cross_attention import GraphTextCrossAttention, NodeStateCrossAttention
from .graph import GraphBatch
from .loading import quiet_library_warnings
from .masking import build_structure_mask, node_position_ids, to_additive_mask
from .message_passing import NodeMessagePassing

__all__ = [
    "GLFusionForCausalLM",
    "GLFusionOutput",
    "GraphAwareLayer",
    "GraphPass",
    "add_graph_tokens",
    "apply_lora",
]


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

    model: GLFusionForCausalLM  # whose message passing and cross-attention the layers run
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
    layer's class is swapped for ``GraphAware<its class>`` (:func:`_make_graph_aware`), so its
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


def _make_graph_aware(layer: nn.Module, index: int) -> None:
    cls = type(layer)
    if not issubclass(cls, GraphAwareLayer):
        if cls not in _GRAPH_AWARE:
            _GRAPH_AWARE[cls] = type(f"GraphAware{cls.__name__}", (GraphAwareLayer, cls), {})
        layer.__class__ = _GRAPH_AWARE[cls]
    layer.glf_index = index


def _mean_ce(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy over labels != -100; an exact, differentiable 0 when every label is
    ignored (instead of the 0/0 NaN of ``F.cross_entropy``)."""
    if not bool((labels != -100).any()):
        return logits.float().sum() * 0.0
    return F.cross_entropy(logits.float(), labels, ignore_index=-100)


def _token_ids(ids: int | list[int] | None, device) -> Tensor | None:
    """One token id or a list of them as a long tensor (None stays None)."""
    if ids is None:
        return None
    return torch.tensor([ids] if isinstance(ids, int) else list(ids), dtype=torch.long,
                        device=device)  # fmt: skip


def _inner(base: nn.Module) -> nn.Module:
    """The ``LlamaForCausalLM`` under any peft wrapper."""
    return base.get_base_model() if hasattr(base, "get_base_model") else base


def _fit_vocabulary(lm: nn.Module, config: GLFusionConfig) -> None:
    """Resize ``lm``'s embeddings so the graph-token ids exist."""
    needed = max(config.graph_start_id, config.node_id, config.graph_end_id) + 1
    if lm.get_input_embeddings().weight.shape[0] < needed:
        lm.resize_token_embeddings(needed, mean_resizing=False)


def add_graph_tokens(tokenizer) -> dict[str, int]:
    """Add ``<graph_start>``, ``<node>``, ``<graph_end>`` to a Hugging Face tokenizer."""
    tokenizer.add_special_tokens({"additional_special_tokens": list(GRAPH_TOKENS)})
    ids = tokenizer.convert_tokens_to_ids(list(GRAPH_TOKENS))
    return dict(zip(("graph_start_id", "node_id", "graph_end_id"), ids))


class GLFusionForCausalLM(nn.Module):
    """GL-Fusion around a base causal LM. Build with :meth:`from_base`."""

    def __init__(self, base: nn.Module, config: GLFusionConfig):
        super().__init__()
        inner = _inner(base)
        self.base = base
        self.config = config.resolve(inner.config.num_hidden_layers)
        D = inner.config.hidden_size
        gated = self.config.variant == "gated"
        self.glf_node_proj = nn.Linear(config.text_dim, D)
        emb = inner.get_input_embeddings().weight.detach()
        self.glf_graph_tokens = nn.Parameter(emb.mean(0).repeat(2, 1).clone())  # start, end
        if gated:  # added to the input of each node's slot, from 0
            nn.init.zeros_(self.glf_node_proj.weight)
            nn.init.zeros_(self.glf_node_proj.bias)
        self.glf_message_passing = nn.ModuleDict(
            {
                str(i): NodeMessagePassing(
                    D, config.edge_dim, config.message_passing_norm, zero_update=gated
                )
                for i in self.config.message_passing_layers
            }
        )
        self.glf_cross_attention = nn.ModuleDict(
            {
                str(i): NodeStateCrossAttention(D, config.cross_attention_heads)
                if gated
                else GraphTextCrossAttention(D, config.text_dim, config.cross_attention_heads)
                for i in self.config.cross_attention_layers
            }
        )
        self.glf_gnn_head = nn.Linear(D, config.num_node_classes)
        if config.target_marker:  # zero at init: the prompt means what it meant without it
            self.glf_target_marker = nn.Parameter(torch.zeros(D))
        for i, layer in enumerate(inner.model.layers):
            _make_graph_aware(layer, i)
        self.to(emb.device, emb.dtype)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_base(
        cls, base_lm: nn.Module, config: GLFusionConfig | None = None, tokenizer=None
    ) -> GLFusionForCausalLM:
        """Wrap ``base_lm`` (a ``LlamaForCausalLM``, possibly peft-wrapped). Unset graph-token ids
        are created: through ``tokenizer`` when given, else as three new ids past the vocabulary;
        the base's embeddings are resized to hold them."""
        config = config or GLFusionConfig()
        inner = _inner(base_lm)
        if min(config.graph_start_id, config.node_id, config.graph_end_id) < 0:
            if tokenizer is not None:
                ids = add_graph_tokens(tokenizer)
            else:
                v = inner.get_input_embeddings().weight.shape[0]
                ids = {"graph_start_id": v, "node_id": v + 1, "graph_end_id": v + 2}
            for key, value in ids.items():
                setattr(config, key, value)
        _fit_vocabulary(inner, config)
        return cls(base_lm, config)

    # ------------------------------------------------------------------ inside the layers

    @property
    def gated(self) -> bool:
        return self.config.variant == "gated"

    def _message_passing(self, index: int, p: GraphPass, hidden: Tensor) -> Tensor:
        """Message passing over the node tokens' states after decoder layer ``index`` (where
        set; decoding has no node token)."""
        key = str(index)
        if key not in self.glf_message_passing or p.decoding:
            return hidden
        rows, cols = p.slots[:, 0], p.slots[:, 1]
        nodes = self.glf_message_passing[key](hidden[rows, cols], p.graph.edge_index,
                                              p.graph.edge_attr)  # fmt: skip
        return hidden.index_put((rows, cols), nodes)

    def _cross_attention(self, index: int, p: GraphPass, hidden: Tensor) -> Tensor:
        """Cross-attention after decoder layer ``index`` (where set)."""
        key, graph = str(index), p.graph
        if key not in self.glf_cross_attention:
            return hidden
        layer = self.glf_cross_attention[key]
        if self.gated:
            if p.decoding:
                kv = p.memory[key]
                reads = p.after_graph.to(hidden.device)[:, None].expand(hidden.shape[:2])
            else:
                kv = layer.project_nodes(hidden[p.slots[:, 0], p.slots[:, 1]])
                if p.memory is not None:
                    p.memory[key] = kv
                reads = p.reads
            return layer(hidden, kv, graph.node_batch, reads)
        kv = None
        if p.memory is not None:
            if key not in p.memory:
                p.memory[key] = layer.project_text(graph.node_text, hidden.dtype)
            kv = p.memory[key]
        return layer(hidden, graph.node_text, graph.node_text_mask, graph.node_batch, p.slots,
                     p.attention_mask, after_graph=p.after_graph, text_kv=kv)  # fmt: skip

    def gradient_checkpointing_enable(self) -> None:
        """Recompute the base LM's layers in backward (non-reentrant checkpointing); a
        recomputed layer gets the same GraphPass as the first pass."""
        _inner(self.base).gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )

    # ------------------------------------------------------------------ forward

    def _embed(self, input_ids: Tensor, graph: GraphBatch, slots: Tensor) -> Tensor:
        """Input embeddings: the paper's form replaces each node token's with its node text's
        projected encoding; the gated form adds that (normalised, through a projection that
        starts at 0) to the embedding of each node's slot, its text's last token."""
        embeds = _inner(self.base).get_input_embeddings()(input_ids)  # (B, S, D)
        mask = graph.node_text_mask.unsqueeze(-1).to(graph.node_text.dtype)
        pooled = (graph.node_text * mask).sum(1) / mask.sum(1).clamp_min(1.0)  # (M, text_dim)
        if self.gated:
            pooled = F.layer_norm(pooled.float(), pooled.shape[-1:])
        node_emb = self.glf_node_proj(pooled.to(self.glf_node_proj.weight.dtype))
        if self.config.target_marker and graph.target_nodes is not None:
            # every layer can tell which node the prompt asks about (node tokens share one
            # position and attend to each other symmetrically otherwise)
            has = graph.target_nodes >= 0
            marker = torch.zeros_like(node_emb[:, :1]).expand_as(node_emb).clone()
            marker[graph.target_nodes[has]] = self.glf_target_marker.to(node_emb.dtype)
            node_emb = node_emb + marker
        index = (slots[:, 0], slots[:, 1])
        if self.gated:
            return embeds.index_put(index, node_emb.to(embeds.dtype), accumulate=True)
        embeds = embeds.index_put(index, node_emb.to(embeds.dtype))
        cfg = self.config
        for row, token_id in enumerate((cfg.graph_start_id, cfg.graph_end_id)):
            embeds = torch.where(
                (input_ids == token_id)[..., None],
                self.glf_graph_tokens[row].to(embeds.dtype),
                embeds,
            )
        return embeds

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        graph: GraphBatch | None = None,
        labels: Tensor | None = None,
        node_labels: Tensor | None = None,
        label_choices: list[list[int]] | None = None,
        classes: Tensor | None = None,
    ) -> GLFusionOutput:
        """The twin predictor's pass with its training loss (transformers' contract:
        ``model(**batch).loss``): ``CE(GNN) + lm_loss_weight * CE(LM)`` over the targets given.

        ``node_labels (M,)``: the GNN head's targets (-100 ignored). The LM head's target is
        either ``labels (B, S)``, next tokens (-100 ignored, shifted inside like HF), or
        ``classes (B,)`` with ``label_choices`` (token ids of every label name): the
        cross-entropy over the label names' scores (:meth:`score_labels`, with gradients);
        ``input_ids`` then end at the prompt and ``logits`` are only the rows that predict the
        label names' tokens, ``(B, n, vocab)``. Without a graph the output is the base model's."""
        if label_choices is not None:
            if classes is None or labels is not None:
                raise ValueError("label_choices needs classes (and no labels)")
            scores, out = self._score_pass(input_ids, attention_mask, graph, label_choices)
            lm_loss = F.cross_entropy(scores, classes.to(scores.device))
        else:
            out = self._pass(input_ids, attention_mask, graph)
            lm_loss = self.lm_loss(out.logits, labels) if labels is not None else None
        gnn_loss = None
        if node_labels is not None and out.node_logits is not None:
            gnn_loss = self._gnn_loss(out.node_logits, node_labels)
        parts = [gnn_loss, None if lm_loss is None else self.config.lm_loss_weight * lm_loss]
        parts = [x for x in parts if x is not None]
        loss = sum(parts) if parts else None
        return dataclasses.replace(out, loss=loss, lm_loss=lm_loss, gnn_loss=gnn_loss)

    def node_logits(
        self, input_ids: Tensor, attention_mask: Tensor | None, graph: GraphBatch
    ) -> Tensor:
        """The GNN head over every node token, ``(M, num_node_classes)``, from one pass that
        projects no vocabulary logits but the last position's."""
        return self._prompt_pass(input_ids, attention_mask, graph, logits_to_keep=1).node_logits

    def _pass(self, input_ids, attention_mask, graph, cache=None, memory=None) -> GLFusionOutput:
        """The base model itself without a graph; the graph-aware pass with one."""
        if graph is None:
            return self._base_pass(input_ids, attention_mask, cache)
        return self._prompt_pass(input_ids, attention_mask, graph, cache=cache, memory=memory)

    def _check_no_nodes(self, input_ids: Tensor) -> None:
        if bool((input_ids == self.config.node_id).any()):
            raise ValueError("input_ids hold <node> tokens but no graph was given")

    def _base_pass(self, input_ids, attention_mask, cache=None) -> GLFusionOutput:
        """No graph: exactly the base model's logits (``cache``, a transformers
        ``DynamicCache``, is filled with the keys and values)."""
        self._check_no_nodes(input_ids)
        positions = None  # left padding: positions count the real tokens, as decoding does
        if attention_mask is not None and not bool(attention_mask[:, 0].bool().all()):
            positions = node_position_ids(torch.zeros_like(input_ids, dtype=torch.bool),
                                          attention_mask)  # fmt: skip
        out = self.base(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            use_cache=cache is not None,
            **({"cache": cache} if cache is not None else {}),
        )
        return GLFusionOutput(logits=out.logits)

    def _prompt_pass(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None,
        graph: GraphBatch | None,
        *,
        blocks: Tensor | None = None,
        cache=None,
        logits_to_keep: Tensor | int | None = None,
        memory: dict | None = None,
    ) -> GLFusionOutput:
        """Prompts through the structure-aware mask and node positions; with a graph,
        node-token embeddings, message passing, cross-attention and the GNN head.

        ``blocks (B, S)`` long packs continuations of one prompt into one pass: 0 marks the
        prompt, ``k >= 1`` the k-th continuation (contiguous). A continuation's tokens see the
        prompt and the earlier tokens of their own continuation only, and their positions start
        after the prompt's, so each is exactly the prompt followed by it alone.
        ``logits_to_keep`` (transformers' option): the vocabulary logits of those positions
        only, ``(B, k, vocab)``. ``memory``: filled with what cross-attention reads, for
        decoding (:attr:`GraphPass.memory`)."""
        graph_pass = None
        node_mask = input_ids == self.config.node_id
        if graph is None:
            self._check_no_nodes(input_ids)
            embeds = _inner(self.base).get_input_embeddings()(input_ids)
            allowed = build_structure_mask(node_mask, attention_mask)
            positions = node_position_ids(node_mask, attention_mask)
        else:
            if (graph.text_spans is not None) != self.gated:
                raise ValueError(
                    "the gated form's graphs give each node's text_spans in the prompt; the "
                    "paper's form's give none (its prompts hold <node> tokens)"
                )
            slots = graph.validate(input_ids, self.config.node_id, attention_mask)
            if blocks is not None and bool((blocks[slots[:, 0], slots[:, 1]] != 0).any()):
                raise ValueError("every node's text must sit in the prompt (block 0)")
            embeds = self._embed(input_ids, graph, slots)
            graph_pass = GraphPass(self, graph, slots, attention_mask, memory=memory)
            allowed, positions = self._layout(input_ids, attention_mask, graph, slots, graph_pass)
        if blocks is not None:
            if bool((node_mask & (blocks != 0)).any()):
                raise ValueError("node tokens must sit in the prompt (block 0)")
            allowed = self._block_mask(allowed, blocks)
            positions = self._block_positions(positions, blocks)
        keep = {} if logits_to_keep is None else {"logits_to_keep": logits_to_keep}
        out = self._decoder(embeds, allowed, positions, graph_pass, cache, **keep)
        if graph_pass is None:
            return GLFusionOutput(logits=out.logits)
        final = graph_pass.final_hidden
        node_logits = self.glf_gnn_head(final[slots[:, 0], slots[:, 1]])  # (M, classes)
        return GLFusionOutput(logits=out.logits, node_logits=node_logits)

    def _layout(self, input_ids, attention_mask, graph, slots, graph_pass):
        """The mask ``(B, 1, S, S)`` and positions ``(B, S)`` of graph prompts: the paper's
        structure-aware ones, or for the gated form the base LLM's own (its prompts hold no
        node token), where the text after each graph (``graph_pass.reads``) reads it."""
        node_mask = input_ids == self.config.node_id
        allowed = build_structure_mask(node_mask, attention_mask)
        positions = node_position_ids(node_mask, attention_mask)
        if self.gated:
            cfg = self.config
            if bool(((input_ids == cfg.graph_start_id) | (input_ids == cfg.graph_end_id)).any()):
                raise ValueError(
                    "the gated form's prompts hold no <graph_start>/<graph_end> (those would "
                    "reach the text outside the gates)"
                )
            B, S = input_ids.shape
            last = torch.full((B,), S, dtype=torch.long, device=input_ids.device)
            last.scatter_reduce_(0, slots[:, 0], slots[:, 1], reduce="amax", include_self=False)
            reads = torch.arange(S, device=input_ids.device)[None] > last[:, None]
            if attention_mask is not None:
                reads = reads & attention_mask.bool()
            graph_pass.reads = reads
        return allowed, positions

    def _decoder(self, embeds, allowed, positions, graph_pass, cache, **keep):
        """The base LM on input embeddings under the boolean mask ``allowed (B, 1, S, K)``;
        ``graph_pass`` goes to every decoder layer, and a prompt pass collects the final norm's
        output into it."""
        kwargs = {} if cache is None else {"cache": cache}
        hook = None
        if graph_pass is not None:
            kwargs["glf_pass"] = graph_pass
            if not graph_pass.decoding:
                norm = _inner(self.base).model.norm
                hook = norm.register_forward_hook(graph_pass.keep_final)
        try:
            return self.base(
                inputs_embeds=embeds,
                attention_mask=to_additive_mask(allowed, embeds.dtype),
                position_ids=positions,
                use_cache=cache is not None,
                **kwargs,
                **keep,
            )
        finally:
            if hook is not None:
                hook.remove()

    @staticmethod
    def _gnn_loss(node_logits: Tensor, node_labels: Tensor) -> Tensor:
        M, C = node_logits.shape
        if tuple(node_labels.shape) != (M,):
            raise ValueError(
                f"node_labels must be (M,) = ({M},), one per node, got {tuple(node_labels.shape)}"
            )
        bad = (node_labels != -100) & ((node_labels < 0) | (node_labels >= C))
        if bool(bad.any()):
            raise ValueError(
                f"node_labels {sorted(set(node_labels[bad].tolist()))} outside 0..{C - 1} "
                "(use -100 to ignore a node)"
            )
        return _mean_ce(node_logits, node_labels)

    @staticmethod
    def lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
        """Next-token cross-entropy (labels shifted inside, -100 ignored; 0 when all are)."""
        if labels.shape != logits.shape[:2]:
            raise ValueError(
                f"labels must be (B, S) = {tuple(logits.shape[:2])}, got {tuple(labels.shape)}"
            )
        return _mean_ce(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())

    # ------------------------------------------------------------------ generation

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        graph: GraphBatch | None = None,
        *,
        max_new_tokens: int = 20,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int = 0,
        seed: int | None = None,
        return_logits: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Continue each prompt (a graph may sit in it) with a key/value cache.

        The prompt runs once (the prefill) as in :meth:`forward`; each new token reads the
        cache and, as text after the graph, cross-attends to its graph (what each layer reads
        is kept from the first step). Prompts may be padded on either side.

        Returns the new tokens ``(B, N)`` (``pad_token_id`` after a sequence's
        ``eos_token_id``, one id or a list: the tokenizer's end-of-text and end-of-turn), and
        with ``return_logits`` also the logits each was chosen from, ``(B, N, vocab)``.
        Greedy unless ``do_sample`` (with ``temperature`` and ``top_k``);
        ``<graph_start>``, ``<node>`` and ``<graph_end>`` are never chosen.
        """
        from transformers import DynamicCache

        B, dev = input_ids.shape[0], input_ids.device
        mask, next_pos = self._generation_start(input_ids, attention_mask, max_new_tokens)
        if do_sample and temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        generator = None if seed is None else torch.Generator(device=dev).manual_seed(seed)
        cache = DynamicCache(config=_inner(self.base).config)
        memory: dict = {}  # what each cross-attention layer reads, for every step
        step_logits, after_graph = self._prefill(input_ids, mask, graph, cache, memory)
        cfg = self.config
        special = torch.tensor([cfg.graph_start_id, cfg.node_id, cfg.graph_end_id], device=dev)
        stops = _token_ids(eos_token_id, dev)
        keys = mask.clone()
        tokens, chosen = [], []
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        for t in range(max_new_tokens):
            chosen.append(step_logits)
            # the graph's special tokens are never generated: a new <node> has no node
            allowed = step_logits.index_fill(-1, special, float("-inf"))
            tok = self._choose(allowed, do_sample, temperature, top_k, generator)
            tok = tok.masked_fill(done, pad_token_id)
            tokens.append(tok)
            if stops is not None:
                done = done | torch.isin(tok, stops)
            if t == max_new_tokens - 1 or bool(done.all()):
                break
            keys = torch.cat([keys, torch.ones_like(keys[:, :1])], dim=-1)
            step_logits = self._decode_step(
                tok[:, None], keys, next_pos + t, cache, graph, after_graph, memory
            )
        out = torch.stack(tokens, dim=1)
        return (out, torch.stack(chosen, dim=1)) if return_logits else out

    def _prefill(self, input_ids, mask, graph, cache, memory) -> tuple[Tensor, Tensor]:
        """The prompt's pass into ``cache`` (and, in the gated form, what cross-attention reads
        into ``memory``): the logits after each row's last real token ``(B, vocab)`` and which
        rows have a graph ``(B,)``."""
        B, S = input_ids.shape
        prefill_memory = memory if self.gated else None  # the paper's form projects it later
        logits = self._pass(input_ids, mask, graph, cache, prefill_memory).logits
        last = S - 1 - mask.bool().flip(-1).long().argmax(-1)  # (B,) last real column
        step_logits = logits[torch.arange(B, device=logits.device), last]
        if graph is None:
            return step_logits, torch.zeros(B, dtype=torch.bool, device=input_ids.device)
        has_graph = torch.bincount(graph.node_batch, minlength=B)[:B] > 0
        return step_logits, has_graph.to(input_ids.device)

    def _generation_start(self, input_ids, attention_mask, max_new_tokens: int):
        """The checked prompt mask ``(B, S)`` long and each row's next position ``(B,)``."""
        B, S = input_ids.shape
        if S == 0:
            raise ValueError("cannot generate from an empty prompt (no tokens)")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
        if tuple(mask.shape) != (B, S):
            raise ValueError(f"attention_mask must be (B, S) = {(B, S)}, got {tuple(mask.shape)}")
        if not bool(mask.bool().any(-1).all()):
            raise ValueError("cannot generate from an empty prompt (a row without real tokens)")
        limit = getattr(_inner(self.base).config, "max_position_embeddings", None)
        positions = node_position_ids(input_ids == self.config.node_id, mask)
        next_pos = positions.max(-1).values + 1  # (B,)
        if limit is not None and int(next_pos.max()) + max_new_tokens > limit:
            raise ValueError(
                f"prompt + max_new_tokens reach position {int(next_pos.max()) + max_new_tokens}, "
                f"past the base model's max_position_embeddings={limit}"
            )
        return mask, next_pos

    @staticmethod
    def _choose(logits, do_sample, temperature, top_k, generator) -> Tensor:
        if not do_sample:
            return logits.argmax(-1)
        scores = logits.float() / temperature
        if top_k and top_k < scores.shape[-1]:
            kth = scores.topk(top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        return torch.multinomial(scores.softmax(-1), 1, generator=generator)[:, 0]

    def _decode_step(self, tok, keys, pos, cache, graph, after_graph, memory=None) -> Tensor:
        """Logits ``(B, vocab)`` after the text tokens ``tok (B, 1)`` at positions ``pos (B,)``;
        ``keys (B, K)`` marks the real cached keys plus the new one."""
        inner = _inner(self.base)
        embeds = inner.get_input_embeddings()(tok)  # (B, 1, D)
        allowed = keys.bool()[:, None, None, :]  # (B, 1, 1, K): every real key so far
        graph_pass = None
        if graph is not None:
            empty = torch.zeros(0, 2, dtype=torch.long, device=tok.device)
            graph_pass = GraphPass(self, graph, empty, after_graph=after_graph, memory=memory)
        out = self._decoder(embeds, allowed, pos[:, None], graph_pass, cache)
        return out.logits[:, -1]

    # ------------------------------------------------------------------ twin predictor

    @staticmethod
    def _block_mask(allowed: Tensor, blocks: Tensor) -> Tensor:
        """``allowed (B, 1, S, S)`` restricted so that a continuation sees only the prompt and
        itself."""
        same = blocks[:, :, None] == blocks[:, None, :]  # (B, S query, S key)
        prompt_key = (blocks == 0)[:, None, :]
        return allowed & (same | prompt_key)[:, None]

    @staticmethod
    def _block_positions(positions: Tensor, blocks: Tensor) -> Tensor:
        """Positions with every continuation numbered on from the prompt's last position."""
        B, S = blocks.shape
        idx = torch.arange(S, device=blocks.device).expand(B, S)
        in_prompt = blocks == 0
        next_pos = positions.masked_fill(~in_prompt, -1).max(-1, keepdim=True).values + 1
        change = torch.ones_like(in_prompt)
        change[:, 1:] = blocks[:, 1:] != blocks[:, :-1]
        start = torch.where(change, idx, torch.zeros_like(idx)).cummax(-1).values
        return torch.where(in_prompt, positions, next_pos + idx - start)

    def _score_pass(self, input_ids, attention_mask, graph, label_ids):
        """One forward pass of each prompt followed by every label name (as continuations):
        ``(scores (B, K), output)``."""
        if not label_ids:
            raise ValueError("label_ids is empty")
        for k, tokens in enumerate(label_ids):
            if len(tokens) == 0:
                raise ValueError(f"label {k} has no tokens")
        B, S = input_ids.shape
        dev = input_ids.device
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
        real = mask.bool()
        if not bool(real.any(-1).all()):
            raise ValueError("every prompt needs at least one real token")
        flat = torch.tensor([t for tokens in label_ids for t in tokens], device=dev)
        block = torch.tensor(
            [k + 1 for k, tokens in enumerate(label_ids) for _ in tokens], device=dev
        )
        n = flat.numel()
        ids = torch.cat([input_ids, flat.expand(B, n)], 1)
        full_mask = torch.cat([mask, torch.ones(B, n, dtype=mask.dtype, device=dev)], 1)
        blocks = torch.cat([torch.zeros(B, S, dtype=torch.long, device=dev), block.expand(B, n)], 1)
        last = S - 1 - real.flip(-1).long().argmax(-1)  # (B,) the prompt's last real token
        # the token at column S + j is predicted by the column before it, or for a label's
        # first token by the prompt's last real token
        first = torch.ones(n, dtype=torch.bool, device=dev)
        first[1:] = block[1:] != block[:-1]
        cols = S + torch.arange(n, device=dev) - 1
        pred = torch.where(first[None, :], last[:, None], cols[None, :])  # (B, n)
        # vocabulary logits of the predicting positions only: (B, n, vocab), not (B, S + n, vocab)
        out = self._prompt_pass(ids, full_mask, graph, blocks=blocks, logits_to_keep=pred)
        dtype = torch.promote_types(out.logits.dtype, torch.float32)
        logp = out.logits.to(dtype).log_softmax(-1)  # (B, n, vocab)
        token_logp = logp.gather(2, flat.expand(B, n)[..., None])[..., 0]  # (B, n)
        scores = torch.zeros(B, len(label_ids), dtype=dtype, device=dev)
        scores.index_add_(1, block - 1, token_logp)
        return scores, out

    @torch.no_grad()
    def score_labels(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None,
        graph: GraphBatch | None,
        label_ids: list[list[int]],
    ) -> Tensor:
        """Log-probability of each label name (token ids) right after each prompt: ``(B, K)``.

        One forward pass: the label names follow the prompt as separate continuations (each sees
        the prompt and itself only: ``blocks`` of :meth:`_prompt_pass`), so a name of several tokens
        is scored exactly as the prompt followed by that name alone. Prompts may be padded on
        either side."""
        return self._score_pass(input_ids, attention_mask, graph, label_ids)[0]

    @torch.no_grad()
    def predict(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None,
        graph: GraphBatch,
        label_ids: list[list[int]],
        weight: float = 0.5,
    ) -> dict[str, Tensor]:
        """GNN, LM and combined class distributions for each sequence's target node:
        ``ensemble = weight * p_gnn + (1 - weight) * p_lm``; each ``(B, K)``."""
        if graph.target_nodes is None:
            raise ValueError("graph.target_nodes is required for predict")
        if bool((graph.target_nodes < 0).any()):
            rows = torch.nonzero(graph.target_nodes < 0).flatten().tolist()
            raise ValueError(f"sequences {rows} have no graph (no target node) to predict for")
        scores, out = self._score_pass(input_ids, attention_mask, graph, label_ids)
        p_gnn = out.node_logits[graph.target_nodes].float().softmax(-1)  # one pass for both
        p_lm = scores.softmax(-1)
        if p_gnn.shape[-1] != p_lm.shape[-1]:
            raise ValueError(f"{p_gnn.shape[-1]} GNN classes but {p_lm.shape[-1]} label names")
        return {"gnn": p_gnn, "lm": p_lm, "ensemble": weight * p_gnn + (1 - weight) * p_lm}

    # ------------------------------------------------------------------ save / load

    def glfusion_state_dict(self) -> dict[str, Tensor]:
        """The GL-Fusion modules plus the base's rows for the graph tokens."""
        state = {
            k: v.detach().contiguous().cpu()
            for k, v in self.state_dict().items()
            if k.startswith("glf_")
        }
        inner = _inner(self.base)
        ids = torch.tensor(
            [self.config.graph_start_id, self.config.node_id, self.config.graph_end_id]
        )
        state["base_rows.embed_tokens"] = inner.get_input_embeddings().weight.detach()[ids].cpu()
        state["base_rows.lm_head"] = inner.get_output_embeddings().weight.detach()[ids].cpu()
        return state

    def save_pretrained(self, path: str | Path) -> None:
        """``glfusion_config.json``, ``glfusion_modules.safetensors`` and, when the base carries
        LoRA adapters, ``adapter/`` (peft's safetensors)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.config.save(path / "glfusion_config.json")
        save_file(self.glfusion_state_dict(), str(path / "glfusion_modules.safetensors"))
        if hasattr(self.base, "peft_config"):
            # LoRA weights alone: peft would otherwise copy the frozen base's whole (resized)
            # embedding and output matrices; their graph-token rows are saved above and every
            # other row is the base LLM's, which loading is given
            self.base.save_pretrained(str(path / "adapter"), save_embedding_layers=False)

    @classmethod
    def from_pretrained(cls, path: str | Path, base_lm: nn.Module) -> GLFusionForCausalLM:
        """Rebuild around a fresh copy of the same base LM (adapters loaded when saved)."""
        path = Path(path)
        config = GLFusionConfig.load(path / "glfusion_config.json")
        if (path / "adapter").is_dir():
            from peft import PeftModel

            if not (path / "adapter" / "adapter_model.safetensors").is_file():
                raise ValueError(
                    f"{path / 'adapter'} holds no adapter_model.safetensors: only safetensors "
                    "adapters are loaded (a pickled .bin file can run code when read)"
                )

            _fit_vocabulary(base_lm, config)  # the adapter was saved on the resized base
            with quiet_library_warnings():
                base_lm = PeftModel.from_pretrained(
                    base_lm, str(path / "adapter"), is_trainable=True
                )
        model = cls.from_base(base_lm, config)
        state = load_file(str(path / "glfusion_modules.safetensors"))
        rows = {k: state.pop(k) for k in list(state) if k.startswith("base_rows.")}
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if k.startswith("glf_")]
        if missing or unexpected:
            raise ValueError(f"{path}: missing {missing}, unexpected {unexpected}")
        inner = _inner(model.base)
        ids = torch.tensor([config.graph_start_id, config.node_id, config.graph_end_id])
        with torch.no_grad():
            inner.get_input_embeddings().weight[ids] = rows["base_rows.embed_tokens"].to(
                inner.get_input_embeddings().weight.dtype
            )
            inner.get_output_embeddings().weight[ids] = rows["base_rows.lm_head"].to(
                inner.get_output_embeddings().weight.dtype
            )
        return model


def apply_lora(
    model: GLFusionForCausalLM,
    r: int = 8,
    alpha: int = 16,
    dropout: float = 0.0,
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"),
) -> GLFusionForCausalLM:
    """Put LoRA adapters (peft) on the base LM; the base is frozen, GL-Fusion stays trainable."""
    from peft import LoraConfig, get_peft_model

    if hasattr(model.base, "peft_config"):
        raise ValueError("the base already carries adapters")
    lora = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(target_modules),
        task_type="CAUSAL_LM",
    )
    with quiet_library_warnings():
        model.base = get_peft_model(model.base, lora)
    for name, p in model.named_parameters():
        if name.startswith("glf_"):
            p.requires_grad_(True)
    return model
