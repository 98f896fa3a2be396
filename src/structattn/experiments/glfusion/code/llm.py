"""The LLM models of code-names: the same LLM (SmolLM2 + LoRA) reading the tree as text, reading
the masked code, or, as GL-Fusion, reading the tree as text and as node tokens.

Every prompt ends with the cue ``"\nFunction name:"`` (no node text holds it) and the target is
the name's sub-tokens joined by spaces (``" get user name"``) followed by a newline; only those
tokens are LM targets, and names are generated greedily with a key/value cache up to the
newline, then split into sub-tokens again.

* ``llm-tree``: the node texts (``"Name: self"``, ``"Load"``, ...) in depth-first (source)
  order, one per line (each cut to ``node_text_tokens``), as many lines as the prompt budget
  holds;
* ``llm-code``: the masked function's source (docstrings removed), cut to the prompt budget;
* ``glfusion`` (the gated form): exactly ``llm-tree``'s prompt; each AST node whose line it
  holds is a node of the graph, its slot the line's last token (nodes past the budget leave
  the graph with their edges). Message passing runs over both directions of the
  parent -> child and next-token edges, whose texts ("child", "parent", "next token",
  "previous token") are encoded by the frozen sentence encoder as edge features. The twin GNN
  head reads the mean of the final node-token states through one linear map per sub-token
  position (OGB's readout): its logits are the mean over the graph's nodes of GL-Fusion's
  linear node head with ``5 x vocabulary`` outputs.
* ``glfusion`` with ``variant: paper``: ``<graph_start><node>...<node><graph_end>`` between an
  instruction and the cue ``"\nName:"``, each node token's embedding its node text's encoding,
  the target ending with the end-of-text token (the prompt of the table's first GL-Fusion
  rows).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.utils import scatter

from structattn.data.code import EDGE_TEXTS, MAX_SUBTOKENS, CodeExample, split_subtokens
from structattn.experiments.glfusion.prompts import fitted_lines, node_lines
from structattn.glfusion.graph import GraphBatch
from structattn.glfusion.modeling import GLFusionForCausalLM

__all__ = [
    "LLM_MODELS",
    "NamingLM",
    "NamingPrompt",
    "PromptSpec",
    "build_prompt",
    "collate_prompts",
    "edge_lists",
    "subtokens_of_text",
]

LLM_MODELS = ("llm-tree", "llm-code", "glfusion")
INSTRUCTION = {
    "llm-tree": "Name the Python function whose syntax tree nodes follow, in source order.\n",
    "llm-code": "Name the Python function whose code follows (its name is _mask_).\n",
}
ANSWER = "\nFunction name:"
END = "\n"  # the target's last token
#: The paper-form prompt's instruction and cue (the target ends with the end-of-text token).
PAPER_INSTRUCTION = "Name the Python function whose syntax tree this graph is. Graph:"
PAPER_ANSWER = "\nName:"
#: Texts of the reversed edges, beside :data:`EDGE_TEXTS` of the stored ones.
REVERSED = ("parent", "previous token")


@dataclass
class NamingPrompt:
    """One function as an LLM example: the prompt, the target tokens and, for GL-Fusion, the
    graph (node texts, edges in both directions and their texts)."""

    prompt_ids: list[int]
    target_ids: list[int]  # " sub tokens" + end of text
    subtokens: list[str]  # the whole true name, for scoring
    name_ids: list[int] | None = None  # the GNN head's targets (MAX_SUBTOKENS ids)
    texts: list[str] | None = None
    edge_index: Tensor | None = None
    edge_texts: list[str] | None = None
    spans: list[tuple[int, int]] | None = None  # the gated form: each node's line in the prompt


def edge_lists(ex: CodeExample) -> tuple[Tensor, list[str]]:
    """Both directions of every stored edge, ``(2, 2E)`` and their texts."""
    edges = torch.tensor(ex.edges, dtype=torch.long).reshape(-1, 2).T
    texts = [EDGE_TEXTS[k] for k in ex.edge_kinds] + [REVERSED[k] for k in ex.edge_kinds]
    return torch.cat([edges, edges.flip(0)], dim=1), texts


def _cut(ids: list[int], budget: int) -> list[int]:
    return ids[: max(budget, 0)]


@dataclass
class PromptSpec:
    """How prompts are built: the graph-token ids, the budgets and the form."""

    node_id: int
    graph_start: int
    graph_end: int
    max_prompt_tokens: int = 512  # the whole prompt at most (text bodies are cut)
    node_text_tokens: int = 16  # each node's line at most (its newline included)
    variant: str = "gated"  # GL-Fusion's form: gated | paper


def build_prompt(ex: CodeExample, mode: str, tokenizer, spec: PromptSpec,
                 name_ids: list[int] | None = None) -> NamingPrompt:  # fmt: skip
    """The prompt of ``ex`` for model ``mode`` (one of :data:`LLM_MODELS`); text bodies are cut
    so that the prompt holds at most ``spec.max_prompt_tokens`` tokens besides the node tokens
    (a graph is never cut: the trees are at most 150 nodes)."""
    if mode not in LLM_MODELS:
        raise ValueError(f"mode must be one of {LLM_MODELS}, got {mode!r}")
    tok = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    if mode == "glfusion" and spec.variant == "paper":
        return _paper_prompt(ex, tok, tokenizer, spec, name_ids)
    head, tail = tok(INSTRUCTION["llm-tree" if mode == "glfusion" else mode]), tok(ANSWER)
    target = tok(" " + " ".join(ex.target)) + tok(END)
    budget = spec.max_prompt_tokens - len(head) - len(tail)
    if mode == "llm-code":
        return NamingPrompt(head + _cut(tok(ex.source), budget) + tail, target, ex.subtokens)
    if mode == "llm-tree":
        body, _ = node_lines(ex.node_texts(), tok, budget, spec.node_text_tokens, tok(END))
        return NamingPrompt(head + body + tail, target, ex.subtokens)
    body, spans = fitted_lines(ex.node_texts(), tok, budget, spec.node_text_tokens, tok(END),
                               len(head), f"{ex.qualname}: max_prompt_tokens="
                               f"{spec.max_prompt_tokens}")  # fmt: skip
    edges, etexts = edge_lists(ex)
    inside = (edges < len(spans)).all(0)
    return NamingPrompt(head + body + tail, target, ex.subtokens, name_ids,
                        ex.node_texts()[: len(spans)], edges[:, inside],
                        [t for t, k in zip(etexts, inside.tolist()) if k], spans)  # fmt: skip


def _paper_prompt(ex, tok, tokenizer, spec, name_ids) -> NamingPrompt:
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    target = tok(" " + " ".join(ex.target)) + eos
    edges, etexts = edge_lists(ex)
    body = [spec.graph_start] + [spec.node_id] * ex.num_nodes + [spec.graph_end]
    return NamingPrompt(tok(PAPER_INSTRUCTION) + body + tok(PAPER_ANSWER), target, ex.subtokens,
                        name_ids, ex.node_texts(), edges, etexts)  # fmt: skip


def subtokens_of_text(text: str) -> list[str]:
    """The sub-tokens of a generated name: words split like names, at most 5."""
    out: list[str] = []
    for word in text.replace(",", " ").split():
        out.extend(split_subtokens("".join(c for c in word if c.isalnum() or c == "_")))
    return out[:MAX_SUBTOKENS]


def _pad(rows: Sequence[list[int]], value: int) -> tuple[Tensor, Tensor]:
    S = max(map(len, rows))
    ids = torch.full((len(rows), S), value, dtype=torch.long)
    mask = torch.zeros(len(rows), S, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[b, : len(row)] = 1
    return ids, mask


def collate_prompts(
    prompts: Sequence[NamingPrompt],
    encode: Callable[[list[str]], tuple[Tensor, Tensor]] | None,
    with_targets: bool = True,
    edge_features: bool = True,
) -> dict:
    """Right-padded ``input_ids``, ``attention_mask``, ``labels`` (the target tokens only; with
    ``with_targets``, else the prompt alone) and, for graph prompts, the :class:`GraphBatch`
    (node texts from ``encode``; with ``edge_features`` the mean-pooled edge-text encodings)
    and ``name_ids (B, 5)``."""
    from structattn.experiments.glfusion.prompts import mean_pool

    seqs = [p.prompt_ids + (p.target_ids if with_targets else []) for p in prompts]
    ids, mask = _pad(seqs, 0)
    out: dict = {"input_ids": ids, "attention_mask": mask}
    if with_targets:
        labels = torch.full_like(ids, -100)
        for b, p in enumerate(prompts):
            n = len(p.prompt_ids)
            labels[b, n : n + len(p.target_ids)] = torch.tensor(p.target_ids)
        out["labels"] = labels
    if prompts[0].texts is not None:
        if encode is None:
            raise ValueError("graph prompts need an encoder for their node texts")
        encoded = [encode(p.texts) for p in prompts]
        attrs = None
        if edge_features:
            attrs = [mean_pool(*encode(p.edge_texts)) for p in prompts]
        spans = None
        if prompts[0].spans is not None:
            spans = [torch.tensor(p.spans, dtype=torch.long) for p in prompts]
        graph = GraphBatch.from_graphs([e for e, _ in encoded], [p.edge_index for p in prompts],
                                       edge_attrs=attrs, targets=[0] * len(prompts),
                                       text_spans=spans)  # fmt: skip
        graph.node_text_mask = torch.cat([m for _, m in encoded])
        out["graph"] = graph
        if prompts[0].name_ids is not None:
            out["name_ids"] = torch.tensor([p.name_ids for p in prompts], dtype=torch.long)
    return out


@dataclass
class NamingOutput:
    loss: Tensor | None
    lm_loss: Tensor | None = None
    gnn_loss: Tensor | None = None


class NamingLM(nn.Module):
    """GL-Fusion (or, without a graph, exactly its base LLM) trained to write names; the twin
    GNN head, when ``gnn_vocab`` is set, predicts :data:`MAX_SUBTOKENS` ids of a vocabulary of
    that size from the mean final node state."""

    def __init__(self, glf: GLFusionForCausalLM, gnn_vocab: int | None = None):
        super().__init__()
        self.glf, self.gnn_vocab = glf, gnn_vocab
        if gnn_vocab is not None and glf.config.num_node_classes != MAX_SUBTOKENS * gnn_vocab:
            raise ValueError("the node head must have MAX_SUBTOKENS * gnn_vocab outputs")

    def _name_logits(self, node_logits: Tensor, graph: GraphBatch) -> Tensor:
        pooled = scatter(node_logits.float(), graph.node_batch, dim=0, reduce="mean")
        return pooled.view(pooled.shape[0], MAX_SUBTOKENS, self.gnn_vocab)

    def forward(self, input_ids, attention_mask, labels=None, graph=None, name_ids=None):
        out = self.glf(input_ids, attention_mask, graph=graph, labels=labels)
        gnn_loss = None
        if name_ids is not None and self.gnn_vocab is not None and out.node_logits is not None:
            logits = self._name_logits(out.node_logits, graph)
            gnn_loss = F.cross_entropy(logits.flatten(0, 1), name_ids.flatten())
        parts = [x for x in (out.lm_loss, gnn_loss) if x is not None]
        return NamingOutput(sum(parts) if parts else None, out.lm_loss, gnn_loss)

    @torch.no_grad()
    def head_ids(self, input_ids, attention_mask, graph) -> Tensor:
        """The GNN head's predicted ids ``(B, MAX_SUBTOKENS)``."""
        node_logits = self.glf.node_logits(input_ids, attention_mask, graph)
        return self._name_logits(node_logits, graph).argmax(-1)

    @torch.no_grad()
    def generate_names(self, input_ids, attention_mask, graph, tokenizer, stop_ids,
                       max_new_tokens: int = 12) -> list[list[str]]:  # fmt: skip
        """Greedy names (sub-token lists) for each prompt, with a key/value cache."""
        new = self.glf.generate(input_ids, attention_mask, graph, max_new_tokens=max_new_tokens,
                                eos_token_id=list(stop_ids) or None,
                                pad_token_id=stop_ids[0] if stop_ids else 0)  # fmt: skip
        texts = tokenizer.batch_decode(new, skip_special_tokens=True)
        return [subtokens_of_text(t.split("\n")[0]) for t in texts]
