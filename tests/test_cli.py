"""The structattn command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from structattn.cli import main


def test_cost_table(capsys):
    main(["cost", "--levels", "3", "--stride", "2"])
    out = capsys.readouterr().out
    assert "1.3125" in out and "1.3333" in out and "3.0000" in out


def test_cost_json_exact_length(capsys):
    main(["cost", "--levels", "2", "--stride", "2", "--seq-len", "5", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["paper_score_ratio"] == pytest.approx(34 / 25)
    assert data["fast_score_ratio"] == 2.0


def test_bad_option_is_one_line_error():
    proc = subprocess.run(
        [sys.executable, "-m", "structattn.cli", "cost", "--levels", "0"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0
    assert "n_levels must be >= 1" in proc.stderr and "Traceback" not in proc.stderr


def test_glfusion_cli_rejects_unknown_preset_and_subcommand():
    for argv, message in (
        (["glfusion", "train", "--preset", "huge"], "no preset 'huge'"),
        (["glfusion", "fit"], "usage: structattn glfusion train"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "structattn.cli", *argv], capture_output=True, text=True
        )
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_glfusion_help_lists_its_three_commands_and_the_presets():
    def run(*argv):
        return subprocess.run(
            [sys.executable, "-m", "structattn.cli", "glfusion", *argv],
            capture_output=True,
            text=True,
            env={**os.environ, "COLUMNS": "200"},  # one line per flag
        )

    top = run("--help")
    assert top.returncode == 0, top.stderr
    assert all(name in top.stdout for name in ("train", "predict", "ablate"))
    train = run("train", "--preset", "recipe", "--help")
    assert train.returncode == 0, train.stderr
    assert "--config" in train.stdout and "quick | paper | recipe" in train.stdout
    assert "(default: labels)" in train.stdout  # the recipe preset's lm_loss is the default
    ablate = run("ablate", "--help")
    assert ablate.returncode == 0 and "--summary-only" in ablate.stdout
    assert "--no-summary-only" not in ablate.stdout  # the flags it always had, no more


def test_glfusion_config_file_parses():

    from structattn.experiments.glfusion import load_glfusion

    quick, paper = (load_glfusion("glfusion", k) for k in ("quick", "paper"))
    assert quick.dataset == "wordnet" and paper.dataset == "arxiv"
    assert paper.lora_r == 64 and paper.optim.lr == 3e-5 and paper.optim.weight_decay == 0.0
    assert quick.train.max_steps == 120 and quick.optim.beta2 == 0.999
    assert paper.message_passing_layers == list(range(0, 32, 4))
    assert paper.cross_attention_layers == list(range(3, 32, 4))


def test_help_lists_every_command():
    proc = subprocess.run(
        [sys.executable, "-m", "structattn.cli", "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0
    for name in ("train", "glfusion", "eval", "reproduce", "diagnose", "data", "params", "cost"):
        assert f"  {name} " in proc.stdout, name


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--config", "listops-hkt", "--preset", "huge"], "no preset 'huge'"),
        (["train", "--config", "nope"], "config 'nope' not found"),
        (["train", "--config", "listops-hkt", "--train.max-steps", "0"], "max_steps must be >= 1"),
        (["bogus"], "unknown command 'bogus'"),
    ],
)
def test_bad_input_is_one_line(argv, message):
    proc = subprocess.run(
        [sys.executable, "-m", "structattn.cli", *argv], capture_output=True, text=True
    )
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_internal_errors_keep_their_traceback(monkeypatch):
    import structattn.experiments.lra.experiment as hkt

    def broken(cfg, data=None, progress=True):
        raise ValueError("an internal bug")

    monkeypatch.setattr(hkt, "train", broken)
    with pytest.raises(ValueError, match="an internal bug"):
        main(["train", "--config", "listops-hkt", "--train.max-steps", "1"])


@pytest.mark.parametrize(("argv", "flag"), [
    (["reproduce", "--set", "train.max_steps=2", "--set", "train.batch_size=4"], "--set"),
    (["train", "--preset", "quick", "--train.max-steps=2", "--train.max-steps", "3"],
     "--train.max-steps"),
    (["glfusion", "train", "--dataset", "wordnet", "--dataset", "wordnet"], "--dataset"),
    (["reproduce", "--out_dir", "elsewhere"], "--out-dir"),  # the same flag spelt with _
    (["reproduce", "--progress", "--no-progress"], "--progress"),  # a switch and its negation
    (["train", "--preset", "quick", "--train.bf16", "--train.no-bf16"], "--train.bf16"),
])  # fmt: skip
def test_a_flag_given_twice_is_refused_instead_of_keeping_the_last(tmp_path, argv, flag):
    """``--set A --set B`` would silently drop ``A`` (the parser keeps the last): one line."""
    with pytest.raises(SystemExit, match=f"{flag} is given twice"):
        main([*argv, "--out-dir" if argv[0] == "reproduce" else "--run-dir", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists() and not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize("preset", ["cpu", "cpu512"])
def test_reproduce_set_shrinks_a_run_to_seconds(lra_data_dir, tmp_path, capsys, preset):
    """``reproduce --set KEY=VALUE`` changes preset keys of every run (dotted keys, YAML values),
    so the documented command (``cpu``, and ``cpu512`` at the paper's ListOps length) is
    testable in seconds; the runs record the changed keys."""
    out = tmp_path / "out"
    main([
        "reproduce", "--preset", preset, "--tasks", "listops", "--seeds", "0", "--no-progress",
        "--out-dir", str(out), "--data-dir", str(lra_data_dir),
        "--set", "train.max_steps=2", "train.eval_every=2", "train.batch_size=4",
        "data.seq_len=32", "data.listops_min_length=4", "data.listops_sizes=[40,8,8]",
        "model.d_model=16", "model.n_layers=1",
    ])  # fmt: skip
    assert "| listops |" in capsys.readouterr().out
    results = json.loads((out / preset / "results.json").read_text())
    assert results["overrides"]["train"]["max_steps"] == 2
    assert results["overrides"]["data"]["listops_sizes"] == [40, 8, 8]
    for model in ("hkt", "mha"):
        final = json.loads((out / preset / f"listops-{model}" / "seed0" / "final.json").read_text())
        assert final["steps"] == 2
    for bad, message in ((["train.max_steps"], "KEY=VALUE"), (["a..b=1"], "dotted key"),
                         (["train=1", "train.x=2"], "overlap"),
                         (["train.max_steps=1", "train.max_steps=5"], "given twice"),
                         (["train.max_steps=3", "train={max_steps: 2}"], "overlap"),
                         (["train={max_steps: 2}", "train.max_steps=3"], "overlap")):  # fmt: skip
        with pytest.raises(SystemExit, match=message):
            main(["reproduce", "--tasks", "listops", "--out-dir", str(out), "--set", *bad])


def test_an_hkt_layers_width_heads_and_causality_are_no_flags(tmp_path, capsys):
    """The model sets its HKT layers' width, heads and causality: ``--model.hkt.d-model`` is an
    unknown flag (one line, nothing written), ``--help`` does not list it, the layer's own
    options stay flags."""
    with pytest.raises(SystemExit, match="model.hkt.d-model"):
        main(["train", "--preset", "quick", "--model.hkt.d-model", "8",
              "--run-dir", str(tmp_path / "x")])  # fmt: skip
    assert not (tmp_path / "x").exists()
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    shown = capsys.readouterr().out
    assert "--model.hkt.n-levels" in shown and "--model.d-model" in shown
    assert not any(f"--model.hkt.{f}" in shown for f in ("d-model", "n-heads", "causal"))
