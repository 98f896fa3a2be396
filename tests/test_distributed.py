"""Two processes on CPUs (torchrun, gloo): both ranks finish, one run directory is written once,
a run killed with SIGTERM resumes, and the result matches one process with the same global
batch. Slow: each case launches several multi-process runs (``make test-slow``)."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import tiny_glfusion_models, write_wordnet
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def launch(nproc: int, argv: list[str], **popen) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "structattn.cli", *argv]
    if nproc > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "structattn.cli",
            *argv,
        ]
    return subprocess.Popen(
        cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen
    )


def run(nproc: int, argv: list[str], timeout: int = 600) -> str:
    proc = launch(nproc, argv)
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def hkt_args(run_dir: Path, data_dir: Path, batch: int, steps: int = 8) -> list[str]:
    return [
        "train",
        "--config",
        "listops-hkt",
        "--run-dir",
        str(run_dir),
        "--data.data-dir",
        str(data_dir),
        "--data.seq-len",
        "32",
        "--data.listops-min-length",
        "4",
        "--data.listops-sizes",
        "96",
        "16",
        "16",
        "--model.d-model",
        "16",
        "--model.n-layers",
        "1",
        "--model.dropout",
        "0",
        "--train.batch-size",
        str(batch),
        "--train.max-steps",
        str(steps),
        "--train.eval-every",
        "2",
        "--train.log-every",
        "1",
    ]


def final_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step-{step:08d}" / "model.safetensors"))


def assert_close_weights(a, b, atol=1e-5):
    """Equal up to float rounding. Key-projection biases are left out: softmax ignores them, so
    their exact gradient is 0 and Adam turns the rounding noise of a sum over 1 or 2 ranks
    into full-size, different steps."""
    assert a.keys() == b.keys() and a
    for key in a:
        if "k_proj" in key and key.endswith("bias"):
            continue
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=atol, msg=key)


def metric_rows(run_dir: Path) -> list[tuple[int, str]]:
    with (run_dir / "metrics.csv").open() as f:
        return [(int(r["step"]), r["split"]) for r in csv.DictReader(f)]


def assert_same_metrics(a: Path, b: Path):
    """The same rows (one writer) with the same values up to float tolerance."""
    with (a / "metrics.csv").open() as fa, (b / "metrics.csv").open() as fb:
        ra, rb = list(csv.DictReader(fa)), list(csv.DictReader(fb))
    assert [(r["step"], r["split"]) for r in ra] == [(r["step"], r["split"]) for r in rb]
    for x, y in zip(ra, rb):
        for key in ("loss", "acc", "lr"):
            if x[key]:
                assert float(y[key]) == pytest.approx(float(x[key]), rel=1e-4, abs=1e-6), (x, y)


def test_two_processes_train_hkt_once_and_match_one_process(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    run(1, hkt_args(tmp_path / "one", data, batch=8))
    out = run(2, hkt_args(tmp_path / "two", data, batch=4))
    assert '"processes": 2' in out
    two = tmp_path / "two"
    rows = metric_rows(two)
    assert len(rows) == len(set(rows))  # each row once: one writer
    assert_same_metrics(tmp_path / "one", two)  # training loss is the global batch's
    assert_close_weights(final_weights(tmp_path / "one", 8), final_weights(two, 8))
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == [
        "latest",
        "step-00000006",
        "step-00000008",
    ]


def test_two_processes_stopped_by_sigterm_resume(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    run(2, hkt_args(tmp_path / "straight", data, batch=4, steps=40))
    args = hkt_args(tmp_path / "r", data, batch=4, steps=40)
    proc = launch(2, args, start_new_session=True)
    ckpt = tmp_path / "r" / "checkpoints" / "step-00000004"
    deadline = time.time() + 300
    while not ckpt.is_dir() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert ckpt.is_dir(), proc.communicate()[0][-4000:]
    os.killpg(proc.pid, signal.SIGTERM)  # what a cluster sends every process on preemption
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0 and "SIGTERM: stopped at step" in out, out[-4000:]
    run(2, [*args, "--resume"])
    straight, resumed = final_weights(tmp_path / "straight", 40), final_weights(tmp_path / "r", 40)
    assert_close_weights(straight, resumed)
    assert_same_metrics(tmp_path / "straight", tmp_path / "r")


def _glfusion_assets(tmp_path: Path) -> tuple[Path, Path, Path]:
    data = tmp_path / "data"
    write_wordnet(data / "wordnet" / "data.noun")
    (llm, tok), (enc, enc_tok) = tiny_glfusion_models(tmp_path)
    llm_dir, enc_dir = tmp_path / "llm", tmp_path / "encoder"
    llm.save_pretrained(llm_dir)
    tok.save_pretrained(llm_dir)
    enc.save_pretrained(enc_dir)
    enc_tok.save_pretrained(enc_dir)
    return data, llm_dir, enc_dir


def glfusion_args(run_dir, data, llm, enc, batch):
    return [
        "glfusion",
        "train",
        "--dataset",
        "wordnet",
        "--data-dir",
        str(data),
        "--llm",
        str(llm),
        "--encoder",
        str(enc),
        "--max-train",
        "16",
        "--max-val",
        "4",
        "--max-test",
        "4",
        "--max-nodes",
        "4",
        "--text-tokens",
        "8",
        "--lora-r",
        "2",
        "--lora-alpha",
        "4",
        "--baseline-epochs",
        "5",
        "--eval-batch-size",
        "4",
        "--run-dir",
        str(run_dir),
        "--train.batch-size",
        str(batch),
        "--train.max-steps",
        "4",
        "--train.eval-every",
        "2",
    ]


def test_two_processes_train_glfusion_once_and_match_one_process(tmp_path):
    data, llm, enc = _glfusion_assets(tmp_path)
    run(1, glfusion_args(tmp_path / "one", data, llm, enc, batch=4))
    run(2, glfusion_args(tmp_path / "two", data, llm, enc, batch=2))
    two = tmp_path / "two"
    assert_same_metrics(tmp_path / "one", two)
    assert_close_weights(final_weights(tmp_path / "one", 4), final_weights(two, 4), atol=1e-5)
    assert (two / "final.json").is_file() and (two / "best" / "adapter").is_dir()


def test_sigkill_at_arbitrary_moments_resumes_bit_exactly(tmp_path):
    """SIGKILL cannot be caught: atomic writes alone must make every moment safe, mid-write
    included. Kill one process three times at spread-out moments, then finish."""
    import random

    data = tmp_path / "data"
    data.mkdir()
    steps = 30
    run(1, hkt_args(tmp_path / "straight", data, batch=8, steps=steps))
    args = hkt_args(tmp_path / "r", data, batch=8, steps=steps)
    rng = random.Random(0)
    for _ in range(3):
        extra = ["--resume"] if (tmp_path / "r" / "checkpoints").is_dir() else []
        proc = launch(1, [*args, *extra])
        latest = tmp_path / "r" / "checkpoints" / "latest"
        before = latest.read_text() if latest.is_file() else None
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:  # wait for a new checkpoint
            if latest.is_file() and latest.read_text() != before:
                break
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.4))
        proc.kill()
        proc.communicate(timeout=60)
        if proc.returncode == 0:  # finished before the kill
            break
    if not (tmp_path / "r" / "final.json").is_file():
        run(1, [*args, "--resume"])
    a, b = final_weights(tmp_path / "straight", steps), final_weights(tmp_path / "r", steps)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert metric_rows(tmp_path / "r") == metric_rows(tmp_path / "straight")
