"""Node-classification examples for GL-Fusion: subgraph, node texts, prompt, label tokens.

For a target node, :func:`build_example` samples a k-hop subgraph (target first, node cap),
writes each node's text — training-set neighbours may carry their label
(``"[category: animal] ..."``), the target never does — and builds the prompt. The gated
form's holds the node texts, one line each (:func:`node_lines`: each cut to a token budget, as
many lines as the prompt's budget holds; nodes past it leave the subgraph)::

    <instruction>\n<text of node 0>\n<text of node 1>\n... Answer:<space><label name>

the paper's form's the node tokens::

    <instruction> <graph_start><node>...<node><graph_end> Answer:<space><label name>

with the LM's tokenizer; only the label tokens are LM targets. With ``chat`` (:func:`framing`)
the prompt is the user's turn of the tokenizer's chat template and the label the assistant's
answer, closed by the end-of-turn token, which is a target too: a trained run answers a
question about a node with its label and stops. :func:`collate_examples` pads a
list of examples into model inputs: ``input_ids``, ``attention_mask``, ``labels``,
``node_labels`` (the target's class, -100 elsewhere) and a :class:`GraphBatch` whose node texts
come from an encoder (see :class:`structattn.glfusion.loading.EncodingCache`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from structattn.data.graphs import TextAttributedGraph, sample_subgraph
from structattn.errors import ConfigError
from structattn.glfusion.build import stop_token_ids
from structattn.glfusion.configuration import GLFusionConfig
from structattn.glfusion.graph import GraphBatch

__all__ = [
    "NodeExample",
    "build_example",
    "chat_frame",
    "chat_parts",
    "collate_examples",
    "fitted_lines",
    "framing",
    "label_token_ids",
    "mean_pool",
    "node_lines",
    "node_text",
]

INSTRUCTION = "Classify the first node of this graph. Graph:"
GATED_INSTRUCTION = "Classify the first node of this graph. Its nodes, one per line:\n"
ANSWER = " Answer:"


@dataclass
class NodeExample:
    target: int  # global node id of the target
    nodes: Tensor  # (n,) global node ids, target first
    edge_index: Tensor  # (2, E) local indices
    texts: list[str]  # the text shown for each node (labels of train neighbours, never target)
    prompt_ids: list[int]  # instruction, graph tokens, " Answer:" (or the chat template's turns)
    label_ids: list[int]  # tokens of " <label name>" (chat: the name and the end of the turn)
    label: int  # class of the target
    edge_texts: list[str] | None = None  # one per local edge, when edges carry text
    spans: list[tuple[int, int]] | None = None  # the gated form: each node's line in the prompt


def node_text(graph: TextAttributedGraph, node: int, show_label: bool) -> str:
    """The text shown for ``node``; with ``show_label`` its label leads (``[category: X]``
    first, so truncating a long text to the encoder's token budget never cuts it off)."""
    text = graph.node_texts[node]
    if show_label:
        text = f"[category: {graph.label_names[int(graph.labels[node])]}] {text}"
    return text


def build_example(
    graph: TextAttributedGraph,
    target: int,
    tokenizer,
    config: GLFusionConfig,
    *,
    num_hops: int = 2,
    max_nodes: int = 16,
    seed: int = 0,
    show_neighbour_labels: bool = True,
    train_nodes: set[int] | None = None,
    edge_texts: bool = False,
    node_text_tokens: int = 32,
    max_prompt_tokens: int = 512,
    chat: bool = False,
    frame: tuple | None = None,
) -> NodeExample:
    """One example around ``target``; ``train_nodes`` (default: the graph's train split) are the
    neighbours allowed to show their label; ``edge_texts``: each edge's text
    (:meth:`TextAttributedGraph.edge_text`) rides along, for edge features. The gated form's
    lines hold at most ``node_text_tokens`` tokens each and the prompt ``max_prompt_tokens``;
    ``chat``: the prompt and answer as :func:`framing` frames them (``frame``: its result,
    computed once for many examples)."""
    nodes, edges = sample_subgraph(graph, target, num_hops, max_nodes, seed)
    if train_nodes is None:
        train_nodes = set(graph.splits["train"].tolist())
    texts = [
        node_text(
            graph, int(v), show_label=show_neighbour_labels and i > 0 and int(v) in train_nodes
        )
        for i, v in enumerate(nodes)
    ]
    tok = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    label = int(graph.labels[target])
    before, tail, answer = frame or framing(tokenizer, chat)
    label_ids = answer(graph.label_names[label])
    spans = None
    if config.variant == "gated":
        head = before + tok(GATED_INSTRUCTION)
        budget = max_prompt_tokens - len(head) - len(tail)
        where = f"node {target}: max_prompt_tokens={max_prompt_tokens}"
        body, spans = fitted_lines(texts, tok, budget, node_text_tokens, tok("\n"), len(head),
                                   where)  # fmt: skip
        n = len(spans)
        nodes, edges, texts = nodes[:n], edges[:, (edges < n).all(0)], texts[:n]
        prompt = head + body + tail
    else:
        graph_tokens = [config.graph_start_id, *[config.node_id] * len(nodes), config.graph_end_id]
        prompt = before + tok(INSTRUCTION) + graph_tokens + tail
    etexts = None
    if edge_texts:
        etexts = [graph.edge_text(nodes[a], nodes[b]) for a, b in edges.t().tolist()]
    return NodeExample(target, nodes, edges, texts, prompt, label_ids, label, etexts, spans)


def node_lines(texts: list[str], tok, budget: int, per_node: int,
               newline: list[int]) -> tuple[list[int], list[tuple[int, int]]]:  # fmt: skip
    """Each text's tokens (``tok(text)``, cut to ``per_node - len(newline)``) followed by
    ``newline``, the lines in order until one does not fit in ``budget`` tokens: the ids and
    each text's ``(start, end)`` in them (empty from the first line that does not fit)."""
    ids: list[int] = []
    spans = []
    full = False
    for text in texts:
        line = tok(text)[: max(per_node - len(newline), 0)] + newline
        full = full or len(ids) + len(line) > budget
        if full:
            line = []
        spans.append((len(ids), len(ids) + len(line)))
        ids += line
    return ids, spans


def fitted_lines(texts: list[str], tok, budget: int, per_node: int, newline: list[int],
                 offset: int, where: str) -> tuple[list[int], list[tuple[int, int]]]:  # fmt: skip
    """:func:`node_lines` for a prompt whose lines start at column ``offset``: the ids and the
    spans of the nodes whose line fits (a prefix of ``texts``; nodes past it leave the graph),
    shifted to prompt columns. No line fitting is an error naming ``where``."""
    body, spans = node_lines(texts, tok, budget, per_node, newline)
    kept = [(a + offset, b + offset) for a, b in spans if b > a]
    if not kept:
        raise ValueError(f"{where} holds no node's line beside the instruction and answer cue")
    return body, kept


def chat_parts(tokenizer) -> tuple[list[int], list[int]]:
    """The token ids the tokenizer's chat template puts before and after one user message
    (its generation prompt included): ``([], [])`` for a tokenizer without a template."""
    if not getattr(tokenizer, "chat_template", None):
        return [], []
    marker = "\x00GLFUSION\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
    before, after = text.split(marker)
    tok = lambda t: tokenizer(t, add_special_tokens=False)["input_ids"] if t else []  # noqa: E731
    return tok(before), tok(after)


def mean_pool(encodings: Tensor, mask: Tensor) -> Tensor:
    """``(n, Lt, dim)`` token encodings and ``(n, Lt)`` masks -> ``(n, dim)`` float means."""
    m = mask.unsqueeze(-1).float()
    return (encodings.float() * m).sum(1) / m.sum(1).clamp_min(1)


def label_token_ids(graph: TextAttributedGraph, tokenizer, chat: bool = False) -> list[list[int]]:
    """Token ids of every label name as it follows the prompt (for label scoring); ``chat``: as
    :func:`framing` frames an answer."""
    answer = framing(tokenizer, chat)[2]
    return [answer(name) for name in graph.label_names]


def framing(tokenizer, chat: bool = False):
    """``(before, cue, answer)``: the ids before the instruction, the ids between the prompt and
    the label, and ``answer(name)``, a label's ids. Plain: no ids before, the cue " Answer:",
    the answer " <name>". ``chat``: the chat template's opening of the user's turn, its close
    and the assistant's opening as the cue (" Answer:" for a tokenizer without a template), the
    answer the name closed by the end-of-turn (else end-of-text) token."""
    tok = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    if not chat:
        return [], tok(ANSWER), lambda name: tok(" " + name)
    stops = stop_token_ids(tokenizer)
    if not stops:
        raise ConfigError("chat: the tokenizer has no end-of-text or end-of-turn token to close "
                          "an answer with")  # fmt: skip
    before, cue = chat_frame(tokenizer)
    space = " " if cue == tok(ANSWER) else ""  # after the assistant's opening: a new line
    return before, cue, lambda name: tok(space + name) + [stops[-1]]


def chat_frame(tokenizer) -> tuple[list[int], list[int]]:
    """The ids a chat-framed prompt starts with and ends with: the chat template's opening of the
    user's turn, and its close with the assistant's opening (" Answer:" without a template)."""
    before, after = chat_parts(tokenizer)
    return before, after or tokenizer(ANSWER, add_special_tokens=False)["input_ids"]


def collate_examples(
    examples: Sequence[NodeExample],
    encode: Callable[[list[str]], tuple[Tensor, Tensor]],
    with_labels: bool = True,
) -> dict:
    """Pad examples into model inputs. ``encode(texts) -> (encodings (n, Lt, dim), masks)``.
    With ``with_labels`` the label tokens follow the prompt and are the only LM targets;
    without, the prompt ends at its answer cue (for scoring label names)."""
    seqs, targets = [], []
    for ex in examples:
        ids = ex.prompt_ids + (ex.label_ids if with_labels else [])
        seqs.append(ids)
        targets.append([-100] * len(ex.prompt_ids) + (ex.label_ids if with_labels else []))
    S = max(map(len, seqs))
    B = len(seqs)
    input_ids = torch.zeros(B, S, dtype=torch.long)
    attention_mask = torch.zeros(B, S, dtype=torch.long)
    labels = torch.full((B, S), -100, dtype=torch.long)
    for b, (ids, tgt) in enumerate(zip(seqs, targets)):
        input_ids[b, : len(ids)] = torch.tensor(ids)
        attention_mask[b, : len(ids)] = 1
        labels[b, : len(tgt)] = torch.tensor(tgt)
    node_texts, node_labels = [], []
    for ex in examples:
        enc, mask = encode(ex.texts)
        node_texts.append(list(zip(enc, mask)))
        node_labels += [ex.label] + [-100] * (len(ex.nodes) - 1)
    texts = [[e for e, _ in nt] for nt in node_texts]
    edge_attrs = None
    if examples and examples[0].edge_texts is not None:  # each edge's text, mean-pooled
        dim = texts[0][0].shape[-1]
        edge_attrs = [
            mean_pool(*encode(ex.edge_texts)) if ex.edge_texts else torch.zeros(0, dim)
            for ex in examples
        ]
    spans = None
    if examples[0].spans is not None:
        spans = [torch.tensor(ex.spans, dtype=torch.long) for ex in examples]
    graph = GraphBatch.from_graphs(
        [torch.stack(t) for t in texts],
        [ex.edge_index for ex in examples],
        edge_attrs=edge_attrs,
        targets=[0] * B,
        text_spans=spans,
    )
    graph.node_text_mask = torch.cat([torch.stack([m for _, m in nt]) for nt in node_texts])
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": labels if with_labels else None,
        "graph": graph,
        "node_labels": torch.tensor(node_labels),
        "classes": torch.tensor([e.label for e in examples]),
    }
