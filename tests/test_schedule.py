"""The learning-rate schedule and the step batch sampler, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from structattn.engine import StepBatchSampler, lr_lambda
from structattn.engine.config import OptimConfig
from structattn.errors import RunError


def _fn(schedule, warmup, max_steps=110):
    return lr_lambda(OptimConfig(warmup_steps=warmup, schedule=schedule), max_steps)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_warmup_rises_linearly_from_one_step_to_the_peak(schedule):
    fn = _fn(schedule, warmup=10)
    assert fn(0) == pytest.approx(0.1)  # the first update already moves: lr / warmup, not 0
    assert fn(4) == pytest.approx(0.5)
    assert fn(9) == pytest.approx(1.0)  # the last warmup step reaches the peak
    assert fn(10) == pytest.approx(1.0)  # and the decay starts from it


def test_cosine_at_known_fractions_of_the_decay():
    fn = _fn("cosine", warmup=10, max_steps=110)  # 100 decay steps
    assert fn(35) == pytest.approx((2 + math.sqrt(2)) / 4)  # a quarter: (1 + cos(pi/4)) / 2
    assert fn(60) == pytest.approx(0.5)
    assert fn(85) == pytest.approx((2 - math.sqrt(2)) / 4)
    assert fn(110) == pytest.approx(0.0, abs=1e-15)
    assert fn(500) == pytest.approx(0.0, abs=1e-15)  # past the end it stays at the minimum


def test_linear_and_constant_shapes():
    lin, const = _fn("linear", warmup=10), _fn("constant", warmup=10)
    assert [lin(s) for s in (10, 35, 60, 110, 200)] == pytest.approx([1, 0.75, 0.5, 0, 0])
    assert [const(s) for s in (10, 60, 109, 1000)] == [1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_decay_never_goes_negative_or_rises(schedule):
    fn = _fn(schedule, warmup=5, max_steps=40)
    values = [fn(s) for s in range(5, 60)]
    assert min(values) == pytest.approx(0.0, abs=1e-15) and all(v >= 0 for v in values)
    assert all(b <= a + 1e-15 for a, b in zip(values, values[1:]))


def test_no_warmup_starts_at_the_peak_and_a_warmup_as_long_as_the_run_is_finite():
    assert _fn("cosine", warmup=0)(0) == 1.0
    fn = _fn("cosine", warmup=20, max_steps=20)
    assert fn(19) == pytest.approx(1.0) and math.isfinite(fn(20))


def test_the_optimizer_sees_peak_times_multiplier_at_each_step():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=0.2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _fn("linear", warmup=4, max_steps=8))
    seen = []
    for _ in range(8):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.05, 0.1, 0.15, 0.2, 0.2, 0.15, 0.1, 0.05])


# ----------------------------------------------------------------------------- sampler


def _batches(*args, **kw):
    return list(StepBatchSampler(*args, **kw))


def test_length_is_the_number_of_steps():
    assert len(StepBatchSampler(50, 4, 0, 3, 10)) == 7 == len(_batches(50, 4, 0, 3, 10))
    assert len(StepBatchSampler(50, 4, 0, 10, 10)) == 0 == len(_batches(50, 4, 0, 12, 10))


def test_every_index_once_per_epoch_then_a_new_order():
    n, bs = 24, 4  # 6 steps per epoch, nothing dropped
    batches = _batches(n, bs, 7, 0, 12)
    assert all(len(b) == bs for b in batches)
    first = [i for b in batches[:6] for i in b]
    second = [i for b in batches[6:] for i in b]
    assert sorted(first) == list(range(n)) and sorted(second) == list(range(n))
    assert first != second  # each epoch reshuffles


def test_the_incomplete_tail_is_dropped_and_indices_never_repeat_within_an_epoch():
    batches = _batches(26, 4, 0, 0, 6)  # 6 full batches use 24 of the 26 examples
    flat = [i for b in batches for i in b]
    assert len(flat) == len(set(flat)) == 24 and all(0 <= i < 26 for i in flat)
    assert len(_batches(26, 4, 0, 6, 7)[0]) == 4  # step 6 opens the next epoch, full


def test_batches_are_a_pure_function_of_seed_and_step():
    full = _batches(30, 4, 3, 0, 20)
    assert _batches(30, 4, 3, 0, 20) == full
    assert _batches(30, 4, 3, 13, 20) == full[13:]  # a restart at step 13 continues exactly
    assert _batches(30, 4, 4, 0, 20) != full


def test_ranks_take_disjoint_parts_of_the_single_process_batch():
    n, bs, world = 40, 3, 4
    single = _batches(n, bs * world, 5, 0, 7)  # 3 steps per epoch: crosses two epochs
    ranks = [_batches(n, bs, 5, 0, 7, rank=r, world=world) for r in range(world)]
    for step in range(7):
        parts = [ranks[r][step] for r in range(world)]
        flat = [i for p in parts for i in p]
        assert len(flat) == len(set(flat)) == bs * world
        assert flat == single[step]


def test_small_sets_shrink_the_batch_and_empty_ones_are_refused():
    batches = _batches(5, 8, 0, 0, 3)
    assert all(sorted(b) == list(range(5)) for b in batches)  # one epoch per step
    assert [len(b) for b in _batches(6, 8, 0, 0, 2, rank=1, world=2)] == [3, 3]
    with pytest.raises(RunError, match="empty"):
        StepBatchSampler(0, 4, 0, 0, 1)
