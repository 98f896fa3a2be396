"""Method naming on ``code-names`` on the shared engine: one :class:`MethodNaming` run trains one
model (:data:`.config.MODELS`), picks its best weights by validation F1, and reports validation
and test scores (OGB's ogbg-code2 F1, precision, recall, exact match), with example predictions
beside the true names."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch_geometric.data import Batch

from structattn.data.code import CodeExample, CodeNames, load_code_names
from structattn.engine import Experiment, FitResult
from structattn.utils.fingerprint import fingerprint

from .config import CodeNamesConfig
from .gnn import NameGNN, Vocabulary, graph_data
from .metrics import name_scores
from .report import run_table

__all__ = ["MethodNaming", "train_code_names"]

DRAW_SEED = 0  # the draw of max_train / max_val / max_test examples: one for every model and seed
EXAMPLES_SHOWN = 12  # test predictions written beside the true names


def draw(examples: Sequence[CodeExample], n: int | None) -> list[CodeExample]:
    """``n`` examples drawn with a fixed seed (all of them, in order, when ``n`` is None or
    at least their number)."""
    if n is None or n >= len(examples):
        return list(examples)
    keep = sorted(random.Random(DRAW_SEED).sample(range(len(examples)), n))
    return [examples[i] for i in keep]


class MethodNaming(Experiment):
    """Name each function from its tree; ``data`` (a :class:`CodeNames`) replaces the dataset
    folder of the config (tests)."""

    select = "f1"

    def __init__(self, cfg: CodeNamesConfig, data: CodeNames | None = None, progress: bool = True):
        super().__init__(cfg, progress)
        self.data = data
        self.started = time.perf_counter()

    def build_data(self) -> None:
        cfg = self.cfg
        data = self.data if self.data is not None else load_code_names(cfg.resolved_dataset())
        self.source = data.info.get("source", str(cfg.resolved_dataset()))
        self.splits = {
            "train": draw(data.train, cfg.max_train),
            "val": draw(data.val, cfg.max_val),
            "test": draw(data.test, cfg.max_test),
        }
        for name, exs in self.splits.items():
            if not exs:
                raise ValueError(f"code-names: the {name} split holds no example")
        self.vocab = Vocabulary.from_examples(self.splits["train"], cfg.num_vocab,
                                              cfg.num_attributes)  # fmt: skip
        self.graphs = {s: [graph_data(ex, self.vocab, cfg.max_depth) for ex in exs]
                       for s, exs in self.splits.items()}  # fmt: skip
        self.train_set = self.graphs["train"]

    def data_identity(self) -> dict[str, Any]:
        keys = {s: [(ex.project, ex.path, ex.qualname, ex.source) for ex in exs]
                for s, exs in self.splits.items()}  # fmt: skip
        return {"source": "code-names", "sha256": fingerprint(keys)}

    def build_model(self) -> nn.Module:
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        return NameGNN(self.vocab, cfg.model, cfg.gnn_layers, cfg.emb_dim, cfg.virtual_node,
                       cfg.dropout, cfg.max_depth)  # fmt: skip

    def collate(self, items: list) -> dict[str, Any]:
        graphs = Batch.from_data_list(items)
        return {"graphs": graphs, "labels": graphs.y}

    @torch.no_grad()
    def predict(self, model: nn.Module, split: str, limit: int | None = None) -> list[list[str]]:
        """The predicted sub-token lists of a split's examples (the first ``limit``)."""
        graphs = self.graphs[split][:limit]
        was_training = model.training
        model.eval()
        out: list[list[str]] = []
        try:
            step = self.cfg.eval_batch_size
            for i in range(0, len(graphs), step):
                batch = Batch.from_data_list(graphs[i : i + step]).to(self.engine.device)
                out.extend(self.vocab.decode(row.tolist()) for row in model.predict_ids(batch))
        finally:
            model.train(was_training)
        return out

    def scores(self, model: nn.Module, split: str, limit: int | None = None):
        preds = self.predict(model, split, limit)
        refs = [ex.subtokens for ex in self.splits[split][: len(preds)]]
        return name_scores(refs, preds), preds

    def validate(self, model: nn.Module) -> dict[str, float]:
        cfg = self.cfg
        limit = None
        if cfg.train.eval_batches is not None:
            limit = cfg.train.eval_batches * cfg.eval_batch_size
        return self.scores(model, "val", limit)[0]

    def report(self, model: nn.Module, fit: FitResult) -> dict[str, Any]:
        val, _ = self.scores(model, "val")
        test, preds = self.scores(model, "test")
        pairs = list(zip(self.splits["test"], preds))[:EXAMPLES_SHOWN]
        shown = [{"qualname": ex.qualname, "project": ex.project, "true": ex.subtokens,
                  "predicted": p} for ex, p in pairs]  # fmt: skip
        results = {
            "dataset": "code-names",
            "model": self.cfg.model,
            "examples": {s: len(exs) for s, exs in self.splits.items()},
            "val": val,
            "test": test,
            "test_examples": shown,
            "best_step": fit.best["step"],
            "median_step_ms": fit.median_step_ms,
            "wall_s": time.perf_counter() - self.started,
        }
        if self.engine.is_main:
            self.engine.write_json("vocabulary.json", self.vocab.to_dict())
            self.engine.dir.write_text("results.md", run_table(results) + "\n")
        return results


def train_code_names(cfg: CodeNamesConfig, data: CodeNames | None = None,
                     progress: bool = True) -> dict[str, Any]:  # fmt: skip
    """Train and evaluate one model; returns (and writes ``final.json``) the results."""
    return MethodNaming(cfg, data, progress).run()
