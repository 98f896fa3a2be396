"""What a run folder refuses to evaluate or resume with, and the errors that are one line: the
data against ``data.json`` at eval, model shapes the data decides, non-finite weights, a resume
past ``max_steps``, a damaged best-weights record, a full disk, a non-finite loss from the
command line, and optimiser hyperparameters out of range."""

from __future__ import annotations

import errno
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from helpers import TINY_MODEL
from safetensors.torch import load_file, save_file

from structattn.cli import main
from structattn.engine.checkpoint import (
    atomic_save_weights,
    load_weights,
    save_checkpoint,
    weights_metadata,
)
from structattn.engine.config import OptimConfig
from structattn.engine.loop import NonFiniteLossError, best_record
from structattn.engine.optim import build_optimizer, check_optim
from structattn.errors import ConfigError, RunError, UserError
from structattn.experiments.lra import build_model, evaluate_run, load_lra, train

LISTOPS = {"seq_len": 32, "listops_min_length": 4, "listops_sizes": [48, 8, 8]}


def tiny(data_dir, run_dir, model=None, **changes):
    train_cfg = {"max_steps": 4, "batch_size": 8, "eval_every": 2, "log_every": 1}
    train_cfg.update(changes.pop("train", {}))
    return load_lra("listops-hkt", "quick", run_dir=str(run_dir),
                    data={**LISTOPS, "data_dir": str(data_dir)},
                    model={**TINY_MODEL, **(model or {})}, train=train_cfg,
                    **changes)  # fmt: skip


@pytest.fixture
def data_dir(tmp_path):
    path = tmp_path / "data"
    path.mkdir()
    return path


def _generated(data_dir: Path, split: str) -> Path:
    (path,) = data_dir.rglob(f"listops-generated/*/basic_{split}.tsv")
    return path


def _reordered(path: Path) -> str:
    lines = path.read_text().splitlines()
    return "\n".join([lines[0], *reversed(lines[1:])]) + "\n"


# ---------------------------------------------------------------------- eval and data.json


def test_eval_refuses_a_changed_test_file(data_dir, tmp_path):
    run = tmp_path / "run"
    final = train(tiny(data_dir, run), progress=False)
    assert evaluate_run(run)["acc"] == pytest.approx(final["test_acc"])  # the same data
    test_file = _generated(data_dir, "test")
    test_file.write_text(_reordered(test_file))
    with pytest.raises(
        RunError,
        match=r"the data differs from the run's .*data\.json.*sha256 "
        r"[0-9a-f]{12}\), this is .*sha256 [0-9a-f]{12}\); evaluate with",
    ):
        evaluate_run(run)


def test_eval_refuses_lra_files_added_after_training(data_dir, tmp_path):
    run = tmp_path / "run"
    train(tiny(data_dir, run), progress=False)
    lra = data_dir / "listops"
    lra.mkdir()
    for split in ("train", "val", "test"):
        shutil.copy(_generated(data_dir, split), lra / f"basic_{split}.tsv")
    evaluate_run(run)  # the same examples from other files: the same data
    (lra / "basic_train.tsv").write_text(_reordered(lra / "basic_train.tsv"))
    with pytest.raises(
        RunError,
        match=r"trained on ListOps, own generator .* this is "
        r"ListOps, LRA TSVs from",
    ):
        evaluate_run(run)


def test_eval_of_a_run_without_data_json_warns(data_dir, tmp_path):
    run = tmp_path / "run"
    train(tiny(data_dir, run), progress=False)
    (run / "data.json").unlink()
    with pytest.warns(RuntimeWarning, match=r"data\.json is missing .* not checked"):
        assert evaluate_run(run)["n"] == 8
    (run / "data.json").write_text("{not json")
    with pytest.raises(RunError, match=r"data\.json is damaged"):
        evaluate_run(run)


# ---------------------------------------------------------------------- shapes the data decides


@pytest.mark.parametrize("key", ["vocab_size", "num_classes", "max_len"])
def test_a_model_shape_other_than_the_datas_is_refused_before_anything_is_written(
    key, data_dir, tmp_path
):
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=rf"model\.{key}=7 is not used: the data \(ListOps"):
        train(tiny(data_dir, run, model={key: 7}), progress=False)
    assert not (run / "config.yaml").exists() and not (run / "data.json").exists()


def test_a_model_shape_equal_to_the_datas_is_accepted(data_dir):
    from structattn.data import load_task

    cfg = tiny(data_dir, data_dir / "run", model={"vocab_size": 16, "max_len": 32})
    data = load_task(cfg.data)
    assert (data.vocab_size, data.seq_len) == (16, 32)
    assert build_model(cfg, data).config.max_len == 32


def test_a_language_model_shape_other_than_the_datas_is_refused():
    from structattn.experiments.lm import LMConfig
    from structattn.experiments.lm.generate import build_lm

    cfg = LMConfig()
    cfg.model = cfg.model.replace(max_len=100)
    with pytest.raises(ConfigError, match=r"model\.max_len=100 is not used: data\.seq_len gives"):
        build_lm(cfg, 258)


# ---------------------------------------------------------------------- non-finite weights


def test_non_finite_weights_are_refused_naming_the_file_and_tensor(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    path = tmp_path / "w.safetensors"
    with torch.no_grad():
        model[1].bias.fill_(float("nan"))
        model[1].weight[0, 0] = float("inf")
    atomic_save_weights(model, path)
    with pytest.raises(
        ValueError,
        match=r"w\.safetensors holds non-finite weights .* in "
        r"'1\.bias' and 1 more",
    ):
        load_weights(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)), path)


def test_eval_refuses_non_finite_best_weights(data_dir, tmp_path):
    run = tmp_path / "run"
    train(tiny(data_dir, run), progress=False)
    best = run / "best.safetensors"
    weights, meta = load_file(str(best)), weights_metadata(best)
    name = next(k for k, t in weights.items() if t.is_floating_point())
    weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, str(best), metadata=meta)
    with pytest.raises(RunError, match=rf"best\.safetensors holds non-finite .* in '{name}'"):
        evaluate_run(run)


# ---------------------------------------------------------------------- resume


def test_resume_with_max_steps_below_the_checkpoint_is_refused(data_dir, tmp_path):
    run = tmp_path / "run"
    train(tiny(data_dir, run, train={"max_steps": 6, "stop_at": 4}), progress=False)
    before = (run / "config.yaml").read_text()
    with pytest.raises(RunError, match=r"step-00000004 is at step 4, past train.max_steps=2"):
        train(tiny(data_dir, run, resume=True, train={"max_steps": 2}), progress=False)
    assert (run / "config.yaml").read_text() == before and not (run / "final.json").exists()


@pytest.mark.parametrize("meta", [{"step": "abc", "value": "0.5"},
                                  {"step": "2", "value": "nan"}])  # fmt: skip
def test_a_damaged_best_record_is_ignored_with_a_warning(meta, data_dir, tmp_path):
    run = tmp_path / "run"
    train(tiny(data_dir, run, train={"max_steps": 6, "stop_at": 4}), progress=False)
    best = run / "best.safetensors"
    save_file(load_file(str(best)), str(best), metadata={**meta, "select": "acc"})
    with pytest.warns(RuntimeWarning, match="the header's record .* is not a step"):
        final = train(tiny(data_dir, run, resume=True, train={"max_steps": 6}), progress=False)
    assert json.loads((run / "final.json").read_text())["steps"] == 6
    assert final["best_step"] in (2, 4, 6)  # the loop's own record


def test_best_record_reads_the_header():
    path = Path("best.safetensors")
    assert best_record({"step": "4", "value": "0.25"}, path) == {"step": 4, "value": 0.25}
    assert best_record({}, path) == {}  # a file from before the record was kept
    with pytest.warns(RuntimeWarning, match="step='-1'"):
        assert best_record({"step": "-1", "value": "0.5"}, path) == {}


# ---------------------------------------------------------------------- a full disk


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _torch_no_space(*args, **kwargs):
    raise RuntimeError("[enforce fail at inline_container.cc:595] . unexpected pos 64 vs 0")


@pytest.mark.parametrize("where, writer", [("save_file", _no_space),
                                           ("torch.save", _torch_no_space)])  # fmt: skip
def test_a_full_disk_is_one_line_naming_the_path_and_free_space(
    where, writer, monkeypatch, tmp_path
):
    import structattn.engine.checkpoint as checkpoint

    model = torch.nn.Linear(2, 2)
    save_checkpoint(tmp_path / "ckpt", 1, model, {})
    if where == "save_file":
        monkeypatch.setattr(checkpoint, "save_file", writer)
    else:
        monkeypatch.setattr(checkpoint.torch, "save", writer)
    with pytest.raises(RunError) as info:
        save_checkpoint(tmp_path / "ckpt", 2, model, {})
    message = str(info.value)
    assert "\n" not in message and "could not be written" in message
    assert "step-00000002" in message and " free on the disk of " in message
    assert ("No space left on device" if where == "save_file" else "inline_container") in message
    kept = {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert kept == {"step-00000001", "latest"}  # the earlier checkpoint kept, no litter


def test_a_full_disk_while_writing_best_weights_stops_training_in_one_line(
    monkeypatch, data_dir, tmp_path
):
    import structattn.engine.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "save_file", _no_space)
    with pytest.raises(RunError, match=r"could not be written: .*best\.safetensors \(No space"):
        train(tiny(data_dir, tmp_path / "run"), progress=False)


# ---------------------------------------------------------------------- one line from the CLI


def _cli_error(*args: str) -> str:
    with pytest.raises(SystemExit) as info:
        main(list(args))
    message = str(info.value.code)
    assert message.startswith("structattn: error: ") and "\n" not in message, message
    return message


def _cli_args(data_dir, run_dir, *extra: str) -> list[str]:
    return ["train", "--run-dir", str(run_dir), "--data.data-dir", str(data_dir),
            "--data.seq-len", "32", "--data.listops-min-length", "4",
            "--data.listops-sizes", "48", "8", "8", "--model.d-model", "16",
            "--model.n-layers", "1", "--model.n-heads", "2", "--model.mlp-ratio", "1",
            "--train.max-steps", "4", "--train.batch-size", "8", "--train.eval-every", "2",
            "--train.log-every", "1", *extra]  # fmt: skip


def test_a_non_finite_loss_is_one_line_from_the_command_line(data_dir, tmp_path):
    assert issubclass(NonFiniteLossError, UserError | RuntimeError)
    args = _cli_args(data_dir, tmp_path / "run", "--optim.lr", "1e30", "--optim.grad-clip", "0",
                     "--optim.warmup-steps", "0")  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        message = _cli_error(*args)
    assert "non-finite training" in message and "train.nonfinite=skip" in message


@pytest.mark.parametrize("flag, value, expected", [
    ("--optim.beta1", "1.5", "optim.beta1 must be in [0, 1), got 1.5"),
    ("--optim.beta2", "-0.1", "optim.beta2 must be in [0, 1), got -0.1"),
])  # fmt: skip
def test_optimiser_values_out_of_range_are_one_line_before_anything_is_written(
    flag, value, expected, data_dir, tmp_path
):
    run = tmp_path / "run"
    assert expected in _cli_error(*_cli_args(data_dir, run, flag, value))
    assert not run.exists()


def test_build_optimizer_checks_its_hyperparameters():
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))], "weight_decay": 0.0}]
    check_optim(OptimConfig())
    for key, bad in (("beta1", 1.0), ("beta2", 1.5), ("lr", 0.0), ("weight_decay", -1.0)):
        optim = OptimConfig()
        setattr(optim, key, bad)  # past the dataclass's own checks
        with pytest.raises(ConfigError, match=rf"optim\.{key} must be"):
            build_optimizer(params, optim, 10)
