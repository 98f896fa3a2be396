"""The run folder as a contract, and one line for each misuse: ``--overwrite``, the data's identity
on ``--resume``, an edited ``metrics.csv``, the best weights and their record, a sweep that
finds a finished run of another configuration, gradients through the decoding cache, and the
command-line errors that used to be tracebacks or boxes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TINY_LISTOPS, TINY_MODEL, tiny_listops

from structattn.engine import RunDir
from structattn.errors import ConfigError, RunError
from structattn.experiments.lra import evaluate_run, train

LISTOPS = TINY_LISTOPS


def tiny(data_dir, run_dir, **changes):
    return tiny_listops(data_dir, run_dir, 6, **changes)


@pytest.fixture
def data_dir(tmp_path):
    path = tmp_path / "data"
    path.mkdir()
    return path


# ---------------------------------------------------------------------- overwrite


def test_overwrite_retrains_a_finished_run_and_keeps_foreign_files(data_dir, tmp_path):
    run = tmp_path / "run"
    first = train(tiny(data_dir, run, train={"max_steps": 4}), progress=False)
    (run / "notes.txt").write_text("mine")
    with pytest.raises(RunError, match="already holds checkpoints.*--overwrite"):
        train(tiny(data_dir, run), progress=False)
    with pytest.warns(UserWarning, match="notes.txt"):
        second = train(tiny(data_dir, run, overwrite=True), progress=False)
    assert (first["steps"], second["steps"]) == (4, 6)
    assert RunDir(run).read_final()["steps"] == 6 and (run / "notes.txt").read_text() == "mine"
    rows = RunDir(run).metrics.read_text().splitlines()
    assert max(int(r.split(",")[0]) for r in rows[1:]) == 6 and len(rows) == 1 + 6 + 3
    with pytest.raises(RunError, match="cannot be combined with --resume"):
        train(tiny(data_dir, run, overwrite=True, resume=True), progress=False)


# ---------------------------------------------------------------------- the data's identity


def test_resume_refuses_other_data_and_accepts_the_same_data_moved(data_dir, tmp_path):
    run = tmp_path / "run"
    train(tiny(data_dir, run, train={"stop_at": 2}), progress=False)
    saved = json.loads((run / "data.json").read_text())
    assert len(saved["sha256"]) == 64 and "ListOps" in saved["source"]
    moved = tmp_path / "moved"
    os.rename(data_dir, moved)  # the same files elsewhere: the same data
    cfg = tiny(moved, run, resume=True, train={"stop_at": 4})
    assert train(cfg, progress=False)["paused_at"] == 4
    # the same names with other content: the run would switch datasets mid-way
    (tsv,) = moved.rglob("basic_train.tsv")
    lines = tsv.read_text().splitlines()
    tsv.write_text("\n".join([lines[0], *reversed(lines[1:])]) + "\n")
    with pytest.raises(RunError, match="the data differs from the run's"):
        train(tiny(moved, run, resume=True), progress=False)


# ---------------------------------------------------------------------- metrics.csv


def _paused(data_dir, run):
    train(tiny(data_dir, run, train={"stop_at": 4}), progress=False)
    return RunDir(run).metrics


def test_an_edited_metrics_csv_is_set_aside_not_truncated(data_dir, tmp_path):
    metrics = _paused(data_dir, tmp_path / "run")
    edited = "\n".join(metrics.read_text().splitlines()[1:]) + "\n"  # the header removed
    metrics.write_text(edited)
    with pytest.warns(RuntimeWarning, match="before-resume-4"):
        train(tiny(data_dir, tmp_path / "run", resume=True), progress=False)
    assert (metrics.parent / "metrics.csv.before-resume-4").read_text() == edited
    rows = metrics.read_text().splitlines()
    assert rows[0] == "step,split,loss,acc,lr,step_ms"
    assert [int(r.split(",")[0]) for r in rows[1:] if ",train," in r] == [5, 6]


def test_an_added_column_is_set_aside_too(data_dir, tmp_path):
    metrics = _paused(data_dir, tmp_path / "run")
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join(f"{line},note" for line in lines) + "\n")
    with pytest.warns(RuntimeWarning, match="does not read as this run's log"):
        train(tiny(data_dir, tmp_path / "run", resume=True), progress=False)
    assert "note" in (metrics.parent / "metrics.csv.before-resume-4").read_text()


def test_a_clean_log_keeps_its_rows_and_loses_only_a_cut_last_line(data_dir, tmp_path):
    metrics = _paused(data_dir, tmp_path / "run")
    before = metrics.read_text()
    metrics.write_text(before + "5,train,0.5")  # a kill in the middle of a row
    train(tiny(data_dir, tmp_path / "run", resume=True), progress=False)
    after = metrics.read_text()
    assert after.startswith(before) and "0.5\n" not in after.replace("\r", "")
    steps = [int(r.split(",")[0]) for r in after.splitlines()[1:] if ",train," in r]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert not list(metrics.parent.glob("metrics.csv.before-resume-*"))


# ---------------------------------------------------------------------- best weights


def test_best_weights_carry_their_record(data_dir, tmp_path):
    from structattn.engine.checkpoint import weights_metadata

    run = tmp_path / "run"
    final = train(tiny(data_dir, run), progress=False)
    meta = weights_metadata(run / "best.safetensors")
    assert int(meta["step"]) == final["best_step"] and float(meta["value"]) == final["val_acc"]


def test_deleted_best_weights_are_chosen_again_after_resume(data_dir, tmp_path):
    run = tmp_path / "run"
    train(tiny(data_dir, run, train={"stop_at": 4}), progress=False)
    (run / "best.safetensors").unlink()
    with pytest.warns(RuntimeWarning, match="best is chosen again"):
        final = train(tiny(data_dir, run, resume=True), progress=False)
    assert final["best_step"] == 6  # the only evaluation after the resume
    evaluated = evaluate_run(run, "test")  # the weights on disk are the ones reported
    assert evaluated["acc"] == pytest.approx(final["test_acc"])


# ---------------------------------------------------------------------- sweeps


def test_reproduce_refuses_a_finished_run_of_another_configuration(data_dir, tmp_path):
    from structattn.experiments.lra.reproduce import reproduce

    def overrides(width):
        model = {**TINY_MODEL, "d_model": width}
        return dict(data=LISTOPS, model=model, train={"max_steps": 2, "batch_size": 8,
                                                      "eval_every": 2})  # fmt: skip

    kw = dict(seeds=(0,), tasks=("listops",), out_dir=tmp_path / "out", data_dir=data_dir,
              progress=False, variants=("hkt",), baselines=False)  # fmt: skip
    reproduce("quick", overrides=overrides(16), **kw)
    reproduce("quick", overrides=overrides(16), **kw)  # the same runs: reused
    with pytest.raises(ConfigError, match=r"another configuration \(model.d_model differ\)"):
        reproduce("quick", overrides=overrides(32), **kw)


# ---------------------------------------------------------------------- gradients


@pytest.mark.parametrize("attention", ["hkt", "mha"])
def test_gradients_through_the_decoding_cache_match_the_full_forward(attention):
    from structattn.hkt import CausalLM, ModelConfig, use_compiled_step

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=20, max_len=32, d_model=16, n_layers=2, n_heads=2, causal=True,
                      attention=attention, dropout=0.0)  # fmt: skip
    model = CausalLM(cfg).double()
    ids = torch.randint(1, 20, (2, 11))
    params = list(model.parameters())
    with use_compiled_step(False):
        out = model(ids[:, :5], cache=model.new_cache())
        logits, cache = [out.logits[:, -1:]], out.cache
        for t in range(5, 10):  # five cached steps
            out = model(ids[:, t : t + 1], cache=cache)
            logits.append(out.logits)
            cache = out.cache
    stepped = torch.cat(logits, 1)
    assert torch.allclose(stepped, model(ids).logits[:, 4:10], atol=1e-10)
    got = torch.autograd.grad((stepped[:, 1:] ** 2).sum(), params, allow_unused=True)
    full = model(ids).logits[:, 5:10]  # the same positions in one pass over the whole text
    expected = torch.autograd.grad((full**2).sum(), params, allow_unused=True)
    for g, e in zip(got, expected):
        if e is None:
            assert g is None or not g.abs().any()
        else:
            assert torch.allclose(g, e, atol=1e-9), (g - e).abs().max()


# ---------------------------------------------------------------------- one line each


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "structattn.cli", *args], capture_output=True,
                          text=True, env=env, timeout=300)  # fmt: skip


@pytest.mark.parametrize(
    "args, message",
    [
        (["cost", "--head-dim", "-4"], "head_dim must be >= 1"),
        (["generate", "RUN", "--top-k", "-5"], "top_k must be >= 1"),
        (["generate", "RUN", "--temperature", "nan"], "temperature must be a finite number"),
        (["params", "--out", "."], "is a folder"),
        (["train", "--data.listops-sizes", "-100", "300", "50"], "listops_sizes must be"),
        (["train", "--no-such-flag", "3"], "Unrecognized options: --no-such-flag"),
        (["glfusion", "train", "--max-nodes", "0"], "max_nodes must be >= 1"),
    ],
)
def test_misuse_is_one_line(args, message, tmp_path):
    out = _cli(*[str(tmp_path) if a == "RUN" else a for a in args])
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0 and len(lines) == 1, out.stderr
    assert lines[0].startswith("structattn: error:") and message in lines[0], lines[0]
    assert not any(c in out.stderr for c in "╭│╰"), out.stderr


def test_generate_says_when_max_new_tokens_does_not_fit():
    from structattn.experiments.lm import generate_text
    from structattn.hkt import CausalLM, ModelConfig

    lm = CausalLM(ModelConfig(vocab_size=258, max_len=16, d_model=16, n_layers=1, n_heads=2,
                              causal=True))  # fmt: skip
    with pytest.warns(UserWarning, match=r"max_new_tokens=2000 does not fit.*at most 12"):
        (text,) = generate_text(lm, ["abcd"], max_new_tokens=2000, do_sample=False)
    assert len(text) <= 12  # one character per generated byte (invalid UTF-8 decodes to U+FFFD)


def test_a_pickled_adapter_is_refused(tmp_path):
    from structattn.glfusion.configuration import GLFusionConfig
    from structattn.glfusion.modeling import GLFusionForCausalLM

    folder = tmp_path / "best"
    (folder / "adapter").mkdir(parents=True)
    GLFusionConfig(text_dim=8, num_node_classes=3).save(folder / "glfusion_config.json")
    marker = tmp_path / "ran"
    (folder / "adapter" / "adapter_model.bin").write_bytes(b"not read")
    with pytest.raises(ValueError, match="only safetensors adapters are loaded"):
        GLFusionForCausalLM.from_pretrained(folder, base_lm=torch.nn.Linear(2, 2))
    assert not marker.exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_run_dir_is_one_error_before_data(data_dir, tmp_path):
    run = tmp_path / "ro"
    run.mkdir()
    (run / ".lock").write_text("")
    run.chmod(0o555)
    try:
        with pytest.raises(RunError, match="cannot be written"):
            train(tiny(data_dir, run), progress=False)
    finally:
        run.chmod(0o755)
    assert not list(Path(data_dir).iterdir())  # refused before the data was built


def test_a_section_changes_an_experiments_own_defaults_key_by_key():
    from structattn.engine import build_dataclass
    from structattn.experiments.lm import LMConfig

    flat = build_dataclass(LMConfig, {"model": {"n_levels": 2}})  # an older file's flat key
    nested = build_dataclass(LMConfig, {"model": {"hkt": {"stride": 3}}})
    assert (flat.model.hkt.n_levels, flat.model.d_model, flat.model.causal) == (2, 128, True)
    assert (nested.model.hkt.stride, nested.model.hkt.n_levels, nested.model.d_model) == (3, 3, 128)


def test_overwrite_touches_nothing_in_a_folder_that_is_not_a_run(tmp_path):
    folder = tmp_path / "mine"
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "hf").mkdir()
    (folder / "config.yaml").write_text("my: own\n")  # a config alone is no run's
    with pytest.raises(RunError, match="not a run folder.*nothing removed"):
        RunDir(folder).clear()
    assert (folder / "hf").is_dir() and (folder / "config.yaml").is_file()


def test_a_finished_run_of_an_earlier_version_reads_as_finished(tmp_path):
    rd = RunDir(tmp_path)
    (tmp_path / "results.json").write_text('{"heads": {}}')
    assert rd.is_finished() and rd.read_final() == {"heads": {}}
    (tmp_path / "final.json").write_text('{"steps": 3}')
    assert rd.read_final() == {"steps": 3}
