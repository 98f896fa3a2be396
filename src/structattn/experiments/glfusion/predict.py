"""Predictions of a finished GL-Fusion run for any nodes of its graph."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from structattn.data.base import default_data_dir
from structattn.data.graphs import TextAttributedGraph
from structattn.engine import RunDir
from structattn.engine.config import with_saved_defaults
from structattn.errors import ConfigError, RunError
from structattn.experiments import check_run_kind
from structattn.experiments.glfusion.prompts import label_token_ids
from structattn.glfusion.loading import EncodingCache, load_llm, load_text_encoder
from structattn.glfusion.modeling import GLFusionForCausalLM

from .config import (
    LLM_DTYPES,
    GLFusionTrainConfig,
    build_glfusion_config,
    load_graph,
)
from .evaluation import head_probabilities
from .run import NodeClassification
from .targets import prompt_examples

__all__ = ["LoadedRun", "load_run", "load_run_config", "match_label_names", "predict_nodes"]


def load_run_config(run_dir: Path) -> GLFusionTrainConfig:
    """The config a GL-Fusion run was trained with (``config.yaml``); it must have ``best/``."""
    rd = RunDir(run_dir)
    values = rd.read_config()
    check_run_kind(run_dir, values, "glfusion", "a GL-Fusion node classifier")
    if not (rd.file(NodeClassification.BEST_MODEL) / "glfusion_config.json").is_file():
        raise RunError(f"{run_dir} has no best/ weights (did the run finish?)")
    values["resume"] = False
    values = with_saved_defaults(GLFusionTrainConfig, values)
    saved = rd.file(NodeClassification.GRAPH)
    graph_path = values.get("graph_path")
    if values.get("dataset") == "file" and saved.is_dir() and not Path(str(graph_path)).is_dir():
        values["graph_path"] = str(saved)  # the run folder moved: its own copy of the graph
    try:
        return build_glfusion_config(values)
    except ConfigError as err:
        raise RunError(f"{rd.config}: {err}") from None


def _ensemble_weight(run_dir: Path, cfg: GLFusionTrainConfig) -> float:
    """The weight the run evaluated its ensemble with (its results), else its config's."""
    rd = RunDir(run_dir)
    results = rd.read_final() if rd.is_finished() else {}
    default = cfg.ensemble_weight if cfg.ensemble_weight is not None else 0.5
    return results.get("ensemble_weight", default)


@dataclass
class LoadedRun:
    """A finished run's config, graph, best model (eval mode), tokenizer and encoding cache."""

    cfg: GLFusionTrainConfig
    graph: TextAttributedGraph
    model: GLFusionForCausalLM
    tokenizer: Any
    cache: Any


def match_label_names(graph: TextAttributedGraph, names: list[str]) -> TextAttributedGraph:
    """``graph`` with the label names ``names`` (a run's classes, in its GNN head's order): the
    graph itself when its names are ``names``; when they are the same names in another order,
    a copy whose labels are renumbered to ``names``' order; else a ConfigError listing the
    names that differ."""
    given = list(graph.label_names)
    if given == list(names):
        return graph
    if sorted(given) == sorted(names) and len(set(names)) == len(names):
        order = torch.tensor([names.index(n) for n in given], dtype=torch.long)
        labels = torch.where(graph.labels >= 0, order[graph.labels.clamp_min(0)], graph.labels)
        return dataclasses.replace(graph, labels=labels, label_names=list(names))
    missing = [n for n in names if n not in given]
    foreign = [n for n in given if n not in names]
    twice = sorted({n for n in given if given.count(n) > 1})
    diff = "; ".join(part for part in (
        f"missing the run's {missing}" if missing else "",
        f"not the run's {foreign}" if foreign else "",
        f"given more than once {twice}" if twice else "",
    ) if part)  # fmt: skip
    count = ""
    if len(given) != len(names):
        count = (f"the graph has {len(given)} label names but the run's GNN head predicts "
                 f"{len(names)} classes: ")  # fmt: skip
    raise ConfigError(
        f"{count}the graph's label names do not match the run's ({diff}): give a graph with "
        "the run's label names (in any order)"
    )


def _run_label_names(model: GLFusionForCausalLM, cfg: GLFusionTrainConfig, run_dir: Path):
    """The run's label names in its GNN head's order: saved with its model, or, for a run
    saved before they were, those of the graph its config names."""
    extra = model.config.extra if isinstance(model.config.extra, dict) else {}
    names = extra.get("label_names")
    if isinstance(names, list) and all(isinstance(n, str) for n in names):
        return names
    try:
        return list(load_graph(cfg).label_names)
    except (OSError, ValueError) as err:
        raise RunError(
            f"{run_dir}: its label names are not saved with its model and its graph cannot be "
            f"read to learn them ({err}); give the run's graph where its config.yaml names it"
        ) from None


def load_run(run_dir, llm=None, encoder=None, graph=None, data_dir=None) -> LoadedRun:
    """The run at ``run_dir`` with its best weights; ``llm``/``encoder`` (``(model,
    tokenizer)``) and ``graph`` default to what its config names. A graph's label names are
    matched to the run's by name (reordered when they are the run's in another order; other
    names are one error).

    Node-text encodings are cached in ``data_dir`` (default ``$STRUCTATTN_DATA_DIR`` or
    ``~/.cache/structattn``), the caller's own folder: never in the ``data_dir`` of the run's
    config, since a run folder may come from someone else."""
    run_dir = Path(run_dir)
    cfg = load_run_config(run_dir)
    given = graph
    graph = graph if graph is not None else load_graph(cfg)
    base, tokenizer = llm if llm is not None else load_llm(cfg.llm, dtype=LLM_DTYPES[cfg.llm_dtype])
    enc_model, enc_tok = encoder if encoder is not None else load_text_encoder(cfg.encoder)
    try:
        model = GLFusionForCausalLM.from_pretrained(run_dir / NodeClassification.BEST_MODEL, base)
    except (ValueError, OSError) as err:  # a damaged or foreign best/ folder
        raise RunError(f"{run_dir}: cannot load best/ ({err})") from None
    model = model.eval()
    classes = model.config.num_node_classes
    saved = isinstance(model.config.extra, dict) and "label_names" in model.config.extra
    if given is None and not saved:
        names = list(graph.label_names)  # the graph the run's config names: the run's names
    else:
        names = _run_label_names(model, cfg, run_dir)
    if len(names) != classes:
        raise RunError(
            f"{run_dir}: {len(names)} label names for a GNN head of {classes} classes "
            "(the run's files disagree)"
        )
    graph = match_label_names(graph, names)
    root = Path(data_dir) if data_dir is not None else default_data_dir()
    cache = EncodingCache(root / "encodings", enc_model, enc_tok, cfg.text_tokens)
    return LoadedRun(cfg, graph, model, tokenizer, cache)


def node_indices(graph: TextAttributedGraph, nodes) -> list[int]:
    """The indices of ``nodes`` (indices, or the graph's node ids, e.g. ``"pkg:bash"``); one
    ConfigError naming every node that is not in the graph."""
    if not nodes:
        raise ConfigError("name at least one node (an index or a node id)")
    out, bad = [], []
    for node in nodes:
        try:
            out.append(graph.node_index(node))
        except ValueError:
            bad.append(node)
    if bad:
        some = ", ".join(repr(x) for x in graph.node_ids[:3])
        ids = f" or node ids ({some}, ...)" if graph.node_ids else ""
        raise ConfigError(f"nodes {bad} are not in the graph: give 0..{graph.num_nodes - 1}{ids}")
    return out


def predict_nodes(
    run_dir: str | Path,
    node_ids: list[int | str],
    llm=None,
    encoder=None,
    graph: TextAttributedGraph | None = None,
    batch_size: int = 8,
    top_k: int = 3,
    data_dir: str | Path | None = None,
) -> list[dict[str, Any]]:
    """Classify nodes of the run's graph (any nodes: new targets, not only the run's test set;
    by index or by the graph's node ids) with a saved run's best weights: per node its index and
    id, the GNN, LM and ensemble distributions (the run's ensemble weight) and the predicted
    label name.

    ``llm``, ``encoder`` (``(model, tokenizer)``) and ``graph`` default to what the run's
    ``config.yaml`` names; pass them for models or graphs that are not on disk. ``graph`` may
    be a new graph holding nodes the run never saw (their text and edges; a node outside the
    splits may be unlabelled, ``y = -1``, and its ``"true"`` is then ``None``); its label names
    must be the run's (any order: they are matched by name). ``top`` lists each head's
    ``top_k`` labels with their probabilities. Encodings are cached in ``data_dir`` (see
    :func:`load_run`), never where the run's config points."""
    run = load_run(run_dir, llm, encoder, graph, data_dir)
    cfg, graph, model, tokenizer = run.cfg, run.graph, run.model, run.tokenizer
    node_ids = node_indices(graph, node_ids)
    if top_k < 1:
        raise ConfigError(f"top_k must be >= 1, got {top_k}")
    weight = _ensemble_weight(Path(run_dir), cfg)
    examples = prompt_examples(graph, node_ids, tokenizer, model.config, cfg)
    label_ids = label_token_ids(graph, tokenizer, cfg.chat)
    probs = head_probabilities(model, examples, run.cache.get, label_ids, batch_size)
    out = []
    for i, v in enumerate(node_ids):
        mix = weight * probs["gnn"][i] + (1 - weight) * probs["lm"][i]
        label = int(graph.labels[int(v)])
        dists = {"ensemble": mix, "gnn": probs["gnn"][i], "lm": probs["lm"][i]}
        out.append(
            {
                "node": int(v),
                "node_id": graph.node_ids[int(v)] if graph.node_ids else str(int(v)),
                "predicted": graph.label_names[int(mix.argmax())],
                "true": graph.label_names[label] if label >= 0 else None,  # -1: unlabelled
                **{k: d.tolist() for k, d in dists.items()},
                "top": {k: _top(d, graph.label_names, top_k) for k, d in dists.items()},
                "ensemble_weight": weight,
            }
        )
    return out


def _top(dist, names: list[str], k: int) -> list[tuple[str, float]]:
    values, idx = dist.topk(min(k, len(names)))
    return [(names[int(i)], round(float(p), 6)) for p, i in zip(values, idx)]
