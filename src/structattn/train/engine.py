"""The training engine both systems share: one loop, any device, any number of processes.

An experiment (``structattn.train.hkt``, ``structattn.experiments.glfusion``) builds its data and
model and hands them to :class:`Engine`; the engine owns everything else:

* ``accelerate`` setup (mixed precision, device, processes) and device placement of every batch
  (dicts, lists, dataclasses with ``.to``: :func:`accelerate.utils.send_to_device`);
* the model contract of transformers: ``model(**batch)`` returns an output with ``.loss``;
* AdamW over :func:`param_groups` (one stated decay rule), linear warmup then cosine / linear /
  constant decay, gradient clipping, gradient accumulation (``train.grad_accum`` micro-batches
  per step, same examples per step);
* evaluation every ``train.eval_every`` steps with the best weights kept
  (``best.safetensors``), CSV + TensorBoard logs, a tqdm bar;
* atomic checkpoints and exact resume: weights, optimizer, scheduler, step, RNG states and the
  data position (batches are a pure function of the step), ``stop_at`` pauses;
* faults: SIGINT and SIGTERM finish the step in progress, checkpoint and exit with
  ``128 + signal``; a damaged newest checkpoint falls back to the previous valid one; a
  non-finite loss or gradient stops the run (``train.nonfinite=skip`` drops the update and
  counts it); ``--resume`` refuses a config that changed more than budget and logging;
* ranks: every rank trains its slice of each step's batch; only the main process writes, and
  all ranks meet before and after each checkpoint.

Launching several processes::

    # GPUs (run `accelerate config` once for FSDP / DeepSpeed, or pass flags)
    accelerate launch --num_processes 8 -m structattn.cli train --config listops-hkt
    torchrun --nproc-per-node 8 -m structattn.cli train --config listops-hkt
    # CPUs (gloo): torchrun; the engine switches accelerate to multi-CPU when WORLD_SIZE > 1
    torchrun --nproc-per-node 2 -m structattn.cli train --config listops-hkt
"""

from __future__ import annotations

import contextlib
import csv
import io
import math
import os
import signal
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn
from torch.utils.data import Sampler
from tqdm import tqdm

from structattn.errors import RunError

from .checkpoint import (
    atomic_save_weights,
    atomic_write_text,
    checkpoint_dirs,
    load_latest_valid,
    load_weights,
    remove_litter,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from .config import RESUMABLE_CHANGES, OptimConfig, TrainConfig, config_diff

__all__ = [
    "Engine",
    "FitResult",
    "MetricsLog",
    "NonFiniteLossError",
    "StepBatchSampler",
    "json_safe",
    "lr_lambda",
    "param_groups",
]

METRIC_FIELDS = ["step", "split", "loss", "acc", "lr", "step_ms"]
#: The advisory lock file of a run folder (held by the process writing it).
LOCK_FILE = ".lock"
#: Files whose presence means a run folder holds results that a fresh run must not overwrite.
RESULT_FILES = ("final.json", "results.json", "best.safetensors", "best")
#: Run folders whose lock this process holds (resolved path -> open descriptor): released when
#: the process ends, however it ends.
_HELD_LOCKS: dict[Path, int] = {}


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN or infinite loss or gradient norm."""


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
            raise RunError("the training set is empty")
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


def lr_lambda(optim: OptimConfig, max_steps: int):
    """Multiplier of the peak rate at each step: linear warmup, then the decay schedule."""

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


#: Module types whose ``weight`` is decayed; every other parameter is not.
DECAYED_MODULES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def param_groups(
    model: nn.Module, weight_decay: float, lr: float | None = None
) -> list[dict[str, Any]]:
    """AdamW groups by one rule: **decay the ``weight`` of Linear and Conv layers, nothing
    else** (biases, norms, embeddings, HKT level logits and beta, GL-Fusion gates and graph
    tokens are not decayed). A parameter shared with any other module (a tied embedding) is
    not decayed. Frozen parameters are left out. Each group carries ``names`` for reporting."""
    owners: dict[int, list[bool]] = {}
    for module in model.modules():
        for pname, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(
                isinstance(module, DECAYED_MODULES) and pname == "weight"
            )
    decay, no_decay, seen = ([], []), ([], []), set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        target = decay if all(owners.get(id(p), [False])) else no_decay
        target[0].append(p)
        target[1].append(name)
    groups = [
        {"params": decay[0], "names": decay[1], "weight_decay": weight_decay},
        {"params": no_decay[0], "names": no_decay[1], "weight_decay": 0.0},
    ]
    if lr is not None:
        for g in groups:
            g["lr"] = lr
    return [g for g in groups if g["params"]]


def describe_groups(groups: list[dict[str, Any]]) -> str:
    parts = []
    for g in groups:
        n = sum(p.numel() for p in g["params"])
        parts.append(
            f"weight_decay={g['weight_decay']}: {len(g['params'])} tensors, {n:,} parameters"
        )
    return "param groups (decay: Linear/Conv weights only): " + "; ".join(parts)


def json_safe(x: Any) -> Any:
    """NaN and infinities as ``None`` (JSON has no NaN)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    return x


class MetricsLog:
    """``metrics.csv`` + TensorBoard. On resume, rows past the resumed step are dropped by an
    atomic rewrite (only after the checkpoint has loaded)."""

    def __init__(self, run_dir: Path, resume_step: int, enabled: bool):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.csv"
        self.tb = None
        if not enabled:
            return
        rows = []
        if resume_step and self.path.is_file():
            with self.path.open(newline="") as f:
                for r in csv.DictReader(f):
                    try:
                        if int(r["step"]) <= resume_step:
                            rows.append({k: r.get(k, "") for k in METRIC_FIELDS})
                    except (TypeError, ValueError, KeyError):
                        continue  # a row cut by a kill
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=METRIC_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_text(self.path, buf.getvalue())
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(log_dir=str(Path(run_dir) / "tb"), purge_step=resume_step or None)

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


@dataclass
class FitResult:
    """What :meth:`Engine.fit` ends with."""

    step: int
    best: dict[str, Any]
    step_times: list[float]
    skipped_steps: int
    paused: bool
    model: nn.Module  # the unwrapped model (weights of the last step)
    history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def median_step_ms(self) -> float | None:
        return 1e3 * statistics.median(self.step_times) if self.step_times else None


class _StopSignals:
    """SIGINT / SIGTERM set a flag that the loop reads between steps; a second SIGINT
    raises ``KeyboardInterrupt`` at once (every write is atomic, so nothing breaks)."""

    def __init__(self):
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handler(self, signum, frame):
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum
        print(
            f"\n{signal.Signals(signum).name}: finishing this step, then checkpointing "
            "(Ctrl-C again aborts at once)",
            file=sys.stderr,
        )

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


class Engine:
    """One training run in ``run_dir``. Create it first (it sets up ``accelerate``, checks the
    run directory and seeds every RNG), then build data and model, then call :meth:`fit`.

    ``config`` is the experiment's plain config dict: written to ``config.yaml`` and compared on
    ``resume`` (keys outside ``resumable`` may not change). ``only_trainable`` checkpoints just
    the parameters that require grad (a frozen base LM is not copied). ``select`` is the
    evaluation metric that picks the best weights (higher is better)."""

    def __init__(
        self,
        *,
        run_dir: Path,
        optim: OptimConfig,
        train: TrainConfig,
        seed: int,
        config: dict[str, Any],
        resume: bool = False,
        name: str = "train",
        progress: bool = True,
        only_trainable: bool = False,
        select: str = "acc",
        resumable: frozenset[str] = RESUMABLE_CHANGES,
    ):
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        self.run_dir = Path(run_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.optim, self.train, self.seed = optim, train, seed
        self.config, self.name, self.progress = config, name, progress
        self.only_trainable, self.select = only_trainable, select
        self.resume = resume
        # torchrun on machines without CUDA: accelerate needs cpu=True to form a gloo group.
        multi_cpu = not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1
        self.accelerator = Accelerator(
            mixed_precision="bf16" if train.bf16 else "no", cpu=multi_cpu
        )
        self.is_main = self.accelerator.is_main_process
        self._check_run_dir(resumable)
        self.accelerator.wait_for_everyone()
        set_seed(seed)

    # ------------------------------------------------------------------ run directory

    @classmethod
    def for_experiment(
        cls, cfg: Any, run_dir: Path, name: str, progress: bool = True, **kwargs: Any
    ) -> Engine:
        """The engine of an experiment config holding ``optim``, ``train``, ``seed`` and
        ``resume`` (written to ``config.yaml`` as a plain dict)."""
        from .config import config_to_dict

        return cls(
            run_dir=run_dir,
            optim=cfg.optim,
            train=cfg.train,
            seed=cfg.seed,
            config=config_to_dict(cfg),
            resume=cfg.resume,
            name=name,
            progress=progress,
            **kwargs,
        )

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def _lock_run_dir(self) -> None:
        """One writer per run folder: an advisory lock on ``run_dir/.lock`` held for this
        process's life (the file descriptor stays open on the engine); a second process is
        refused naming the holder's PID. Runs one after another in one process share it."""
        import fcntl

        for parent in (self.run_dir, *self.run_dir.parents):
            if parent.exists() and not parent.is_dir():
                raise RunError(f"run_dir {self.run_dir}: {parent} is a file, not a folder")
        key = self.run_dir.resolve()
        if key in _HELD_LOCKS:
            return
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise RunError(f"run_dir {self.run_dir} cannot be written ({err.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunError(
                f"{self.run_dir} is in use by another process (PID {holder}); one writer per "
                "run folder: wait for it, or choose another run_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        _HELD_LOCKS[key] = fd

    def _check_run_dir(self, resumable: frozenset[str]) -> None:
        if self.is_main:
            self._lock_run_dir()
        has_checkpoints = bool(checkpoint_dirs(self.ckpt_dir))
        if not self.resume and has_checkpoints:
            raise RunError(
                f"{self.run_dir} already holds checkpoints: pass --resume to continue, "
                "or choose another run_dir"
            )
        results = [n for n in RESULT_FILES if (self.run_dir / n).exists()]
        if not self.resume and results:
            raise RunError(
                f"{self.run_dir} already holds results ({', '.join(results)}) and is never "
                "overwritten by a fresh run: choose another run_dir, or remove the folder"
            )
        if self.resume and not has_checkpoints:
            raise RunError(f"--resume: {self.ckpt_dir} holds no checkpoint to resume from")
        if self.resume:
            saved_path = self.run_dir / "config.yaml"
            if not saved_path.is_file():
                raise RunError(f"--resume: {saved_path} is missing")
            try:
                saved = yaml.safe_load(saved_path.read_text())
            except yaml.YAMLError as err:
                raise RunError(f"--resume: {saved_path} is not valid YAML ({err})") from None
            changed = [k for k in config_diff(saved or {}, self.config) if k not in resumable]
            if changed:
                raise RunError(
                    f"--resume: the config differs from {saved_path} in {', '.join(changed)}; "
                    f"only {', '.join(sorted(resumable))} may change on resume "
                    "(start a new run_dir to change the rest)"
                )
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            remove_litter(self.run_dir)

    def write_config(self) -> None:
        if self.is_main:
            atomic_write_text(
                self.run_dir / "config.yaml", yaml.safe_dump(self.config, sort_keys=False)
            )

    def write_json(self, name: str, payload: dict[str, Any]) -> None:
        """``run_dir/name`` as strict JSON (NaN written as null), main process only."""
        import json

        if self.is_main:
            text = json.dumps(json_safe(payload), indent=2, allow_nan=False)
            atomic_write_text(self.run_dir / name, text + "\n")

    # ------------------------------------------------------------------ weights

    def save_best(self, model: nn.Module) -> None:
        if self.is_main:
            atomic_save_weights(model, self.run_dir / "best.safetensors", self.only_trainable)

    def load_best(self, model: nn.Module) -> bool:
        """Load ``best.safetensors`` into ``model``; ``False`` when there is none."""
        path = self.run_dir / "best.safetensors"
        if not path.is_file():
            return False
        try:
            load_weights(model, path, partial=self.only_trainable)
        except ValueError as err:
            raise RunError(str(err)) from None
        return True

    # ------------------------------------------------------------------ the loop

    def fit(
        self,
        model: nn.Module,
        train_set: Sequence[Any],
        collate: Callable[[list[Any]], dict[str, Any]],
        evaluate: Callable[[nn.Module], dict[str, float]],
        *,
        groups: list[dict[str, Any]] | None = None,
        accuracy: Callable[[Any, dict[str, Any]], tuple[int, int]] | None = None,
    ) -> FitResult:
        """Train ``model`` on ``train_set`` (indexable; ``collate(items)`` gives the keyword
        arguments of ``model``, labels included) for ``train.max_steps`` steps.

        ``evaluate(model)`` returns validation metrics including ``self.select``; ``groups``
        overrides :func:`param_groups`; ``accuracy(output, batch) -> (correct, n)`` adds the
        training accuracy to the log."""
        acc = self.accelerator
        tc, oc = self.train, self.optim
        if len(train_set) < 1:
            raise RunError("the training set is empty")
        groups = groups if groups is not None else param_groups(model, oc.weight_decay)
        if self.is_main and self.progress:
            print(describe_groups(groups), file=sys.stderr)
        optimizer = torch.optim.AdamW(
            [{k: v for k, v in g.items() if k != "names"} for g in groups],
            lr=oc.lr,
            betas=(oc.beta1, oc.beta2),
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(oc, tc.max_steps))
        step, best, step_times, skipped, saved_rng = 0, {"value": -math.inf, "step": 0}, [], 0, None
        if self.resume:
            loaded = self._load_latest(model)
            path, state = loaded
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            step, best, step_times = state["step"], state["best"], state["step_times"]
            skipped, saved_rng = state.get("skipped", 0), state["rng"]
            if self.is_main and self.progress:
                print(f"resumed from {path} (step {step})", file=sys.stderr)
        # Only after a successful load: config.yaml and metrics.csv may be rewritten.
        self.write_config()
        model, optimizer = acc.prepare(model, optimizer)
        raw = acc.unwrap_model(model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        log = MetricsLog(self.run_dir, step, enabled=self.is_main)
        sampler = StepBatchSampler(
            len(train_set),
            tc.batch_size,
            self.seed,
            step,
            tc.max_steps,
            acc.process_index,
            acc.num_processes,
        )
        if saved_rng is not None:
            set_rng_state(saved_rng)

        def checkpoint() -> None:
            acc.wait_for_everyone()
            if self.is_main:
                save_checkpoint(
                    self.ckpt_dir,
                    step,
                    raw,
                    {
                        "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(),
                        "rng": rng_state(),
                        "best": best,
                        "step_times": step_times,
                        "skipped": skipped,
                    },
                    keep=tc.keep_checkpoints,
                    only_trainable=self.only_trainable,
                )
            acc.wait_for_everyone()

        bar = tqdm(
            total=tc.max_steps,
            initial=step,
            desc=self.name,
            unit="step",
            disable=not (self.progress and self.is_main),
            file=sys.stderr,
            dynamic_ncols=True,
        )
        run_loss, run_correct, run_count, run_steps = 0.0, 0, 0, 0
        history: list[dict[str, Any]] = []
        paused = False
        signals = _StopSignals()
        with signals:
            try:
                for indices in sampler:
                    start = time.perf_counter()
                    model.train()
                    loss_value, correct, count = self._step(
                        model, train_set, collate, indices, accuracy
                    )
                    norm = None
                    if oc.grad_clip:
                        norm = acc.clip_grad_norm_(trainable, oc.grad_clip)
                    finite = math.isfinite(loss_value) and (
                        norm is None or bool(torch.isfinite(torch.as_tensor(norm)))
                    )
                    finite = self._all_ranks(finite, all)
                    if finite:
                        optimizer.step()
                    else:
                        skipped += 1
                        what = (
                            f"loss {loss_value}"
                            if not math.isfinite(loss_value)
                            else (f"gradient norm {float(norm)}")
                        )
                        if tc.nonfinite == "error" or skipped > tc.max_skipped:
                            raise NonFiniteLossError(
                                f"non-finite training {what} at step {step + 1} of "
                                f"{self.run_dir}; nothing of this step was applied. Lower "
                                "optim.lr, check the data, or set train.nonfinite=skip "
                                f"(skipped so far: {skipped - 1}, limit train.max_skipped="
                                f"{tc.max_skipped}); --resume continues from the last checkpoint"
                            )
                        warnings.warn(
                            f"step {step + 1}: non-finite {what}, update skipped "
                            f"({skipped}/{tc.max_skipped})",
                            RuntimeWarning,
                            stacklevel=2,
                        )
                    scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
                    if acc.device.type == "cuda":
                        torch.cuda.synchronize()
                    step_times.append(time.perf_counter() - start)
                    step += 1
                    if finite:
                        run_loss += loss_value * count
                        run_correct += correct
                        run_count += count
                        run_steps += 1
                    bar.update(1)
                    if step % tc.log_every == 0:
                        loss_sum, correct_sum, count_sum = self._sum_ranks(
                            run_loss, run_correct, run_count
                        )
                        if count_sum:
                            log.log(
                                step,
                                "train",
                                loss=loss_sum / count_sum,
                                acc=correct_sum / count_sum if accuracy is not None else None,
                                lr=scheduler.get_last_lr()[0],
                                step_ms=1e3 * step_times[-1],
                            )
                            bar.set_postfix(loss=f"{loss_sum / count_sum:.3f}")
                        run_loss, run_correct, run_count, run_steps = 0.0, 0, 0, 0
                    evaluated = step % tc.eval_every == 0 or step == tc.max_steps
                    if evaluated:
                        metrics = evaluate(raw)
                        if self.select not in metrics:
                            raise KeyError(f"evaluate() returned no {self.select!r}")
                        log.log(step, "val", loss=metrics.get("loss"), acc=metrics.get("acc"))
                        history.append({"step": step, **metrics})
                        value = metrics[self.select]
                        bar.set_postfix({f"val_{self.select}": f"{value:.3f}"})
                        if value > best["value"]:
                            best = {"value": value, "step": step}
                            self.save_best(raw)
                        checkpoint()
                    if self._all_ranks(signals.received is not None, any):
                        if not evaluated:
                            checkpoint()
                        received = signals.received
                        bar.close()
                        log.close()
                        name = signal.Signals(received).name if received else "signal"
                        print(
                            f"{name}: stopped at step {step}; checkpoint saved, continue with "
                            f"--resume (run_dir {self.run_dir})",
                            file=sys.stderr,
                        )
                        raise SystemExit(128 + (received or signal.SIGTERM))
                    if step == tc.stop_at and step < tc.max_steps:
                        if not evaluated:
                            checkpoint()
                        paused = True
                        break
            finally:
                bar.close()
                log.close()
        return FitResult(step, best, step_times, skipped, paused, raw, history)

    def _step(self, model, train_set, collate, indices, accuracy) -> tuple[float, int, int]:
        """Forward and backward of one step's batch in ``grad_accum`` micro-batches; returns the
        step's mean loss, correct predictions and examples."""
        from accelerate.utils import send_to_device

        acc = self.accelerator
        k = min(self.train.grad_accum, len(indices))
        chunks = [c.tolist() for c in torch.tensor(indices).tensor_split(k)] if k > 1 else [indices]
        total, correct, count = 0.0, 0, 0
        for j, chunk in enumerate(chunks):
            batch = send_to_device(collate([train_set[i] for i in chunk]), self.device)
            sync = contextlib.nullcontext() if j == len(chunks) - 1 else acc.no_sync(model)
            with sync:
                with acc.autocast():
                    out = model(**batch)
                loss = getattr(out, "loss", None)
                if loss is None:
                    raise RuntimeError("the model returned no .loss: the batch must hold labels")
                acc.backward(loss * (len(chunk) / len(indices)) if k > 1 else loss)
            value = loss.item()
            total += value * len(chunk)
            if accuracy is not None:
                c, n = accuracy(out, batch)
                correct += c
            count += len(chunk)
        return total / count, correct, count

    def _all_ranks(self, flag: bool, reduce) -> bool:
        """``reduce`` (``all`` / ``any``) of a flag over the processes."""
        acc = self.accelerator
        if acc.num_processes == 1:
            return flag
        t = torch.tensor([float(flag)], device=acc.device)
        gathered = acc.gather(t)
        return bool(reduce(gathered.bool().tolist()))

    def _sum_ranks(self, *values: float) -> list[float]:
        """Each value summed over the processes (the logged training metrics are global)."""
        acc = self.accelerator
        if acc.num_processes == 1:
            return list(values)
        t = torch.tensor([list(values)], dtype=torch.float64, device=acc.device)
        return acc.gather(t).sum(0).tolist()

    def _load_latest(self, model: nn.Module) -> tuple[Path, dict[str, Any]]:
        """The newest valid checkpoint into ``model`` (main process first: it sets damaged
        ones aside, then the others load what it chose)."""
        loaded = None
        for turn in (True, False):
            if self.is_main == turn:
                try:
                    loaded = load_latest_valid(
                        self.ckpt_dir, model, partial=self.only_trainable, quarantine=turn
                    )
                except ValueError as err:
                    raise RunError(f"--resume: {err}") from None
            self.accelerator.wait_for_everyone()
        if loaded is None:
            raise RunError(f"--resume: {self.ckpt_dir} holds no checkpoint to resume from")
        return loaded
