"""Paired statistics and the shallow baselines."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from structattn.data import SequenceDataset, TaskData
from structattn.data.listops import encode_listops, generate_listops
from structattn.experiments.lra.baselines import majority, outermost_operator, shallow_baselines
from structattn.experiments.stats import mean_std, paired_difference
from structattn.experiments.tables import comparison_row, mean_std_cell


def test_paired_difference_matches_a_hand_computed_t_interval():
    a, b = [0.52, 0.55, 0.53, 0.56], [0.50, 0.51, 0.50, 0.52]
    r = paired_difference(a, b)
    diffs = [x - y for x, y in zip(a, b)]
    mean = sum(diffs) / 4
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 3)
    half = 3.182446305284263 * sd / 2  # t(0.975, 3) * sd / sqrt(4)
    assert r["mean"] == pytest.approx(mean) and r["std"] == pytest.approx(sd)
    assert (r["ci_low"], r["ci_high"]) == pytest.approx((mean - half, mean + half))
    assert r["verdict"] == "a better" and r["n"] == 4


def test_an_interval_covering_zero_is_inconclusive():
    assert paired_difference([0.5, 0.6, 0.4], [0.55, 0.5, 0.45])["verdict"] == "inconclusive"
    assert paired_difference([0.4, 0.41, 0.39], [0.5, 0.52, 0.5])["verdict"] == "b better"
    one = paired_difference([0.9], [0.1])
    assert one["verdict"] == "inconclusive" and one["ci_low"] == -math.inf  # no interval
    with pytest.raises(ValueError, match="equal lengths"):
        paired_difference([1.0], [1.0, 2.0])
    assert mean_std([]) != mean_std([]) or math.isnan(mean_std([])[0])
    assert mean_std([2.0]) == (2.0, None)  # one value: no spread, not a measured 0


def test_one_seed_is_printed_without_a_spread_or_an_interval():
    assert mean_std_cell(*mean_std([95.83])) == "95.83"
    assert mean_std_cell(*mean_std([1.0, 3.0])) == "2.00 ± 1.41"
    assert mean_std_cell(*mean_std([])) == "-"
    one = comparison_row("a − b", paired_difference([0.9], [0.1]), "inconclusive")
    assert "inf" not in one and "- (one seed: no interval)" in one
    two = comparison_row("a − b", paired_difference([0.9, 0.8], [0.1, 0.2]), "a better")
    assert "[" in two and "inf" not in two


def _listops_task(n=600, seed=0):
    def ds(examples):
        return SequenceDataset([torch.tensor(encode_listops(s)) for s, _ in examples],
                               [y for _, y in examples])  # fmt: skip

    ex = generate_listops(n, min_length=4, max_length=40, seed=seed)
    k = n // 5
    return TaskData("listops", ds(ex[2 * k :]), ds(ex[:k]), ds(ex[k : 2 * k]), 10, 16, 40,
                    "ListOps (test)", False)  # fmt: skip


def test_outermost_operator_baseline_is_the_per_operator_majority():
    data = _listops_task()
    r = outermost_operator(data)
    # computed by hand: the most frequent training answer per first token
    from collections import Counter, defaultdict

    table = defaultdict(Counter)
    for s, y in zip(data.train.sequences, data.train.labels.tolist()):
        table[int(s[0])][y] += 1
    best = {t: c.most_common(1)[0][0] for t, c in table.items()}
    fallback = Counter(data.train.labels.tolist()).most_common(1)[0][0]
    pred = [best.get(int(s[0]), fallback) for s in data.test.sequences]
    expected = sum(p == y for p, y in zip(pred, data.test.labels.tolist())) / len(pred)
    assert r["test"] == pytest.approx(expected)
    assert r["test"] > majority(data)["test"]  # the operator tells a lot about the answer


def test_shallow_baselines_on_listops_have_all_three():
    data = _listops_task()
    out = shallow_baselines(data)
    assert set(out) == {"majority", "token_counts_mlp", "outermost_operator"}
    common = Counter(data.train.labels.tolist()).most_common(1)[0][0]
    share = (data.test.labels == common).float().mean().item()
    assert out["majority"]["test"] == pytest.approx(share)
    for r in out.values():
        assert set(r) == {"val", "test"} and all(0.0 <= v <= 1.0 for v in r.values())
