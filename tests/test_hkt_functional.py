"""hkt_attention: fast path against the materialised reference, special cases, validation."""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from helpers import make_inputs, require

from structattn.hkt import hkt_attention, hkt_cost, hkt_scores, level_lengths

LENGTHS = (1, 2, 37, 97, 1025)
#: the exact O(T)-memory paths checked against the reference on every CPU test below (the Triton
#: kernel runs in Triton's interpreter in test_hkt_kernels.py)
EXACT = ("sdpa", "fused_torch", "fused_cpp")


def available(impls):
    """``impls`` less the C++ kernel on a machine without a compiler (the others still run)."""
    out = []
    for impl in impls:
        if impl == "fused_cpp" and shutil.which(os.environ.get("CXX", "c++")) is None:
            continue
        require(impl)
        out.append(impl)
    return out


def _grads(out, tensors, seed=1):
    g = torch.Generator().manual_seed(seed)
    upstream = torch.randn(out.shape, generator=g, dtype=out.dtype)
    return torch.autograd.grad(out, tensors, upstream, allow_unused=False)


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("stride", [2, 3])
@pytest.mark.parametrize("n_levels", [1, 2, 3, 4])
@pytest.mark.parametrize("T", LENGTHS)
def test_fast_matches_reference_forward_backward(T, n_levels, stride, causal, padded):
    q, k, v, theta, mask = make_inputs(T, n_levels, stride, padded=padded, seed=T + n_levels)
    leaves = [*q, *k, v, theta]
    for t in leaves:
        t.requires_grad_(True)
    outs, grads = {}, {}
    for impl in ("reference", *EXACT):
        require(impl)
        lam = torch.softmax(theta, -1)
        out = hkt_attention(
            q, k, v, lam, stride=stride, causal=causal, key_padding_mask=mask, impl=impl
        )
        outs[impl] = out
        grads[impl] = _grads(out, leaves)
    for impl in EXACT:
        torch.testing.assert_close(outs[impl], outs["reference"], rtol=1e-10, atol=1e-10)
        for g_impl, g_ref in zip(grads[impl], grads["reference"]):
            torch.testing.assert_close(g_impl, g_ref, rtol=1e-9, atol=1e-9)
        if mask is not None:
            assert (outs[impl].masked_select(~mask[:, None, :, None]) == 0).all()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_fast_matches_reference_with_holes_in_mask(causal):
    """A mask that is not right padding (holes, a fully padded row) stays exact and finite."""
    q, k, v, theta, _ = make_inputs(29, 3, 2, B=3)
    mask = torch.rand(3, 29, generator=torch.Generator().manual_seed(3)) > 0.4
    mask[2] = False  # a sequence with no real token
    lam = torch.softmax(theta, -1)
    for t in (*q, *k, v):
        t.requires_grad_(True)
    outs = [
        hkt_attention(q, k, v, lam, causal=causal, key_padding_mask=mask, impl=impl)
        for impl in ("reference", *available(EXACT))
    ]
    g_ref = _grads(outs[0], [*q, *k, v])
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-10, atol=1e-10)
        assert torch.isfinite(out).all()
        assert (out[2] == 0).all()
        for a, b in zip(_grads(out, [*q, *k, v]), g_ref):
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("impl", ["reference", *EXACT])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_gradcheck(impl, causal):
    require(impl)
    q, k, v, theta, mask = make_inputs(7, 3, 2, B=2, H=2, d=3, d_v=2, padded=True, seed=5)
    inputs = [*q, *k, v, theta]
    for t in inputs:
        t.requires_grad_(True)

    def fn(q0, q1, q2, k0, k1, k2, v, theta):
        lam = torch.softmax(theta, -1)
        return hkt_attention(
            [q0, q1, q2], [k0, k1, k2], v, lam, causal=causal, key_padding_mask=mask, impl=impl
        )

    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["reference", *EXACT])
def test_low_precision_error_bounded_by_same_precision_baseline(dtype, impl):
    """Each path in low precision is at most 2x (plus a floor) as far from the float64 truth as
    plain SDPA attention is in the same precision."""
    require(impl)
    q, k, v, theta, mask = make_inputs(97, 3, 2, B=2, H=2, d=16, d_v=16, padded=True)
    lam = torch.softmax(theta, -1)
    truth = hkt_attention(q, k, v, lam, key_padding_mask=mask, impl="reference")
    low = hkt_attention(
        [t.to(dtype) for t in q],
        [t.to(dtype) for t in k],
        v.to(dtype),
        lam.to(dtype),
        key_padding_mask=mask,
        impl=impl,
    )
    assert low.dtype == dtype
    err = (low.double() - truth).abs().max().item()
    sdpa_truth = F.scaled_dot_product_attention(q[0], k[0], v, is_causal=True)
    sdpa_low = F.scaled_dot_product_attention(
        q[0].to(dtype), k[0].to(dtype), v.to(dtype), is_causal=True
    )
    baseline = (sdpa_low.double() - sdpa_truth).abs().max().item()
    assert err <= 2 * baseline + 4 * torch.finfo(dtype).eps, (err, baseline)


@pytest.mark.parametrize("impl", ["reference", *EXACT])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_single_level_weight_is_standard_attention(impl, causal):
    """lambda = e_0 (any L) is exactly SDPA on level 0 (Prop. 3.4)."""
    require(impl)
    q, k, v, _, _ = make_inputs(37, 3, 2)
    lam = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    out = hkt_attention(q, k, v, lam, causal=causal, impl=impl)
    expected = F.scaled_dot_product_attention(q[0], k[0], v, is_causal=causal)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_coarsest_level_only_gives_block_constant_scores():
    """lambda = e_{L-1}: the fused score depends only on (i // s^(L-1), j // s^(L-1))."""
    q, k, _, _, _ = make_inputs(24, 3, 2)
    scores = hkt_scores(q, k, torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64))
    blocks = scores.unflatten(-1, (6, 4)).unflatten(-3, (6, 4))  # (B, H, 6, 4, 6, 4)
    assert torch.equal(blocks, blocks[:, :, :, :1, :, :1].expand_as(blocks))


def test_level_weights_shared_or_per_head_agree():
    q, k, v, theta, _ = make_inputs(20, 2, 2, H=3)
    lam = torch.softmax(theta[0], -1)  # (L,)
    a = hkt_attention(q, k, v, lam)
    b = hkt_attention(q, k, v, lam.expand(3, -1))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("impl", ["reference", *EXACT])
def test_causality_by_perturbation_functional(impl):
    """Changing fine positions >= t (and coarse rows only they use) never changes outputs < t."""
    require(impl)
    T, L, s = 50, 3, 2
    q, k, v, theta, _ = make_inputs(T, L, s)
    lam = torch.softmax(theta, -1)
    base = hkt_attention(q, k, v, lam, impl=impl)
    for t in (1, 13, 32, 49):
        q2 = [x.clone() for x in q]
        k2 = [x.clone() for x in k]
        for l in range(L):
            first_future = (t - 1) // s**l + 1  # coarse rows used only by positions >= t
            q2[l][:, :, first_future:] += 10.0
            k2[l][:, :, first_future:] -= 10.0
        v2 = v.clone()
        v2[:, :, t:] *= -3.0
        out = hkt_attention(q2, k2, v2, lam, impl=impl)
        torch.testing.assert_close(out[:, :, :t], base[:, :, :t], rtol=1e-12, atol=1e-12)
        assert not torch.allclose(out[:, :, t:], base[:, :, t:])


def _valid():
    q, k, v, theta, _ = make_inputs(10, 3, 2)
    return q, k, v, torch.softmax(theta, -1)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda q, k, v, lam: (q[:2], k, v, lam, {}), "q has 2 levels but k has 3"),
        (
            lambda q, k, v, lam: ([q[0], q[1], q[2][:, :, :2]], k, v, lam, {}),
            r"q\[2\] has shape",
        ),
        (lambda q, k, v, lam: (q, k, v, lam, {"stride": 3}), r"q\[1\] has shape"),
        (lambda q, k, v, lam: (q, k, v, lam, {"stride": 1}), "stride must be >= 2"),
        (lambda q, k, v, lam: (q, k, v, -lam, {}), "non-negative"),
        (lambda q, k, v, lam: (q, k, v, lam * 0.5, {}), "sum to 1"),
        (lambda q, k, v, lam: (q, k, v, lam[:, :2], {}), "level_weights must have shape"),
        (lambda q, k, v, lam: (q, k, v, lam[:1].expand(5, 3), {}), "level_weights must have"),
        (
            lambda q, k, v, lam: (q, k, v, lam, {"key_padding_mask": torch.ones(2, 9) > 0}),
            "key_padding_mask must have shape",
        ),
        (
            lambda q, k, v, lam: (q, k, v, lam, {"key_padding_mask": torch.ones(2, 10)}),
            "key_padding_mask must be bool",
        ),
        (lambda q, k, v, lam: (q, k, v, lam, {"impl": "nope"}), "impl must be one of"),
        (lambda q, k, v, lam: (q[0], k, v, lam, {}), "sequences of per-level tensors"),
        (lambda q, k, v, lam: ([], [], v, lam, {}), "at least one level"),
    ],
)
def test_bad_input_raises_value_error(mutate, match):
    q, k, v, lam, kwargs = mutate(*_valid())
    with pytest.raises(ValueError, match=match):
        hkt_attention(q, k, v, lam, **kwargs)


def test_level_lengths_any_T():
    assert level_lengths(1025, 4, 2) == [1025, 513, 257, 129]
    assert level_lengths(1, 3, 3) == [1, 1, 1]
    assert level_lengths(10, 3, 3) == [10, 4, 2]


def test_cost_model():
    c = hkt_cost(3, 2)
    assert c.paper_score_ratio == pytest.approx(1.3125)
    assert c.paper_bound == pytest.approx(4 / 3)
    assert c.fast_score_ratio == 3.0
    assert c.fused_total_ratio == pytest.approx((1.3125 + 1) / 2)
    # Any L stays under the bound; L = 1 costs exactly standard attention.
    assert all(
        hkt_cost(L, s).paper_score_ratio < hkt_cost(L, s).paper_bound
        for L in range(1, 9)
        for s in (2, 3, 4)
    )
    assert hkt_cost(1, 2).paper_score_ratio == 1.0 == hkt_cost(1, 2).fast_total_ratio
    # Exact lengths: T = 5, L = 2, s = 2 -> T_1 = 3.
    exact = hkt_cost(2, 2, seq_len=5, head_dim=8)
    assert exact.paper_score_ratio == pytest.approx((25 + 9) / 25)
    assert exact.mha_flops == 4 * 25 * 8
    assert math.isclose(hkt_cost(3, 2, seq_len=4096).paper_score_ratio, 1.3125)


# ---------------------------------------------------------------------- odd input, every impl

ALL = ("reference", *EXACT)


def _same_as_reference(outs):
    ref = outs["reference"]
    for impl, out in outs.items():
        assert torch.equal(torch.isnan(out), torch.isnan(ref)), impl
        finite = ~torch.isnan(ref)
        torch.testing.assert_close(out[finite], ref[finite], rtol=1e-10, atol=1e-10, msg=impl)


@pytest.mark.parametrize("where", ["query", "key", "value", "coarse_key"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_nan_input_gives_the_reference_nans_on_every_path(where, causal):
    q, k, v, theta, _ = make_inputs(37, 3, 2)
    lam = torch.softmax(theta, -1)
    target = {"query": q[0], "key": k[0], "value": v, "coarse_key": k[1]}[where]
    target[0, 1, 9, 0] = math.nan
    outs = {
        impl: hkt_attention(q, k, v, lam, causal=causal, impl=impl)
        for impl in ("reference", *available(EXACT))
    }
    assert torch.isnan(outs["reference"]).any() and not torch.isnan(outs["reference"]).all()
    _same_as_reference(outs)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_level_weights_give_the_reference_nans_on_every_path(bad):
    """A diverged run's weights: no error (the loss reports it), NaN outputs on every path
    (the C++ kernel alone returned finite, wrong values)."""
    q, k, v, theta, _ = make_inputs(21, 3, 2)
    lam = torch.softmax(theta, -1)
    lam[0, 1] = bad
    impls = ("reference", *available(EXACT))
    outs = {impl: hkt_attention(q, k, v, lam, impl=impl) for impl in impls}
    assert torch.isnan(outs["reference"][:, 0]).all()  # head 0 is NaN throughout
    _same_as_reference(outs)


@pytest.mark.parametrize("impl", ALL)
def test_integer_inputs_are_errors(impl):
    q, k, v, theta, _ = make_inputs(9, 2, 2)
    lam = torch.softmax(theta, -1)
    as_int = lambda xs: [x.long() for x in xs]  # noqa: E731
    with pytest.raises(ValueError, match="floating-point"):
        hkt_attention(as_int(q), as_int(k), v.long(), lam, impl=impl)


@pytest.mark.parametrize("impl", ALL)
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"causal": "no"}, "causal must be True or False"),
        ({"stride": 2.0}, "stride must be an integer"),
        ({"stride": True}, "stride must be an integer"),
    ],
)
def test_bad_flags_are_clear_errors(impl, kwargs, match):
    q, k, v, theta, _ = make_inputs(8, 1, 2)
    with pytest.raises(ValueError, match=match):
        hkt_attention(q, k, v, torch.softmax(theta, -1), impl=impl, **kwargs)


@pytest.mark.parametrize("stride, T, n_levels", [(100, 128, 3), (1000, 50, 3), (7, 30, 4)])
def test_strides_longer_than_the_sequence_stay_exact_and_small(stride, T, n_levels):
    """Coarse levels of one token cannot change the softmax: the blockwise kernels drop them
    (tiles stay ~T instead of stride^(L-1)) and still give their exact zero gradients."""
    q, k, v, theta, mask = make_inputs(T, n_levels, stride, padded=True)
    lam = torch.softmax(theta, -1)
    for t in (*q, *k, v, lam):
        t.requires_grad_(True)
    ref = hkt_attention(q, k, v, lam, stride=stride, key_padding_mask=mask, impl="reference")
    g_ref = _grads(ref, [*q, *k, v, lam])
    for impl in available(EXACT):
        out = hkt_attention(q, k, v, lam, stride=stride, key_padding_mask=mask, impl=impl)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
        for a, b in zip(_grads(out, [*q, *k, v, lam]), g_ref):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_the_blockwise_tile_never_exceeds_the_sequence_for_long_strides():
    from structattn.hkt.levels import effective_levels, round_tile

    assert effective_levels(128, 3, 100) == 2 and round_tile(128, 2, 100) == 200
    assert effective_levels(50, 3, 1000) == 1 and round_tile(50, 1, 1000) == 50
    assert effective_levels(4096, 3, 2) == 3


def test_fast_is_a_deprecated_name_of_sdpa():
    q, k, v, theta, _ = make_inputs(20, 3, 2)
    lam = torch.softmax(theta, -1)
    with pytest.warns(DeprecationWarning, match="impl='sdpa'"):
        old = hkt_attention(q, k, v, lam, impl="fast")
    assert torch.equal(old, hkt_attention(q, k, v, lam, impl="sdpa"))


def test_without_impl_the_call_runs_the_auto_choice(monkeypatch):
    """No ``impl``: the path ``auto`` names for the device (the C++ kernel on the CPU when it
    builds, SDPA with dropout), never the T x T reference."""
    from structattn.hkt import ATTENTION_IMPLS, resolve_impl

    ran = []
    for name, fn in list(ATTENTION_IMPLS.items()):
        if fn is not None:
            spy = lambda *a, _n=name, _f=fn: (ran.append(_n), _f(*a))[1]  # noqa: E731
            monkeypatch.setitem(ATTENTION_IMPLS, name, spy)
    q, k, v, theta, _ = make_inputs(20, 3, 2)
    lam = torch.softmax(theta, -1)
    hkt_attention(q, k, v, lam)
    hkt_attention(q, k, v, lam, dropout_p=0.1)
    assert ran == [resolve_impl("auto", "cpu"), resolve_impl("auto", "cpu", 0.1)]
    assert "reference" not in ran and ran[1] == "sdpa"


@pytest.mark.parametrize("impl", ALL)
@pytest.mark.parametrize("scale", [0.0, -0.5, math.nan, math.inf, True])
def test_a_scale_that_is_not_finite_and_positive_is_one_error_on_every_path(impl, scale):
    """scale 0 or < 0 gave NaN on the SDPA path where the reference was finite, and NaN gave
    finite numbers on the C++ path: every path now refuses it the same way."""
    q, k, v, theta, _ = make_inputs(8, 2, 2)
    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        hkt_attention(q, k, v, torch.softmax(theta, -1), impl=impl, scale=scale)


@pytest.mark.parametrize("impl", ALL)
def test_a_positive_scale_matches_the_reference_on_every_path(impl):
    q, k, v, theta, _ = make_inputs(12, 2, 2)
    lam = torch.softmax(theta, -1)
    ref = hkt_attention(q, k, v, lam, impl="reference", scale=0.3)
    torch.testing.assert_close(hkt_attention(q, k, v, lam, impl=impl, scale=0.3), ref)
    assert not torch.allclose(ref, hkt_attention(q, k, v, lam, impl="reference"))


@pytest.mark.parametrize("impl", ALL)
def test_a_head_dim_of_zero_is_one_error(impl):
    q, k, v, theta, _ = make_inputs(8, 2, 2)
    lam = torch.softmax(theta, -1)
    empty = lambda xs: [x[..., :0] for x in xs]  # noqa: E731
    with pytest.raises(ValueError, match="head dims must be >= 1"):
        hkt_attention(empty(q), empty(k), v, lam, impl=impl)
    with pytest.raises(ValueError, match="head dims must be >= 1"):
        hkt_attention(q, k, v[..., :0], lam, impl=impl)


def test_the_layer_runs_forward_and_backward_on_the_meta_device():
    """The SDPA path makes no data-dependent host decision: on `meta` tensors (no data) any
    bool(tensor) or .item() would raise."""
    from structattn.hkt import HKTAttention, HKTConfig

    layer = HKTAttention(HKTConfig(d_model=32, n_heads=4, n_levels=3, causal=True, impl="sdpa"))
    layer = layer.to("meta")
    x = torch.randn(2, 40, 32, device="meta", requires_grad=True)
    y = layer(x)
    assert y.shape == (2, 40, 32) and y.device.type == "meta"
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
def test_projection_views_give_outputs_in_their_layout(dtype, padded):
    """q, k, v as views of one ``(B, T, 3 H d)`` projection (what the layer passes): the
    blockwise kernel's output comes back as ``(B, T, H, d)`` memory, so the caller's
    ``transpose(1, 2).reshape(B, T, H * d)`` is a view and no copy is made; the values equal
    those of contiguous inputs, padded or not."""
    if dtype == torch.bfloat16:
        from structattn.hkt.kernels.fused_cpp import lowp_route

        if not (lowp_route(torch.bfloat16) or "").startswith("brgemm"):
            pytest.skip("no bfloat16 batch-reduce GEMM on this CPU")
    impl = available(["fused_cpp"])
    if not impl:
        pytest.skip("the C++ kernel could not be built here")
    B, H, T, d = 2, 4, 40, 8
    g = torch.Generator().manual_seed(0)
    proj = torch.randn(B, T, 3 * H * d, generator=g).to(dtype)
    q0, k0, v = (t.view(B, T, H, d).transpose(1, 2) for t in proj.split(H * d, -1))
    q1 = torch.randn(B, H, T // 2, d, generator=g).to(dtype)
    k1 = torch.randn(B, H, T // 2, d, generator=g).to(dtype)
    lam = torch.softmax(torch.randn(H, 2, generator=g), -1)
    mask = torch.ones(B, T, dtype=torch.bool)
    if padded:
        mask[1, 25:] = False
    kw = dict(stride=2, causal=False, key_padding_mask=mask, impl="fused_cpp")
    out = hkt_attention([q0, q1], [k0, k1], v, lam, **kw)
    assert out.transpose(1, 2).is_contiguous()
    dense = hkt_attention([q0.contiguous(), q1], [k0.contiguous(), k1], v.contiguous(), lam, **kw)
    assert torch.equal(out, dense)


def test_zero_padded_false_leaves_padded_rows_and_keeps_real_ones():
    """``zero_padded=False`` skips only the zeroing of padded query rows: real rows are equal
    to the default call's, padded rows are finite (they attend the real keys)."""
    q, k, v, theta, _ = make_inputs(33, 3, 2, seed=0)
    lam = torch.softmax(theta, -1)
    mask = torch.ones(2, 33, dtype=torch.bool)
    mask[0, 20:] = False
    for impl in available(EXACT):
        kw = dict(stride=2, causal=True, key_padding_mask=mask, impl=impl)
        zeroed = hkt_attention(q, k, v, lam, **kw)
        kept = hkt_attention(q, k, v, lam, zero_padded=False, **kw)
        real = mask[:, None, :, None].expand_as(kept)
        assert torch.equal(kept[real], zeroed[real])
        assert (zeroed[~real] == 0).all() and torch.isfinite(kept).all()
    for impl in available(["reference", *EXACT]):  # a dense output stays contiguous
        out = hkt_attention(q, k, v, lam, stride=2, causal=True, key_padding_mask=mask, impl=impl)
        if not out.transpose(1, 2).is_contiguous():
            assert out.is_contiguous(), impl


def test_tracing_a_training_layer_skips_the_recomputation():
    """``torch.jit.trace`` of a layer with gradients on traces the plain level path (the
    checkpoint's recomputation would make the traced graphs differ)."""
    from structattn.hkt import HKTAttention, HKTConfig

    layer = HKTAttention(HKTConfig(d_model=16, n_heads=4, n_levels=3, causal=True)).train()
    x = torch.randn(2, 24, 16, requires_grad=True)
    traced = torch.jit.trace(layer, (x,))
    torch.testing.assert_close(traced(x), layer(x))
