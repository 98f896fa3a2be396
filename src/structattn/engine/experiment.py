"""The one interface the engine runs: an experiment builds data and a model, collates batches,
evaluates, and reports; :meth:`Experiment.run` does the rest the same way for every experiment.

::

    class MyTask(Experiment):
        def build_data(self):            self.train_set, self.val_set = ...
        def build_model(self):           return MyModel(self.cfg.model)
        def collate(self, items):        return {"x": ..., "labels": ...}   # model(**batch).loss
        def validate(self, model):       return {"acc": ...}                # holds `select`
        def report(self, model, fit):    return {"test_acc": ...}           # -> final.json

    result = MyTask(cfg).run()   # cfg: a RunConfig subclass

The LRA tasks (:mod:`structattn.experiments.lra`), the byte LM (:mod:`structattn.experiments.lm`)
and GL-Fusion node classification (:mod:`structattn.experiments.glfusion`) are three of them.
"""

from __future__ import annotations

import dataclasses
import json
import time
import warnings
from collections.abc import Sequence
from typing import Any

from torch import nn

from structattn.errors import ConfigError, RunError

from .loop import Engine, FitRules
from .metrics import plot_metrics
from .rundir import RunDir, json_safe
from .state import FitResult

__all__ = ["Experiment", "check_data_decided", "check_run_data"]


def check_data_decided(section: Any, decided: dict[str, tuple[Any, str]], where: str) -> None:
    """Fields of the config dataclass ``section`` (``where``: its key) whose value the data
    decides, ``{field: (the data's value, what gives it)}``: a field at its default is left to
    the data (the caller builds the model with the data's value); any other value must equal
    it, else a ConfigError (``config.yaml`` would record a value the model does not use)."""
    defaults = {f.name: f.default for f in dataclasses.fields(section)}
    for name, (value, what) in decided.items():
        given = getattr(section, name)
        if given != defaults.get(name) and given != value:
            raise ConfigError(
                f"{where}.{name}={given} is not used: {what} gives {value}; leave "
                f"{where}.{name} out (the data decides it) or set it to {value}"
            )


def check_run_data(run_dir: str | Any, identity: dict[str, Any]) -> None:
    """The data about to be evaluated is the data the run trained on: ``identity`` (the
    training's :meth:`Experiment.data_identity`) against the run's ``data.json``. Other data is
    a RunError naming both; a run without the record (from before it was kept) a warning."""
    rd = RunDir(run_dir)
    path = rd.file(RunDir.DATA)
    if not path.is_file():
        warnings.warn(
            f"{path} is missing (a run from before the data was recorded): the data "
            f"({identity.get('source')}) is not checked against the data it was trained on",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    try:
        saved = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError, OSError) as err:
        raise RunError(f"{path} is damaged ({err}); the data cannot be checked") from None
    if not isinstance(saved, dict) or "sha256" not in saved:
        raise RunError(f"{path} does not hold the data's identity (source and sha256)")
    if saved["sha256"] != identity.get("sha256"):
        raise RunError(
            f"the data differs from the run's ({path}): it trained on {saved.get('source')} "
            f"(sha256 {str(saved['sha256'])[:12]}), this is {identity.get('source')} "
            f"(sha256 {str(identity.get('sha256'))[:12]}); evaluate with the data it trained "
            f"on (data.* in {rd.config}), or train a new run on this data"
        )


class Experiment:
    """One run of one experiment. Subclasses set :attr:`train_set` in :meth:`build_data` and
    implement the methods below; ``self.engine`` exists from :meth:`build_data` on (its device
    and ``accelerator.autocast`` are what evaluation uses)."""

    #: The validation metric that picks the best weights (higher is better).
    select: str = "acc"
    #: The validation metric logged in ``metrics.csv``'s ``acc`` column (the curves).
    curve: str = "acc"
    #: Checkpoint only the parameters that train (a frozen base model is not copied).
    only_trainable: bool = False
    #: Some parameters may get no gradient in a step (a GL-Fusion path with nothing to read in
    #: a batch, the graph tokens of the gated form): distributed training then looks for them
    #: after each backward instead of waiting for their gradients.
    unused_parameters: bool = False

    def __init__(self, cfg: Any, progress: bool = True):
        self.cfg = cfg
        self.progress = progress
        self.engine: Engine | None = None
        self.train_set: Sequence[Any] = ()

    # ------------------------------------------------------------------ what an experiment is

    def build_data(self) -> None:
        """Load or build the data; set :attr:`train_set` (indexable examples)."""
        raise NotImplementedError

    def build_model(self) -> nn.Module:
        """The model to train: ``model(**collate(items))`` returns an output with ``.loss``."""
        raise NotImplementedError

    def collate(self, items: list[Any]) -> dict[str, Any]:
        """The keyword arguments of the model for a list of training examples."""
        raise NotImplementedError

    def validate(self, model: nn.Module) -> dict[str, float]:
        """Validation metrics, :attr:`select` among them (called every ``train.eval_every``)."""
        raise NotImplementedError

    def report(self, model: nn.Module, fit: FitResult) -> dict[str, Any]:
        """The results of the finished run (``model`` holds the best weights); written to
        ``final.json``. Other files go through ``self.engine.dir``."""
        raise NotImplementedError

    def data_identity(self) -> dict[str, Any] | None:
        """``{"source": ..., "sha256": ...}`` of the data built (a content hash, see
        :func:`structattn.utils.fingerprint.fingerprint`): recorded by a fresh run, and
        ``--resume`` refuses other data. ``None``: not checked."""
        return None

    def param_groups(self, model: nn.Module) -> list[dict[str, Any]] | None:
        """AdamW groups; ``None``: the engine's one decay rule."""
        return None

    def accuracy(self, output: Any, batch: dict[str, Any]) -> tuple[int, int] | None:
        """``(correct, n)`` of a training batch for the log, or ``None`` (not logged)."""
        return None

    # ------------------------------------------------------------------ the run

    def make_engine(self) -> Engine:
        rules = FitRules(self.only_trainable, self.select, self.curve, self.unused_parameters)
        return Engine(self.cfg, self.progress, rules)

    def run(self) -> dict[str, Any]:
        """Train, then report on the best weights; returns the results (also in
        ``final.json``), or ``{"paused_at": step, ...}`` when ``train.stop_at`` paused it.
        ``wall_s`` in the results (unless the report gives its own) is the run's wall time over
        every segment of a resumed run: the earlier ones up to their last checkpoint, and
        this one."""
        started = time.perf_counter()
        self.engine = engine = self.make_engine()
        with engine.accelerator.main_process_first():  # data prepared once, then read by all
            self.build_data()
        identity = self.data_identity()
        if identity is not None:
            engine.check_data(identity)
        model = self.build_model()
        accuracy = self.accuracy if type(self).accuracy is not Experiment.accuracy else None
        fit = engine.fit(model, self.train_set, self.collate, self.validate,
                         groups=self.param_groups(model), accuracy=accuracy)  # fmt: skip
        if fit.paused:
            return {"name": self.cfg.name, "paused_at": fit.step, "run_dir": str(engine.run_dir)}
        fit = _with_best_record(fit, engine.load_best(fit.model), engine)
        final = json_safe(self.report(fit.model, fit))
        final.setdefault("wall_s", fit.earlier_wall_s + time.perf_counter() - started)
        engine.write_json(engine.dir.FINAL, final)
        if engine.is_main:
            try:
                plot_metrics(engine.dir, self.cfg.name)
            except (OSError, ValueError, RuntimeError) as err:  # the results are already written
                warnings.warn(f"curves.png not drawn ({err})", RuntimeWarning, stacklevel=2)
        return final


def _with_best_record(fit: FitResult, record: dict[str, Any] | None, engine: Engine) -> FitResult:
    """``fit`` whose ``best`` describes the weights the model now holds: the record stored in
    ``best.safetensors``, or, with no such file, the last step's weights and evaluation."""
    if record:
        return dataclasses.replace(fit, best=record)
    if record is None:
        last = fit.history[-1][engine.rules.select] if fit.history else float("nan")
        warnings.warn(
            f"{engine.dir.best} does not exist (no evaluation improved on the start): the "
            f"report is of the last step's weights (step {fit.step})",
            RuntimeWarning,
            stacklevel=3,
        )
        return dataclasses.replace(fit, best={"value": last, "step": fit.step})
    return fit  # a file from before the record was kept: the loop's own record
