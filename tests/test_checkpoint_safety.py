"""Loading a run folder never executes what its files hold (state.pt through weights_only)."""

from __future__ import annotations

import os
import random
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from structattn.engine.checkpoint import (
    load_latest_valid,
    rng_state,
    save_checkpoint,
    set_rng_state,
)


class _Bomb:
    """Unpickling this runs ``os.system``: what a shared, crafted run folder could carry."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _model():
    torch.manual_seed(0)
    return nn.Linear(3, 2)


def test_a_state_file_that_would_run_code_is_refused_and_never_runs(tmp_path):
    model = _model()
    save_checkpoint(tmp_path / "ckpt", 1, model, {"rng": rng_state(), "best": {}})
    save_checkpoint(tmp_path / "ckpt", 2, model, {"rng": rng_state(), "best": {}})
    marker = tmp_path / "marker"
    bomb = tmp_path / "ckpt" / "step-00000002" / "state.pt"
    torch.save({"step": 2, "rng": _Bomb(marker)}, bomb)
    with pytest.warns(RuntimeWarning, match="step-00000002 is damaged") as caught:
        path, state = load_latest_valid(tmp_path / "ckpt", _model())
    assert not marker.exists()  # the object's __reduce__ never ran
    message = str(caught[0].message)  # one line naming what was refused, no advice to unpickle
    assert "\n" not in message and "system" in message and "weights_only" not in message
    assert path.name == "step-00000001" and state["step"] == 1
    assert (tmp_path / "ckpt" / "damaged-step-00000002").is_dir()  # kept, never deleted


def test_rng_state_round_trips_through_a_weights_only_file(tmp_path):
    model = _model()
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    save_checkpoint(tmp_path / "ckpt", 1, model, {"rng": rng_state()})
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    _, state = load_latest_valid(tmp_path / "ckpt", _model())
    set_rng_state(state["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_a_state_file_of_the_older_format_with_numpy_arrays_still_loads(tmp_path):
    """Before the key array travelled as a tensor, state.pt held numpy's own RNG tuple."""
    model = _model()
    np.random.seed(5)
    save_checkpoint(tmp_path / "ckpt", 1, model, {})
    old = {"step": 1, "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                              "numpy": np.random.get_state()}}  # fmt: skip
    expected = np.random.rand()
    torch.save(old, tmp_path / "ckpt" / "step-00000001" / "state.pt")
    np.random.seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, state = load_latest_valid(tmp_path / "ckpt", _model())
    set_rng_state(state["rng"])
    assert np.random.rand() == expected


def test_a_state_file_holding_an_unknown_object_names_it_in_one_line(tmp_path):
    """Not code, only a type ``weights_only`` does not know (a numpy scalar): the warning names
    the object, without torch's advice on how to load the file anyway."""
    model = _model()
    save_checkpoint(tmp_path / "ckpt", 1, model, {"rng": rng_state(), "best": {}})
    save_checkpoint(tmp_path / "ckpt", 2, model, {"rng": rng_state(), "best": {}})
    torch.save(
        {"step": 2, "best": np.float64(0.5)}, tmp_path / "ckpt" / "step-00000002" / "state.pt"
    )
    with pytest.warns(RuntimeWarning, match="step-00000002 is damaged") as caught:
        path, _ = load_latest_valid(tmp_path / "ckpt", _model())
    message = str(caught[0].message)
    assert path.name == "step-00000001" and "\n" not in message
    assert "not training state: Unsupported global: GLOBAL numpy" in message
    assert "weights_only" not in message and "(1)" not in message
