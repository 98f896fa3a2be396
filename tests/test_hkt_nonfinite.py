"""Non-finite level weights (a diverged run): every path gives the reference's NaN outputs and
gradients, in float32 too, at every length; the layer and the model turn NaN as well."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import make_inputs, require

from structattn.hkt import HKTAttention, HKTConfig, hkt_attention

#: every non-reference path that runs on the CPU (``auto`` is resolved there)
PATHS = ("auto", "sdpa", "fused_torch", "fused_cpp")
BAD = [math.nan, math.inf, -math.inf]


def _run(impl, q, k, v, lam, causal, mask, upstream):
    """Outputs and gradients with respect to ``q``, ``k``, ``v`` and ``lam``."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (*q, *k, v, lam)]
    L = len(q)
    out = hkt_attention(
        leaves[:L],
        leaves[L : 2 * L],
        leaves[2 * L],
        leaves[-1],
        causal=causal,
        key_padding_mask=mask,
        impl=impl,
    )
    return out, torch.autograd.grad(out, leaves, upstream)


def _bad_inputs(T, bad, padded, level=1):
    q, k, v, theta, mask = make_inputs(T, 3, 2, dtype=torch.float32, padded=padded, seed=T)
    lam = torch.softmax(theta, -1)
    lam[0, level] = bad
    return q, k, v, lam, mask


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("T", [5, 37])
@pytest.mark.parametrize("bad", BAD, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("impl", PATHS)
def test_non_finite_level_weight_gives_the_reference_nans_and_grads(impl, bad, T, causal, padded):
    """float32, short and long rows: the SDPA and blockwise paths zeroed the NaN head (short
    rows) where the reference is NaN; outputs and gradients now have the reference's NaNs and
    its values elsewhere."""
    require(impl)
    q, k, v, lam, mask = _bad_inputs(T, bad, padded, level=2 if T == 5 else 1)
    upstream = torch.randn(2, 2, T, 3, generator=torch.Generator().manual_seed(1))
    ref, ref_grads = _run("reference", q, k, v, lam, causal, mask, upstream)
    real = torch.ones(2, T, dtype=torch.bool) if mask is None else mask
    assert torch.isnan(ref[:, 0][real]).all() and not torch.isnan(ref[:, 1]).any()
    out, grads = _run(impl, q, k, v, lam, causal, mask, upstream)
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    torch.testing.assert_close(out, ref, equal_nan=True)
    assert any(torch.isnan(g).any() for g in ref_grads)
    for i, (g, g_ref) in enumerate(zip(grads, ref_grads)):
        assert torch.equal(torch.isnan(g), torch.isnan(g_ref)), i
        torch.testing.assert_close(g, g_ref, equal_nan=True, msg=f"gradient {i}")


@pytest.mark.parametrize("bad", BAD, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("impl", PATHS)
def test_non_finite_level_weight_without_reading_it_back(impl, bad, monkeypatch):
    """Where the weights are not read back (other devices, or under ``torch.compile``), the
    heads with non-finite weights are made NaN by arithmetic: the reference's NaN outputs, and
    NaN gradients wherever the reference has them."""
    require(impl)
    q, k, v, lam, _ = _bad_inputs(5, bad, padded=False, level=2)
    upstream = torch.randn(2, 2, 5, 3, generator=torch.Generator().manual_seed(1))
    ref, ref_grads = _run("reference", q, k, v, lam, True, None, upstream)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    out, grads = _run(impl, q, k, v, lam, True, None, upstream)
    torch.testing.assert_close(out, ref, equal_nan=True)
    for i, (g, g_ref) in enumerate(zip(grads, ref_grads)):
        assert torch.isnan(g)[torch.isnan(g_ref)].all(), i


@pytest.mark.parametrize("impl", PATHS)
def test_finite_level_weights_keep_every_bit_without_reading_them_back(impl, monkeypatch):
    """The arithmetic that makes non-finite heads NaN multiplies finite outputs by exactly 1."""
    require(impl)
    q, k, v, theta, mask = make_inputs(37, 3, 2, dtype=torch.float32, padded=True)
    lam = torch.softmax(theta, -1)
    base = hkt_attention(q, k, v, lam, key_padding_mask=mask, impl=impl)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert torch.equal(hkt_attention(q, k, v, lam, key_padding_mask=mask, impl=impl), base)


@pytest.mark.parametrize("T", [5, 37])
@pytest.mark.parametrize("impl", PATHS)
def test_layer_with_nan_level_logits_gives_nan(impl, T):
    """A NaN level logit makes its head's weights NaN: the layer's outputs at real positions
    are NaN (the output projection mixes the heads), as with the reference, and so are the
    gradients of that head's level logits."""
    require(impl)
    torch.manual_seed(0)
    layer = HKTAttention(HKTConfig(d_model=16, n_heads=4, n_levels=3, impl=impl))
    with torch.no_grad():
        layer.level_logits[1, 2] = math.nan
    ref = copy.deepcopy(layer)
    ref.config.impl = "reference"
    x = torch.randn(2, T, 16, generator=torch.Generator().manual_seed(2))
    mask = torch.arange(T)[None] < torch.tensor([T, T - 2])[:, None]
    for m in (layer, ref):
        y = m(x, mask)
        assert torch.isnan(y[mask]).all() and (y[~mask] == 0).all()
        y.sum().backward()
        assert torch.isnan(m.level_logits.grad[1]).all()


@pytest.mark.parametrize("impl", ["auto", "sdpa"])
def test_model_with_nan_level_logits_gives_nan_loss(impl):
    """A diverged model cannot look finite: a NaN level logit in one layer gives NaN logits
    and a NaN loss, as the reference does."""
    from structattn.hkt import ModelConfig
    from structattn.hkt.model import SequenceClassifier

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=11, max_len=16, d_model=16, n_layers=2, n_heads=4,
                      dropout=0.0, hkt=HKTConfig(n_levels=3, impl=impl))  # fmt: skip
    model = SequenceClassifier(cfg).eval()
    with torch.no_grad():
        model.encoder.blocks[0].attn.level_logits[0, 0] = math.nan
    tokens = torch.randint(1, 11, (2, 6), generator=torch.Generator().manual_seed(3))
    out = model(tokens, labels=torch.tensor([1, 2]))
    assert torch.isnan(out.logits).all() and torch.isnan(out.loss)
