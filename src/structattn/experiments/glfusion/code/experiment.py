"""Method naming on ``code-names`` on the shared engine: one :class:`MethodNaming` run trains one
model (:data:`.config.MODELS`), picks its best weights by validation F1, and reports validation
and test scores (OGB's ogbg-code2 F1, precision, recall, exact match), with example predictions
beside the true names."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch_geometric.data import Batch

from structattn.data.base import default_data_dir
from structattn.data.code import MAX_SUBTOKENS, CodeExample, CodeNames, load_code_names
from structattn.engine import Experiment, FitResult
from structattn.engine.loop import stop_requested
from structattn.utils.fingerprint import fingerprint

from ..evaluation import check_stop, stop_exits
from .config import GNN_MODELS, CodeNamesConfig
from .gnn import NameGNN, Vocabulary, graph_data
from .llm import PromptSpec
from .metrics import name_scores
from .report import run_table

__all__ = [
    "LLMNaming",
    "MethodNaming",
    "NamingParts",
    "build_naming_lm",
    "prompt_spec",
    "train_code_names",
]

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
    curve = "f1"  # metrics.csv's acc column holds validation F1

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
                check_stop(self._stop)
                batch = Batch.from_data_list(graphs[i : i + step]).to(self.engine.device)
                out.extend(self.vocab.decode(row.tolist()) for row in model.predict_ids(batch))
        finally:
            model.train(was_training)
        return out

    def scores(self, model: nn.Module, split: str, limit: int | None = None):
        preds = self.predict(model, split, limit)
        refs = [ex.subtokens for ex in self.splits[split][: len(preds)]]
        return name_scores(refs, preds), preds

    #: Read before every batch of a prediction pass (a stop of the training loop, during
    #: validation): a pass asked to stop ends the process (:func:`stop_exits`).
    _stop = None

    def validate(self, model: nn.Module) -> dict[str, float]:
        """Validation scores (the first ``train.eval_batches`` batches when set); a SIGINT or
        SIGTERM received by the training loop stops the pass between batches (``--resume``
        continues from the last checkpoint)."""
        cfg = self.cfg
        limit = None
        if cfg.train.eval_batches is not None:
            limit = cfg.train.eval_batches * cfg.eval_batch_size
        self._stop = stop_requested
        try:
            with stop_exits(self.engine.run_dir):
                return self.val_metrics(model, limit)
        finally:
            self._stop = None

    def val_metrics(self, model: nn.Module, limit: int | None) -> dict[str, float]:
        return self.scores(model, "val", limit)[0]

    def report(self, model: nn.Module, fit: FitResult) -> dict[str, Any]:
        val, _ = self.scores(model, "val")
        test, preds = self.scores(model, "test")
        return self._write_results(fit, val, test, preds)

    def _write_results(self, fit: FitResult, val, test, preds, **chosen) -> dict[str, Any]:
        """The results (``chosen``: which head and every head's scores, after ``test``), with
        the first test functions' names beside the predicted ones; the main process writes
        ``vocabulary.json`` and ``results.md``."""
        pairs = list(zip(self.splits["test"], preds))[:EXAMPLES_SHOWN]
        shown = [{"qualname": ex.qualname, "project": ex.project, "true": ex.subtokens,
                  "predicted": p} for ex, p in pairs]  # fmt: skip
        results = {
            "dataset": "code-names",
            "model": self.cfg.model,
            "examples": {s: len(exs) for s, exs in self.splits.items()},
            "val": val,
            "test": test,
            **chosen,
            "test_examples": shown,
            "best_step": fit.best["step"],
            "median_step_ms": fit.median_step_ms,
            "wall_s": fit.earlier_wall_s + time.perf_counter() - self.started,
        }
        if self.engine.is_main:
            self.engine.write_json("vocabulary.json", self.vocab.to_dict())
            self.engine.dir.write_text("results.md", run_table(results) + "\n")
        return results


class LLMNaming(MethodNaming):
    """The LLM models (``llm-tree``, ``llm-code``, ``glfusion``): prompts from
    :func:`.llm.build_prompt`, LoRA on the LLM, names generated greedily with a key/value cache;
    GL-Fusion also scores its twin GNN head at every validation, keeps the checkpoint where the
    better head is best, and reports that head. ``llm`` and
    ``encoder`` (``(model, tokenizer)`` pairs) may be passed in (tests); else they load offline."""

    only_trainable = True  # the frozen LLM is not copied into every checkpoint
    unused_parameters = True  # a path with nothing to read in a batch gets no gradient

    def __init__(self, cfg, data=None, llm=None, encoder=None, progress: bool = True):
        super().__init__(cfg, data, progress)
        self._llm, self._encoder = llm, encoder

    @property
    def graph_mode(self) -> bool:
        return self.cfg.model == "glfusion"

    def build_data(self) -> None:
        from structattn.glfusion.loading import EncodingCache

        from .llm import build_prompt

        super().build_data()
        cfg = self.cfg
        parts = build_naming_lm(cfg, len(self.vocab.subtokens), self._llm, self._encoder)
        self.model, self.tokenizer, self.stop_ids = parts.model, parts.tokenizer, parts.stop_ids
        graph = self.graph_mode
        spec = prompt_spec(cfg, parts.model.glf.config)
        self.prompts = {
            s: [build_prompt(ex, cfg.model, self.tokenizer, spec,
                             self.vocab.encode_target(ex.subtokens) if graph else None)
                for ex in exs]
            for s, exs in self.splits.items()
        }  # fmt: skip
        self.cache = None
        if graph:
            root = Path(cfg.data_dir) if cfg.data_dir is not None else default_data_dir()
            self.cache = EncodingCache(root / "encodings", *parts.encoder, cfg.text_tokens)
            texts = {
                t for ps in self.prompts.values() for p in ps for t in (*p.texts, *p.edge_texts)
            }
            self.cache.get(sorted(texts), progress=self.progress)
        self.train_set = self.prompts["train"]

    def data_identity(self) -> dict[str, Any]:
        identity = super().data_identity()
        ids = {s: [(p.prompt_ids, p.target_ids) for p in ps] for s, ps in self.prompts.items()}
        identity["sha256"] = fingerprint(identity["sha256"], ids)
        return identity

    def build_model(self) -> nn.Module:
        return self.model

    def param_groups(self, model: nn.Module) -> list[dict[str, Any]]:
        """GL-Fusion's groups (gates, modules, GNN head, LoRA), each at its own learning rate;
        the text-only models train LoRA alone (``lora_lr``)."""
        from structattn.experiments.glfusion.groups import glfusion_param_groups

        return glfusion_param_groups(model.glf, self.cfg)

    def encode(self, texts):
        return self.cache.get(texts)

    def collate(self, items: list) -> dict[str, Any]:
        from .llm import collate_prompts

        return collate_prompts(items, self.encode if self.graph_mode else None,
                               edge_features=self.cfg.edge_texts)  # fmt: skip

    def _batches(self, split: str, limit: int | None):
        from accelerate.utils import send_to_device

        from .llm import collate_prompts

        prompts = self.prompts[split][:limit]
        step = self.cfg.eval_batch_size
        for i in range(0, len(prompts), step):
            encode = self.encode if self.graph_mode else None
            batch = collate_prompts(prompts[i : i + step], encode, with_targets=False,
                                    edge_features=self.cfg.edge_texts)  # fmt: skip
            yield send_to_device(batch, self.engine.device)

    @torch.no_grad()
    def predict(self, model: nn.Module, split: str, limit: int | None = None, head: str = "lm"):
        """Generated names (``head="lm"``) or the GNN head's (``head="gnn"``), under the
        engine's autocast (``--train.bf16`` generates in bfloat16 as it trains)."""
        was_training = model.training
        model.eval()
        out: list[list[str]] = []
        try:
            for b in self._batches(split, limit):
                check_stop(self._stop)
                with self.engine.accelerator.autocast():
                    out.extend(self._predict_batch(model, b, head))
        finally:
            model.train(was_training)
        return out

    def _predict_batch(self, model: nn.Module, b: dict, head: str) -> list[list[str]]:
        graph = b.get("graph")
        if head == "gnn":
            ids = model.head_ids(b["input_ids"], b["attention_mask"], graph)
            return [self.vocab.decode(row.tolist()) for row in ids]
        return model.generate_names(b["input_ids"], b["attention_mask"], graph, self.tokenizer,
                                    self.stop_ids, self.cfg.max_new_tokens)  # fmt: skip

    def scores(self, model: nn.Module, split: str, limit: int | None = None, head: str = "lm"):
        preds = self.predict(model, split, limit, head)
        refs = [p.subtokens for p in self.prompts[split][: len(preds)]]
        return name_scores(refs, preds), preds

    @property
    def heads(self) -> list[str]:
        """The heads a run trains and reports: the LM head, and GL-Fusion's GNN head."""
        return ["lm"] + (["gnn"] if self.graph_mode and self.cfg.gnn_head else [])

    def val_metrics(self, model: nn.Module, limit: int | None) -> dict[str, float]:
        """Validation F1 of every head; ``f1``, which picks the checkpoint, is the best head's
        (:meth:`report` then reports the head that is best on the whole validation split)."""
        by_head = {h: self.scores(model, "val", limit, head=h)[0] for h in self.heads}
        best = _best_head({h: v["f1"] for h, v in by_head.items()})
        return {**by_head[best], **{f"{h}_f1": v["f1"] for h, v in by_head.items()}}

    def report(self, model: nn.Module, fit: FitResult) -> dict[str, Any]:
        heads = self.heads
        by_head = {h: {s: self.scores(model, s, head=h) for s in ("val", "test")} for h in heads}
        chosen = _best_head({h: v["val"][0]["f1"] for h, v in by_head.items()})
        val, (test, preds) = by_head[chosen]["val"][0], by_head[chosen]["test"]
        every = {h: {s: v[0] for s, v in d.items()} for h, d in by_head.items()}
        # the head chosen on validation F1, and every head's scores
        return self._write_results(fit, val, test, preds, head=chosen, heads=every)


def _best_head(val_f1: dict[str, float]) -> str:
    """The head with the best validation F1; a tie goes to the LM head (the generated names)."""
    return max(val_f1, key=lambda h: (val_f1[h], h == "lm"))


def prompt_spec(cfg: CodeNamesConfig, glf_config) -> PromptSpec:
    """How ``cfg``'s prompts are built, with the graph-token ids of ``glf_config``."""
    return PromptSpec(glf_config.node_id, glf_config.graph_start_id, glf_config.graph_end_id,
                      cfg.max_prompt_tokens, cfg.node_text_tokens, cfg.variant)  # fmt: skip


@dataclass
class NamingParts:
    """An LLM model of code-names before training: the model, its tokenizer and stop tokens,
    and (GL-Fusion) the sentence encoder of node and edge texts."""

    model: nn.Module
    tokenizer: Any
    stop_ids: list[int]
    encoder: tuple[Any, Any] | None


def build_naming_lm(cfg: CodeNamesConfig, num_subtokens: int, llm=None, encoder=None):
    """The :class:`~.llm.NamingLM` of ``cfg.model`` over a vocabulary of ``num_subtokens``
    target sub-tokens: the LLM with GL-Fusion's modules (those of the ablations turned off) and
    LoRA, seeded by ``cfg.seed``; for the text-only models GL-Fusion's modules are frozen (they
    receive nothing). ``llm`` / ``encoder`` are ``(model, tokenizer)`` pairs, else loaded
    offline from ``cfg.llm`` / ``cfg.encoder``."""
    from structattn.glfusion.build import stop_token_ids
    from structattn.glfusion.configuration import GLFusionConfig
    from structattn.glfusion.loading import load_llm, load_text_encoder
    from structattn.glfusion.modeling import GLFusionForCausalLM, apply_lora

    from .llm import END, NamingLM

    dtype = torch.bfloat16 if cfg.llm_dtype == "bfloat16" else torch.float32
    base, tok = llm if llm is not None else load_llm(cfg.llm, dtype=dtype)
    graph = cfg.model == "glfusion"
    enc = None
    if graph:
        enc = encoder if encoder is not None else load_text_encoder(cfg.encoder)
        text_dim = enc[0].config.hidden_size
    else:
        text_dim = 8  # unused: no graph reaches the model
    n_layers = base.config.num_hidden_layers
    gl_config = GLFusionConfig(
        text_dim=text_dim,
        num_node_classes=MAX_SUBTOKENS * num_subtokens if cfg.gnn_head else 1,
        edge_dim=text_dim if cfg.edge_texts else 0,
        message_passing_layers=list(range(0, n_layers, 4)) if cfg.message_passing else [],
        cross_attention_layers=list(range(3, n_layers, 4)) if cfg.cross_attention else [],
        variant=cfg.variant if graph else "gated",
    )
    torch.manual_seed(cfg.seed)
    glf = GLFusionForCausalLM.from_base(base, gl_config, tokenizer=tok)
    glf = apply_lora(glf, r=cfg.lora_r, alpha=cfg.lora_alpha)
    if not graph:
        for name, p in glf.named_parameters():
            if name.startswith("glf_"):
                p.requires_grad_(False)
    model = NamingLM(glf, num_subtokens if (graph and cfg.gnn_head) else None)
    stops = stop_token_ids(tok)
    if not (graph and cfg.variant == "paper"):  # the target ends with a newline
        stops = tok(END, add_special_tokens=False)["input_ids"][-1:] + stops
    return NamingParts(model, tok, stops, enc)


def train_code_names(cfg: CodeNamesConfig, data: CodeNames | None = None, progress: bool = True,
                     llm=None, encoder=None) -> dict[str, Any]:  # fmt: skip
    """Train and evaluate one model; returns (and writes ``final.json``) the results."""
    if cfg.model in GNN_MODELS:
        return MethodNaming(cfg, data, progress).run()
    return LLMNaming(cfg, data, llm, encoder, progress).run()
