"""Free text about a node of a graph from a finished GL-Fusion run: the node's sampled subgraph
sits in the prompt (the gated form: its nodes' texts, one line each, the first the node asked
about; the paper's form: node tokens), the question follows it, all inside the tokenizer's chat
template where it has one, and the LLM continues until a stop token of its tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch

from structattn.data.graphs import TextAttributedGraph
from structattn.errors import ConfigError
from structattn.experiments.glfusion.prompts import (
    GATED_INSTRUCTION,
    INSTRUCTION,
    build_example,
    chat_frame,
    chat_parts,
    collate_examples,
    node_lines,
)
from structattn.glfusion.build import stop_token_ids

from .predict import load_run, node_indices

__all__ = ["generate_about_node"]


def generate_about_node(
    run_dir: str | Path,
    node: int | str,
    prompt: str,
    graph: TextAttributedGraph | None = None,
    llm=None,
    encoder=None,
    max_new_tokens: int = 40,
    do_sample: bool = False,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
    data_dir: str | Path | None = None,
) -> str:
    """The continuation of ``prompt`` by the run's best model, the prompt being the graph of
    ``node``'s subgraph (``node``: an index or a node id; sampled as the run samples it)
    followed by ``prompt`` (not training's classification instruction); greedy unless
    ``do_sample``. Stops at the tokenizer's end-of-text or end-of-turn token or after
    ``max_new_tokens``. Node-text encodings are cached in ``data_dir`` (default
    ``$STRUCTATTN_DATA_DIR`` or ``~/.cache/structattn``), never where the run's config
    points."""
    if not prompt.strip():
        raise ConfigError("prompt must be a non-empty text")
    run = load_run(run_dir, llm, encoder, graph, data_dir)
    cfg, graph, model, tok = run.cfg, run.graph, run.model, run.tokenizer
    (node,) = node_indices(graph, [node])
    ex = build_example(graph, node, tok, model.config, num_hops=cfg.num_hops,
                       max_nodes=cfg.max_nodes, seed=cfg.seed,
                       show_neighbour_labels=cfg.show_neighbour_labels,
                       edge_texts=cfg.edge_texts, node_text_tokens=cfg.node_text_tokens,
                       max_prompt_tokens=cfg.max_prompt_tokens, chat=cfg.chat)  # fmt: skip
    ids, spans = question_prompt(tok, model.config, ex.texts, prompt, cfg.node_text_tokens,
                                 trained_chat=cfg.chat)  # fmt: skip
    ex.spans = spans
    batch = collate_examples([ex], run.cache.get, with_labels=False)
    with torch.no_grad():
        new = model.generate(torch.tensor([ids]), graph=batch["graph"],
                             max_new_tokens=max_new_tokens, do_sample=do_sample,
                             temperature=temperature, top_k=top_k,
                             eos_token_id=stop_token_ids(tok), seed=seed)  # fmt: skip
    stops = set(stop_token_ids(tok))
    out = []
    for t in new[0].tolist():
        if t in stops:
            break
        out.append(t)
    return tok.decode(out, skip_special_tokens=True)


#: What the gated form's question prompt says about the lines that follow.
NODES_INTRO = "A graph's nodes, one per line; the first is the node asked about:\n"


def question_prompt(tok, config, texts: list[str], question: str, node_text_tokens: int,
                    trained_chat: bool = False):  # fmt: skip
    """The token ids of a free-text ``question`` about the first of ``texts`` (a subgraph's
    node texts) inside the chat template, and the gated form's node spans in them (``None``
    for the paper's form, whose graph is node tokens). A run trained in the chat template
    (``trained_chat``) is asked inside its training instruction, the question after the graph;
    others after a neutral line introducing the nodes."""
    # a chat run is asked before the cue it answered after in training
    before, after = chat_frame(tok) if trained_chat else chat_parts(tok)
    ask = tok("\n" + question.strip(), add_special_tokens=False)["input_ids"]
    tokens = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    if config.variant != "gated":
        graph = [config.graph_start_id, *[config.node_id] * len(texts), config.graph_end_id]
        head = before + (tokens(INSTRUCTION) if trained_chat else [])
        return head + graph + ask + after, None
    head = before + tokens(GATED_INSTRUCTION if trained_chat else NODES_INTRO)
    body, spans = node_lines(texts, tokens, 10**9, node_text_tokens, tokens("\n"))
    return head + body + ask + after, [(a + len(head), b + len(head)) for a, b in spans]
