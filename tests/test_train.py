"""Training harness: configs, end-to-end runs, exact resume, atomic checkpoints, reproduce."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers import TINY_MODEL, tiny_lra
from safetensors.torch import load_file

from structattn.cli import main as cli_main
from structattn.engine.checkpoint import latest_checkpoint, save_checkpoint
from structattn.engine.config import CONFIG_DIR, build_dataclass
from structattn.errors import RunError
from structattn.experiments.lra import LRAConfig, evaluate_run, load_lra, train
from structattn.experiments.lra.reproduce import reproduce
from structattn.hkt import diagnostics as dg

TINY_TRAIN = dict(max_steps=6, batch_size=8, eval_every=3, log_every=2)


#: every test builds its runs with these train settings unless it says otherwise
tiny = functools.partial(tiny_lra, **TINY_TRAIN)


@pytest.mark.parametrize("task", ["listops", "image", "text"])
def test_tiny_end_to_end_train_and_eval(task, lra_data_dir, tmp_path):
    cfg = tiny(task, "hkt", lra_data_dir, tmp_path / "run")
    final = train(cfg, progress=False)
    assert final["steps"] == 6 and final["task"] == task and final["median_step_ms"] > 0
    assert final["skipped_steps"] == 0
    assert final["stand_in"] == (task == "image")  # aclImdb fixture is the original layout
    assert len(final["hkt"]["level_weights"]) == 1  # one layer
    run = tmp_path / "run"
    for name in ("config.yaml", "metrics.csv", "best.safetensors", "final.json"):
        assert (run / name).is_file(), name
    assert list((run / "tb").iterdir())
    assert json.loads((run / "final.json").read_text())["test_acc"] == final["test_acc"]
    rows = (run / "metrics.csv").read_text().splitlines()
    assert rows[0] == "step,split,loss,acc,lr,step_ms" and any(",val," in r for r in rows)
    val = [(int(r[0]), float(r[3])) for r in (x.split(",") for x in rows[1:]) if r[1] == "val"]
    best_step, best_acc = max(val, key=lambda sv: (sv[1], -sv[0]))  # the first best evaluation
    assert (final["best_step"], final["val_acc"]) == (best_step, pytest.approx(best_acc))
    evaluated = evaluate_run(run, "test")  # the best weights, read back from disk
    assert evaluated["acc"] == pytest.approx(final["test_acc"])
    assert evaluated["n"] == final["test_examples"]


def test_training_learns_a_separable_task(lra_data_dir, tmp_path):
    cfg = tiny("image", "mha", lra_data_dir, tmp_path / "r", max_steps=40, eval_every=20)
    cfg.optim.lr = 5e-3
    final = train(cfg, progress=False)
    assert final["val_acc"] > 0.3  # chance is 0.1; labels shift the grey level


@pytest.mark.parametrize("attention", ["hkt", "mha"])
def test_resume_is_exact(attention, lra_data_dir, tmp_path):
    """2N steps straight == N steps, stop, resume N more (weights, optimizer, RNG, data)."""
    straight = tiny("listops", attention, lra_data_dir, tmp_path / "a", max_steps=8, eval_every=4)
    train(straight, progress=False)
    first = tiny(
        "listops", attention, lra_data_dir, tmp_path / "b", max_steps=8, eval_every=4, stop_at=5
    )
    paused = train(first, progress=False)
    assert paused["paused_at"] == 5
    with pytest.raises(ValueError, match="already holds checkpoints"):
        train(first, progress=False)
    second = tiny("listops", attention, lra_data_dir, tmp_path / "b", max_steps=8, eval_every=4)
    second.resume = True
    train(second, progress=False)
    a = load_file(str(tmp_path / "a" / "checkpoints" / "step-00000008" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "checkpoints" / "step-00000008" / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    steps = [int(r.split(",")[0]) for r in (tmp_path / "b" / "metrics.csv").read_text().split()[1:]]
    assert steps == sorted(steps)  # no rows duplicated by the resume


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    model = torch.nn.Linear(3, 2)
    save_checkpoint(tmp_path, 1, model, {"x": 1})
    assert latest_checkpoint(tmp_path).name == "step-00000001"

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(RunError, match=r"could not be written: .*step-00000002 \(disk full\)"):
        save_checkpoint(tmp_path, 2, model, {"x": 2})
    assert latest_checkpoint(tmp_path).name == "step-00000001"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001"]


# configs/<task>-<model>.yaml are HKT experiments; configs/glfusion.yaml is tested in test_cli,
# configs/lm.yaml and configs/glfusion-code.yaml below.
OTHERS = ("glfusion", "lm", "glfusion-code")
EXPERIMENTS = sorted(p for p in CONFIG_DIR.glob("*.yaml") if p.stem not in OTHERS)


def test_the_six_experiment_files_exist():
    assert [p.stem for p in EXPERIMENTS] == [
        f"{t}-{m}" for t in ("image", "listops", "text") for m in ("hkt", "mha")
    ]


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.name)
def test_every_config_file_parses(path):
    doc = yaml.safe_load(path.read_text())
    task, attention = path.stem.split("-")
    # presets at the paper's lengths on a CPU
    extra = {"listops": {"cpu512"}, "image": {"cpu784"}, "text": {"cpu1024"}}[task]
    assert set(doc) == {"quick", "cpu", "paper"} | extra
    for preset in doc:
        cfg = load_lra(path, preset)
        assert cfg.data.task == task and cfg.model.attention == attention
        assert cfg.name == path.stem


def _leaves(doc, prefix=()):
    for key, value in doc.items():
        if isinstance(value, dict):
            yield from _leaves(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def _load_any(path, preset):
    from structattn.engine import load_config
    from structattn.experiments.glfusion.code import CodeNamesConfig
    from structattn.experiments.lm import LMConfig

    classes = {"lm": LMConfig, "glfusion-code": CodeNamesConfig}
    if path.stem in classes:
        return load_config(classes[path.stem], path, preset)
    return load_lra(path, preset)


@pytest.mark.parametrize(
    "path",
    [*EXPERIMENTS, CONFIG_DIR / "lm.yaml", CONFIG_DIR / "glfusion-code.yaml"],
    ids=lambda p: p.name,
)
def test_every_value_in_a_config_file_reaches_the_config(path):
    """No key of a preset is silently ignored or renamed on the way to the dataclasses."""
    for preset, doc in yaml.safe_load(path.read_text()).items():
        cfg = _load_any(path, preset)
        for keys, value in _leaves(doc):
            got = cfg
            for key in keys:
                got = getattr(got, key)
            got = list(got) if isinstance(got, tuple) else got
            assert got == value, (path.name, preset, keys, got, value)


@pytest.mark.parametrize(
    "values, match",
    [
        ({"data": {"task": "cifar"}}, "data.task must be one of"),
        ({"train": {"max_steps": -5}}, "train.max_steps must be >= 1"),
        ({"optim": {"lr": -1.0}}, "optim.lr must be > 0"),
        ({"model": {"attention": "linear"}}, "model.attention must be one of"),
        ({"data": {"data_dir": "/nonexistent/structattn"}}, "data.data_dir does not exist"),
        ({"train": {"maxsteps": 3}}, "unknown key.*train.maxsteps"),
        ({"bogus": 1}, "unknown key.*bogus"),
    ],
)
def test_bad_config_names_the_key(values, match):
    with pytest.raises(ValueError, match=match):
        build_dataclass(LRAConfig, values)


def test_train_cli_overrides_yaml(lra_data_dir, tmp_path, capsys):
    cli_main(
        [
            "train",
            "--config",
            "listops-mha",
            "--preset",
            "quick",
            "--run-dir",
            str(tmp_path / "c"),
            "--data.data-dir",
            str(lra_data_dir),
            "--data.seq-len",
            "32",
            "--data.listops-min-length",
            "4",
            "--data.listops-sizes",
            "40",
            "8",
            "8",
            "--model.d-model",
            "16",
            "--model.n-layers",
            "1",
            "--train.max-steps",
            "3",
            "--train.eval-every",
            "3",
            "--seed",
            "4",
        ]
    )
    saved = yaml.safe_load((tmp_path / "c" / "config.yaml").read_text())
    assert saved["seed"] == 4 and saved["train"]["max_steps"] == 3
    assert saved["model"]["attention"] == "mha" and saved["model"]["d_model"] == 16
    assert json.loads(capsys.readouterr().out)["steps"] == 3


def test_reproduce_table_and_skip(lra_data_dir, tmp_path):
    overrides = dict(
        data={"seq_len": 32, "listops_min_length": 4, "listops_sizes": [48, 8, 8]},
        model=TINY_MODEL,
        train={**TINY_TRAIN, "max_steps": 3},
    )
    out = tmp_path / "out"
    results = reproduce(
        "quick",
        seeds=(0, 1),
        tasks=("listops",),
        out_dir=out,
        data_dir=lra_data_dir,
        progress=False,
        overrides=overrides,
    )
    row = results["tasks"]["listops"]
    assert len(row["hkt"]["test_acc"]) == 2 and row["step_time_ratio"] > 0
    table = (out / "quick" / "results.md").read_text()
    assert "55.10 ± 0.29" in table and "50.33 ± 0.12" in table and "| listops |" in table
    summaries = [  # the table's diagnostics are the means of the HKT runs' own reports
        json.loads(
            (
                out / "quick" / "listops-hkt" / f"seed{s}" / "diagnostics" / "diagnostics.json"
            ).read_text()
        )["summary"]
        for s in (0, 1)
    ]
    for key in ("kappa", "reciprocity"):
        expected = sum(d[f"{key}_mean"] for d in summaries) / 2
        assert row[key] == pytest.approx(expected) and row[key] > 0
    for png in ("val_accuracy.png", "hkt_levels_beta.png"):
        assert (out / "quick" / png).stat().st_size > 0
    # a call that trained no MHA (e.g. HKT's ablations only) shows "-", not nan
    import copy

    from structattn.experiments.lra.reproduce import results_table

    no_mha = copy.deepcopy(results)
    no_mha["tasks"]["listops"]["mha"].update(test_acc=[], mean=float("nan"), std=float("nan"))
    no_mha["tasks"]["listops"]["diff_pp"] = float("nan")
    summary_row = results_table(no_mha).splitlines()[4]
    assert "nan" not in summary_row and "| - | - |" in summary_row
    final = out / "quick" / "listops-hkt" / "seed0" / "final.json"
    before = final.stat().st_mtime_ns
    reproduce(
        "quick",
        seeds=(0, 1),
        tasks=("listops",),
        out_dir=out,
        data_dir=lra_data_dir,
        progress=False,
        overrides=overrides,
    )
    assert final.stat().st_mtime_ns == before  # finished runs are skipped


def test_the_headline_difference_pairs_seeds_when_one_model_has_more(tmp_path):
    """A table read back from a folder may hold three HKT seeds and two MHA seeds: Δ and the
    step-time ratio use the two seeds both finished, and the table says which."""
    from structattn.experiments.lra.reproduce import results_table, summarise

    def final(acc, ms):
        return {"test_acc": acc, "median_step_ms": ms, "parameters": 10, "seq_len": 8,
                "data_source": "generated", "stand_in": False, "hkt": {}}  # fmt: skip

    finals = {("listops", "hkt", 0): final(0.40, 2.0), ("listops", "hkt", 1): final(0.42, 2.0),
              ("listops", "hkt", 2): final(0.70, 9.0), ("listops", "mha", 0): final(0.39, 1.0),
              ("listops", "mha", 1): final(0.40, 1.0)}  # fmt: skip
    results = summarise(tmp_path, ["listops"], [0, 1, 2], finals)
    row = results["tasks"]["listops"]
    assert row["diff_pp"] == pytest.approx(1.5) and row["diff_seeds"] == [0, 1]
    assert row["step_time_ratio"] == pytest.approx(2.0)
    assert "| +1.50 (seeds 0, 1) |" in results_table(results).splitlines()[4]
    finals.pop(("listops", "hkt", 2))  # the same seeds: no note
    row = summarise(tmp_path, ["listops"], [0, 1, 2], finals)["tasks"]["listops"]
    assert "| +1.50 |" in results_table({**results, "tasks": {"listops": row}}).splitlines()[4]


def test_reproduce_rejects_unknown_task(tmp_path):
    with pytest.raises(ValueError, match="unknown task"):
        reproduce("quick", seeds=(0,), tasks=("mnist",), out_dir=tmp_path)


def test_missing_data_is_a_clear_error(tmp_path):
    cfg = load_lra(
        "image-hkt", "quick", data={"data_dir": str(tmp_path)}, run_dir=str(tmp_path / "r")
    )
    with pytest.raises(FileNotFoundError, match="make data"):
        train(cfg, progress=False)


def test_configs_ship_with_the_package_and_are_found_from_anywhere(tmp_path, monkeypatch):
    import structattn
    from structattn.engine.config import find_config

    assert CONFIG_DIR == Path(structattn.__file__).parent / "configs"
    monkeypatch.chdir(tmp_path)  # no configs/ folder here
    assert find_config("listops-hkt") == CONFIG_DIR / "listops-hkt.yaml"
    assert find_config("glfusion") == CONFIG_DIR / "glfusion.yaml"
    with pytest.raises(ValueError, match="not found.*listops-hkt"):
        find_config("listops-hk")
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert '"structattn" = ["configs/*.yaml"]' in pyproject  # package data in the wheel


def test_reproduce_with_paused_runs_reports_them(lra_data_dir, tmp_path):
    overrides = dict(
        data={"seq_len": 32, "listops_min_length": 4, "listops_sizes": [48, 8, 8]},
        model=TINY_MODEL,
        train={**TINY_TRAIN, "max_steps": 4, "stop_at": 2},
    )
    results = reproduce(
        "quick",
        seeds=(0,),
        tasks=("listops",),
        out_dir=tmp_path / "out",
        data_dir=lra_data_dir,
        progress=False,
        overrides=overrides,
    )
    assert results["incomplete"] == [
        "listops-hkt/seed0 (paused at 2)",
        "listops-mha/seed0 (paused at 2)",
    ]
    assert "Not in the table (unfinished" in (tmp_path / "out" / "quick" / "results.md").read_text()


def test_diagnose_a_trained_run(lra_data_dir, tmp_path, capsys):
    run = tmp_path / "run"
    train(tiny("listops", "hkt", lra_data_dir, run), progress=False)
    cli_main(["diagnose", str(run), "--sequences", "2", "--max-len", "24"])
    assert "kappa mean" in capsys.readouterr().out
    report = json.loads((run / "diagnostics" / "diagnostics.json").read_text())
    layer = report["layers"][0]
    a = layer["approximation"]
    for h in range(2):
        parts = a["hierarchical"][h] + a["quantisation"][h] + a["optimisation"][h]
        assert parts == pytest.approx(a["total"][h], abs=1e-9)
    assert len(layer["kappa"]) == 2 and all(k > 0 for k in layer["kappa"])
    assert report["cost"]["paper_score_ratio"] > 1
    for name in ("diagnostics.md", "diagnostics.png", "kurtosis.png"):
        assert (run / "diagnostics" / name).stat().st_size > 0
    # every reading of the paper's kappa, printed and in the report; levels_mardia is kappa
    assert "`softmax_rows`" in (run / "diagnostics" / "diagnostics.md").read_text()
    assert layer["kurtosis_candidates"]["levels_mardia"] == layer["kappa"]
    assert set(report["kurtosis_candidates"]) == set(dg.KURTOSIS_CANDIDATES)
    # the paper's kappa by value is Mardia's b2,p itself: kappa times p(p+2) = 15 at L = 3
    b2 = report["kurtosis_candidates"]["levels_mardia_b2"]
    assert b2["gaussian"] == 15
    assert b2["mean"] == pytest.approx(15 * report["summary"]["kappa_mean"])
    assert report["summary"]["paper_kappa_mean"] == b2["mean"]
    # --untrained: the same configuration before training, into its own folder
    cli_main(["diagnose", str(run), "--sequences", "2", "--max-len", "24", "--untrained"])
    assert "`fused_pairs`" in capsys.readouterr().out
    before = json.loads((run / "diagnostics-untrained" / "diagnostics.json").read_text())
    assert before["weights"].startswith("untrained")
    assert before["layers"][0]["level_weights"] != layer["level_weights"]


def test_diagnose_rejects_mha_runs(lra_data_dir, tmp_path):
    from structattn.experiments.lra.diagnose import diagnose

    run = tmp_path / "mha"
    train(tiny("listops", "mha", lra_data_dir, run), progress=False)
    with pytest.raises(ValueError, match="diagnose needs hkt"):
        diagnose(run)


def test_reproduce_variants_sweep_baselines_and_paired_statistics(lra_data_dir, tmp_path):
    overrides = dict(
        data={"seq_len": 32, "listops_min_length": 4, "listops_sizes": [64, 16, 16]},
        model=TINY_MODEL,
        train={**TINY_TRAIN, "max_steps": 4, "eval_every": 1},
    )
    out = tmp_path / "out"
    results = reproduce(
        "quick",
        seeds=(0, 1),
        tasks=("listops",),
        out_dir=out,
        data_dir=lra_data_dir,
        progress=False,
        overrides=overrides,
        variants=("hkt", "mha", "mha-wide", "hkt-fixed-lambda"),
        lr_sweep=(1e-3, 3e-3),
    )
    row = results["tasks"]["listops"]
    # the sweep ran one seed per rate and model, on validation, apart from the reported seeds
    sweep = results["lr_sweep"]["tasks"]["listops"]
    assert set(sweep) == {"hkt", "mha"} and set(sweep["hkt"]["val_acc"]) == {"0.001", "0.003"}
    chosen = float(sweep["mha"]["chosen"])
    cfg = yaml.safe_load((out / "quick" / "listops-mha-wide" / "seed0" / "config.yaml").read_text())
    assert cfg["optim"]["lr"] == chosen  # the wide MHA uses MHA's tuned rate
    # the wide MHA has about HKT's parameter count, far more than MHA
    h, m, w = (row[v]["parameters"] for v in ("hkt", "mha", "mha-wide"))
    assert abs(w - h) < abs(m - h) and w > m
    fixed = yaml.safe_load(
        (out / "quick" / "listops-hkt-fixed-lambda" / "seed1" / "config.yaml").read_text()
    )
    assert fixed["model"]["hkt"]["learn_levels"] is False
    # paired differences by seed, with the verdict
    d = row["comparisons"]["hkt - mha"]
    assert d["mean"] == pytest.approx(
        sum(a - b for a, b in zip(row["hkt"]["test_acc"], row["mha"]["test_acc"])) / 2
    )
    assert d["verdict"] in ("a better", "b better", "inconclusive") and d["n"] == 2
    assert set(row["shallow"]) == {"majority", "token_counts_mlp", "outermost_operator"}
    assert set(row["beats_outermost"]) == {"hkt", "mha", "mha-wide", "hkt-fixed-lambda"}
    assert len(row["hkt"]["plateau"]) == 2
    table = (out / "quick" / "results.md").read_text()
    for text in ("HKT − MHA widened to HKT's parameter count", "95% interval",
                 "shallow: most frequent answer per outermost operator", "Learning-rate sweep",
                 "outermost-operator cue"):  # fmt: skip
        assert text in table, text


def test_ablations_train_each_variant_on_the_same_seed(lra_data_dir, tmp_path):
    from structattn.experiments.lra.reproduce import ABLATIONS

    overrides = dict(
        data={"seq_len": 32, "listops_min_length": 4, "listops_sizes": [48, 8, 8]},
        model=TINY_MODEL,
        train={**TINY_TRAIN, "max_steps": 2},
    )
    results = reproduce("quick", seeds=(0,), tasks=("listops",), out_dir=tmp_path,
                        data_dir=lra_data_dir, progress=False, overrides=overrides,
                        variants=ABLATIONS, baselines=False)  # fmt: skip
    hkt = {}
    for variant in ABLATIONS:
        cfg = yaml.safe_load(
            (tmp_path / "quick" / f"listops-{variant}" / "seed0" / "config.yaml").read_text()
        )
        hkt[variant] = cfg["model"]["hkt"]
        assert cfg["seed"] == 0 and cfg["train"]["max_steps"] == 2  # the same budget
    assert hkt["hkt-no-hybrid"]["hybrid"] is False and hkt["hkt"]["hybrid"] is True
    assert hkt["hkt-L1-hybrid"]["n_levels"] == 1 and hkt["hkt-L1-hybrid"]["hybrid"] is True
    assert hkt["hkt-fixed-lambda"]["learn_levels"] is False
    assert (hkt["hkt-L2"]["n_levels"], hkt["hkt-L4"]["n_levels"]) == (2, 4)
    assert set(results["tasks"]["listops"]["comparisons"]) == {f"hkt - {v}" for v in ABLATIONS[1:]}
    assert "HKT with fixed uniform λ" in (tmp_path / "quick" / "results.md").read_text()


def test_a_finished_run_is_never_overwritten_by_a_fresh_one(lra_data_dir, tmp_path):
    """With its checkpoints deleted (to save space), a finished run was silently replaced."""
    cfg = tiny("listops", "hkt", lra_data_dir, tmp_path / "r", max_steps=4, eval_every=2)
    train(cfg, progress=False)
    run = tmp_path / "r"
    shutil.rmtree(run / "checkpoints")
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    with pytest.raises(ValueError, match=r"already holds results \(final.json, best.safetensors"):
        train(cfg, progress=False)
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def test_a_run_folder_held_by_another_process_is_refused_naming_its_pid(lra_data_dir, tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, os, sys, time\n"
         f"fd = os.open({str(run / '.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, f'{os.getpid()}\\n'.encode())\n"
         "print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        cfg = tiny("listops", "hkt", lra_data_dir, run, max_steps=2, eval_every=2)
        with pytest.raises(ValueError, match=f"in use by another process \\(PID {holder.pid}\\)"):
            train(cfg, progress=False)
        assert not (run / "metrics.csv").exists() and not (run / "config.yaml").exists()
    finally:
        holder.kill()
        holder.wait()
    train(cfg, progress=False)  # the holder gone, the folder is free
    assert (run / "final.json").is_file()


def test_a_run_dir_that_is_a_file_is_one_error(lra_data_dir, tmp_path):
    (tmp_path / "f").write_text("x")
    for run in (tmp_path / "f", tmp_path / "f" / "inside"):
        cfg = tiny("listops", "hkt", lra_data_dir, run, max_steps=2, eval_every=2)
        with pytest.raises(ValueError, match="is a file, not a folder"):
            train(cfg, progress=False)
