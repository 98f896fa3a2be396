"""The public interface of HKT attention: :func:`hkt_attention`, the registry of its exact
implementations, the backend selector :func:`resolve_impl` and the input validation in front of
every implementation.

Hierarchical Kernel Transformer (arXiv 2604.08829), as specified in this project's design notes.

Shapes (legend used in every comment below):
    B  batch                 H  heads                 L  levels (level 0 = full resolution)
    T  sequence length       T_l = ceil(T_{l-1} / s), T_0 = T
    d  query/key head dim    d_v value head dim       s  stride between levels

The equations are in :mod:`.reference` (the materialised reference), the fast path's identity
in :mod:`.kernels.sdpa`, the blockwise kernels in :mod:`.kernels`, the level geometry in
:mod:`.levels` and the cost model in :mod:`.cost`.

Padding convention: ``key_padding_mask`` is ``(B, T)`` bool, True = real token. Padded keys are
never attended to and the outputs at padded query positions are exactly 0.

Host synchronisation: the checks of the weights' values and the finiteness tests that send
non-finite level weights to the reference and other odd input to the ``sdpa`` path read one
small tensor back from CPU tensors, once per call, and so does the padding layout of a causal
call with a mask; on any other device nothing is read back (no device synchronisation: the
kernels' own arithmetic decides NaN outputs, a head with non-finite level weights is made NaN
by one multiplication with a per-head factor, and the padding layout is the caller's
``right_padded`` or the path exact for any padding). A test runs the layer on the ``meta``
device, where any data-dependent host decision fails.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .kernels import (
    cpp_hkt_attention,
    fused_hkt_attention,
    sdpa_attention,
    triton_available,
    triton_hkt_attention,
)
from .kernels.extension import cpu_kernel
from .levels import level_lengths
from .reference import reference_attention

__all__ = ["ATTENTION_IMPLS", "BLOCKWISE", "hkt_attention", "resolve_impl"]


def _check_scale(scale: float | None) -> None:
    """Refuse a ``scale`` that is not None or a finite real number > 0 (bools included)."""
    if scale is not None and (
        isinstance(scale, bool)
        or not isinstance(scale, numbers.Real)
        or not math.isfinite(scale)
        or scale <= 0
    ):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")


def _level_lists(q: Sequence[Tensor], k: Sequence[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    """``q`` and ``k`` as lists, checked to be sequences of the same number (>= 1) of levels."""
    if isinstance(q, Tensor) or isinstance(k, Tensor):
        raise ValueError("q and k must be sequences of per-level tensors (a list of L tensors)")
    q, k = list(q), list(k)
    n_levels = len(q)
    if n_levels < 1:
        raise ValueError("q must hold at least one level (got an empty sequence)")
    if len(k) != n_levels:
        raise ValueError(f"q has {n_levels} levels but k has {len(k)}")
    return q, k


def _check_stride_and_causal(stride: int, causal: bool) -> None:
    """Refuse a stride that is not an integer >= 2 and a ``causal`` that is not a bool."""
    if isinstance(stride, bool) or not isinstance(stride, int):
        raise ValueError(f"stride must be an integer >= 2, got {stride!r}")
    if stride < 2:
        raise ValueError(f"stride must be >= 2, got {stride}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")


def _check_values_tensor(v: Tensor) -> None:
    """Check that ``v`` is a floating ``(B, H, T, d_v)`` tensor with ``T >= 1``."""
    if not isinstance(v, Tensor) or v.dim() != 4:
        raise ValueError(f"v must have shape (B, H, T, d_v), got {getattr(v, 'shape', v)!r}")
    if not torch.is_floating_point(v):
        raise ValueError(f"q, k and v must be floating-point tensors, got {v.dtype}")
    if v.shape[2] < 1:
        raise ValueError("sequence length T must be >= 1")


def _check_level_shapes(q: list[Tensor], k: list[Tensor], v: Tensor, stride: int) -> None:
    """Check every level of ``q`` and ``k`` against ``(B, H, T_l, d)`` and ``v``'s dtype, and
    that both head dims are >= 1."""
    B, H, T, d_v = v.shape
    lengths = level_lengths(T, len(q), stride)
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
    if d < 1 or d_v < 1:
        raise ValueError(f"head dims must be >= 1, got d = {d} (q, k) and d_v = {d_v} (v)")


def _check_level_weights(level_weights: Tensor, H: int, n_levels: int) -> Tensor:
    """Check the level weights' dtype and shape (no values: see :func:`_check_values`); return
    them as ``(H, L)``, a shared ``(L,)`` row expanded to every head."""
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
    return lam


def _check_mask(key_padding_mask: Tensor | None, B: int, T: int) -> None:
    """Check that a given ``key_padding_mask`` is a bool ``(B, T)`` tensor."""
    if key_padding_mask is None:
        return
    if key_padding_mask.dtype != torch.bool:
        raise ValueError(
            f"key_padding_mask must be bool (True = real token), got {key_padding_mask.dtype}"
        )
    if tuple(key_padding_mask.shape) != (B, T):
        raise ValueError(
            f"key_padding_mask must have shape (B, T) = {(B, T)}, "
            f"got {tuple(key_padding_mask.shape)}"
        )


def _validate(
    q: Sequence[Tensor],
    k: Sequence[Tensor],
    v: Tensor,
    level_weights: Tensor,
    stride: int,
    key_padding_mask: Tensor | None,
    causal: bool = True,
    scale: float | None = None,
) -> Tensor:
    """Check types, shapes and the scale in front of every implementation (no host
    synchronisation; the weights' values are :func:`_check_values`'); return the level weights
    as ``(H, L)``."""
    _check_scale(scale)
    q, k = _level_lists(q, k)
    _check_stride_and_causal(stride, causal)
    _check_values_tensor(v)
    B, H, T, d_v = v.shape
    _check_level_shapes(q, k, v, stride)
    lam = _check_level_weights(level_weights, H, len(q))
    _check_mask(key_padding_mask, B, T)
    return lam.to(v.dtype)


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
    "reference": reference_attention,
    "sdpa": sdpa_attention,
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


def _check_values(
    lam: Tensor, inputs: Sequence[Tensor] | None, check_lam: bool
) -> tuple[bool, bool]:
    """The value checks, read back from the host in one transfer; returns ``(lam_finite,
    inputs_finite)``. With ``check_lam``: refuse finite weights that are negative or whose rows
    do not sum to 1, and report whether every weight is finite (non-finite weights, a training
    run diverging, are no error: the caller runs the reference, whose NaN outputs every path
    gives); without it ``lam_finite`` is True. With ``inputs``: ``inputs_finite`` is False when
    any holds NaN or +-inf (or sums overflow, which only costs the slower exact path), else
    True. CPU tensors only (see the module notes)."""
    flags = []
    if check_lam:
        tol = max(1e-6, 2 * lam.shape[-1] * torch.finfo(lam.dtype).eps)
        flags += [
            torch.isfinite(lam).all(),
            (lam < 0).any(),
            ((lam.sum(-1) - 1).abs() > tol).any(),
        ]
    if inputs is not None:  # one reduction per tensor
        # float16 sums overflow at 65504, so they are taken in float32 (a converting pass);
        # bfloat16 has float32's range and sums in place
        sums = [t.detach().sum(dtype=torch.float32 if t.dtype == torch.float16 else None)
                for t in inputs]  # fmt: skip
        flags.append(torch.isfinite(torch.stack([x.float() for x in sums]).sum()))
    if not flags:
        return True, True
    values = torch.stack(flags).tolist()  # the one host transfer
    lam_finite = bool(values[0]) if check_lam else True
    if check_lam and lam_finite:
        if values[1]:
            raise ValueError("level_weights must be non-negative (they are convex weights)")
        if values[2]:
            raise ValueError(
                f"level_weights rows must sum to 1 (got sums {lam.detach().sum(-1).tolist()})"
            )
    return lam_finite, bool(values[-1]) if inputs is not None else True


def _nan_heads(out: Tensor, lam: Tensor) -> Tensor:
    """``out (B, H, T, d_v)`` with the heads whose level weights ``lam (H, L)`` hold NaN or
    +-inf made NaN throughout, as in the reference, without reading anything back: one
    multiplication by a per-head factor that is exactly 1 for finite weights (so finite outputs
    keep every bit) and NaN otherwise. The factor is detached: nothing more is saved for the
    backward pass, and NaN output gradients reach the kernel's backward as they are."""
    factor = 1.0 + 0.0 * lam.detach().sum(-1)  # (H,): 1, or NaN where a weight is not finite
    return out * factor.to(out.dtype).view(1, -1, 1, 1)


def hkt_attention(
    q: Sequence[Tensor], k: Sequence[Tensor], v: Tensor, level_weights: Tensor, *,
    stride: int = 2, causal: bool = True, key_padding_mask: Tensor | None = None,
    scale: float | None = None, impl: str = "auto", dropout_p: float = 0.0,
    right_padded: bool | None = None, zero_padded: bool = True) -> Tensor:  # fmt: skip
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
        scale: score scale, a finite number > 0, default ``1 / sqrt(d)``.
        impl: which exact implementation (all O(T) memory except ``"reference"``):
            ``"auto"`` (default: the fastest measured path on the device), ``"sdpa"`` (one SDPA
            call on the concatenated levels; ``"fast"`` is its deprecated name), ``"fused"``
            (the best blockwise kernel on the device), ``"fused_cpp"`` (C++/OpenMP CPU kernel,
            built on first use), ``"fused_triton"`` (Triton, CUDA or ``TRITON_INTERPRET=1``),
            ``"fused_torch"`` (the PyTorch tile loop) or ``"reference"`` (materialised
            ``T x T``). The blockwise kernels do not implement ``dropout_p``.
        dropout_p: dropout on the attention probabilities (default 0).
        right_padded: the caller's word that every row of ``key_padding_mask`` is real
            tokens followed by padding (the ``sdpa`` path then keeps the causal flash kernel in
            O(T) memory). None (default): read from a CPU mask; never read from a mask on
            another device (see the host synchronisation note above).
        zero_padded: outputs at padded query positions are 0 (default). False leaves them
            as the kernel computed them (finite, attending the real keys), without the
            masked copy of the output: for a caller that zeroes those rows itself.

    Every implementation gives the reference's answer on odd input too: NaN or infinity in
    ``q``, ``k`` or ``v`` reaches the same outputs as in the reference (the blockwise kernels
    hand such inputs to the ``sdpa`` path, which propagates them like the reference does).
    NaN or infinity in ``level_weights`` makes every output of its head NaN, as in the
    reference: CPU calls then run the reference itself (its outputs and gradients), calls on
    other devices multiply those heads by NaN (see the host synchronisation note above).

    Returns:
        ``(B, H, T, d_v)``.

    Raises:
        ValueError: on mismatched level counts or lengths, non-floating inputs, a head dim of
            0, finite level weights that are negative or do not sum to 1 (checked on CPU
            tensors), a stride that is not an integer >= 2, a ``scale`` that is not a finite
            number > 0, a ``causal`` that is not a bool, a mask of the wrong shape or dtype, or
            an unknown ``impl``.
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"impl must be one of {sorted(ATTENTION_IMPLS)}, got {impl!r}")
    weights = _validate(q, k, v, level_weights, stride, key_padding_mask, causal, scale)
    lam, scale = weights.to(v.dtype), _score_scale(q, scale)
    name = resolve_impl(impl, v.device, dropout_p)  # here: its warning's stacklevel counts on it
    out = _attend(name, q, k, v, weights, lam, stride, causal, key_padding_mask, scale,
                  dropout_p, right_padded)  # fmt: skip
    return _zero_padding(out, key_padding_mask) if zero_padded else out


def _score_scale(q: Sequence[Tensor], scale: float | None) -> float:
    """The score scale as a float: ``scale``, by default ``1 / sqrt(d)``."""
    return 1.0 / math.sqrt(q[0].shape[-1]) if scale is None else float(scale)


def _attend(
    name: str,
    q: Sequence[Tensor],
    k: Sequence[Tensor],
    v: Tensor,
    weights: Tensor,
    lam: Tensor,
    stride: int,
    causal: bool,
    key_padding_mask: Tensor | None,
    scale: float,
    dropout_p: float,
    right_padded: bool | None,
) -> Tensor:
    """Run implementation ``name`` on validated input, or the reference / ``sdpa`` path where
    the CPU value checks send the call, with NaN heads for non-finite weights elsewhere."""
    # Non-finite level weights (a diverged run) make every output of their head NaN in the
    # reference, where the other paths may return zeros (the CPU SDPA kernel does on short
    # rows): such calls run the reference where the weights are read back (one flag of the
    # value checks' one transfer) and get NaN heads by arithmetic elsewhere (_nan_heads).
    lam_read = False
    if v.device.type == "cpu" and lam.device.type == "cpu":
        lam_read = not torch.compiler.is_compiling()
        inputs = [*q, *k, v, lam] if name in BLOCKWISE else None
        lam_finite, inputs_finite = _check_values(weights, inputs, check_lam=lam_read)
        if not lam_finite:
            name = "reference"
        elif not inputs_finite:
            name = "sdpa"  # the kernels' online softmax would drop NaN keys and zero NaN rows
    # the padding hint goes to the one path that reads the mask's layout (only when given, so
    # that the registry's nine-argument contract holds otherwise)
    extra = {"right_padded": right_padded} if name == "sdpa" and right_padded is not None else {}
    out = ATTENTION_IMPLS[name](
        list(q), list(k), v, lam, stride, causal, key_padding_mask, scale, dropout_p, **extra
    )
    if not lam_read and name != "reference":
        out = _nan_heads(out, lam)
    return out


def _zero_padding(out: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    """``out (B, H, T, d_v)`` with the padded query rows set to 0 (a ``(B, T, H, d_v)``-contiguous
    kernel output keeps that layout)."""
    if key_padding_mask is not None:
        if out.transpose(1, 2).is_contiguous():  # a (B, T, H, d) kernel output stays so
            out = out.transpose(1, 2).masked_fill(~key_padding_mask[:, :, None, None], 0.0)
            return out.transpose(1, 2)
        out = out.masked_fill(~key_padding_mask[:, None, :, None], 0.0)
    return out
