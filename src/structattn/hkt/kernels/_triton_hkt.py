"""Triton kernels of blockwise HKT attention (imported lazily by :mod:`.fused_triton`).

One program per (query tile, batch x head) in the forward pass and in the dQ pass, one per
(key tile, batch x head) in the dK/dV pass (no atomics). Per tile pair the fine scores are one
``tl.dot``, every coarse level ``l`` one ``tl.dot`` at coarse resolution
(``BM/s^l x BN/s^l``); the levels are folded coarse-to-fine and broadcast to the fine tile by
reshapes. Coarse score gradients are nested block sums of the fine score gradient. Tiles are
powers of two and multiples of ``s^(L-1)`` (so ``s`` is a power of two), at most four levels.
Accumulation is float32 (float64 inputs: float64).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rows(ptr, row0, n_rows, D, ROWS: tl.constexpr, BD: tl.constexpr):
    """Rows ``row0 .. row0 + ROWS`` of a (n_rows, D) row-major matrix, zero outside."""
    r = row0 + tl.arange(0, ROWS)
    c = tl.arange(0, BD)
    return tl.load(
        ptr + r[:, None] * D + c[None, :], mask=(r[:, None] < n_rows) & (c[None, :] < D), other=0.0
    )


@triton.jit
def _store_rows(ptr, x, row0, n_rows, D, ROWS: tl.constexpr, BD: tl.constexpr):
    r = row0 + tl.arange(0, ROWS)
    c = tl.arange(0, BD)
    tl.store(
        ptr + r[:, None] * D + c[None, :],
        x.to(ptr.dtype.element_ty),
        mask=(r[:, None] < n_rows) & (c[None, :] < D),
    )


@triton.jit
def _expand(x, R: tl.constexpr, C: tl.constexpr, S: tl.constexpr):
    """(R, C) -> (R*S, C*S): every entry repeated over its S x S block."""
    x = tl.broadcast_to(x[:, None, :, None], (R, S, C, S))
    return tl.reshape(x, (R * S, C * S))


@triton.jit
def _block_sum(x, R: tl.constexpr, C: tl.constexpr, S: tl.constexpr):
    """(R*S, C*S) -> (R, C): sums over S x S blocks (the adjoint of :func:`_expand`)."""
    x = tl.reshape(x, (R, S, C, S))
    return tl.sum(tl.sum(x, axis=3), axis=1)


@triton.jit
def _coarse(
    qp,
    kp,
    ci0,
    cj0,
    Tl,
    D,
    scale,
    CM: tl.constexpr,
    CN: tl.constexpr,
    BD: tl.constexpr,
    ACC: tl.constexpr,
):
    """Raw coarse scores of one level on a tile: ``scale * Q_l K_l^T`` (CM, CN)."""
    q = _rows(qp, ci0, Tl, D, CM, BD)
    k = _rows(kp, cj0, Tl, D, CN, BD)
    return tl.dot(q, tl.trans(k), input_precision="ieee", out_dtype=ACC) * scale


@triton.jit
def _level_ptrs(bh, T, T1, T2, T3, D, p0, p1, p2, p3):
    """Pointers to head ``bh`` of four per-level (B*H, T_l, D) tensors."""
    return p0 + bh * T * D, p1 + bh * T1 * D, p2 + bh * T2 * D, p3 + bh * T3 * D


@triton.jit
def _scores(i0, j0, q0, k0, q1, k1, q2, k2, q3, k3, T, T1, T2, T3, lam, D, scale,
            L: tl.constexpr, S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
            BD: tl.constexpr, CM1: tl.constexpr, CN1: tl.constexpr, CM2: tl.constexpr,
            CN2: tl.constexpr, CM3: tl.constexpr, CN3: tl.constexpr,
            ACC: tl.constexpr):  # fmt: skip
    """Fine scores ``f0`` (scale in, weight out) and fused scores ``s`` of a (BM, BN) tile."""
    q = _rows(q0, i0, T, D, BM, BD)
    k = _rows(k0, j0, T, D, BN, BD)
    f0 = tl.dot(q, tl.trans(k), input_precision="ieee", out_dtype=ACC) * scale
    s = tl.load(lam) * f0
    if L >= 2:
        g = tl.load(lam + 1) * _coarse(q1, k1, i0 // S, j0 // S, T1, D, scale, CM1, CN1, BD, ACC)
        if L >= 3:
            f2 = S * S
            g2 = tl.load(lam + 2) * _coarse(
                q2, k2, i0 // f2, j0 // f2, T2, D, scale, CM2, CN2, BD, ACC
            )
            if L >= 4:
                f3 = S * S * S
                g3 = tl.load(lam + 3) * _coarse(
                    q3, k3, i0 // f3, j0 // f3, T3, D, scale, CM3, CN3, BD, ACC
                )
                g2 += _expand(g3, CM3, CN3, S)
            g += _expand(g2, CM2, CN2, S)
        s += _expand(g, CM1, CN1, S)
    return f0, s


@triton.jit
def _mask(s, i0, j0, T, km, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, BM: tl.constexpr,
          BN: tl.constexpr):  # fmt: skip
    rows = i0 + tl.arange(0, BM)
    cols = j0 + tl.arange(0, BN)
    ok = (cols[None, :] < T) & (rows[:, None] >= 0)
    if CAUSAL:
        ok = ok & (cols[None, :] <= rows[:, None])
    if HAS_MASK:
        real = tl.load(km + cols, mask=cols < T, other=0)
        ok = ok & (real != 0)[None, :]
    return tl.where(ok, s, float("-inf"))


@triton.jit
def hkt_fwd_kernel(q0, k0, q1, k1, q2, k2, q3, k3, v, lam, km, out, lse,
                   T, T1, T2, T3, H, D, DV, scale,
                   L: tl.constexpr, S: tl.constexpr, CAUSAL: tl.constexpr,
                   HAS_MASK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BD: tl.constexpr, BDV: tl.constexpr, CM1: tl.constexpr, CN1: tl.constexpr,
                   CM2: tl.constexpr, CN2: tl.constexpr, CM3: tl.constexpr,
                   CN3: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    i0 = tl.program_id(0) * BM
    bh = tl.program_id(1).to(tl.int64)
    h = bh % H
    q0, q1, q2, q3 = _level_ptrs(bh, T, T1, T2, T3, D, q0, q1, q2, q3)
    k0, k1, k2, k3 = _level_ptrs(bh, T, T1, T2, T3, D, k0, k1, k2, k3)
    v += bh * T * DV
    out += bh * T * DV
    lse += bh * T
    lam += h * L
    km += (bh // H) * T

    m = tl.full((BM,), float("-inf"), ACC)
    den = tl.zeros((BM,), ACC)
    acc = tl.zeros((BM, BDV), ACC)
    hi = T
    if CAUSAL:
        hi = tl.minimum(i0 + BM, T)
    for j0 in range(0, hi, BN):
        _, s = _scores(i0, j0, q0, k0, q1, k1, q2, k2, q3, k3, T, T1, T2, T3, lam, D, scale,
                       L, S, BM, BN, BD, CM1, CN1, CM2, CN2, CM3, CN3, ACC)  # fmt: skip
        s = _mask(s, i0, j0, T, km, CAUSAL, HAS_MASK, BM, BN)
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        corr = tl.exp(m - m_safe)
        den = den * corr + tl.sum(p, 1)
        vt = _rows(v, j0, T, DV, BN, BDV)
        acc = acc * corr[:, None] + tl.dot(
            p.to(vt.dtype), vt, input_precision="ieee", out_dtype=ACC
        )
        m = m_new
    has = den > 0
    o = acc / tl.where(has, den, 1.0)[:, None]
    _store_rows(out, o, i0, T, DV, BM, BDV)
    rows = i0 + tl.arange(0, BM)
    tl.store(lse + rows, tl.where(has, m + tl.log(tl.where(has, den, 1.0)), float("inf")),
             mask=rows < T)  # fmt: skip


@triton.jit
def hkt_bwd_dkdv_kernel(q0, k0, q1, k1, q2, k2, q3, k3, v, lam, km, lse, delta, dout,
                        dk0, dk1, dk2, dk3, dv, dlam,
                        T, T1, T2, T3, H, D, DV, scale, NKB,
                        L: tl.constexpr, S: tl.constexpr, CAUSAL: tl.constexpr,
                        HAS_MASK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        BD: tl.constexpr, BDV: tl.constexpr, CM1: tl.constexpr,
                        CN1: tl.constexpr, CM2: tl.constexpr, CN2: tl.constexpr,
                        CM3: tl.constexpr, CN3: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """dK, dV and the level weights' gradient for one key tile ``j0 .. j0 + BN`` of one
    (batch, head), looping over the query tiles that see it (no atomics).

    With ``S_ij = scale * sum_l lam_l q_l[i // s^l] . k_l[j // s^l]`` (the fine scores ``f0`` at
    ``l = 0``), ``P = exp(S - lse)`` from the forward pass and ``delta_i = dO_i . O_i``:
    ``dV_j = sum_i P_ij dO_i``, ``dS = P * (dO V^T - delta)``, the fine key
    ``dk_0[j] = lam_0 scale sum_i dS_ij q_0[i]``, and at level ``l`` the coarse score gradient
    ``dS^l`` (``dS`` summed over ``s^l x s^l`` blocks, nested: ``_block_sum``) gives
    ``dk_l[c] = lam_l scale sum_r dS^l_rc q_l[r]`` and ``dlam_l = sum dS^l * C_l`` with ``C_l``
    the unweighted coarse scores; ``dlam`` holds one partial sum per key tile (summed after)."""
    pid = tl.program_id(0)
    j0 = pid * BN
    bh = tl.program_id(1).to(tl.int64)
    h = bh % H
    q0, q1, q2, q3 = _level_ptrs(bh, T, T1, T2, T3, D, q0, q1, q2, q3)
    k0, k1, k2, k3 = _level_ptrs(bh, T, T1, T2, T3, D, k0, k1, k2, k3)
    dk0, dk1, dk2, dk3 = _level_ptrs(bh, T, T1, T2, T3, D, dk0, dk1, dk2, dk3)
    v += bh * T * DV
    dv += bh * T * DV
    dout += bh * T * DV
    lse += bh * T
    delta += bh * T
    lam += h * L
    km += (bh // H) * T
    dlam += (bh * NKB + pid) * L

    vt = _rows(v, j0, T, DV, BN, BDV)
    acc_dv = tl.zeros((BN, BDV), ACC)
    acc_k0 = tl.zeros((BN, BD), ACC)
    acc_k1 = tl.zeros((CN1, BD), ACC)
    acc_k2 = tl.zeros((CN2, BD), ACC)
    acc_k3 = tl.zeros((CN3, BD), ACC)
    dl0 = tl.zeros((1,), ACC)
    dl1 = tl.zeros((1,), ACC)
    dl2 = tl.zeros((1,), ACC)
    dl3 = tl.zeros((1,), ACC)
    lo = 0
    if CAUSAL:
        lo = (j0 // BM) * BM
    for i0 in range(lo, T, BM):
        f0, s = _scores(i0, j0, q0, k0, q1, k1, q2, k2, q3, k3, T, T1, T2, T3, lam, D, scale,
                        L, S, BM, BN, BD, CM1, CN1, CM2, CN2, CM3, CN3, ACC)  # fmt: skip
        s = _mask(s, i0, j0, T, km, CAUSAL, HAS_MASK, BM, BN)
        rows = i0 + tl.arange(0, BM)
        lse_i = tl.load(lse + rows, mask=rows < T, other=float("inf"))
        p = tl.exp(s - lse_i[:, None])
        do = _rows(dout, i0, T, DV, BM, BDV)
        acc_dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision="ieee", out_dtype=ACC)
        dp = tl.dot(do, tl.trans(vt), input_precision="ieee", out_dtype=ACC)
        delta_i = tl.load(delta + rows, mask=rows < T, other=0.0)
        ds = p * (dp - delta_i[:, None])
        dl0 += tl.sum(tl.sum(ds * f0, 1), 0)
        qi = _rows(q0, i0, T, D, BM, BD)
        acc_k0 += tl.dot(tl.trans(ds).to(qi.dtype), qi, input_precision="ieee", out_dtype=ACC) * (
            tl.load(lam) * scale
        )
        if L >= 2:
            d1 = _block_sum(ds, CM1, CN1, S)
            c1 = _coarse(q1, k1, i0 // S, j0 // S, T1, D, scale, CM1, CN1, BD, ACC)
            dl1 += tl.sum(tl.sum(d1 * c1, 1), 0)
            q1i = _rows(q1, i0 // S, T1, D, CM1, BD)
            acc_k1 += tl.dot(
                tl.trans(d1).to(q1i.dtype), q1i, input_precision="ieee", out_dtype=ACC
            ) * (tl.load(lam + 1) * scale)
            if L >= 3:
                f2 = S * S
                d2 = _block_sum(d1, CM2, CN2, S)
                c2 = _coarse(q2, k2, i0 // f2, j0 // f2, T2, D, scale, CM2, CN2, BD, ACC)
                dl2 += tl.sum(tl.sum(d2 * c2, 1), 0)
                q2i = _rows(q2, i0 // f2, T2, D, CM2, BD)
                acc_k2 += tl.dot(
                    tl.trans(d2).to(q2i.dtype), q2i, input_precision="ieee", out_dtype=ACC
                ) * (tl.load(lam + 2) * scale)
                if L >= 4:
                    f3 = S * S * S
                    d3 = _block_sum(d2, CM3, CN3, S)
                    c3 = _coarse(q3, k3, i0 // f3, j0 // f3, T3, D, scale, CM3, CN3, BD, ACC)
                    dl3 += tl.sum(tl.sum(d3 * c3, 1), 0)
                    q3i = _rows(q3, i0 // f3, T3, D, CM3, BD)
                    acc_k3 += tl.dot(tl.trans(d3).to(q3i.dtype), q3i, input_precision="ieee") * (
                        tl.load(lam + 3) * scale
                    )
    _store_rows(dv, acc_dv, j0, T, DV, BN, BDV)
    _store_rows(dk0, acc_k0, j0, T, D, BN, BD)
    one = tl.arange(0, 1)
    tl.store(dlam + one, dl0)
    if L >= 2:
        _store_rows(dk1, acc_k1, j0 // S, T1, D, CN1, BD)
        tl.store(dlam + 1 + one, dl1)
    if L >= 3:
        _store_rows(dk2, acc_k2, j0 // (S * S), T2, D, CN2, BD)
        tl.store(dlam + 2 + one, dl2)
    if L >= 4:
        _store_rows(dk3, acc_k3, j0 // (S * S * S), T3, D, CN3, BD)
        tl.store(dlam + 3 + one, dl3)


@triton.jit
def hkt_bwd_dq_kernel(q0, k0, q1, k1, q2, k2, q3, k3, v, lam, km, lse, delta, dout,
                      dq0, dq1, dq2, dq3,
                      T, T1, T2, T3, H, D, DV, scale,
                      L: tl.constexpr, S: tl.constexpr, CAUSAL: tl.constexpr,
                      HAS_MASK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      BD: tl.constexpr, BDV: tl.constexpr, CM1: tl.constexpr,
                      CN1: tl.constexpr, CM2: tl.constexpr, CN2: tl.constexpr,
                      CM3: tl.constexpr, CN3: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """dQ for one query tile ``i0 .. i0 + BM`` of one (batch, head), looping over the key tiles
    it sees: ``dS = P * (dO V^T - delta)`` as in :func:`hkt_bwd_dkdv_kernel`, the fine query
    ``dq_0[i] = lam_0 scale sum_j dS_ij k_0[j]`` and at level ``l``
    ``dq_l[r] = lam_l scale sum_c dS^l_rc k_l[c]`` with ``dS^l`` the block-summed ``dS``."""
    i0 = tl.program_id(0) * BM
    bh = tl.program_id(1).to(tl.int64)
    h = bh % H
    q0, q1, q2, q3 = _level_ptrs(bh, T, T1, T2, T3, D, q0, q1, q2, q3)
    k0, k1, k2, k3 = _level_ptrs(bh, T, T1, T2, T3, D, k0, k1, k2, k3)
    dq0, dq1, dq2, dq3 = _level_ptrs(bh, T, T1, T2, T3, D, dq0, dq1, dq2, dq3)
    v += bh * T * DV
    dout += bh * T * DV
    lse += bh * T
    delta += bh * T
    lam += h * L
    km += (bh // H) * T

    rows = i0 + tl.arange(0, BM)
    lse_i = tl.load(lse + rows, mask=rows < T, other=float("inf"))
    delta_i = tl.load(delta + rows, mask=rows < T, other=0.0)
    do = _rows(dout, i0, T, DV, BM, BDV)
    acc_q0 = tl.zeros((BM, BD), ACC)
    acc_q1 = tl.zeros((CM1, BD), ACC)
    acc_q2 = tl.zeros((CM2, BD), ACC)
    acc_q3 = tl.zeros((CM3, BD), ACC)
    hi = T
    if CAUSAL:
        hi = tl.minimum(i0 + BM, T)
    for j0 in range(0, hi, BN):
        _, s = _scores(i0, j0, q0, k0, q1, k1, q2, k2, q3, k3, T, T1, T2, T3, lam, D, scale,
                       L, S, BM, BN, BD, CM1, CN1, CM2, CN2, CM3, CN3, ACC)  # fmt: skip
        s = _mask(s, i0, j0, T, km, CAUSAL, HAS_MASK, BM, BN)
        p = tl.exp(s - lse_i[:, None])
        vt = _rows(v, j0, T, DV, BN, BDV)
        dp = tl.dot(do, tl.trans(vt), input_precision="ieee", out_dtype=ACC)
        ds = p * (dp - delta_i[:, None])
        kj = _rows(k0, j0, T, D, BN, BD)
        acc_q0 += tl.dot(ds.to(kj.dtype), kj, input_precision="ieee", out_dtype=ACC) * (
            tl.load(lam) * scale
        )
        if L >= 2:
            d1 = _block_sum(ds, CM1, CN1, S)
            k1j = _rows(k1, j0 // S, T1, D, CN1, BD)
            acc_q1 += tl.dot(d1.to(k1j.dtype), k1j, input_precision="ieee", out_dtype=ACC) * (
                tl.load(lam + 1) * scale
            )
            if L >= 3:
                d2 = _block_sum(d1, CM2, CN2, S)
                k2j = _rows(k2, j0 // (S * S), T2, D, CN2, BD)
                acc_q2 += tl.dot(d2.to(k2j.dtype), k2j, input_precision="ieee", out_dtype=ACC) * (
                    tl.load(lam + 2) * scale
                )
                if L >= 4:
                    d3 = _block_sum(d2, CM3, CN3, S)
                    k3j = _rows(k3, j0 // (S * S * S), T3, D, CN3, BD)
                    acc_q3 += tl.dot(
                        d3.to(k3j.dtype), k3j, input_precision="ieee", out_dtype=ACC
                    ) * (tl.load(lam + 3) * scale)
    _store_rows(dq0, acc_q0, i0, T, D, BM, BD)
    if L >= 2:
        _store_rows(dq1, acc_q1, i0 // S, T1, D, CM1, BD)
    if L >= 3:
        _store_rows(dq2, acc_q2, i0 // (S * S), T2, D, CM2, BD)
    if L >= 4:
        _store_rows(dq3, acc_q3, i0 // (S * S * S), T3, D, CM3, BD)
