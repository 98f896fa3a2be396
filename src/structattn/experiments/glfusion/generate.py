"""Free text about a node of a graph from a finished GL-Fusion run: the node's sampled subgraph
sits in the prompt (node tokens, message passing, cross-attention to the node texts), the
question follows it, and the LLM continues until a stop token of its tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch

from structattn.data.graphs import TextAttributedGraph
from structattn.errors import ConfigError
from structattn.glfusion.build import stop_token_ids
from structattn.glfusion.prompts import build_example, collate_examples

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
                       edge_texts=cfg.edge_texts)  # fmt: skip
    graph_tokens = [model.config.graph_start_id, *[model.config.node_id] * len(ex.nodes),
                    model.config.graph_end_id]  # fmt: skip
    ids = graph_tokens + tok(" " + prompt.strip(), add_special_tokens=False)["input_ids"]
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
