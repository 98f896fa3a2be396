"""Predictions of a finished GL-Fusion run for any nodes of its graph."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from structattn.data.graphs import TextAttributedGraph
from structattn.engine import RunDir
from structattn.errors import ConfigError, RunError
from structattn.glfusion.loading import load_llm, load_text_encoder
from structattn.glfusion.modeling import GLFusionForCausalLM
from structattn.glfusion.prompts import label_token_ids

from .config import (
    LLM_DTYPES,
    GLFusionTrainConfig,
    build_glfusion_config,
    encoding_cache,
    load_graph,
)
from .evaluation import head_probabilities
from .run import NodeClassification
from .targets import prompt_examples

__all__ = ["LoadedRun", "load_run", "load_run_config", "predict_nodes"]


def load_run_config(run_dir: Path) -> GLFusionTrainConfig:
    """The config a GL-Fusion run was trained with (``config.yaml``); it must have ``best/``."""
    rd = RunDir(run_dir)
    values = rd.read_config()
    if not (rd.file(NodeClassification.BEST_MODEL) / "glfusion_config.json").is_file():
        raise RunError(f"{run_dir} has no best/ weights (did the run finish?)")
    values["resume"] = False
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


def load_run(run_dir, llm=None, encoder=None, graph=None) -> LoadedRun:
    """The run at ``run_dir`` with its best weights; ``llm``/``encoder`` (``(model,
    tokenizer)``) and ``graph`` default to what its config names. A graph whose label names are
    not the run's is one error."""
    run_dir = Path(run_dir)
    cfg = load_run_config(run_dir)
    graph = graph if graph is not None else load_graph(cfg)
    base, tokenizer = llm if llm is not None else load_llm(cfg.llm, dtype=LLM_DTYPES[cfg.llm_dtype])
    enc_model, enc_tok = encoder if encoder is not None else load_text_encoder(cfg.encoder)
    try:
        model = GLFusionForCausalLM.from_pretrained(run_dir / NodeClassification.BEST_MODEL, base)
    except (ValueError, OSError) as err:  # a damaged or foreign best/ folder
        raise RunError(f"{run_dir}: cannot load best/ ({err})") from None
    model = model.eval()
    classes = model.config.num_node_classes
    if len(graph.label_names) != classes:
        raise ConfigError(
            f"the graph has {len(graph.label_names)} label names but the run's GNN head "
            f"predicts {classes} classes: give a graph with the run's label names"
        )
    return LoadedRun(cfg, graph, model, tokenizer, encoding_cache(cfg, enc_model, enc_tok))


def predict_nodes(
    run_dir: str | Path,
    node_ids: list[int],
    llm=None,
    encoder=None,
    graph: TextAttributedGraph | None = None,
    batch_size: int = 8,
    top_k: int = 3,
) -> list[dict[str, Any]]:
    """Classify nodes of the run's graph (any ids: new targets, not only the run's test set) with
    a saved run's best weights: per node the GNN, LM and ensemble distributions (the run's
    ensemble weight) and the predicted label name.

    ``llm``, ``encoder`` (``(model, tokenizer)``) and ``graph`` default to what the run's
    ``config.yaml`` names; pass them for models or graphs that are not on disk. ``graph`` may
    be a new graph holding nodes the run never saw (their text and edges; a node outside the
    splits may be unlabelled, ``y = -1``, and its ``"true"`` is then ``None``); its label names
    must be the run's. ``top`` lists each head's ``top_k`` labels with their probabilities."""
    run = load_run(run_dir, llm, encoder, graph)
    cfg, graph, model, tokenizer = run.cfg, run.graph, run.model, run.tokenizer
    bad = [v for v in node_ids if not 0 <= int(v) < graph.num_nodes]
    if bad or not node_ids:
        raise ConfigError(f"node ids must be in 0..{graph.num_nodes - 1}, got {bad or node_ids}")
    if top_k < 1:
        raise ConfigError(f"top_k must be >= 1, got {top_k}")
    weight = _ensemble_weight(Path(run_dir), cfg)
    examples = prompt_examples(graph, node_ids, tokenizer, model.config, cfg)
    label_ids = label_token_ids(graph, tokenizer)
    probs = head_probabilities(model, examples, run.cache.get, label_ids, batch_size)
    out = []
    for i, v in enumerate(node_ids):
        mix = weight * probs["gnn"][i] + (1 - weight) * probs["lm"][i]
        label = int(graph.labels[int(v)])
        dists = {"ensemble": mix, "gnn": probs["gnn"][i], "lm": probs["lm"][i]}
        out.append(
            {
                "node": int(v),
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
