"""A run folder and the files it holds: the one place that names them.

::

    run_dir/
      config.yaml          the resolved config (compared on --resume)
      metrics.csv          step, split, loss, acc, lr, step_ms
      tb/                  TensorBoard events
      checkpoints/         step-NNNNNNNN/ (weights + state.pt) and a `latest` pointer
      best.safetensors     the weights with the best validation metric
      final.json           the run's results: its presence means the run is finished
      data.json            the data's identity (source + content hash), checked on --resume
      curves.png           training and validation loss / accuracy against the step
      .lock                held by the process writing the folder (its PID inside)

Experiments add their own files beside these (``samples.md``, ``hf/``, ``best/``,
``results.md``) through :meth:`RunDir.file`.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from structattn.compat import EARLIER_FINAL, final_file
from structattn.errors import ConfigError, RunError

from .checkpoint import (
    atomic_write_text,
    checkpoint_dirs,
    latest_checkpoint,
    load_checkpoint,
    load_weights,
    remove_litter,
)
from .config import config_diff, read_yaml

__all__ = ["RunDir", "json_safe"]

#: Run folders whose lock this process holds (resolved path -> open descriptor): released when
#: the process ends, however it ends.
_HELD_LOCKS: dict[Path, int] = {}
#: The folders among them whose ``.lock`` this process created.
_CREATED_LOCKS: set[Path] = set()


def json_safe(x: Any) -> Any:
    """NaN and infinities as ``None`` (JSON has no NaN)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    return x


class RunDir:
    """The files of one run folder, and the rules of the folder: one writer, never overwritten
    by a fresh run, resumed only with the config it was started with."""

    CONFIG = "config.yaml"
    METRICS = "metrics.csv"
    TENSORBOARD = "tb"
    CHECKPOINTS = "checkpoints"
    BEST = "best.safetensors"
    FINAL = "final.json"
    DATA = "data.json"
    CURVES = "curves.png"
    LOCK = ".lock"
    #: Files whose presence means the folder holds results a fresh run must not overwrite
    #: (``best``: a saved model folder; the earlier versions' results file, see compat).
    RESULT_FILES = (FINAL, EARLIER_FINAL, BEST, "best")
    #: What ``--overwrite`` removes: the files above and those the shipped experiments add.
    RUN_FILES = (CONFIG, METRICS, TENSORBOARD, CHECKPOINTS, DATA, CURVES, *RESULT_FILES,
                 "hf", "samples.md", "results.md", "diagnostics", "vocabulary.json",
                 "graph")  # fmt: skip

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def __str__(self) -> str:
        return str(self.path)

    def __fspath__(self) -> str:  # open(), Path() and os functions take a RunDir
        return str(self.path)

    def file(self, name: str) -> Path:
        return self.path / name

    @property
    def config(self) -> Path:
        return self.path / self.CONFIG

    @property
    def metrics(self) -> Path:
        return self.path / self.METRICS

    @property
    def checkpoints(self) -> Path:
        return self.path / self.CHECKPOINTS

    @property
    def best(self) -> Path:
        return self.path / self.BEST

    @property
    def final(self) -> Path:
        return self.path / self.FINAL

    # ------------------------------------------------------------------ reading

    def has_checkpoints(self) -> bool:
        return bool(checkpoint_dirs(self.checkpoints))

    def _final_file(self) -> Path:
        return final_file(self.path, self.final)

    def is_finished(self) -> bool:
        """The run ended and wrote its results (``final.json``, or the file of earlier versions:
        :mod:`structattn.compat`)."""
        return self._final_file().is_file()

    def read_final(self) -> dict[str, Any]:
        """The finished run's results; a missing or damaged file is a RunError naming it."""
        path = self._final_file()
        try:
            payload = json.loads(path.read_text())
        except FileNotFoundError:
            raise RunError(f"{path} not found: {self.path} is not a finished run") from None
        except (ValueError, UnicodeDecodeError) as err:
            raise RunError(f"{path} is damaged ({err}); remove it to retrain") from None
        if not isinstance(payload, dict):
            raise RunError(f"{path} does not hold a run's results")
        return payload

    def read_config(self) -> dict[str, Any]:
        """The saved ``config.yaml`` as a plain mapping; a missing, damaged or non-mapping file
        is a RunError naming it."""
        if not self.config.is_file():
            raise RunError(f"{self.config} not found: is {self.path} a run directory?")
        try:
            values = read_yaml(self.config)
        except ConfigError as err:
            raise RunError(str(err)) from None
        if not isinstance(values, dict):
            raise RunError(f"{self.config} does not hold a run's config")
        return values

    def load_weights(self, model) -> Path:
        """Load the run's ``best.safetensors``, else its latest checkpoint, into ``model``;
        return the file read. Neither, or a damaged file, is a RunError naming it."""
        try:
            if self.best.is_file():
                load_weights(model, self.best)
                return self.best
            latest = latest_checkpoint(self.checkpoints)
            if latest is None:
                raise RunError(f"{self.path} has neither {self.BEST} nor a checkpoint")
            load_checkpoint(latest, model)
            return latest
        except RunError:
            raise
        except Exception as err:  # damaged files: say which
            msg = f"{self.path}: cannot load weights ({type(err).__name__}: {err})"
            raise RunError(msg) from None

    # ------------------------------------------------------------------ writing

    def write_config(self, config: dict[str, Any]) -> None:
        atomic_write_text(self.config, yaml.safe_dump(config, sort_keys=False))

    def write_json(self, name: str, payload: dict[str, Any]) -> None:
        """``name`` as strict JSON (NaN written as null), atomically."""
        text = json.dumps(json_safe(payload), indent=2, allow_nan=False)
        atomic_write_text(self.file(name), text + "\n")

    def write_text(self, name: str, text: str) -> None:
        atomic_write_text(self.file(name), text)

    # ------------------------------------------------------------------ the rules

    def lock(self) -> None:
        """One writer per run folder: an advisory lock on ``.lock`` held for this process's
        life; a second process is refused naming the holder's PID. Runs one after another in
        one process share it. A path through a file is one error before anything is written."""

        for parent in (self.path, *self.path.parents):
            if parent.exists() and not parent.is_dir():
                raise RunError(f"run_dir {self.path}: {parent} is a file, not a folder")
        key = self.path.resolve()
        if key in _HELD_LOCKS:
            return
        self.check_own_files()
        while True:
            created = not os.path.lexists(self.path / self.LOCK)
            fd = self._locked_fd()
            # a lock file removed (release_created_lock) between our open and our flock is
            # not the folder's lock any more: take the one now on disk
            if os.path.lexists(self.path / self.LOCK):
                if os.fstat(fd).st_ino == os.lstat(self.path / self.LOCK).st_ino:
                    break
            os.close(fd)
        try:  # a folder whose lock file exists may still refuse new files (read-only)
            probe, probe_path = tempfile.mkstemp(
                dir=self.path, prefix=".write-probe.", suffix=".tmp"
            )
            os.close(probe)
            os.unlink(probe_path)
        except OSError as err:
            os.close(fd)
            raise RunError(f"run_dir {self.path} cannot be written ({err.strerror})") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        _HELD_LOCKS[key] = fd
        if created:
            _CREATED_LOCKS.add(key)

    def _locked_fd(self) -> int:
        """``.lock`` opened (never through a link) and locked, or a RunError."""
        import fcntl

        try:
            self.path.mkdir(parents=True, exist_ok=True)
            flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
            fd = os.open(self.path / self.LOCK, flags, 0o644)
        except OSError as err:
            raise RunError(f"run_dir {self.path} cannot be written ({err.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunError(
                f"{self.path} is in use by another process (PID {holder}); one writer per "
                "run folder: wait for it, or choose another run_dir"
            ) from None
        return fd

    def release_created_lock(self) -> None:
        """Let go of a lock this process took on a folder that had no ``.lock`` before, and
        remove the file (for a refusal that leaves someone's folder as it found it)."""
        key = self.path.resolve()
        if key in _CREATED_LOCKS and key in _HELD_LOCKS:
            os.unlink(self.path / self.LOCK)  # while still held: no other writer is inside
            os.close(_HELD_LOCKS.pop(key))
            _CREATED_LOCKS.discard(key)

    def check_own_files(self) -> None:
        """Every file a run reads or writes is the folder's own: a symbolic link among them
        (``.lock``, ``checkpoints/`` or a checkpoint in it, ``tb/``, ``best.safetensors``, ...)
        is a RunError before anything is opened, so a run folder someone hands over never
        makes a run write, delete or resume outside itself."""
        names = [self.LOCK, *self.RUN_FILES]
        links = [n for n in names if self.file(n).is_symlink()]
        for sub in names:  # and anything inside the run's own folders, at any depth
            folder = self.file(sub)
            if not folder.is_dir() or folder.is_symlink():
                continue
            for root, dirs, files in os.walk(folder):  # never follows a link
                for name in sorted(dirs + files):
                    if os.path.islink(os.path.join(root, name)):
                        links.append(os.path.relpath(os.path.join(root, name), self.path))
        if links:
            raise RunError(
                f"{self.path} holds symbolic links where a run keeps its own files "
                f"({', '.join(links)}): replace them with the files themselves, or choose "
                "another run_dir"
            )

    def check_start(self, resume: bool) -> None:
        """A fresh run needs a folder without checkpoints or results; ``resume`` one with a
        checkpoint and a config."""
        has_checkpoints = self.has_checkpoints()
        if not resume and has_checkpoints:
            raise RunError(
                f"{self.path} already holds checkpoints: pass --resume to continue, "
                "--overwrite to start afresh, or choose another run_dir"
            )
        results = [n for n in self.RESULT_FILES if self.file(n).exists()]
        if not resume and results:
            again = ""
            if not self.is_finished() and self.config.is_file():
                again = " (it stopped before its first checkpoint: --resume starts it again)"
            raise RunError(
                f"{self.path} already holds results ({', '.join(results)}) and is never "
                f"overwritten by a fresh run{again}: choose another run_dir, or pass --overwrite"
            )
        if resume and not self.is_resumable():
            what = (
                "is a finished run"
                if self.is_finished()
                else "holds no run stopped before its first checkpoint (config.yaml beside "
                "metrics.csv or best.safetensors)"
            )
            raise RunError(
                f"--resume: {self.checkpoints} holds no checkpoint to resume from and "
                f"{self.path} {what}: start a new run_dir"
            )

    def is_resumable(self) -> bool:
        """``--resume`` continues this folder: it has a checkpoint, or it is an unfinished run
        stopped before its first checkpoint (a config and a log or best weights)."""
        if self.has_checkpoints():
            return True
        marks = (self.METRICS, self.BEST)
        started = self.config.is_file() and any(self.file(n).exists() for n in marks)
        return started and not self.is_finished()

    def is_run_folder(self) -> bool:
        """The folder was written by a run: its ``config.yaml`` is a mapping and it holds a
        checkpoint or a finished run's results (GL-Fusion runs of earlier versions kept a flat
        config), or its config is a run's (``seed``, ``optim``, ``train``) beside a run's log,
        data record or results. What ``--overwrite`` may clear."""
        if not self.config.is_file():
            return False
        try:
            values = read_yaml(self.config)
        except (ConfigError, OSError):
            values = None
        if not isinstance(values, dict):
            return False
        if self.has_checkpoints() or self.is_finished():  # a run's, whatever its config's shape
            return True
        marks = (self.METRICS, self.DATA, *self.RESULT_FILES)
        run_keys = {"seed", "optim", "train"} <= set(values)
        return run_keys and any(self.file(n).exists() for n in marks)

    def check_resume_config(
        self,
        config: dict[str, Any],
        resumable: frozenset[str],
        defaults: dict[str, Any] | None = None,
    ) -> None:
        """``config`` differs from the saved one only in ``resumable`` keys (and in keys added
        since it was saved, at their ``defaults``)."""
        if not self.config.is_file():
            raise RunError(f"--resume: {self.config} is missing")
        try:
            saved = read_yaml(self.config)
        except ConfigError as err:
            raise RunError(f"--resume: {err}") from None
        if not isinstance(saved, dict | None):
            raise RunError(f"--resume: {self.config} does not hold a run's config")
        changed = [k for k in config_diff(saved or {}, config, defaults) if k not in resumable]
        if changed:
            raise RunError(
                f"--resume: the config differs from {self.config} in {', '.join(changed)}; "
                f"only {', '.join(sorted(resumable))} may change on resume "
                "(start a new run_dir to change the rest)"
            )

    def clear(self) -> list[str]:
        """Remove what a run wrote (:attr:`RUN_FILES`) for ``--overwrite``; anything else in
        the folder is kept (and named in a warning). Returns the names removed."""
        import shutil
        import warnings

        if not self.path.is_dir():
            return []
        present = [n for n in self.RUN_FILES if self.file(n).exists() or self.file(n).is_symlink()]
        if not present:
            return []
        if not self.is_run_folder():  # someone's own files under a run's names: keep them
            why = (f"no {self.CONFIG}" if not self.config.is_file()
                   else f"its {self.CONFIG} is not a run's config, and it holds no checkpoint "
                   "or finished run")  # fmt: skip
            self.release_created_lock()
            raise RunError(
                f"--overwrite: {self.path} holds {', '.join(present)} but is not a run folder "
                f"({why}): nothing removed; choose another run_dir"
            )
        removed = []
        for name in self.RUN_FILES:
            target = self.file(name)
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
            else:
                continue
            removed.append(name)
        others = sorted(p.name for p in self.path.iterdir() if p.name != self.LOCK)
        if others:
            warnings.warn(f"--overwrite kept what no run writes in {self.path}: {others}",
                          UserWarning, stacklevel=2)  # fmt: skip
        return removed

    def check_data(self, identity: dict[str, Any], resume: bool) -> bool:
        """The data of this run: recorded in ``data.json`` by a fresh run (returns True when
        written); on resume compared with the record, a different content hash a RunError
        (a run that predates the record gets one)."""
        path = self.file(self.DATA)
        if resume and path.is_file():
            try:
                saved = json.loads(path.read_text())
            except (ValueError, UnicodeDecodeError) as err:
                raise RunError(f"--resume: {path} is damaged ({err})") from None
            if saved.get("sha256") != identity.get("sha256"):
                raise RunError(
                    f"--resume: the data differs from the run's ({path}): it started on "
                    f"{saved.get('source')} (sha256 {str(saved.get('sha256'))[:12]}), this is "
                    f"{identity.get('source')} (sha256 {str(identity.get('sha256'))[:12]}); "
                    "resume with the data it started on, or start a new run_dir"
                )
            return False
        self.write_json(self.DATA, identity)
        return True

    def clean(self) -> None:
        """Create the folder and remove what interrupted atomic writes left in it."""
        self.path.mkdir(parents=True, exist_ok=True)
        remove_litter(self.path)
