"""HKT attention as a function: the readable reference and the exact O(T)-memory fast path.

Hierarchical Kernel Transformer (arXiv 2604.08829), as specified in this project's design notes.

Shapes (legend used in every comment below):
    B  batch                 H  heads                 L  levels (level 0 = full resolution)
    T  sequence length       T_l = ceil(T_{l-1} / s), T_0 = T
    d  query/key head dim    d_v value head dim       s  stride between levels

Equations. For each head h, with level weights lambda_h on the simplex,

    S^l_h      = Q^l_h K^l_h^T * scale                                   (T_l x T_l)
    S_h[i, j]  = sum_l lambda_{h,l} S^l_h[floor(i / s^l), floor(j / s^l)]
    A_h        = softmax(S_h + mask),     O_h = A_h V_h

The fast path uses that nearest upsampling U_l is linear and lambda >= 0:

    sum_l lambda_l U_l S^l U_l^T = Q~ K~^T,   Q~ = [lambda_0 U_0 Q^0, ..., lambda_{L-1} U Q^{L-1}]
                                              K~ = [U_0 K^0, ..., U K^{L-1}]     (head dim L*d)

so one call of ``scaled_dot_product_attention`` (flash kernels on CPU and GPU) computes HKT
attention exactly without ever holding a T x T matrix. The weights are applied to the query side
only, so gradients with respect to lambda stay finite at lambda = 0.

Padding convention: ``key_padding_mask`` is ``(B, T)`` bool, True = real token. Padded keys are
never attended to and the outputs at padded query positions are exactly 0.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .blockwise import attendable_keys
from .cpu_kernel import cpp_hkt_attention, cpu_kernel
from .fused import fused_hkt_attention
from .triton_kernel import triton_available, triton_hkt_attention

__all__ = [
    "ATTENTION_IMPLS",
    "HKTCost",
    "resolve_impl",
    "hkt_attention",
    "hkt_cost",
    "hkt_scores",
    "level_lengths",
    "masked_sdpa",
    "upsample_levels",
]


def level_lengths(seq_len: int, n_levels: int, stride: int) -> list[int]:
    """Level lengths: ``T_0 = seq_len``, ``T_l = ceil(T_{l-1} / stride)`` for ``l < n_levels``."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if n_levels < 1:
        raise ValueError(f"n_levels must be >= 1, got {n_levels}")
    if stride < 2:
        raise ValueError(f"stride must be >= 2, got {stride}")
    lengths = [seq_len]
    for _ in range(1, n_levels):
        lengths.append(-(-lengths[-1] // stride))
    return lengths


def upsample_levels(x: Tensor, factor: int, seq_len: int) -> Tensor:
    """Nearest upsampling along dim -2: row ``i`` of the result is row ``i // factor`` of ``x``.

    Shapes: ``x (..., T_l, d) -> (..., seq_len, d)`` with ``T_l * factor >= seq_len``.
    """
    if factor == 1:
        return x[..., :seq_len, :]
    return x.repeat_interleave(factor, dim=-2)[..., :seq_len, :]


# ---------------------------------------------------------------------------------------------
# Input validation (shared by every implementation)
# ---------------------------------------------------------------------------------------------


def _validate(
    q: Sequence[Tensor],
    k: Sequence[Tensor],
    v: Tensor,
    level_weights: Tensor,
    stride: int,
    key_padding_mask: Tensor | None,
    causal: bool = True,
) -> Tensor:
    """Check types, shapes and values in front of every implementation; return the level
    weights as ``(H, L)`` in the dtype of ``v``."""
    if isinstance(q, Tensor) or isinstance(k, Tensor):
        raise ValueError("q and k must be sequences of per-level tensors (a list of L tensors)")
    q, k = list(q), list(k)
    n_levels = len(q)
    if n_levels < 1:
        raise ValueError("q must hold at least one level (got an empty sequence)")
    if len(k) != n_levels:
        raise ValueError(f"q has {n_levels} levels but k has {len(k)}")
    if isinstance(stride, bool) or not isinstance(stride, int):
        raise ValueError(f"stride must be an integer >= 2, got {stride!r}")
    if stride < 2:
        raise ValueError(f"stride must be >= 2, got {stride}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    if not isinstance(v, Tensor) or v.dim() != 4:
        raise ValueError(f"v must have shape (B, H, T, d_v), got {getattr(v, 'shape', v)!r}")
    if not torch.is_floating_point(v):
        raise ValueError(f"q, k and v must be floating-point tensors, got {v.dtype}")
    B, H, T, _ = v.shape
    if T < 1:
        raise ValueError("sequence length T must be >= 1")
    lengths = level_lengths(T, n_levels, stride)
    d = q[0].shape[-1]
    for name, levels in (("q", q), ("k", k)):
        for l, (x, T_l) in enumerate(zip(levels, lengths)):
            expected = (B, H, T_l, d)
            if tuple(x.shape) != expected:
                raise ValueError(
                    f"{name}[{l}] has shape {tuple(x.shape)}, expected (B, H, T_l, d) = {expected} "
                    f"(T_l = ceil(T_(l-1) / stride) with T = {T}, stride = {stride})"
                )
            if x.dtype != v.dtype:
                raise ValueError(f"{name}[{l}] has dtype {x.dtype} but v has {v.dtype}")

    lam = level_weights
    if not torch.is_floating_point(lam):
        raise ValueError(f"level_weights must be a floating tensor, got {lam.dtype}")
    if lam.dim() == 1:
        lam = lam.unsqueeze(0).expand(H, -1)
    if lam.dim() != 2 or lam.shape[-1] != n_levels or lam.shape[0] != H:
        raise ValueError(
            f"level_weights must have shape (L,) = ({n_levels},) or (H, L) = ({H}, {n_levels}), "
            f"got {tuple(level_weights.shape)}"
        )
    # Non-finite weights (a training run diverging) are let through: every path then gives the
    # reference's NaN outputs, and the loss says so.
    if not torch.compiler.is_compiling() and bool(torch.isfinite(lam).all()):
        if bool((lam < 0).any()):
            raise ValueError("level_weights must be non-negative (they are convex weights)")
        tol = max(1e-6, 2 * n_levels * torch.finfo(lam.dtype).eps)
        if bool(((lam.sum(-1) - 1).abs() > tol).any()):
            raise ValueError(
                f"level_weights rows must sum to 1 (got sums {lam.detach().sum(-1).tolist()})"
            )

    if key_padding_mask is not None:
        if key_padding_mask.dtype != torch.bool:
            raise ValueError(
                f"key_padding_mask must be bool (True = real token), got {key_padding_mask.dtype}"
            )
        if tuple(key_padding_mask.shape) != (B, T):
            raise ValueError(
                f"key_padding_mask must have shape (B, T) = {(B, T)}, "
                f"got {tuple(key_padding_mask.shape)}"
            )
    return lam.to(v.dtype)


# ---------------------------------------------------------------------------------------------
# Reference: materialised, readable
# ---------------------------------------------------------------------------------------------


def hkt_scores(
    q: Sequence[Tensor],
    k: Sequence[Tensor],
    level_weights: Tensor,
    *,
    stride: int = 2,
    scale: float | None = None,
) -> Tensor:
    """Fused HKT scores ``S_h = sum_l lambda_{h,l} U_l S^l_h U_l^T``, materialised.

    Shapes: ``q[l], k[l] (B, H, T_l, d)``; ``level_weights (H, L)`` or ``(L,)``;
    returns ``(B, H, T, T)`` (no mask applied). Meant for tests and diagnostics.
    """
    B, H, T, d = q[0].shape
    n_levels = len(q)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    lam = level_weights if level_weights.dim() == 2 else level_weights.expand(H, n_levels)
    scores = q[0].new_zeros(B, H, T, T)
    for l in range(n_levels):
        s_l = (q[l] @ k[l].transpose(-1, -2)) * scale  # (B, H, T_l, T_l)
        idx = torch.arange(T, device=s_l.device) // stride**l  # fine position -> coarse index
        s_up = s_l[:, :, idx][:, :, :, idx]  # (B, H, T, T)
        scores = scores + lam[:, l].view(1, H, 1, 1) * s_up
    return scores


def _attention_reference(q, k, v, lam, stride, causal, key_padding_mask, scale, dropout_p):
    B, H, T, _ = v.shape
    scores = hkt_scores(q, k, lam, stride=stride, scale=scale)  # (B, H, T, T)
    allowed = torch.ones(T, T, dtype=torch.bool, device=v.device)
    if causal:
        allowed = allowed.tril()
    allowed = allowed.view(1, 1, T, T)
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask.view(B, 1, 1, T)
    # A row with no admissible key is a padded query (a real query always sees itself); let it
    # attend anywhere to stay finite, its output is zeroed below.
    allowed = allowed | ~allowed.any(-1, keepdim=True)
    attn = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    if dropout_p > 0:
        attn = F.dropout(attn, p=dropout_p)
    return attn @ v  # (B, H, T, d_v)


# ---------------------------------------------------------------------------------------------
# Fast path: SDPA on concatenated, lambda-weighted, upsampled levels
# ---------------------------------------------------------------------------------------------


def is_right_padded(key_padding_mask: Tensor) -> bool:
    """True when every row is a block of real tokens followed by padding."""
    return not bool((key_padding_mask[:, 1:] & ~key_padding_mask[:, :-1]).any())


def masked_sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """``scaled_dot_product_attention`` with a ``(B, T)`` key padding mask, in O(T) memory for
    right-padded batches (and for any mask when bidirectional).

    Shapes: ``q, k (B, H, T, E)``, ``v (B, H, T, E_v)``, mask ``(B, T)`` bool (True = real),
    returns ``(B, H, T, E_v)``. Rows of padded queries hold finite values that callers discard;
    :func:`hkt_attention` zeroes them.
    """
    B, _, T, _ = q.shape
    attn_mask = None
    is_causal = causal
    if key_padding_mask is not None:
        if causal and is_right_padded(key_padding_mask):
            # Real queries sit before every padded key, so the causal mask already hides the
            # padding from them; padded query rows are discarded by the caller.
            pass
        else:
            keys = attendable_keys(key_padding_mask)
            attn_mask = keys.view(B, 1, 1, T)  # broadcast over queries: O(T) memory
            if causal:
                # A hole inside a sequence under a causal mask: the only case that needs a
                # materialised (B, 1, T, T) bool mask.
                tril = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
                attn_mask = attn_mask & tril.view(1, 1, T, T)
                attn_mask = attn_mask | ~attn_mask.any(-1, keepdim=True)
                is_causal = False
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
    )


def _concat_last(parts: list[Tensor]) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def _pad_last(x: Tensor, width: int) -> Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def _attention_sdpa(q, k, v, lam, stride, causal, key_padding_mask, scale, dropout_p):
    B, H, T, d_v = v.shape
    n_levels = len(q)
    d = q[0].shape[-1]
    q_cat = _concat_last(
        [upsample_levels(q[l], stride**l, T) * lam[:, l].view(1, H, 1, 1) for l in range(n_levels)]
    )  # (B, H, T, L*d)
    k_cat = _concat_last([upsample_levels(k[l], stride**l, T) for l in range(n_levels)])
    # The flash kernels need one head dim for q, k and v; zero columns change no score.
    width = max(n_levels * d, d_v)
    q_cat = _pad_last(q_cat, width)
    k_cat = _pad_last(k_cat, width)  # (B, H, T, width)
    v_pad = _pad_last(v, width)  # (B, H, T, width)

    out = masked_sdpa(
        q_cat,
        k_cat,
        v_pad,
        causal=causal,
        key_padding_mask=key_padding_mask,
        scale=scale,
        dropout_p=dropout_p,
    )  # (B, H, T, width)
    return out if width == d_v else out[..., :d_v]


AttentionFn = Callable[..., Tensor]

#: The blockwise kernels, by implementation name.
BLOCKWISE = {
    "fused_torch": fused_hkt_attention,
    "fused_cpp": cpp_hkt_attention,
    "fused_triton": triton_hkt_attention,
}

#: Registered implementations of HKT attention, by name. Every entry takes
#: ``(q, k, v, lam(H, L), stride, causal, key_padding_mask, scale, dropout_p)`` after validation
#: and returns ``(B, H, T, d_v)``; padded query rows are zeroed by :func:`hkt_attention`.
#: All are exact; ``reference`` is the only one that materialises ``T x T``. ``fused`` and
#: ``auto`` are resolved by :func:`resolve_impl`; ``fast`` is the old name of ``sdpa``.
ATTENTION_IMPLS: dict[str, AttentionFn | None] = {
    "reference": _attention_reference,
    "sdpa": _attention_sdpa,
    **BLOCKWISE,
    "fused": None,
    "auto": None,
    "fast": None,
}


def resolve_impl(impl: str, device: torch.device | str, dropout_p: float = 0.0) -> str:
    """The implementation that ``impl`` runs on ``device``: the one backend selector.

    ``fused``: the device's blockwise kernel (C++ on the CPU when it builds, Triton on CUDA when
    installed, else the PyTorch tile loop). ``auto``: the fastest exact path measured for the
    device (``benchmarks/attention.py``): the C++ kernel on the CPU, ``sdpa`` elsewhere and
    whenever attention dropout is on or the kernel cannot build. ``fast``: ``sdpa``
    (deprecated name)."""
    device = torch.device(device).type
    if impl == "fast":
        warnings.warn(
            "impl='fast' is now called impl='sdpa' (the SDPA path); 'fast' will be removed",
            DeprecationWarning,
            stacklevel=3,
        )
        return "sdpa"
    if impl == "fused":
        if device == "cpu" and cpu_kernel() is not None:
            return "fused_cpp"
        if device == "cuda" and triton_available():
            return "fused_triton"
        return "fused_torch"
    if impl == "auto":
        if dropout_p == 0 and device == "cpu" and cpu_kernel() is not None:
            return "fused_cpp"
        return "sdpa"
    return impl


def _all_finite(tensors: Sequence[Tensor]) -> bool:
    """One reduction per tensor: False when any holds NaN or +-inf (or sums overflow, which
    only costs the slower exact path)."""
    sums = [t.detach().sum(dtype=torch.float32 if t.element_size() < 4 else None) for t in tensors]
    return bool(torch.isfinite(torch.stack([x.float() for x in sums]).sum()))


def hkt_attention(
    q: Sequence[Tensor],
    k: Sequence[Tensor],
    v: Tensor,
    level_weights: Tensor,
    *,
    stride: int = 2,
    causal: bool = True,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    impl: str = "auto",
    dropout_p: float = 0.0,
) -> Tensor:
    """Hierarchical kernel attention over ``L`` resolution levels.

    Args:
        q: ``L`` query tensors, level ``l`` of shape ``(B, H, T_l, d)``.
        k: ``L`` key tensors, same shapes as ``q``.
        v: values at full resolution, ``(B, H, T, d_v)``.
        level_weights: convex level weights ``(H, L)`` (per head) or ``(L,)`` (shared):
            non-negative, rows summing to 1 (NaN weights give NaN outputs, as in the
            reference).
        stride: ``s >= 2``, an integer, the length ratio between consecutive levels.
        causal: causal (default) or bidirectional attention (a bool).
        key_padding_mask: ``(B, T)`` bool, True = real token (default None: no padding).
            Outputs at padded positions are 0.
        scale: score scale, default ``1 / sqrt(d)``.
        impl: which exact implementation (all O(T) memory except ``"reference"``):
            ``"auto"`` (default: the fastest measured path on the device), ``"sdpa"`` (one SDPA
            call on the concatenated levels; ``"fast"`` is its deprecated name), ``"fused"``
            (the best blockwise kernel on the device), ``"fused_cpp"`` (C++/OpenMP CPU kernel,
            built on first use), ``"fused_triton"`` (Triton, CUDA or ``TRITON_INTERPRET=1``),
            ``"fused_torch"`` (the PyTorch tile loop) or ``"reference"`` (materialised
            ``T x T``). The blockwise kernels do not implement ``dropout_p``.
        dropout_p: dropout on the attention probabilities (default 0).

    Every implementation gives the reference's answer on odd input too: NaN or infinity in
    ``q``, ``k`` or ``v`` reaches the same outputs as in the reference (the blockwise kernels
    hand such inputs to the ``sdpa`` path, which propagates them like the reference does).

    Returns:
        ``(B, H, T, d_v)``.

    Raises:
        ValueError: on mismatched level counts or lengths, non-floating inputs, finite level
            weights that are negative or do not sum to 1, a stride that is not an integer
            >= 2, a ``causal`` that is not a bool, a mask of the wrong shape or dtype, or an
            unknown ``impl``.
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"impl must be one of {sorted(ATTENTION_IMPLS)}, got {impl!r}")
    lam = _validate(q, k, v, level_weights, stride, key_padding_mask, causal)
    if scale is None:
        scale = 1.0 / math.sqrt(q[0].shape[-1])
    name = resolve_impl(impl, v.device, dropout_p)
    if name in BLOCKWISE and not _all_finite([*q, *k, v, lam]):
        name = "sdpa"  # the kernels' online softmax would drop NaN keys and zero NaN rows
    out = ATTENTION_IMPLS[name](
        list(q), list(k), v, lam, stride, causal, key_padding_mask, scale, dropout_p
    )
    if key_padding_mask is not None:
        out = out.masked_fill(~key_padding_mask[:, None, :, None], 0.0)
    return out


# ---------------------------------------------------------------------------------------------
# Cost model
# ---------------------------------------------------------------------------------------------


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
    if n_levels < 1:
        raise ValueError(f"n_levels must be >= 1, got {n_levels}")
    if stride < 2:
        raise ValueError(f"stride must be >= 2, got {stride}")
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
