"""A run folder someone hands over is data: nothing it holds makes a run write, delete or resume
outside it; ``--overwrite`` clears only a run's own folder; a run stopped before its first
checkpoint resumes; a sweep's table is the union of the finished runs in its folder."""

from __future__ import annotations

import json
import os

import pytest
from helpers import TINY_LISTOPS, TINY_MODEL, tiny_listops

from structattn.engine import RunDir
from structattn.engine.config import RunConfig
from structattn.errors import ConfigError, RunError
from structattn.experiments.lra import train

LISTOPS = TINY_LISTOPS


def tiny(data_dir, run_dir, **changes):
    return tiny_listops(data_dir, run_dir, 4, **changes)


@pytest.fixture
def data_dir(tmp_path):
    path = tmp_path / "data"
    path.mkdir()
    return path


# ---------------------------------------------------------------------- symbolic links


def test_a_lock_file_linked_to_a_users_file_is_refused_and_left_alone(tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").symlink_to(precious)
    with pytest.raises(RunError, match=r"symbolic links .*\.lock"):
        RunDir(run).lock()
    assert precious.read_text() == "keep me"


def test_a_dangling_lock_link_creates_nothing_outside(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(RunError, match="symbolic links"):
        RunDir(run).lock()
    assert not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize("linked", ["checkpoints", "tb", "best.safetensors"])
def test_a_run_file_linked_elsewhere_is_refused_before_anything_is_written(
    data_dir, tmp_path, linked
):
    other = tmp_path / "other"
    train(tiny(data_dir, other, train={"stop_at": 2}), progress=False)
    before = {p: p.stat().st_mtime_ns for p in other.rglob("*") if p.is_file()}
    run = tmp_path / "run"
    run.mkdir()
    (run / linked).symlink_to(other / linked)
    with pytest.raises(RunError, match=f"symbolic links .*{linked}"):
        train(tiny(data_dir, run, resume=True), progress=False)
    assert {p: p.stat().st_mtime_ns for p in other.rglob("*") if p.is_file()} == before
    assert os.listdir(run) == [linked]


def test_a_linked_checkpoint_inside_checkpoints_is_refused(data_dir, tmp_path):
    other = tmp_path / "other"
    train(tiny(data_dir, other, train={"stop_at": 2}), progress=False)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (step,) = [p for p in (other / "checkpoints").iterdir() if p.name.startswith("step-")]
    (run / "checkpoints" / step.name).symlink_to(step)
    with pytest.raises(RunError, match=f"checkpoints/{step.name}"):
        RunDir(run).lock()
    assert step.is_dir()


@pytest.mark.parametrize("name", ["../../x", "a/b", "..", ".hidden", "", "a\\b"])
def test_a_run_name_stays_one_folder_under_runs(name):
    with pytest.raises(ConfigError, match="must be one folder name"):
        RunConfig(name=name).resolved_run_dir()


def test_a_plain_run_name_is_its_folder():
    assert str(RunConfig(name="listops-hkt", seed=2).resolved_run_dir()) == "runs/listops-hkt/seed2"


# ---------------------------------------------------------------------- overwrite and resume


def test_overwrite_refuses_a_folder_holding_only_a_config_and_own_files(data_dir, tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    for name, text in (("config.yaml", "a: 1\n"), ("results.md", "mine\n")):
        (folder / name).write_text(text)
    (folder / "hf").mkdir()
    with pytest.raises(RunError, match="not a run folder"):
        train(tiny(data_dir, folder, overwrite=True), progress=False)
    assert sorted(os.listdir(folder)) == ["config.yaml", "hf", "results.md"]  # no .lock left


def test_a_run_stopped_between_best_and_its_first_checkpoint_resumes(data_dir, tmp_path):
    run = tmp_path / "run"
    done = train(tiny(data_dir, run), progress=False)
    # the state a kill (or a full disk) leaves after best.safetensors, before any checkpoint
    for path in (run / "checkpoints").iterdir():
        for f in path.iterdir() if path.is_dir() else []:
            f.unlink()
        path.rmdir() if path.is_dir() else path.unlink()
    (run / "final.json").unlink()
    assert RunDir(run).is_resumable() and not RunDir(run).is_finished()
    with pytest.raises(RunError, match="--resume starts it again"):
        train(tiny(data_dir, run), progress=False)
    with pytest.warns(RuntimeWarning, match="stopped before its first checkpoint"):
        again = train(tiny(data_dir, run, resume=True), progress=False)
    assert again["steps"] == 4 and again["test_acc"] == done["test_acc"]
    rows = RunDir(run).metrics.read_text().splitlines()[1:]
    assert [int(r.split(",")[0]) for r in rows if ",train," in r] == [1, 2, 3, 4]


def test_resume_of_a_finished_run_without_checkpoints_says_so(data_dir, tmp_path):
    run = tmp_path / "run"
    train(tiny(data_dir, run, train={"keep_checkpoints": 1}), progress=False)
    for path in (run / "checkpoints").glob("step-*"):
        for f in path.iterdir():
            f.unlink()
        path.rmdir()
    with pytest.raises(RunError, match="is a finished run"):
        train(tiny(data_dir, run, resume=True), progress=False)


# ---------------------------------------------------------------------- tables


def test_reproduce_tables_every_finished_run_of_its_folder(data_dir, tmp_path):
    from structattn.experiments.lra.reproduce import reproduce

    overrides = dict(data=LISTOPS, model=TINY_MODEL,
                     train={"max_steps": 2, "batch_size": 8, "eval_every": 2})  # fmt: skip
    kw = dict(tasks=("listops",), out_dir=tmp_path / "out", data_dir=data_dir, progress=False,
              baselines=False, overrides=overrides)  # fmt: skip
    reproduce("quick", seeds=(0,), variants=("hkt", "mha"), **kw)
    later = reproduce("quick", seeds=(1,), variants=("hkt",), **kw)
    row = later["tasks"]["listops"]
    assert row["hkt"]["seeds"] == [0, 1] and row["mha"]["seeds"] == [0]
    saved = json.loads((tmp_path / "out" / "quick" / "results.json").read_text())
    assert saved["seeds"] == [0, 1] and saved["variants"] == ["hkt", "mha"]
    # a finished run of another configuration is named, not tabled
    other = dict(overrides, model={**TINY_MODEL, "d_model": 32})
    kw["overrides"] = other
    third = reproduce("quick", seeds=(2,), variants=("hkt",), **kw)
    assert third["tasks"]["listops"]["hkt"]["seeds"] == [2]
    assert len(third["left_out"]) == 3 and "model.d_model" in third["left_out"][0]
    assert (
        "Not in the table (finished, not reusable here)"
        in (tmp_path / "out" / "quick" / "results.md").read_text()
    )


def test_resume_alone_continues_a_run_from_its_own_config(data_dir, tmp_path, capsys):
    from structattn.cli import main

    run = tmp_path / "run"
    train(tiny(data_dir, run, train={"stop_at": 2}), progress=False)
    main(["train", "--run-dir", str(run), "--resume"])  # no --config, --preset or model flags
    final = json.loads(capsys.readouterr().out)
    assert final["steps"] == 4 and RunDir(run).is_finished()
    straight = train(tiny(data_dir, tmp_path / "straight"), progress=False)
    assert final["test_acc"] == straight["test_acc"] and final["val_acc"] == straight["val_acc"]
    # a folder without a config is no run to resume: the usual refusal
    with pytest.raises(SystemExit, match="holds no checkpoint"):
        main(["train", "--run-dir", str(tmp_path / "empty"), "--resume"])


def test_eval_diagnose_and_resume_read_a_handed_runs_data_folder_but_never_write_it(
    data_dir, tmp_path, capsys
):
    """The ListOps a handed config's ``data_dir`` lacks is generated in memory: `eval`,
    `diagnose` and `train --run-dir X --resume` leave that folder as it was."""
    import shutil

    from structattn.cli import main

    run = tmp_path / "run"
    train(tiny(data_dir, run, train={"stop_at": 2}), progress=False)
    shutil.rmtree(data_dir / "listops-generated")  # the folder the config names, now lacking it
    main(["eval", str(run), "--split", "val"])
    main(["train", "--run-dir", str(run), "--resume"])
    main(["diagnose", str(run), "--out-dir", str(tmp_path / "diag"), "--sequences", "2"])
    assert list(data_dir.iterdir()) == []
    final = json.loads((run / "final.json").read_text())
    straight = train(tiny(data_dir, tmp_path / "straight"), progress=False)
    assert final["test_acc"] == straight["test_acc"] and final["val_acc"] == straight["val_acc"]
    capsys.readouterr()


def test_a_damaged_best_file_is_refused_when_the_run_resumes(data_dir, tmp_path):
    """Not after training to the end with a traceback: the best weights are lost, one line."""
    run = tmp_path / "run"
    train(tiny(data_dir, run, train={"stop_at": 2}), progress=False)
    best = run / "best.safetensors"
    best.write_bytes(best.read_bytes()[:100])
    with pytest.raises(RunError, match="best.safetensors cannot be read.*--overwrite"):
        train(tiny(data_dir, run, resume=True), progress=False)
    assert not (run / "checkpoints" / "step-00000004").exists()


def test_a_resumed_runs_wall_time_counts_every_segment(data_dir, tmp_path):
    import time

    from structattn.engine.checkpoint import load_latest_valid
    from structattn.experiments.lra.experiment import SequenceClassification, build_model

    run = tmp_path / "run"
    slow = SequenceClassification.validate

    def validate(self, model):  # the first segment takes seconds longer than its steps
        time.sleep(2.0)
        return slow(self, model)

    SequenceClassification.validate = validate
    try:
        train(tiny(data_dir, run, train={"stop_at": 2}), progress=False)
    finally:
        SequenceClassification.validate = slow
    cfg = tiny(data_dir, run, resume=True)
    _, state = load_latest_valid(run / "checkpoints", build_model(cfg, _data(cfg)))
    assert state["wall_s"] > 2.0  # the first segment's time, up to its checkpoint
    started = time.perf_counter()
    final = train(cfg, progress=False)
    second = time.perf_counter() - started
    # the total is the first segment's time plus the part of the second spent training (its two
    # tiny steps take far less than the 2 s the first segment slept, so without the first
    # segment's time the total could not exceed it); setup before the clock starts may be slow
    # on a loaded machine and is left out
    assert state["wall_s"] < final["wall_s"] <= state["wall_s"] + second + 0.01


def _data(cfg):
    from structattn.data import load_task

    return load_task(cfg.data)


def test_resume_alone_continues_a_run_started_with_overwrite(data_dir, tmp_path, capsys):
    from structattn.cli import main

    run = tmp_path / "run"
    train(tiny(data_dir, run, overwrite=True, train={"stop_at": 2}), progress=False)
    main(["train", "--run-dir", str(run), "--resume"])
    assert json.loads(capsys.readouterr().out)["steps"] == 4


def test_overwrite_clears_a_finished_run_of_an_earlier_flat_config(data_dir, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("lr: 0.001\nmax_steps: 4\n")  # an earlier flat config
    (run / "results.json").write_text("{}")
    with pytest.raises(RunError, match="already holds results"):
        train(tiny(data_dir, run), progress=False)
    assert train(tiny(data_dir, run, overwrite=True), progress=False)["steps"] == 4


def test_a_sweep_table_skips_odd_folders_and_names_runs_it_cannot_read(tmp_path):
    from structattn.experiments.sweep import SweepRun, finished_folders, read_finished

    for name in ("seed0", "seed007", "seed\u00b2", "seedx"):
        (tmp_path / "a" / name).mkdir(parents=True)
        (tmp_path / "a" / name / "final.json").write_text("{}")
    assert finished_folders(tmp_path) == [("a", 0)]

    def missing_data():
        raise FileNotFoundError("data.noun not found")

    run = SweepRun(("a", 0), tmp_path / "a" / "seed0", "a", lambda resume: {}, missing_data)
    (tmp_path / "a" / "seed0" / "config.yaml").write_text("seed: 0\n")
    finals, left_out = read_finished([run])
    assert finals == {} and "data.noun not found" in left_out[0]
