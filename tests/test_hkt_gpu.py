"""The Triton kernel compiled for a CUDA GPU (skipped without one; `benchmarks/gpu_check.sh`)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from helpers import make_inputs

from structattn.hkt import hkt_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]


def _out_and_grads(impl, q, k, v, theta, mask, causal, stride):
    leaves = [t.detach().clone().requires_grad_(True) for t in (*q, *k, v, theta)]
    L = len(q)
    lam = torch.softmax(leaves[-1], -1)
    out = hkt_attention(
        leaves[:L], leaves[L : 2 * L], leaves[2 * L], lam, stride=stride, causal=causal,
        key_padding_mask=mask, impl=impl,
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    up = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out)
    return out, torch.autograd.grad(out, leaves, up)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize(("T", "n_levels", "stride"), [(1, 3, 2), (37, 3, 2), (300, 2, 4),
                                                       (1025, 3, 2), (700, 4, 2)])  # fmt: skip
def test_triton_on_gpu_matches_reference(T, n_levels, stride, causal, dtype):
    q, k, v, theta, mask = make_inputs(T, n_levels, stride, d=32, d_v=24, padded=True, seed=T)
    ref_out, ref_grads = _out_and_grads("reference", q, k, v, theta, mask, causal, stride)

    def cuda(t):
        return t.to("cuda", dtype)

    out, grads = _out_and_grads(
        "fused_triton", [cuda(x) for x in q], [cuda(x) for x in k], cuda(v), cuda(theta),
        mask.cuda(), causal, stride,
    )  # fmt: skip
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(out.cpu().double(), ref_out, rtol=tol, atol=tol)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.cpu().double(), b, rtol=10 * tol, atol=10 * tol)


def test_triton_bf16_error_bounded_by_flash_attention():
    q, k, v, theta, _ = make_inputs(2048, 3, 2, B=2, H=4, d=64, d_v=64)
    lam = torch.softmax(theta, -1)
    truth = hkt_attention(q, k, v, lam, impl="reference")
    bf = [t.to("cuda", torch.bfloat16) for t in (*q, *k, v)]
    out = hkt_attention(bf[:3], bf[3:6], bf[6], lam.cuda(), impl="fused_triton")
    err = (out.cpu().double() - truth).abs().max().item()
    sdpa = F.scaled_dot_product_attention(bf[0], bf[3], bf[6], is_causal=True)
    base = sdpa.cpu().double() - F.scaled_dot_product_attention(q[0], k[0], v, is_causal=True)
    assert err <= 2 * base.abs().max().item() + 4 * torch.finfo(torch.bfloat16).eps
