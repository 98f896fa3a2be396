"""The structattn command line."""

from __future__ import annotations

import json
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


def test_glfusion_config_file_parses():
    import yaml

    from structattn.glfusion.train import GLFusionTrainConfig
    from structattn.train.config import find_config

    doc = yaml.safe_load(find_config("glfusion").read_text())
    quick, paper = (GLFusionTrainConfig(**doc[k]) for k in ("quick", "paper"))
    assert quick.dataset == "wordnet" and paper.dataset == "arxiv"
    assert paper.lora_r == 64 and paper.lr == 3e-5
    assert paper.message_passing_layers == list(range(0, 32, 4))
    assert paper.cross_attention_layers == list(range(3, 32, 4))
