"""HKTAttention: exactness of the fast path, causality, padding, special cases (Prop. 3.4)."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from structattn.hkt import CausalDownsample, HKTAttention, HKTConfig


def make_layer(seed=0, dtype=torch.float64, **overrides):
    cfg = dict(d_model=16, n_heads=4, n_levels=3, stride=2, causal=True, hybrid=True)
    cfg.update(overrides)
    torch.manual_seed(seed)
    layer = HKTAttention(HKTConfig(**cfg)).to(dtype).eval()
    with torch.no_grad():  # move the level weights and beta off their symmetric init
        layer.level_logits.normal_()
        if hasattr(layer, "beta_logits"):
            layer.beta_logits.normal_()
    return layer


def _randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("T", [1, 2, 37, 97])
def test_fast_layer_matches_reference_layer(T, causal):
    fast = make_layer(causal=causal, impl="sdpa")
    ref = copy.deepcopy(fast)
    ref.config.impl = "reference"
    x = _randn(2, T, 16)
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[1, (T + 1) // 2 :] = False
    y_fast, y_ref = fast(x, mask), ref(x, mask)
    torch.testing.assert_close(y_fast, y_ref, rtol=1e-10, atol=1e-10)
    upstream = _randn(*y_fast.shape, seed=1)
    g_fast = torch.autograd.grad(y_fast, list(fast.parameters()), upstream)
    g_ref = torch.autograd.grad(y_ref, list(ref.parameters()), upstream)
    for (name, _), a, b in zip(fast.named_parameters(), g_fast, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=name)


@settings(max_examples=25, deadline=None, derandomize=True)  # reproducible in CI
@given(
    T=st.integers(2, 70),
    n_levels=st.integers(1, 4),
    stride=st.integers(2, 3),
    kernel=st.integers(1, 5),
    hybrid=st.booleans(),
    impl=st.sampled_from(["sdpa", "auto", "reference"]),
    data=st.data(),
)
def test_layer_causality_by_perturbation(T, n_levels, stride, kernel, hybrid, impl, data):
    """Changing positions >= t never changes outputs < t (downsampling, levels and conv)."""
    t = data.draw(st.integers(1, T - 1), label="t")
    layer = make_layer(
        n_levels=n_levels,
        stride=stride,
        downsample_kernel=kernel,
        conv_kernel=kernel,
        hybrid=hybrid,
        impl=impl,
    )
    x = _randn(2, T, 16)
    x2 = x.clone()
    x2[:, t:] = _randn(2, T - t, 16, seed=7) * 5
    y, y2 = layer(x), layer(x2)
    torch.testing.assert_close(y2[:, :t], y[:, :t], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(y2[:, t:], y[:, t:])


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_padding_never_changes_real_positions(causal):
    """A right-padded batch gives, at real positions, exactly the unpadded per-sequence outputs;
    padded positions are 0 whatever the padding holds."""
    layer = make_layer(causal=causal)
    lengths = [23, 9, 1]
    x = _randn(3, 23, 16)
    x[1, 9:] = 1e3  # garbage in the padding
    x[2, 1:] = -1e3
    mask = torch.arange(23)[None] < torch.tensor(lengths)[:, None]
    y = layer(x, mask)
    for b, n in enumerate(lengths):
        alone = layer(x[b : b + 1, :n])
        torch.testing.assert_close(y[b : b + 1, :n], alone, rtol=1e-10, atol=1e-10)
        assert (y[b, n:] == 0).all()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("impl", ["sdpa", "auto", "reference"])
def test_one_level_without_conv_is_multihead_attention(impl, causal):
    """Prop. 3.4: L = 1, beta = 1 equals torch's nn.MultiheadAttention with the same weights."""
    layer = make_layer(n_levels=1, hybrid=False, impl=impl, causal=causal)
    mha = nn.MultiheadAttention(16, 4, batch_first=True, dtype=torch.float64).eval()
    with torch.no_grad():
        mha.in_proj_weight.copy_(
            torch.cat([layer.q_proj[0].weight, layer.k_proj[0].weight, layer.v_proj.weight])
        )
        mha.in_proj_bias.copy_(
            torch.cat([layer.q_proj[0].bias, layer.k_proj[0].bias, layer.v_proj.bias])
        )
        mha.out_proj.weight.copy_(layer.o_proj.weight)
        mha.out_proj.bias.copy_(layer.o_proj.bias)
    x = _randn(2, 31, 16)
    blocked = torch.ones(31, 31, dtype=torch.bool).triu(1) if causal else None
    expected, _ = mha(x, x, x, attn_mask=blocked, need_weights=False)
    torch.testing.assert_close(layer(x), expected, rtol=1e-10, atol=1e-10)


def test_beta_zero_is_the_causal_convolution():
    """Prop. 3.4: beta = 0 leaves only W_O(CausalDWConv(X W_V)); attention has no effect."""
    layer = make_layer(learn_beta=False, beta_init=0.0)
    x = _randn(2, 40, 16)
    y = layer(x)
    expected = layer.o_proj(layer.conv(layer.v_proj(x)))
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)  # GEMM layouts differ
    with torch.no_grad():  # the attention parameters then have no effect at all
        for proj in (*layer.q_proj, *layer.k_proj):
            proj.weight.normal_()
        layer.level_logits.normal_()
    torch.testing.assert_close(layer(x), y, rtol=0, atol=0)
    # Independent check of the branch itself: a causal depthwise conv by explicit sums.
    v = layer.v_proj(x)
    w = layer.conv.conv.weight[:, 0]  # (D, k)
    k = w.shape[-1]
    manual = torch.zeros_like(v)
    for t in range(40):
        for j in range(k):  # weight j multiplies input t - (k - 1 - j)
            src = t - (k - 1 - j)
            if src >= 0:
                manual[:, t] += w[:, j] * v[:, src]
    manual += layer.conv.conv.bias
    torch.testing.assert_close(layer.conv(v), manual, rtol=1e-12, atol=1e-12)


def test_beta_one_fixed_equals_non_hybrid():
    a = make_layer(learn_beta=False, beta_init=1.0, seed=3)
    b = make_layer(hybrid=False, seed=3)
    b.load_state_dict({k: v for k, v in a.state_dict().items() if k in b.state_dict()})
    x = _randn(2, 25, 16)
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)


def test_level_weights_are_convex_and_beta_in_unit_interval():
    layer = make_layer(n_levels=4)
    lam = layer.level_weights()
    assert lam.shape == (4, 4)
    assert (lam >= 0).all()
    torch.testing.assert_close(lam.sum(-1), torch.ones(4, dtype=lam.dtype))
    beta = layer.beta()
    assert beta.shape == (4,) and ((beta > 0) & (beta < 1)).all()
    fresh = HKTAttention(HKTConfig(d_model=16, n_heads=4, beta_init=0.7))
    torch.testing.assert_close(fresh.beta(), torch.full((4,), 0.7))
    torch.testing.assert_close(fresh.level_weights(), torch.full((4, 3), 1 / 3))


def test_downsampler_lengths_and_alignment():
    """ceil(T/s) outputs; coarse token c reads fine positions <= c*s only."""
    down = CausalDownsample(8, kernel_size=4, stride=3).double()
    for T in (1, 2, 3, 4, 10, 11):
        assert down(_randn(1, T, 8)).shape == (1, -(-T // 3), 8)
    x = _randn(1, 12, 8)
    base = down(x)
    for c in range(4):
        x2 = x.clone()
        x2[:, c * 3 + 1 :] += 1.0
        torch.testing.assert_close(down(x2)[:, : c + 1], base[:, : c + 1], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_runs_in_low_precision_and_backpropagates(dtype):
    layer = make_layer(dtype=dtype).train()
    x = _randn(2, 33, 16, dtype=dtype).requires_grad_(True)
    y = layer(x)
    assert y.dtype == dtype and torch.isfinite(y).all()
    y.float().square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())
    assert layer.level_logits.grad.abs().sum() > 0


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_layers_decide_nothing_from_data_on_the_meta_device(causal):
    """No host synchronisation inside the layers' forward and backward: on the ``meta`` device
    every data-dependent host decision (``bool(tensor)``, ``.item()``, ``.tolist()``) raises, so
    the SDPA paths of HKTAttention and of the MHA twin must run there, masked or not."""
    from structattn.hkt import MultiHeadAttention

    cfg = HKTConfig(d_model=16, n_heads=4, n_levels=3, stride=2, causal=causal, impl="sdpa")
    with torch.device("meta"):
        layers = [HKTAttention(cfg), MultiHeadAttention(16, 4, causal)]
        x = torch.randn(2, 37, 16, requires_grad=True)
        mask = torch.ones(2, 37, dtype=torch.bool)
    for layer in layers:
        hinted = {"key_padding_mask": mask, "right_padded": True}
        for kw in ({}, {"key_padding_mask": mask}, hinted):
            y = layer(x, **kw)
            assert y.shape == (2, 37, 16) and y.device.type == "meta"
            y.sum().backward()
            assert all(p.grad is not None for p in layer.parameters())


@pytest.mark.parametrize("impl", ["sdpa", "fused_cpp"])
def test_right_padded_hint_changes_no_value(impl):
    """``right_padded`` picks the causal SDPA path without reading the mask; both paths (and
    a wrong ``False``, the path exact for any padding) give the same outputs."""
    from structattn.hkt import MultiHeadAttention

    layer = make_layer(impl=impl)
    mha = MultiHeadAttention(16, 4, causal=True).double()
    x = _randn(3, 29, 16)
    mask = torch.arange(29)[None] < torch.tensor([29, 11, 1])[:, None]  # right-padded
    for m in (layer, mha):
        base = m(x, key_padding_mask=mask)
        for hint in (True, False):
            torch.testing.assert_close(m(x, key_padding_mask=mask, right_padded=hint), base)


def test_models_read_the_mask_layout_once_not_per_layer(monkeypatch):
    """The encoder reads the padding layout once per forward pass and hands it to every
    layer, so no layer reads a mask back (the check inside the SDPA call is never reached)."""
    from structattn.hkt import ModelConfig
    from structattn.hkt.kernels import sdpa as sdpa_module
    from structattn.hkt.model import CausalLM

    calls = []
    real = sdpa_module.is_right_padded
    monkeypatch.setattr(sdpa_module, "is_right_padded", lambda m: calls.append(1) or real(m))
    for attention in ("hkt", "mha"):
        cfg = ModelConfig(vocab_size=11, max_len=32, d_model=16, n_layers=3,
                          n_heads=4, attention=attention, causal=True, dropout=0.0)  # fmt: skip
        model = CausalLM(cfg).eval()
        tokens = torch.randint(1, 11, (2, 20))
        mask = torch.arange(20)[None] < torch.tensor([20, 7])[:, None]
        model(tokens, mask)
    assert calls == []


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(d_model=30, n_heads=4), "divisible by n_heads"),
        (dict(n_levels=0), "n_levels must be >= 1"),
        (dict(stride=1), "stride must be >= 2"),
        (dict(impl="flash9"), "impl must be one of"),
        (dict(beta_init=1.0), "beta_init must be in \\(0, 1\\)"),
        (dict(learn_beta=False, beta_init=1.5), "beta_init must be in \\[0, 1\\]"),
        (dict(dropout=1.0), "dropout must be in"),
        (dict(conv_kernel=0), "conv_kernel must be >= 1"),
    ],
)
def test_bad_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HKTConfig(**kwargs)


def test_bad_layer_input_raises():
    layer = make_layer()
    with pytest.raises(ValueError, match="x must have shape"):
        layer(_randn(2, 5, 8))
    with pytest.raises(ValueError, match="key_padding_mask must have shape"):
        layer(_randn(2, 5, 16), torch.ones(2, 6, dtype=torch.bool))


@pytest.mark.parametrize("impl", ["sdpa", "auto", "fused_torch", "reference"])
def test_empty_sequence_gives_an_empty_output(impl):
    layer = make_layer(impl=impl).train()
    x = torch.zeros(2, 0, 16, dtype=torch.float64, requires_grad=True)
    y = layer(x, key_padding_mask=torch.zeros(2, 0, dtype=torch.bool))
    assert y.shape == (2, 0, 16)
    y.sum().backward()
    assert x.grad.shape == (2, 0, 16)


def test_layer_config_rejects_bad_flags():
    with pytest.raises(ValueError, match="stride must be an integer"):
        HKTConfig(stride=2.0)
    with pytest.raises(ValueError, match="causal must be True or False"):
        HKTConfig(causal="no")


@pytest.mark.parametrize("T", [0, 1, 2, 5, 17])
@pytest.mark.parametrize("stride", [1, 2, 3])
@pytest.mark.parametrize("kernel", [1, 2, 3, 4])
@pytest.mark.parametrize("path", ["conv2d", "compiled"])
def test_causal_depthwise_conv_is_the_left_padded_conv1d(T, stride, kernel, path, monkeypatch):
    """Both implementations (channels-last conv2d, the compiled loops) against the textbook
    one: pad K - 1 zeros on the left of (B, D, T), depthwise conv1d with stride s; forward and
    gradients in float64, with and without bias, input rows strided (a slice of a wider
    tensor, as the layer passes V)."""
    import torch.nn.functional as F

    from structattn.hkt import CausalDepthwiseConv
    from structattn.hkt.kernels.extension import cpu_kernel

    if path == "compiled" and cpu_kernel() is None:
        pytest.skip("the C++ kernel could not be built here")
    monkeypatch.setattr(CausalDepthwiseConv, "cpp", path == "compiled")
    torch.manual_seed(0)
    for bias in (True, False):
        conv = CausalDepthwiseConv(6, kernel, stride, bias=bias).double()
        wide = torch.randn(2, T, 15, dtype=torch.float64, requires_grad=True)
        x = wide[:, :, 4:10]  # rows 15 apart
        y = conv(x)
        if T == 0:
            assert y.shape == (2, 0, 6)
            continue
        ref = F.conv1d(
            F.pad(x.transpose(1, 2), (kernel - 1, 0)),
            conv.conv.weight,
            conv.conv.bias,
            stride=stride,
            groups=6,
        ).transpose(1, 2)
        assert y.shape == ref.shape == (2, -(-T // stride), 6)
        torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
        g = torch.randn_like(ref)
        params = [wide, *conv.parameters()]
        for a, b in zip(torch.autograd.grad(y, params, g), torch.autograd.grad(ref, params, g)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_compiled_conv_runs_where_expected_and_keeps_nan(monkeypatch):
    """The compiled convolution is what CPU layers run (counted): float32 / float64 in their
    dtype, bfloat16 / float16 (autocast's projections) in float32, cast back; ``cpp=False``
    uses conv2d. NaN and inf inputs give what conv2d gives."""
    from structattn.hkt import CausalDepthwiseConv
    from structattn.hkt import downsample as ds
    from structattn.hkt.kernels.extension import cpu_kernel

    if cpu_kernel() is None:
        pytest.skip("the C++ kernel could not be built here")
    calls = []
    real = ds._CompiledCausalConv.apply
    monkeypatch.setattr(ds._CompiledCausalConv, "apply", lambda *a: calls.append(1) or real(*a))
    conv = CausalDepthwiseConv(4, 3, 2)
    conv(torch.randn(1, 9, 4))
    assert len(calls) == 1
    xb = torch.randn(2, 9, 4, dtype=torch.bfloat16, requires_grad=True)
    got_b = conv(xb)  # float32 weights, a bfloat16 input (as under autocast)
    assert len(calls) == 2 and got_b.dtype == torch.bfloat16
    got_b.float().sum().backward()
    assert xb.grad.dtype == torch.bfloat16 and conv.conv.weight.grad.dtype == torch.float32
    x = torch.randn(2, 9, 4)
    x[0, 3, 1] = float("nan")
    x[1, 5, 2] = float("inf")
    got = conv(x)
    monkeypatch.setattr(CausalDepthwiseConv, "cpp", False)
    ref = conv(x)
    ref_b = conv(xb.detach().float()).to(torch.bfloat16)  # conv2d in float32, rounded once
    assert len(calls) == 3
    assert torch.equal(got.isnan(), ref.isnan())
    torch.testing.assert_close(got, ref, equal_nan=True)
    torch.testing.assert_close(got_b, ref_b, rtol=0, atol=0)


def test_compiled_conv_saves_a_reduced_input_as_given_with_float32_gradients():
    """A bfloat16 input is widened for the float32 kernel but saved for backward as given
    (no float32 copy kept alive), and its gradients are exactly those of convolving the
    float32 copy."""
    from structattn.hkt import CausalDepthwiseConv
    from structattn.hkt.kernels.extension import cpu_kernel

    if cpu_kernel() is None:
        pytest.skip("the C++ kernel could not be built here")
    torch.manual_seed(0)
    conv = CausalDepthwiseConv(8, 3, 1)
    xb = torch.randn(2, 33, 8).to(torch.bfloat16).requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = conv(xb)
    assert all(t.dtype != torch.float32 or t.numel() == 8 * 3 for t in saved)
    g = torch.randn(y.shape).to(torch.bfloat16)
    got = torch.autograd.grad(y, [xb, *conv.parameters()], g)
    xf = xb.detach().float().requires_grad_(True)
    yf = conv(xf)
    want = torch.autograd.grad(yf.to(torch.bfloat16), [xf, *conv.parameters()], g)
    assert torch.equal(y, yf.to(torch.bfloat16))
    assert torch.equal(got[0], want[0].to(torch.bfloat16))
    for a, b in zip(got[1:], want[1:]):
        assert torch.equal(a, b)


def test_fixed_level_weights_stay_uniform_and_are_not_parameters():
    layer = HKTAttention(HKTConfig(d_model=16, n_heads=4, n_levels=3, learn_levels=False))
    assert "level_logits" not in dict(layer.named_parameters())
    assert "level_logits" in layer.state_dict()  # saved and loaded with the weights
    torch.testing.assert_close(layer.level_weights(), torch.full((4, 3), 1 / 3))
    opt = torch.optim.SGD(layer.parameters(), lr=1.0)
    layer(torch.randn(2, 9, 16)).square().sum().backward()
    opt.step()
    torch.testing.assert_close(layer.level_weights(), torch.full((4, 3), 1 / 3))


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_recomputed_levels_give_the_same_values_and_gradients_bit_for_bit(precision):
    """``recompute_levels`` (coarse levels rebuilt in backward) against keeping them: outputs
    and every gradient equal exactly, in float32 and under bfloat16 autocast, with padding."""
    grads, outs = {}, {}
    x = _randn(2, 45, 16, dtype=torch.float32)
    mask = torch.ones(2, 45, dtype=torch.bool)
    mask[1, 30:] = False
    for recompute in (True, False):
        layer = make_layer(dtype=torch.float32, recompute_levels=recompute, causal=False).train()
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bfloat16"):
            y = layer(xi, key_padding_mask=mask)
        y.float().square().sum().backward()
        outs[recompute] = y.detach()
        grads[recompute] = [xi.grad, *(p.grad for p in layer.parameters())]
    assert torch.equal(outs[True], outs[False])
    for a, b in zip(grads[True], grads[False]):
        assert torch.equal(a, b)


def test_recomputed_levels_keep_less_alive_in_a_training_step():
    """The memory the recomputation is for: peak tensor bytes of forward + backward drop."""
    from structattn.utils import TensorMemoryTracker

    x = _randn(4, 256, 16, dtype=torch.float32)
    peaks = {}
    for recompute in (True, False):
        layer = make_layer(dtype=torch.float32, recompute_levels=recompute).train()
        with TensorMemoryTracker() as mem:
            layer(x.clone().requires_grad_(True)).square().sum().backward()
        peaks[recompute] = mem.peak_bytes
    assert peaks[True] < peaks[False]


def test_under_autocast_no_float32_copy_of_the_input_stays_alive_for_backward():
    """The projections and the level path share one bfloat16 copy of a float32 input, so the
    input itself (a LayerNorm output in a block) is freed after the forward pass; the input's
    gradient sums both paths in float32, and stays close to the float32 layer's."""
    from torch.multiprocessing.reductions import StorageWeakRef

    layer = make_layer(dtype=torch.float32).train()
    x0 = _randn(2, 45, 16, dtype=torch.float32).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = x0 * 1.0  # a float32 activation, as a block's LayerNorm output under autocast
        alive = StorageWeakRef(h.untyped_storage())
        y = layer(h)
    del h
    assert alive.expired()
    y.float().square().sum().backward()
    assert x0.grad.dtype == torch.float32
    reference = x0.detach().clone().requires_grad_(True)
    layer(reference).square().sum().backward()
    relative = (x0.grad - reference.grad).norm() / reference.grad.norm()
    assert relative < 0.05  # bfloat16 products (about 3 significant digits) over 45 positions
