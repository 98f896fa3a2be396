"""Config files: shipped names resolve to the package, repeated keys and bad values are named."""

from __future__ import annotations

import math

import pytest

from structattn.engine.config import CONFIG_DIR, OptimConfig, find_config
from structattn.errors import ConfigError
from structattn.experiments.lra import load_lra


def test_a_configs_folder_in_the_working_directory_does_not_shadow_a_shipped_name(
    tmp_path, monkeypatch
):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "listops-hkt.yaml").write_text("quick: {model: {attention: mha}}\n")
    monkeypatch.chdir(tmp_path)
    assert find_config("listops-hkt") == CONFIG_DIR / "listops-hkt.yaml"
    assert load_lra("listops-hkt", "quick").model.attention == "hkt"
    own = tmp_path / "configs" / "listops-hkt.yaml"
    assert find_config("configs/listops-hkt.yaml").resolve() == own
    assert load_lra("configs/listops-hkt.yaml", "quick").model.attention == "mha"
    with pytest.raises(ConfigError, match="config file 'nope.yaml' not found"):
        find_config("nope.yaml")


def test_a_key_given_twice_is_an_error_naming_it(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("quick:\n  optim: {lr: 0.002, lr: 5.0}\n")
    with pytest.raises(ConfigError, match=r"key 'lr' is given twice .*line 2"):
        load_lra(path, "quick")


def test_a_preset_that_is_not_a_mapping_is_named(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("quick: [1, 2]\n")
    with pytest.raises(ConfigError, match="preset 'quick' must be a mapping of keys, got a list"):
        load_lra(path, "quick")


@pytest.mark.parametrize("key", ["lr", "weight_decay", "beta1", "beta2", "grad_clip"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_optimiser_values_are_named(key, bad):
    with pytest.raises(ValueError, match=f"optim.{key} must be a finite number"):
        OptimConfig(**{key: bad})


def test_nan_lr_from_a_file_is_one_config_error(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("quick:\n  optim: {lr: .nan}\n")
    with pytest.raises(ConfigError, match="optim.lr must be a finite number"):
        load_lra(path, "quick")


def test_merge_keys_are_yaml_and_own_keys_override_them(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(
        "base: &base\n  optim: {lr: 0.002}\n  train: {max_steps: 7}\n"
        "quick:\n  <<: *base\n  train: {max_steps: 9}\n"
    )
    config = load_lra(path, "quick")
    assert config.optim.lr == 0.002 and config.train.max_steps == 9


def test_a_run_config_with_a_key_given_twice_is_refused(tmp_path):
    from structattn.engine.rundir import RunDir
    from structattn.errors import RunError

    run = RunDir(tmp_path)
    run.config.write_text("optim:\n  lr: 0.002\n  lr: 5.0\n")
    with pytest.raises(RunError, match="key 'lr' is given twice"):
        run.read_config()
    with pytest.raises(RunError, match="--resume: .*key 'lr' is given twice"):
        run.check_resume_config({"optim": {"lr": 5.0}}, frozenset())


def test_a_set_value_with_a_key_given_twice_is_refused():
    from structattn.cli import parse_settings

    with pytest.raises(SystemExit, match="--set data.x: key 'a' is given twice"):
        parse_settings(["data.x={a: 1, a: 2}"])
    assert parse_settings(["data.x={a: 1, b: 2}"]) == {"data": {"x": {"a": 1, "b": 2}}}


@pytest.mark.parametrize(
    "text, message",
    [("? [a, b]\n: 1\n", "a key must be a plain value"),
     ("b: &b {x: 1}\nc: &c {y: 2}\nq:\n  <<: *b\n  <<: *c\n", "merge key '<<' is given twice")],
)  # fmt: skip
def test_yaml_keys_a_mapping_cannot_hold_are_one_line(text, message):
    from structattn.engine.config import parse_yaml

    with pytest.raises(ConfigError, match=message):
        parse_yaml(text)


def test_a_run_saved_with_relative_paths_still_matches_its_config(tmp_path, monkeypatch):
    """GL-Fusion configs keep their files as absolute paths; a run saved earlier with relative
    ones is the same run when resumed from its working directory (and another file is not)."""
    from structattn.engine.config import config_diff, config_to_dict
    from structattn.experiments.glfusion import build_glfusion_config

    monkeypatch.chdir(tmp_path)
    paths = {"dataset": "file", "graph_path": "graph", "llm": "models/llm", "encoder": "~/enc"}
    saved = {**config_to_dict(build_glfusion_config({})), **paths}  # as an earlier version wrote
    current = config_to_dict(build_glfusion_config(saved))
    assert current["llm"] == str(tmp_path / "models" / "llm")
    assert config_diff(saved, current) == []
    assert config_diff({**saved, "llm": "models/other"}, current) == ["llm"]
