"""A GL-Fusion node-classification run on the shared engine: the task (model, targets, prompts,
encodings), training, evaluation of both heads and the ensemble, the baselines, the results."""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

from torch import Tensor, nn

from structattn.data.graphs import TextAttributedGraph
from structattn.engine import Experiment, FitResult, json_safe
from structattn.engine.loop import stop_requested
from structattn.errors import ConfigError
from structattn.experiments.glfusion.prompts import (
    NodeExample,
    collate_examples,
    label_token_ids,
    mean_pool,
)
from structattn.glfusion.build import check_layers
from structattn.glfusion.configuration import GLFusionConfig
from structattn.glfusion.loading import EncodingCache, llm_layer_count, quiet_library_warnings
from structattn.glfusion.modeling import GLFusionForCausalLM, apply_lora
from structattn.utils.fingerprint import fingerprint

from .baselines import run_baselines
from .config import (
    DEFAULT_LLM,
    GLFusionTrainConfig,
    encoding_cache,
    load_graph,
    load_models,
)
from .evaluation import (
    choose_ensemble_weight,
    gnn_accuracy,
    head_accuracies,
    head_probabilities,
    stop_exits,
)
from .groups import glfusion_param_groups
from .report import PAPER_ARXIV, results_table
from .targets import cut_notice, node_record, prompt_examples, split_sizes, split_targets

__all__ = ["NodeClassification", "build_model", "stop_signal", "train_glfusion"]


def stop_signal() -> int | None:
    """The signal (SIGINT or SIGTERM) that the engine's training loop received and has not acted
    on yet, else ``None`` (:func:`structattn.engine.loop.stop_requested`): a long evaluation
    reads it between batches to stop sooner."""
    return stop_requested()


def _check_layers(cfg: GLFusionTrainConfig, num_layers: int | None) -> None:
    check_layers(num_layers, cfg.llm or DEFAULT_LLM,
                 message_passing_layers=cfg.message_passing_layers,
                 cross_attention_layers=cfg.cross_attention_layers)  # fmt: skip


def build_model(cfg: GLFusionTrainConfig, graph, base, tokenizer, text_dim: int):
    """GL-Fusion around ``base`` with LoRA adapters, as ``cfg`` configures it; the graph's label
    names (the GNN head's classes, in order) are saved with the model (``extra``)."""
    _check_layers(cfg, base.config.num_hidden_layers)
    gl_config = GLFusionConfig(
        text_dim=text_dim,
        num_node_classes=len(graph.label_names),
        message_passing_layers=cfg.message_passing_layers,
        cross_attention_layers=cfg.cross_attention_layers,
        message_passing_norm=cfg.message_passing_norm,
        target_marker=cfg.target_marker,
        lm_loss_weight=0.0 if cfg.heads == "gnn" else 1.0,
        edge_dim=text_dim if cfg.edge_texts else 0,  # edge texts share the node-text encoder
        extra={"label_names": list(graph.label_names)},
        variant=cfg.variant,
    )
    model = GLFusionForCausalLM.from_base(base, gl_config, tokenizer=tokenizer)
    with quiet_library_warnings():  # peft reads a property transformers has deprecated
        model = apply_lora(model, r=cfg.lora_r, alpha=cfg.lora_alpha)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def edge_text_notice(graph: TextAttributedGraph, cfg: GLFusionTrainConfig) -> str | None:
    """One line when the graph carries edge texts that the run leaves unread."""
    if cfg.edge_texts or not graph.edge_texts:
        return None
    return (
        f"note: {graph.name} carries edge texts ({len(graph.edge_texts)} edges, e.g. "
        f"{graph.edge_texts[0]!r}) and edge_texts is off, so every edge shares one learned "
        "embedding: --edge-texts encodes them as message-passing edge features"
    )


class NodeClassification(Experiment):
    """Node classification on a text-attributed graph: each target's prompt holds its sampled
    subgraph; the twin predictor is trained on the training targets. ``graph`` replaces
    ``cfg.dataset``; ``llm = (model, tokenizer)`` and ``encoder = (model, tokenizer)`` may be
    passed in (tests), else they are loaded offline."""

    only_trainable = True  # the frozen LLM is not copied into every checkpoint
    unused_parameters = True  # a path with nothing to read in a batch gets no gradient
    #: Say on stderr, at the start, what the run leaves out of the graph (unread edge texts,
    #: validation / test nodes beyond max_val / max_test).
    notify = True
    #: Saved-pretrained folder of the best weights (LoRA adapters + GL-Fusion modules).
    BEST_MODEL = "best"

    def __init__(self, cfg: GLFusionTrainConfig, graph=None, llm=None, encoder=None,
                 progress: bool = True):  # fmt: skip
        super().__init__(cfg, progress)
        self.graph, self._llm, self._encoder = graph, llm, encoder
        self.started = time.perf_counter()

    #: Where a graph given from Python is saved in the run folder (and the config points).
    GRAPH = "graph"

    def make_engine(self):
        """A graph given from Python is saved into the run folder and the config records it
        (``dataset: file``, ``graph_path``), so every command works on the run. Layer indices
        out of the LLM's range stop here, before anything is written or loaded."""
        count = (
            self._llm[0].config.num_hidden_layers if self._llm else llm_layer_count(self.cfg.llm)
        )
        _check_layers(self.cfg, count)
        if self.graph is not None:
            path = (self.cfg.resolved_run_dir() / self.GRAPH).resolve()
            self.cfg = dataclasses.replace(self.cfg, dataset="file", graph_path=path)
        return super().make_engine()

    def build_data(self) -> None:
        """Graph, models, targets and prompts; every node text encoded once (cached)."""
        cfg = self.cfg
        # a fresh run saves the graph it is given; a resumed one keeps the saved copy (the data
        # check refuses another graph before anything else is written)
        if self.graph is not None and self.engine.is_main and not cfg.resume:
            self.graph.save(cfg.graph_path)
        self.graph = self.graph if self.graph is not None else load_graph(cfg)
        if cfg.edge_texts and self.graph.edge_texts is None:
            raise ConfigError(
                f"edge_texts: true, but the graph {self.graph.name} has no edge texts"
            )
        self.targets = split_targets(self.graph, cfg)
        if self.notify and (self.engine is None or self.engine.is_main):
            for note in (edge_text_notice(self.graph, cfg), cut_notice(self.graph, self.targets)):
                if note:
                    _note(note)
        (base, tokenizer), (enc_model, enc_tok) = load_models(cfg, self._llm, self._encoder)
        self.model = build_model(cfg, self.graph, base, tokenizer, enc_model.config.hidden_size)
        self.examples: dict[str, list[NodeExample]] = {
            s: prompt_examples(self.graph, ts, tokenizer, self.model.config, cfg)
            for s, ts in self.targets.items()
        }
        texts = list(dict.fromkeys(t for exs in self.examples.values() for ex in exs
                                   for t in (*ex.texts, *(ex.edge_texts or ()))))  # fmt: skip
        # One content-keyed cache per encoder folder, shared by runs: a text, encoder or length
        # that changed can never be paired with a stale encoding.
        self.cache: EncodingCache = encoding_cache(cfg, enc_model, enc_tok)
        self.cache.get(texts, progress=self.progress)  # encode everything missing, once
        self.label_choices = label_token_ids(self.graph, tokenizer, cfg.chat)  # after the cue
        self.train_set = self.examples["train"]

    def data_identity(self) -> dict[str, Any]:
        """The graph (texts, labels, edges, splits) and the targets sampled from it."""
        g = self.graph
        parts = (g.node_texts, g.labels, g.label_names, g.edge_index, g.splits, self.targets)
        if self.cfg.edge_texts:
            parts += (g.edge_texts,)
        return {"source": g.source, "sha256": fingerprint(*parts)}

    def build_model(self) -> GLFusionForCausalLM:
        return self.model

    def param_groups(self, model: nn.Module) -> list[dict[str, Any]]:
        return glfusion_param_groups(model, self.cfg)

    def encode(self, texts: list[str]) -> tuple[Tensor, Tensor]:
        return self.cache.get(texts)

    def collate(self, chunk: list[NodeExample]) -> dict[str, Any]:
        """The keyword arguments of the model's training pass."""
        if self.cfg.lm_loss == "labels":  # the prompt only; the LM loss is over the label names
            batch = collate_examples(chunk, self.encode, with_labels=False)
            keys = ("input_ids", "attention_mask", "graph", "node_labels", "classes")
            out = {"label_choices": self.label_choices, **{k: batch[k] for k in keys}}
        else:
            batch = collate_examples(chunk, self.encode)
            keys = ("input_ids", "attention_mask", "graph", "labels", "node_labels")
            out = {k: batch[k] for k in keys}
        if self.cfg.heads == "lm":  # the GNN head is not trained
            out.pop("node_labels")
        return out

    def validate(self, model: nn.Module) -> dict[str, float]:
        """Validation accuracy of what the run reports: the trained head, or with both heads
        trained their ensemble (its weight chosen on these nodes, as :meth:`evaluate` does), so
        the best checkpoint is the best of the reported number; on the first
        ``train.eval_batches`` evaluation batches when that is set.

        A SIGINT or SIGTERM received by the training loop stops the pass between two batches:
        the process exits with ``128 + signal`` without recording this evaluation or a
        checkpoint of this step, and ``--resume`` continues from the last checkpoint."""
        cfg, val = self.cfg, self.examples["val"]
        if cfg.train.eval_batches is not None:
            val = val[: cfg.train.eval_batches * cfg.eval_batch_size]
        with stop_exits(self.engine.run_dir):
            if cfg.heads == "gnn":
                return {"acc": gnn_accuracy(model, val, self.encode, cfg.eval_batch_size,
                                            stop=stop_signal)}  # fmt: skip
            probs = head_probabilities(model, val, self.encode, self.label_choices,
                                       cfg.eval_batch_size, stop=stop_signal)  # fmt: skip
            return {"acc": head_accuracies(probs, _ensemble_weight(cfg, probs))["ensemble"]}

    def evaluate(self, model: GLFusionForCausalLM, progress: bool = False):
        """Val and test accuracy of both heads and the ensemble, and the ensemble's weight."""
        cfg = self.cfg
        probs = {
            s: head_probabilities(
                model, self.examples[s], self.encode, self.label_choices, cfg.eval_batch_size,
                progress,
            )
            for s in ("val", "test")
        }  # fmt: skip
        weight = _ensemble_weight(cfg, probs["val"])  # on validation, never test
        return {s: head_accuracies(p, weight) for s, p in probs.items()}, weight

    def baselines(self, progress: bool = False) -> dict[str, dict[str, float]]:
        """The MLP / GraphSAGE baselines on the nodes the prompts hold, from their plain texts
        (no label text at all), mean-pooled."""
        exs = self.examples.values()
        universe = sorted({int(v) for split in exs for ex in split for v in ex.nodes})
        enc, mask = self.cache.get([self.graph.node_texts[v] for v in universe], progress=progress)
        pooled = mean_pool(enc, mask)
        cfg = self.cfg
        return run_baselines(self.graph, universe, pooled, self.targets, cfg.baseline_epochs,
                             cfg.seed, self.examples, cfg.show_neighbour_labels)  # fmt: skip

    def report(self, model: GLFusionForCausalLM, fit: FitResult) -> dict[str, Any]:
        """Both heads, the ensemble and the baselines; the best weights saved as a model
        folder (``best/``) and the table as ``results.md``."""
        engine = self.engine
        if engine.is_main:
            model.save_pretrained(engine.dir.file(self.BEST_MODEL))
        heads, weight = self.evaluate(model, self.progress)
        results = _results(self, heads, weight, self.baselines(self.progress), fit)
        results["wall_s"] = fit.earlier_wall_s + time.perf_counter() - self.started
        results["processes"] = engine.accelerator.num_processes
        if self.graph.name.startswith("ogbn-arxiv"):  # the paper's figures compare this data
            results["paper_ogbn_arxiv"] = PAPER_ARXIV
        if engine.is_main:
            engine.dir.write_text("results.md", results_table(json_safe(results)) + "\n")
        return results


def _ensemble_weight(cfg: GLFusionTrainConfig, val_probs: dict) -> float:
    """The GNN head's weight in the ensemble: 1 or 0 with one trained head (the ensemble is that
    head), else the config's or the one chosen on ``val_probs``."""
    if cfg.heads != "both":
        return 1.0 if cfg.heads == "gnn" else 0.0
    if cfg.ensemble_weight is not None:
        return cfg.ensemble_weight
    return choose_ensemble_weight(val_probs)


def _results(task: NodeClassification, heads, weight, baselines, fit: FitResult) -> dict:
    cfg, graph = task.cfg, task.graph
    return {
        "dataset": graph.name,
        "data_source": graph.source,
        "stand_in": graph.stand_in,
        "llm": str(cfg.llm or DEFAULT_LLM),
        "seed": cfg.seed,
        "targets": {k: len(v) for k, v in task.targets.items()},
        "split_sizes": split_sizes(graph),  # the nodes of each split, scored or not
        # the nodes scored, as indices and node ids (`baselines --against` checks them)
        "val_nodes": node_record(graph, task.targets["val"]),
        "test_nodes": node_record(graph, task.targets["test"]),
        "heads": heads,
        "ensemble_weight": weight,
        "ensemble_weight_chosen_on_val": cfg.ensemble_weight is None and cfg.heads == "both",
        "heads_trained": cfg.heads,
        "baselines": baselines,
        "best_step": fit.best["step"],
        "skipped_steps": fit.skipped_steps,
        "median_step_ms": fit.median_step_ms,
    }


def train_glfusion(
    cfg: GLFusionTrainConfig,
    progress: bool = True,
    llm=None,
    encoder=None,
    graph: TextAttributedGraph | None = None,
) -> dict:
    """Train and evaluate; returns (and writes ``final.json``) the results, or
    ``{"paused_at": step, ...}`` when ``train.stop_at`` paused the run. ``llm`` and ``encoder``
    (``(model, tokenizer)`` pairs) may be passed in (tests); else they are loaded offline.
    ``graph`` (e.g. ``TextAttributedGraph.from_pyg(...)``) replaces ``cfg.dataset``."""
    return NodeClassification(cfg, graph, llm, encoder, progress).run()
