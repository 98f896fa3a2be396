"""The training engine both systems share: one loop, any device, any number of processes.

An :class:`~structattn.engine.experiment.Experiment` builds its data and model and hands them to
:class:`Engine`; the engine owns everything else:

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
import math
import os
import shutil
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn
from tqdm import tqdm

from structattn.errors import RunError

from .checkpoint import (
    atomic_save_weights,
    load_latest_valid,
    load_weights,
    rng_state,
    save_checkpoint,
    set_rng_state,
    weights_metadata,
)
from .config import RunConfig, config_to_dict, default_config
from .metrics import MetricsLog
from .optim import build_optimizer, check_optim, describe_groups, param_groups
from .rundir import RunDir
from .sampler import StepBatchSampler
from .state import Fit, FitResult, TrainState, Window

__all__ = ["Engine", "FitRules", "NonFiniteLossError", "best_record", "stop_requested"]


class NonFiniteLossError(RunError, RuntimeError):
    """Training produced a NaN or infinite loss or gradient norm: a run that cannot go on as
    configured (one line from the command line, like every :class:`RunError`)."""


def best_record(meta: dict[str, str], path: Path) -> dict[str, Any]:
    """The record in ``best.safetensors``' header (``meta``) as ``{"step": int, "value":
    float}``; empty for a file written before the record was kept, and for a record that does
    not read as a step and a finite value (named in a warning: the loop's own record is used)."""
    if "step" not in meta:
        return {}
    step, value = meta.get("step", ""), meta.get("value", "")
    try:
        record = {"step": int(step), "value": float(value)}
    except (TypeError, ValueError):
        record = None
    if record is None or record["step"] < 0 or not math.isfinite(record["value"]):
        warnings.warn(
            f"{path}: the header's record (step={step!r}, value={value!r}) is not a step and a "
            "finite value; ignored, the training loop's own record of the best is used",
            RuntimeWarning,
            stacklevel=3,
        )
        return {}
    return record


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
        _LISTENING.append(self)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        _LISTENING.remove(self)


#: The stop flags of the training loops in progress in this process (innermost last).
_LISTENING: list[_StopSignals] = []


def stop_requested() -> int | None:
    """The signal (SIGINT or SIGTERM) that the training loop in progress received and has not
    acted on yet, else ``None``: the loop stops after the step in progress, and a long
    evaluation reads this between batches to stop sooner."""
    return _LISTENING[-1].received if _LISTENING else None


def _release_precision(mixed: str) -> None:
    """Let one process train runs of different precisions one after another (a table's GNN rows
    in float32, then its LLM rows under bfloat16 autocast): accelerate keeps one
    ``AcceleratorState`` per process and refuses another ``mixed_precision``. The state that
    holds the precision is dropped; the process group (``PartialState``) is kept."""
    from accelerate.state import AcceleratorState

    if AcceleratorState._shared_state.get("_mixed_precision", mixed) != mixed:
        AcceleratorState._reset_state(reset_partial_state=False)


@dataclass(frozen=True)
class FitRules:
    """How an experiment's fit is kept and judged (its class attributes): ``only_trainable``
    checkpoints just the parameters that require grad (a frozen base LM is not copied);
    ``select`` is the evaluation metric that picks the best weights (higher is better) and
    ``curve`` the one written to ``metrics.csv``'s acc column; ``unused_parameters`` lets a
    distributed step leave parameters without a gradient."""

    only_trainable: bool = False
    select: str = "acc"
    curve: str = "acc"
    unused_parameters: bool = False


class Engine:
    """One training run of a :class:`~structattn.engine.config.RunConfig`: its folder, engine
    sections, seed and resume flag. Create it first (it sets up ``accelerate``, checks the run
    directory and seeds every RNG), then build data and model, then call :meth:`fit`.

    The config, as a plain dict, is written to ``config.yaml`` and compared on ``resume``
    (keys outside the config class's ``resumable`` may not change)."""

    def __init__(self, cfg: RunConfig, progress: bool = True, rules: FitRules = FitRules()):
        from accelerate import Accelerator, DistributedDataParallelKwargs
        from accelerate.utils import set_seed

        check_optim(cfg.optim)  # before anything is written
        self.dir = RunDir(cfg.resolved_run_dir())
        self.run_dir = self.dir.path
        self.optim, self.train, self.seed = cfg.optim, cfg.train, cfg.seed
        self.config, self.name, self.progress = config_to_dict(cfg), cfg.name, progress
        self.rules = rules
        self.resume = resume = cfg.resume
        self.current: Fit | None = None  # what the fit in progress holds (set by fit)
        # torchrun on machines without CUDA: accelerate needs cpu=True to form a gloo group.
        multi_cpu = not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1
        mixed = "bf16" if cfg.train.bf16 else "no"
        _release_precision(mixed)
        ddp = DistributedDataParallelKwargs(find_unused_parameters=rules.unused_parameters)
        self.accelerator = Accelerator(mixed_precision=mixed, cpu=multi_cpu, kwargs_handlers=[ddp])
        self.is_main = self.accelerator.is_main_process
        overwrite = getattr(cfg, "overwrite", False)
        if overwrite and resume:
            raise RunError("--overwrite starts the run afresh: it cannot be combined with --resume")
        if self.is_main:
            self.dir.lock()
            if overwrite:
                self.dir.clear()
        self.accelerator.wait_for_everyone()
        self.dir.check_start(resume)
        if resume:
            self.dir.check_resume_config(self.config, type(cfg).resumable,
                                         default_config(type(cfg)))  # fmt: skip
        if self.is_main:
            self.dir.clean()
        self.accelerator.wait_for_everyone()
        set_seed(cfg.seed)

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def say(self, text: str) -> None:
        """A line on stderr from the main process, when progress is shown."""
        if self.is_main and self.progress:
            print(text, file=sys.stderr)

    # ------------------------------------------------------------------ files

    def write_config(self) -> None:
        if self.is_main:
            self.dir.write_config(self.config)

    def write_json(self, name: str, payload: dict[str, Any]) -> None:
        """``run_dir/name`` as strict JSON (NaN written as null), main process only."""
        if self.is_main:
            self.dir.write_json(name, payload)

    def check_data(self, identity: dict[str, Any]) -> None:
        """Record the data's identity (fresh run) or refuse other data (``resume``)."""
        if self.is_main:
            self.dir.check_data(identity, self.resume)
        self.accelerator.wait_for_everyone()

    def save_best(self, model: nn.Module, best: dict[str, Any]) -> None:
        """``best.safetensors`` with its step and metric value in the file's header: the
        weights and the record of them are one file."""
        if self.is_main:
            record = {"step": str(best["step"]), "value": repr(float(best["value"])),
                      "select": self.rules.select}  # fmt: skip
            atomic_save_weights(model, self.dir.best, self.rules.only_trainable, metadata=record)

    def _check_best(self) -> None:
        """A damaged ``best.safetensors`` is refused when the run resumes, not after it has
        trained to the end (the run's best weights are then lost: only a fresh start helps)."""
        if not self.dir.best.is_file():
            return
        try:
            load_file(str(self.dir.best))
        except Exception as err:  # safetensors raises its own error types for damaged files
            raise RunError(
                f"--resume: {self.dir.best} cannot be read ({type(err).__name__}: {err}); the "
                "run's best weights are lost: start it again with --overwrite"
            ) from None

    def load_best(self, model: nn.Module) -> dict[str, Any] | None:
        """Load ``best.safetensors`` into ``model``; its record (``step``, ``value``; empty
        for files written before the record was kept), or ``None`` when there is no file."""
        if not self.dir.best.is_file():
            return None
        try:
            load_weights(model, self.dir.best, partial=self.rules.only_trainable)
            meta = weights_metadata(self.dir.best)
        except Exception as err:  # ValueError, OSError, safetensors' own errors
            raise RunError(f"{self.dir.best}: {err}") from None
        return best_record(meta, self.dir.best)

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

        ``evaluate(model)`` returns validation metrics including ``rules.select``; ``groups``
        overrides :func:`param_groups`; ``accuracy(output, batch) -> (correct, n)`` adds the
        training accuracy to the log."""
        sampler, log = self._setup(model, train_set, groups, accuracy)
        state = self.current.state
        self.current.earlier_wall_s, self.current.segment_start = state.wall_s, time.perf_counter()
        bar = tqdm(total=self.train.max_steps, initial=state.step, desc=self.name, unit="step",
                   disable=not (self.progress and self.is_main), file=sys.stderr,
                   dynamic_ncols=True)  # fmt: skip
        history: list[dict[str, Any]] = []
        window, paused, signals = Window(), False, _StopSignals()
        with signals:
            try:
                for indices in sampler:
                    self._train_step(train_set, collate, indices, window)
                    bar.update(1)
                    if state.step % self.train.log_every == 0:
                        self._log_train(log, bar, window)
                        window = Window()
                    evaluated = self._maybe_evaluate(evaluate, log, bar, history)
                    if self._all_ranks(signals.received is not None, any):
                        self._stop_on_signal(signals.received, evaluated, bar, log)
                    if state.step == self.train.stop_at and state.step < self.train.max_steps:
                        if not evaluated:
                            self._checkpoint()
                        paused = True
                        break
            finally:
                bar.close()
                log.close()
        return FitResult(state.step, state.best, state.step_times, state.skipped, paused,
                         self.current.raw, history, self.current.earlier_wall_s)  # fmt: skip

    def _setup(self, model, train_set, groups, accuracy) -> tuple[StepBatchSampler, MetricsLog]:
        """Optimizer and schedule, the resumed state (only then are ``config.yaml`` and
        ``metrics.csv`` rewritten), device placement, the step sampler and the RNG."""
        if len(train_set) < 1:
            raise RunError("the training set is empty")
        groups = groups if groups is not None else param_groups(model, self.optim.weight_decay)
        self.say(describe_groups(groups))
        optimizer, scheduler = build_optimizer(groups, self.optim, self.train.max_steps)
        state, saved_rng = TrainState(), None
        if self.resume:
            saved_rng = self._resume(model, optimizer, scheduler, state)
        self.write_config()  # only after a successful load: config.yaml may be rewritten
        model, optimizer = self.accelerator.prepare(model, optimizer)
        self.current = Fit(
            model,
            self.accelerator.unwrap_model(model),
            optimizer,
            scheduler,
            [p for p in model.parameters() if p.requires_grad],
            state,
            accuracy,
        )
        acc = self.accelerator
        log = MetricsLog(self.dir, state.step, enabled=self.is_main)
        sampler = StepBatchSampler(
            len(train_set),
            self.train.batch_size,
            self.seed,
            state.step,
            self.train.max_steps,
            acc.process_index,
            acc.num_processes,
        )
        if saved_rng is not None:
            set_rng_state(saved_rng)
        return sampler, log

    def _resume(self, model, optimizer, scheduler, state: TrainState) -> dict[str, Any] | None:
        """Load the newest valid checkpoint into the model, optimizer, scheduler and state;
        return its RNG state (set once the data sampler exists). A run stopped before its first
        checkpoint starts again (None)."""
        if not self.dir.has_checkpoints():  # stopped before its first checkpoint
            if self.is_main:  # its events would overlap the new ones
                shutil.rmtree(self.dir.file(self.dir.TENSORBOARD), ignore_errors=True)
            warnings.warn(
                f"--resume: {self.dir.path} stopped before its first checkpoint: the run starts "
                "again from step 0 in the same folder",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        self._check_best()
        path, saved = self._load_latest(model)
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        state.load_state_dict(saved)
        if state.step > self.train.max_steps:
            raise RunError(
                f"--resume: the checkpoint {path} is at step {state.step}, past "
                f"train.max_steps={self.train.max_steps}: give train.max_steps >= {state.step}, "
                "or start a new run_dir for a shorter run"
            )
        self.say(f"resumed from {path} (step {state.step})")
        if state.best["step"] and not self.dir.best.is_file():
            warnings.warn(
                f"{self.dir.best} is missing: the best weights (step {state.best['step']}) are "
                "gone, so the best is chosen again from the evaluations after this resume",
                RuntimeWarning,
                stacklevel=3,
            )
            state.best = TrainState().best
        return saved["rng"]

    def _train_step(self, train_set, collate, indices, window: Window) -> None:
        """One optimizer step (or a skipped one) on ``indices``; the step's time recorded."""
        state = self.current.state
        start = time.perf_counter()
        self.current.model.train()
        loss_value, correct, count = self._forward_backward(train_set, collate, indices)
        norm = None
        if self.optim.grad_clip:
            norm = self.accelerator.clip_grad_norm_(self.current.trainable, self.optim.grad_clip)
        finite = math.isfinite(loss_value) and (
            norm is None or bool(torch.isfinite(torch.as_tensor(norm)))
        )
        finite = self._all_ranks(finite, all)
        if finite:
            self.current.optimizer.step()
        else:
            self._skip(loss_value, norm)
        self.current.scheduler.step()
        self.current.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        state.step_times.append(time.perf_counter() - start)
        state.step += 1
        if finite:
            window.add(loss_value, correct, count)

    def _skip(self, loss_value: float, norm) -> None:
        """A non-finite step: stop the run, or (``train.nonfinite=skip``) count and warn."""
        state, tc = self.current.state, self.train
        state.skipped += 1
        what = (
            f"loss {loss_value}"
            if not math.isfinite(loss_value)
            else f"gradient norm {float(norm)}"
        )
        if tc.nonfinite == "error" or state.skipped > tc.max_skipped:
            raise NonFiniteLossError(
                f"non-finite training {what} at step {state.step + 1} of {self.run_dir}; "
                "nothing of this step was applied. Lower optim.lr, check the data, or set "
                f"train.nonfinite=skip (skipped so far: {state.skipped - 1}, limit "
                f"train.max_skipped={tc.max_skipped}); --resume continues from the last checkpoint"
            )
        warnings.warn(
            f"step {state.step + 1}: non-finite {what}, update skipped "
            f"({state.skipped}/{tc.max_skipped})",
            RuntimeWarning,
            stacklevel=3,
        )

    def _log_train(self, log: MetricsLog, bar, window: Window) -> None:
        loss_sum, correct_sum, count_sum = self._sum_ranks(
            window.loss, window.correct, window.count
        )
        if not count_sum:
            return
        log.log(
            self.current.state.step,
            "train",
            loss=loss_sum / count_sum,
            acc=correct_sum / count_sum if self.current.accuracy is not None else None,
            lr=self.current.scheduler.get_last_lr()[0],
            step_ms=1e3 * self.current.state.step_times[-1],
        )
        bar.set_postfix(loss=f"{loss_sum / count_sum:.3f}")

    def _maybe_evaluate(self, evaluate, log: MetricsLog, bar, history: list) -> bool:
        """Evaluate, keep the best weights and checkpoint, every ``eval_every`` steps and at the
        end; whether it did."""
        state = self.current.state
        if not (state.step % self.train.eval_every == 0 or state.step == self.train.max_steps):
            return False
        metrics = evaluate(self.current.raw)
        if self.rules.select not in metrics:
            raise KeyError(f"evaluate() returned no {self.rules.select!r}")
        value = metrics[self.rules.select]
        # the acc column: the validation accuracy, or the experiment's curve metric (code-names:
        # F1, which has no accuracy), so that every run's curve is in the log
        log.log(state.step, "val", loss=metrics.get("loss"), acc=metrics.get(self.rules.curve))
        history.append({"step": state.step, **metrics})
        bar.set_postfix({f"val_{self.rules.select}": f"{value:.3f}"})
        if state.improve(value):
            self.save_best(self.current.raw, state.best)
        self._checkpoint()
        return True

    def _stop_on_signal(self, received: int | None, evaluated: bool, bar, log) -> None:
        """SIGINT/SIGTERM: checkpoint (unless this step just did) and exit ``128 + signal``."""
        if not evaluated:
            self._checkpoint()
        bar.close()
        log.close()
        name = signal.Signals(received).name if received else "signal"
        print(
            f"{name}: stopped at step {self.current.state.step}; checkpoint saved, continue with "
            f"--resume (run_dir {self.run_dir})",
            file=sys.stderr,
        )
        raise SystemExit(128 + (received or signal.SIGTERM))

    def _checkpoint(self) -> None:
        """Weights, optimizer, scheduler, RNG and the loop's state, atomically; all ranks meet
        before and after."""
        self.accelerator.wait_for_everyone()
        state = self.current.state
        state.wall_s = (
            self.current.earlier_wall_s + time.perf_counter() - self.current.segment_start
        )
        if self.is_main:
            extra = {
                "optimizer": self.current.optimizer.state_dict(),
                "scheduler": self.current.scheduler.state_dict(),
                "rng": rng_state(),
                **self.current.state.state_dict(),
            }
            save_checkpoint(self.dir.checkpoints, self.current.state.step, self.current.raw, extra,
                            keep=self.train.keep_checkpoints,
                            only_trainable=self.rules.only_trainable)  # fmt: skip
        self.accelerator.wait_for_everyone()

    def _forward_backward(self, train_set, collate, indices) -> tuple[float, int, int]:
        """Forward and backward of one step's batch in ``grad_accum`` micro-batches; returns the
        step's mean loss, correct predictions and examples."""
        from accelerate.utils import send_to_device

        acc, model = self.accelerator, self.current.model
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
            if self.current.accuracy is not None:
                c, _ = self.current.accuracy(out, batch)
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
                        self.dir.checkpoints,
                        model,
                        partial=self.rules.only_trainable,
                        quarantine=turn,
                    )
                except ValueError as err:
                    raise RunError(f"--resume: {err}") from None
            self.accelerator.wait_for_everyone()
        if loaded is None:
            raise RunError(f"--resume: {self.dir.checkpoints} holds no checkpoint to resume from")
        return loaded
