"""The cost model of HKT attention: score and total FLOPs against standard attention.

Shapes and level lengths as in :mod:`structattn.hkt.levels`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .levels import check_levels, level_lengths

__all__ = ["HKTCost", "hkt_cost"]


@dataclass(frozen=True)
class HKTCost:
    """FLOP ratios of HKT attention against standard attention at the same T and head dim.

    ``paper_score_ratio``  sum_l (T_l / T)^2: the paper's count of score FLOPs (1.3125 for
                           L=3, s=2 at large T).
    ``paper_bound``        s^2 / (s^2 - 1): the bound for any L (4/3 for s = 2).
    ``fast_score_ratio``   score FLOPs the SDPA fast path executes: L (every level at full T).
    ``fast_total_ratio``   scores + A.V of the fast path, with V padded to L*d: (L + L) / 2.
    ``fused_total_ratio``  the floor of an exact fused kernel (coarse scores computed once,
                           A.V with unpadded V): (paper_score_ratio + 1) / 2.
    ``mha_flops``          forward FLOPs of standard attention (scores + A.V, non-causal, one
                           head) when ``seq_len`` is given, else None.
    """

    n_levels: int
    stride: int
    seq_len: int | None
    paper_score_ratio: float
    paper_bound: float
    fast_score_ratio: float
    fast_total_ratio: float
    fused_total_ratio: float
    mha_flops: int | None


def hkt_cost(
    n_levels: int, stride: int = 2, seq_len: int | None = None, head_dim: int = 64
) -> HKTCost:
    """Score-FLOP ratios of HKT vs standard attention (see :class:`HKTCost`).

    With ``seq_len`` the exact level lengths ``T_l = ceil(T_{l-1}/s)`` are used; without it the
    large-T limit ``T_l = T / s^l``. ``head_dim`` only scales ``mha_flops``.
    """
    check_levels(n_levels, stride)
    if head_dim < 1:
        raise ValueError(f"head_dim must be >= 1, got {head_dim}")
    if seq_len is not None and seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if seq_len is None:
        paper = sum(stride ** (-2 * l) for l in range(n_levels))
        mha = None
    else:
        lengths = level_lengths(seq_len, n_levels, stride)
        paper = sum(T_l**2 for T_l in lengths) / seq_len**2
        mha = 2 * 2 * seq_len**2 * head_dim  # Q K^T and A V, 2 FLOPs per multiply-add
    # The fast path pads V to the concatenated width only when d_v < L*d, i.e. for L > 1.
    fast_total = (n_levels + n_levels) / 2
    return HKTCost(
        n_levels=n_levels,
        stride=stride,
        seq_len=seq_len,
        paper_score_ratio=paper,
        paper_bound=stride**2 / (stride**2 - 1),
        fast_score_ratio=float(n_levels),
        fast_total_ratio=fast_total,
        fused_total_ratio=(paper + 1) / 2,
        mha_flops=mha,
    )
