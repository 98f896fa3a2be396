"""One training loop for every classifier in the library, on ``accelerate``.

Launch commands::

    # one CPU or GPU (accelerate picks the device)
    structattn train --config listops-hkt --preset quick --seed 0

    # several GPUs on one node (run `accelerate config` once, or pass flags)
    accelerate launch --num_processes 8 -m structattn.cli train --config listops-hkt --preset paper
    torchrun --nproc-per-node 8 -m structattn.cli train --config listops-hkt --preset paper

    # several nodes
    accelerate launch --num_machines 2 --machine_rank R --main_process_ip HOST \\
        --main_process_port 29500 --num_processes 16 -m structattn.cli train --config ...

With P processes each step consumes ``P * batch_size`` examples (each process its own slice of
the step's batch). AdamW, linear warmup then cosine/linear decay, gradient clipping, optional
bf16 autocast, validation every ``eval_every`` steps with the best weights kept
(``best.safetensors``), and the test set evaluated with them at the end.

A run directory holds ``config.yaml`` (resolved), ``metrics.csv``, TensorBoard events in ``tb/``,
``checkpoints/`` (atomic, resumable), ``best.safetensors`` and ``final.json``. Resuming
(``--resume``) restores weights, optimizer, scheduler, step, RNG states and the data position, so
N + N steps give exactly the parameters of 2N straight steps.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.utils.data import DataLoader, Sampler
from tqdm import tqdm

from structattn.data import SequenceDataset, TaskData, load_task, pad_collate
from structattn.hkt.model import SequenceClassifier, count_parameters

from .checkpoint import (
    atomic_save_weights,
    latest_checkpoint,
    load_checkpoint,
    load_weights,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from .config import ExperimentConfig, config_from_dict, config_to_dict

__all__ = ["MetricsLog", "StepBatchSampler", "evaluate", "evaluate_run", "lr_lambda", "train"]

METRIC_FIELDS = ["step", "split", "loss", "acc", "lr", "step_ms"]


class StepBatchSampler(Sampler[list[int]]):
    """Index batches for steps ``start .. stop - 1``, a pure function of the step.

    Epoch ``e`` shuffles with ``torch.randperm(n, seed + e)``; step ``s`` takes slice
    ``s mod steps_per_epoch`` of it (incomplete tail dropped), and process ``rank`` of ``world``
    its own ``batch_size`` part. Restarting at any step reproduces the same batches.
    """

    def __init__(
        self,
        n: int,
        batch_size: int,
        seed: int,
        start: int,
        stop: int,
        rank: int = 0,
        world: int = 1,
    ):
        if n < 1:
            raise ValueError("the training set is empty")
        self.n, self.seed, self.start, self.stop = n, seed, start, stop
        self.rank, self.world = rank, world
        self.batch_size = min(batch_size, max(1, n // world))
        self.per_epoch = max(1, n // (self.batch_size * world))

    def __len__(self) -> int:
        return max(0, self.stop - self.start)

    def __iter__(self):
        epoch, perm = None, None
        global_bs = self.batch_size * self.world
        for step in range(self.start, self.stop):
            e, offset = divmod(step, self.per_epoch)
            if e != epoch:
                epoch = e
                perm = torch.randperm(
                    self.n, generator=torch.Generator().manual_seed(self.seed + e)
                )
            lo = offset * global_bs + self.rank * self.batch_size
            yield perm[lo : lo + self.batch_size].tolist()


def lr_lambda(optim, max_steps: int):
    def fn(step: int) -> float:
        if optim.warmup_steps and step < optim.warmup_steps:
            return (step + 1) / optim.warmup_steps
        if optim.schedule == "constant":
            return 1.0
        progress = (step - optim.warmup_steps) / max(1, max_steps - optim.warmup_steps)
        progress = min(max(progress, 0.0), 1.0)
        if optim.schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return fn


def _param_groups(model: nn.Module, weight_decay: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        # Matrices decay; biases, norms, embeddings, level logits and beta do not.
        is_matrix = p.dim() >= 2 and "tok." not in name and "pos." not in name
        (decay if is_matrix else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


@torch.no_grad()
def evaluate(
    model: nn.Module,
    dataset: SequenceDataset,
    batch_size: int,
    device: torch.device | str = "cpu",
    max_batches: int | None = None,
    autocast=contextlib.nullcontext,
) -> dict[str, float]:
    """Mean loss and accuracy of ``model`` on ``dataset`` (first ``max_batches`` batches)."""
    was_training = model.training
    model.eval()
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=pad_collate)
    total_loss, correct, count = 0.0, 0, 0
    for i, batch in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        tokens, mask, labels = (batch[k].to(device) for k in ("tokens", "mask", "labels"))
        with autocast():
            logits = model(tokens, mask)
        total_loss += F.cross_entropy(logits.float(), labels, reduction="sum").item()
        correct += (logits.argmax(-1) == labels).sum().item()
        count += len(labels)
    model.train(was_training)
    return {"loss": total_loss / max(count, 1), "acc": correct / max(count, 1), "n": count}


class MetricsLog:
    """CSV + TensorBoard; on resume drops CSV rows past the resumed step."""

    def __init__(self, run_dir: Path, resume_step: int, enabled: bool):
        self.enabled = enabled
        self.path = run_dir / "metrics.csv"
        self.tb = None
        if not enabled:
            return
        rows = []
        if resume_step and self.path.is_file():
            with self.path.open() as f:
                rows = [r for r in csv.DictReader(f) if int(r["step"]) <= resume_step]
        with self.path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=METRIC_FIELDS)
            writer.writeheader()
            writer.writerows(rows)
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(log_dir=str(run_dir / "tb"), purge_step=resume_step or None)

    def log(self, step: int, split: str, **values: float) -> None:
        if not self.enabled:
            return
        row = {"step": step, "split": split, **values}
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, fieldnames=METRIC_FIELDS).writerow(row)
        for key, value in values.items():
            if value is not None and value != "":
                self.tb.add_scalar(f"{split}/{key}", value, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def build_model(cfg: ExperimentConfig, data: TaskData) -> SequenceClassifier:
    """The classifier for ``cfg`` with vocab, classes and max length taken from ``data``."""
    model_cfg = cfg.model.replace(
        vocab_size=data.vocab_size, num_classes=data.num_classes, max_len=data.seq_len
    )
    return SequenceClassifier(model_cfg)


def hkt_state(model: SequenceClassifier) -> dict[str, Any] | None:
    """Learned level weights (H, L) and beta (H,) per HKT layer, as lists."""
    layers = model.encoder.hkt_layers()
    if not layers:
        return None
    with torch.no_grad():
        return {
            "level_weights": [layer.level_weights().float().cpu().tolist() for layer in layers],
            "beta": [layer.beta().float().cpu().tolist() for layer in layers],
        }


def train(cfg: ExperimentConfig, data: TaskData | None = None, progress: bool = True) -> dict:
    """Train ``cfg``; returns the final metrics (also written to ``final.json``)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    run_dir = cfg.resolved_run_dir()
    ckpt_dir = run_dir / "checkpoints"
    resume_from = latest_checkpoint(ckpt_dir) if cfg.resume else None
    if not cfg.resume and latest_checkpoint(ckpt_dir) is not None:
        raise ValueError(
            f"{run_dir} already holds checkpoints: pass resume=True (--resume) "
            "to continue, or choose another run_dir"
        )
    accelerator = Accelerator(mixed_precision="bf16" if cfg.train.bf16 else "no")
    main = accelerator.is_main_process
    run_dir.mkdir(parents=True, exist_ok=True)
    set_seed(cfg.seed)
    data = data if data is not None else load_task(cfg.data)
    model = build_model(cfg, data)
    optimizer = torch.optim.AdamW(
        _param_groups(model, cfg.optim.weight_decay),
        lr=cfg.optim.lr,
        betas=(cfg.optim.beta1, cfg.optim.beta2),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(cfg.optim, cfg.train.max_steps)
    )
    step, best, step_times, saved_rng = 0, {"val_acc": -1.0, "step": 0}, [], None
    if resume_from is not None:
        state = load_checkpoint(resume_from, model)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, best, step_times = state["step"], state["best"], state["step_times"]
        saved_rng = state["rng"]
    if main:
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    model, optimizer = accelerator.prepare(model, optimizer)
    raw_model = accelerator.unwrap_model(model)
    log = MetricsLog(run_dir, step, enabled=main)

    sampler = StepBatchSampler(
        len(data.train),
        cfg.train.batch_size,
        cfg.seed,
        step,
        cfg.train.max_steps,
        accelerator.process_index,
        accelerator.num_processes,
    )
    # Its own generator: creating the iterator must not draw from the global RNG (dropout).
    loader = DataLoader(
        data.train, batch_sampler=sampler, collate_fn=pad_collate, generator=torch.Generator()
    )
    if saved_rng is not None:
        set_rng_state(saved_rng)

    def checkpoint() -> None:
        if main:
            save_checkpoint(
                ckpt_dir,
                step,
                raw_model,
                {
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "rng": rng_state(),
                    "best": best,
                    "step_times": step_times,
                },
                keep=cfg.train.keep_checkpoints,
            )
        accelerator.wait_for_everyone()

    bar = tqdm(
        total=cfg.train.max_steps,
        initial=step,
        desc=cfg.name,
        unit="step",
        disable=not (progress and main),
        file=sys.stderr,
        dynamic_ncols=True,
    )
    run_loss, run_correct, run_count = 0.0, 0, 0
    try:
        for batch in loader:
            start = time.perf_counter()
            model.train()
            tokens, mask, labels = (
                batch[k].to(accelerator.device) for k in ("tokens", "mask", "labels")
            )
            with accelerator.autocast():
                logits = model(tokens, mask)
            loss = F.cross_entropy(logits.float(), labels)
            accelerator.backward(loss)
            if cfg.optim.grad_clip:
                accelerator.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if accelerator.device.type == "cuda":
                torch.cuda.synchronize()
            step_times.append(time.perf_counter() - start)
            step += 1
            run_loss += loss.item() * len(labels)
            run_correct += (logits.argmax(-1) == labels).sum().item()
            run_count += len(labels)
            bar.update(1)
            if step % cfg.train.log_every == 0:
                log.log(
                    step,
                    "train",
                    loss=run_loss / run_count,
                    acc=run_correct / run_count,
                    lr=scheduler.get_last_lr()[0],
                    step_ms=1e3 * step_times[-1],
                )
                bar.set_postfix(loss=f"{run_loss / run_count:.3f}")
                run_loss, run_correct, run_count = 0.0, 0, 0
            if step % cfg.train.eval_every == 0 or step == cfg.train.max_steps:
                val = evaluate(
                    raw_model,
                    data.val,
                    cfg.train.batch_size,
                    accelerator.device,
                    cfg.train.eval_batches,
                    accelerator.autocast,
                )
                log.log(step, "val", loss=val["loss"], acc=val["acc"])
                bar.set_postfix(val_acc=f"{val['acc']:.3f}")
                if val["acc"] > best["val_acc"]:
                    best = {"val_acc": val["acc"], "step": step}
                    if main:
                        atomic_save_weights(raw_model, run_dir / "best.safetensors")
                checkpoint()
            if step == cfg.train.stop_at and step < cfg.train.max_steps:
                if step % cfg.train.eval_every:
                    checkpoint()
                break
    except KeyboardInterrupt:
        checkpoint()
        bar.close()
        log.close()
        raise SystemExit(
            f"interrupted at step {step}; checkpoint saved, continue with --resume "
            f"(run_dir {run_dir})"
        ) from None
    bar.close()
    log.close()
    if step < cfg.train.max_steps:
        return {"name": cfg.name, "paused_at": step, "run_dir": str(run_dir)}

    if (run_dir / "best.safetensors").is_file():
        load_weights(raw_model, run_dir / "best.safetensors")
    test = evaluate(
        raw_model,
        data.test,
        cfg.train.batch_size,
        accelerator.device,
        autocast=accelerator.autocast,
    )
    final = {
        "name": cfg.name,
        "task": data.name,
        "attention": cfg.model.attention,
        "seed": cfg.seed,
        "data_source": data.source,
        "stand_in": data.stand_in,
        "seq_len": data.seq_len,
        "steps": step,
        "best_step": best["step"],
        "val_acc": best["val_acc"],
        "test_acc": test["acc"],
        "test_loss": test["loss"],
        "test_examples": test["n"],
        "median_step_ms": 1e3 * statistics.median(step_times) if step_times else None,
        "parameters": count_parameters(raw_model),
        "device": str(accelerator.device),
        "processes": accelerator.num_processes,
        "hkt": hkt_state(raw_model),
    }
    if main:
        (run_dir / "final.json").write_text(json.dumps(final, indent=2))
    return final


def load_run_config(run_dir: Path) -> ExperimentConfig:
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a run directory?")
    values = yaml.safe_load(path.read_text())
    values["resume"] = False
    return config_from_dict(values)


def evaluate_run(run_dir: Path, split: str = "test", data: TaskData | None = None) -> dict:
    """Evaluate a run's best weights (or its latest checkpoint) on ``split``."""
    if split not in ("train", "val", "test"):
        raise ValueError(f"split must be train, val or test, got {split!r}")
    run_dir = Path(run_dir)
    cfg = load_run_config(run_dir)
    data = data if data is not None else load_task(cfg.data)
    model = build_model(cfg, data)
    best = run_dir / "best.safetensors"
    if best.is_file():
        load_weights(model, best)
        weights = str(best)
    else:
        latest = latest_checkpoint(run_dir / "checkpoints")
        if latest is None:
            raise FileNotFoundError(f"{run_dir} has neither best.safetensors nor a checkpoint")
        load_checkpoint(latest, model)
        weights = str(latest)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    metrics = evaluate(model.to(device), getattr(data, split), cfg.train.batch_size, device)
    return {
        "run_dir": str(run_dir),
        "split": split,
        "weights": weights,
        "data_source": data.source,
        "stand_in": data.stand_in,
        **metrics,
    }
