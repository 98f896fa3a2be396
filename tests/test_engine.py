"""The training engine: param groups, signals, damaged checkpoints, resume checks, non-finite
losses, empty splits, device placement, litter, config typing."""

from __future__ import annotations

import csv
import functools
import json
import math
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from helpers import TINY_MODEL, tiny_lra
from safetensors.torch import load_file, save_file

from structattn.engine import (
    Engine,
    FitRules,
    NonFiniteLossError,
    OptimConfig,
    RunConfig,
    TrainConfig,
    param_groups,
)
from structattn.engine.config import build_dataclass
from structattn.errors import ConfigError, RunError
from structattn.experiments.lra import LRAConfig, load_lra, train
from structattn.hkt import CausalLM, ModelConfig, SequenceClassifier

#: every test trains a tiny ListOps run with these settings unless it says otherwise
tiny = functools.partial(tiny_lra, "listops", max_steps=8, batch_size=8, eval_every=2, log_every=1)


def weights(run_dir, step):
    return load_file(str(Path(run_dir) / "checkpoints" / f"step-{step:08d}" / "model.safetensors"))


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def metrics_steps(run_dir):
    with (Path(run_dir) / "metrics.csv").open() as f:
        return [(int(r["step"]), r["split"]) for r in csv.DictReader(f)]


# ---------------------------------------------------------------------- param groups


def test_param_groups_follow_one_rule():
    model = SequenceClassifier(ModelConfig(vocab_size=20, num_classes=3, max_len=32, **TINY_MODEL))
    groups = param_groups(model, 0.1)
    decay, no_decay = (set(g["names"]) for g in groups)
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    for name, _ in model.named_parameters():
        owner = model.get_submodule(name.rsplit(".", 1)[0])
        is_weight = name.endswith(".weight")
        expected = isinstance(owner, torch.nn.Linear | torch.nn.Conv1d) and is_weight
        assert (name in decay) == expected, name
    # The HKT parameters the old rule decayed (level logits are 2-D) are not decayed.
    assert any(n.endswith("level_logits") for n in no_decay)
    assert not any("level_logits" in n or "beta" in n or ".tok." in n for n in decay)
    assert any("downsample" in n or "conv" in n for n in decay)  # conv kernels are decayed
    total = sum(len(g["params"]) for g in groups)
    assert total == len(list(model.parameters()))


def test_tied_embedding_is_not_decayed():
    lm = CausalLM(ModelConfig(vocab_size=20, max_len=32, attention="mha", **TINY_MODEL))
    groups = param_groups(lm, 0.1)
    names = {n for g in groups for n in g["names"]}
    decayed = set(groups[0]["names"])
    assert "encoder.tok.weight" in names and "encoder.tok.weight" not in decayed
    assert "lm_head.weight" not in names  # the same tensor, counted once


# ---------------------------------------------------------------------- signals


def _signal_at(monkeypatch, where: str, call: int, sig: int):
    """Send ``sig`` to this process during the ``call``-th call of ``where``."""
    count = {"n": 0}

    def wrap(fn):
        def wrapped(*args, **kwargs):
            count["n"] += 1
            if count["n"] == call:
                os.kill(os.getpid(), sig)
            return fn(*args, **kwargs)

        return wrapped

    if where == "optimizer":
        monkeypatch.setattr(torch.optim.AdamW, "step", wrap(torch.optim.AdamW.step))
    elif where == "scheduler":
        from torch.optim.lr_scheduler import LambdaLR

        monkeypatch.setattr(LambdaLR, "step", wrap(LambdaLR.step))
    elif where == "forward":
        monkeypatch.setattr(SequenceClassifier, "forward", wrap(SequenceClassifier.forward))
    elif where == "evaluate":
        import structattn.experiments.lra.experiment as hkt

        monkeypatch.setattr(hkt, "evaluate", wrap(hkt.evaluate))


@pytest.mark.parametrize(
    "where, call, sig",
    [
        ("forward", 5, signal.SIGINT),  # mid forward of step 3 (calls 3-4: validation)
        ("optimizer", 3, signal.SIGTERM),  # inside optimizer.step of step 3
        ("scheduler", 5, signal.SIGINT),  # between the update and the step counter
        ("evaluate", 2, signal.SIGTERM),  # during the validation at step 4
    ],
)
def test_signal_checkpoints_a_consistent_step_and_resumes_exactly(
    where, call, sig, lra_data_dir, tmp_path, monkeypatch
):
    straight = tiny("hkt", lra_data_dir, tmp_path / "a")
    train(straight, progress=False)
    with monkeypatch.context() as m:
        _signal_at(m, where, call, sig)
        with pytest.raises(SystemExit) as exc:
            train(tiny("hkt", lra_data_dir, tmp_path / "b"), progress=False)
    assert exc.value.code == 128 + sig
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored
    stopped = int((tmp_path / "b" / "checkpoints" / "latest").read_text().split("-")[1])
    # LambdaLR steps once when built: its 5th call is step 4's.
    expected = {"forward": 3, "optimizer": 3, "scheduler": 4, "evaluate": 4}[where]
    assert stopped == expected  # the step in progress was finished, then saved
    state = torch.load(
        tmp_path / "b" / "checkpoints" / f"step-{stopped:08d}" / "state.pt", weights_only=False
    )
    assert state["scheduler"]["last_epoch"] == stopped  # N updates in the checkpoint labelled N
    resumed = tiny("hkt", lra_data_dir, tmp_path / "b")
    resumed.resume = True
    final = train(resumed, progress=False)
    assert final["steps"] == 8
    assert_same_weights(weights(tmp_path / "a", 8), weights(tmp_path / "b", 8))
    steps = metrics_steps(tmp_path / "b")
    assert steps == metrics_steps(tmp_path / "a")  # no duplicated or missing rows


# ---------------------------------------------------------------------- damaged checkpoints


def _three_checkpoints(lra_data_dir, tmp_path):
    cfg = tiny("hkt", lra_data_dir, tmp_path / "r", max_steps=10, stop_at=8, keep_checkpoints=3)
    assert train(cfg, progress=False)["paused_at"] == 8
    ckpts = tmp_path / "r" / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step-*")) == [
        "step-00000004",
        "step-00000006",
        "step-00000008",
    ]
    return ckpts


def _resume(lra_data_dir, tmp_path, **train_overrides):
    cfg = tiny(
        "hkt", lra_data_dir, tmp_path / "r", max_steps=10, keep_checkpoints=3, **train_overrides
    )
    cfg.resume = True
    return train(cfg, progress=False)


def _truncate(path: Path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _nan_weights(path: Path):
    w = load_file(str(path))
    key = next(k for k, v in w.items() if v.is_floating_point())
    w[key] = torch.full_like(w[key], math.nan)
    save_file(w, str(path))


@pytest.mark.parametrize(
    "damage",
    ["truncated_weights", "truncated_state", "missing_state", "nan_weights", "bad_pointer"],
)
def test_damaged_newest_checkpoint_falls_back_to_the_previous(damage, lra_data_dir, tmp_path):
    reference = tiny("hkt", lra_data_dir, tmp_path / "straight", max_steps=10)
    train(reference, progress=False)
    ckpts = _three_checkpoints(lra_data_dir, tmp_path)
    newest = ckpts / "step-00000008"
    if damage == "truncated_weights":
        _truncate(newest / "model.safetensors")
    elif damage == "truncated_state":
        _truncate(newest / "state.pt")
    elif damage == "missing_state":
        (newest / "state.pt").unlink()
    elif damage == "nan_weights":
        _nan_weights(newest / "model.safetensors")
    else:
        (ckpts / "latest").write_bytes(b"\x00garbage")
    rows_before = (tmp_path / "r" / "metrics.csv").read_text()
    if damage == "bad_pointer":  # the newest checkpoint itself is fine: resume from it
        final = _resume(lra_data_dir, tmp_path)
    else:
        with pytest.warns(RuntimeWarning, match=f"checkpoint {newest} is damaged"):
            final = _resume(lra_data_dir, tmp_path)
        assert (ckpts / "damaged-step-00000008").is_dir()  # kept for inspection
    assert final["steps"] == 10
    # Steps 7..10 (or 9..10) were replayed from a valid state: the same as a straight run.
    assert_same_weights(weights(tmp_path / "straight", 10), weights(tmp_path / "r", 10))
    header = (tmp_path / "r" / "metrics.csv").read_text().splitlines()[0]
    assert rows_before.splitlines()[0] == header
    assert metrics_steps(tmp_path / "r") == metrics_steps(tmp_path / "straight")


def test_all_checkpoints_damaged_is_an_error_that_loses_nothing(lra_data_dir, tmp_path):
    ckpts = _three_checkpoints(lra_data_dir, tmp_path)
    for step in (4, 6, 8):
        _truncate(ckpts / f"step-{step:08d}" / "model.safetensors")
    metrics = (tmp_path / "r" / "metrics.csv").read_text()
    config = (tmp_path / "r" / "config.yaml").read_text()
    with pytest.warns(RuntimeWarning), pytest.raises(RunError, match="no usable checkpoint"):
        _resume(lra_data_dir, tmp_path)
    assert (tmp_path / "r" / "metrics.csv").read_text() == metrics  # not truncated
    assert (tmp_path / "r" / "config.yaml").read_text() == config
    assert len(list(ckpts.glob("damaged-step-*"))) == 3


def test_resume_without_checkpoints_is_an_error(lra_data_dir, tmp_path):
    cfg = tiny("hkt", lra_data_dir, tmp_path / "empty")
    cfg.resume = True
    with pytest.raises(RunError, match="no checkpoint to resume from"):
        train(cfg, progress=False)


def test_interrupted_write_litter_is_removed(lra_data_dir, tmp_path):
    cfg = tiny("hkt", lra_data_dir, tmp_path / "r", max_steps=4, stop_at=2)
    train(cfg, progress=False)
    ckpts = tmp_path / "r" / "checkpoints"
    (ckpts / ".step-00000004.abc").mkdir()
    (ckpts / ".step-00000004.abc" / "model.safetensors").write_bytes(b"half")
    (ckpts / ".latest.xyz").write_text("step-00000004")
    (tmp_path / "r" / ".best.safetensors.123.tmp").write_bytes(b"half")
    resumed = tiny("hkt", lra_data_dir, tmp_path / "r", max_steps=4)
    resumed.resume = True
    train(resumed, progress=False)
    leftovers = [p.name for p in (tmp_path / "r").rglob(".*") if p.name.endswith((".tmp", ".abc"))]
    assert leftovers == [] and not list(ckpts.glob(".latest.*"))


# ---------------------------------------------------------------------- resume checks


@pytest.mark.parametrize(
    "change, key",
    [
        ({"seed": 5}, "seed"),
        ({"model": {"d_model": 32}}, "model.d_model"),
        ({"optim": {"lr": 0.01}}, "optim.lr"),
        ({"model": {"hkt": {"n_levels": 2}}}, "model.hkt.n_levels"),
    ],
)
def test_resume_refuses_a_changed_config_naming_the_keys(change, key, lra_data_dir, tmp_path):
    train(tiny("hkt", lra_data_dir, tmp_path / "r", max_steps=4, stop_at=2), progress=False)
    before = (tmp_path / "r" / "config.yaml").read_text()
    cfg = tiny("hkt", lra_data_dir, tmp_path / "r", max_steps=4)
    for section, value in change.items():
        if section == "seed":
            cfg.seed = value
        elif section == "optim":
            cfg.optim.lr = value["lr"]
        else:
            cfg.model = cfg.model.replace(**value)
    cfg.resume = True
    with pytest.raises(RunError, match=rf"differs from .* in {key}\b"):
        train(cfg, progress=False)
    assert (tmp_path / "r" / "config.yaml").read_text() == before


def test_resume_accepts_a_longer_budget(lra_data_dir, tmp_path):
    train(tiny("hkt", lra_data_dir, tmp_path / "r", max_steps=4, stop_at=2), progress=False)
    cfg = tiny("hkt", lra_data_dir, tmp_path / "r", max_steps=6, log_every=2)
    cfg.resume = True
    assert train(cfg, progress=False)["steps"] == 6
    assert yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())["train"]["max_steps"] == 6


# ---------------------------------------------------------------------- bad values and splits


def test_non_finite_loss_stops_the_run(lra_data_dir, tmp_path):
    cfg = tiny("hkt", lra_data_dir, tmp_path / "r", max_steps=6)
    cfg.optim.lr = math.inf
    with pytest.raises(NonFiniteLossError, match=r"non-finite training .* at step \d"):
        train(cfg, progress=False)
    assert not (tmp_path / "r" / "final.json").exists()


class _Toy(torch.nn.Module):
    """``loss = mean((w x - y)^2)``; an item with a NaN input makes its step's loss NaN."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)

    def forward(self, x, y):
        return SimpleNamespace(loss=((self.lin(x).squeeze(-1) - y) ** 2).mean())


def _toy_items(nan_at=()):
    g = torch.Generator().manual_seed(0)
    items = []
    for i in range(16):
        x = torch.randn(2, generator=g)
        if i in nan_at:
            x[0] = math.nan
        items.append((x, x.sum()))
    return items


def _toy_collate(items):
    return {"x": torch.stack([x for x, _ in items]), "y": torch.stack([y for _, y in items])}


def _toy_engine(run_dir, **train):
    train_cfg = TrainConfig(
        **{"max_steps": 8, "batch_size": 4, "eval_every": 4, "log_every": 1, **train}
    )
    optim = OptimConfig(lr=0.05, warmup_steps=0)
    cfg = RunConfig(name="toy", run_dir=run_dir, optim=optim, train=train_cfg)
    return Engine(cfg, progress=False, rules=FitRules(select="neg_loss"))


def test_skip_mode_drops_bad_updates_and_counts_them(tmp_path):
    engine = _toy_engine(tmp_path / "r", nonfinite="skip", max_skipped=4)
    model = _Toy()
    with pytest.warns(RuntimeWarning, match="update skipped"):
        result = engine.fit(
            model, _toy_items(nan_at={3}), _toy_collate, lambda m: {"neg_loss": 0.0}
        )
    assert result.skipped_steps == 2  # the NaN item is in one batch per epoch, 2 epochs
    assert all(torch.isfinite(p).all() for p in model.parameters())
    with pytest.raises(NonFiniteLossError, match="max_skipped=1"):
        _toy_engine(tmp_path / "s", nonfinite="skip", max_skipped=1).fit(
            _Toy(), _toy_items(nan_at={3}), _toy_collate, lambda m: {"neg_loss": 0.0}
        )


def test_gradient_accumulation_matches_one_batch(tmp_path):
    runs = {}
    for k in (1, 2, 4):
        torch.manual_seed(0)
        model = _Toy()
        engine = _toy_engine(tmp_path / f"r{k}", grad_accum=k)
        engine.fit(model, _toy_items(), _toy_collate, lambda m: {"neg_loss": 0.0})
        runs[k] = torch.cat([p.detach().flatten() for p in model.parameters()])
    torch.testing.assert_close(runs[2], runs[1], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(runs[4], runs[1], rtol=1e-6, atol=1e-7)


class _AutocastProbe(_Toy):
    """Records whether CPU autocast is on in each forward pass."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x, y):
        self.seen.append(torch.is_autocast_enabled("cpu"))
        return super().forward(x, y)


def test_one_process_trains_float32_then_bfloat16_then_float32(tmp_path):
    """A table trains float32 rows (the GNNs) and bfloat16-autocast rows (the LLMs) in one
    process: each run gets the precision its config asks for, in either order."""
    for i, bf16 in enumerate((False, True, False)):
        engine = _toy_engine(tmp_path / f"r{i}", bf16=bf16, max_steps=2)
        assert engine.accelerator.mixed_precision == ("bf16" if bf16 else "no")
        probe = _AutocastProbe()
        engine.fit(probe, _toy_items(), _toy_collate, lambda m: {"neg_loss": 0.0})
        assert probe.seen and set(probe.seen) == {bf16}


def test_empty_validation_or_test_split_is_an_error(lra_data_dir, tmp_path):
    from structattn.data import load_task

    cfg = tiny("hkt", lra_data_dir, tmp_path / "r")
    data = load_task(cfg.data)
    data.val.sequences, data.val.labels = [], data.val.labels[:0]
    with pytest.raises(RunError, match="the val split is empty"):
        train(cfg, data=data, progress=False)


def test_final_json_is_strict_json(tmp_path):
    engine = _toy_engine(tmp_path / "r")
    engine.write_json("final.json", {"acc": math.nan, "nested": [math.inf, 1.0]})
    text = (tmp_path / "r" / "final.json").read_text()
    assert json.loads(text) == {"acc": None, "nested": [None, 1.0]}
    assert "NaN" not in text and "Infinity" not in text


# ---------------------------------------------------------------------- device placement


class _DeviceRecorder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))
        self.seen: list[tuple[str, torch.device]] = []

    def _record(self, name, value):
        if isinstance(value, torch.Tensor):
            self.seen.append((name, value.device))
        elif hasattr(value, "__dataclass_fields__"):
            for field in value.__dataclass_fields__:
                self._record(f"{name}.{field}", getattr(value, field))

    def forward(self, **batch):
        for name, value in batch.items():
            self._record(name, value)
        return SimpleNamespace(loss=self.w * 1.0)


def _hkt_items():
    from structattn.data import SequenceDataset

    seqs = [torch.randint(1, 10, (n,)) for n in (5, 7, 3, 6)]
    return SequenceDataset(seqs, [0, 1, 0, 1])


def _glfusion_items():

    g = torch.Generator().manual_seed(0)
    return [(torch.randn(2, 3, 4, generator=g), torch.tensor([[0], [1]])) for _ in range(4)]


def _glfusion_collate(items):
    from structattn.glfusion import GraphBatch

    graph = GraphBatch.from_graphs(
        [t for t, _ in items], [e for _, e in items], targets=[0] * len(items)
    )
    n = len(items)
    return {
        "input_ids": torch.ones(n, 5, dtype=torch.long),
        "attention_mask": torch.ones(n, 5, dtype=torch.long),
        "graph": graph,
        "labels": torch.zeros(n, 5, dtype=torch.long),
        "node_labels": torch.zeros(graph.num_nodes, dtype=torch.long),
    }


@pytest.mark.parametrize("system", ["hkt", "glfusion"])
def test_every_tensor_of_a_batch_reaches_the_engine_device(system, tmp_path, monkeypatch):
    from structattn.experiments.lra.experiment import _model_inputs

    monkeypatch.setattr(Engine, "device", property(lambda self: torch.device("meta")))
    engine = _toy_engine(tmp_path / system, max_steps=2, eval_every=2)
    items, collate = (
        (_hkt_items(), _model_inputs) if system == "hkt" else (_glfusion_items(), _glfusion_collate)
    )
    model = _DeviceRecorder()
    engine.fit(model, items, collate, lambda m: {"neg_loss": 0.0})
    names = {name for name, _ in model.seen}
    assert {d.type for _, d in model.seen} == {"meta"}, model.seen
    expected = (
        {"tokens", "mask", "labels"}
        if system == "hkt"
        else {"input_ids", "graph.node_text", "graph.edge_index", "graph.node_batch", "node_labels"}
    )
    assert expected <= names


# ---------------------------------------------------------------------- config values


@pytest.mark.parametrize(
    "values, match",
    [
        ({"data": {"seq_len": 128.5}}, "data.seq_len must be an integer"),
        ({"model": {"causal": "no"}}, "model.causal must be true or false"),
        ({"optim": {"lr": "fast"}}, "optim.lr must be a number"),
        ({"train": {"max_steps": True}}, "train.max_steps must be an integer"),
        ({"model": {"hkt": {"stride": 2.5}}}, "model.hkt.stride must be an integer"),
        ({"model": {"hkt": {"d_model": 8}}}, "model.hkt.d_model: set model.d_model"),
        ({"train": {"nonfinite": "ignore"}}, "train.nonfinite must be error or skip"),
    ],
)
def test_config_values_are_typed(values, match):
    with pytest.raises(ConfigError, match=match):
        build_dataclass(LRAConfig, values)


def test_yaml_scientific_notation_is_a_float(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("quick:\n  optim:\n    lr: 1e-3\n  model:\n    hkt:\n      attn_dropout: 0.1\n")
    assert yaml.safe_load(path.read_text())["quick"]["optim"]["lr"] == "1e-3"  # PyYAML's view
    cfg = load_lra(path, "quick")
    assert cfg.optim.lr == 1e-3 and cfg.model.hkt.attn_dropout == 0.1


def test_legacy_flat_hkt_keys_still_load():
    cfg = build_dataclass(LRAConfig, {"model": {"n_levels": 2, "stride": 3, "d_model": 32}})
    assert (cfg.model.hkt.n_levels, cfg.model.hkt.stride, cfg.model.hkt.d_model) == (2, 3, 32)
