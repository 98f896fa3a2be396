"""The fused kernels: C++/OpenMP on the CPU, Triton (in Triton's interpreter), dispatch, fallback.

The 160-case grid of test_hkt_functional.py already runs ``fused_cpp`` with its default tiles;
these tests add small tiles (many tile boundaries, ragged last tiles, query and key tiles of
different sizes), the vectorised float32 code, determinism, the ``fused`` / ``auto`` dispatch
and the clean fallback when no compiler is present.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import make_inputs, require

from structattn.hkt import hkt_attention
from structattn.hkt.interface import ATTENTION_IMPLS
from structattn.hkt.kernels import extension as ext
from structattn.hkt.kernels import fused_cpp as ck


def _run(fn, q, k, v, theta, mask, stride, causal, **kw):
    """Output and gradients (q, k, v, theta) of one implementation."""
    leaves = [*q, *k, v, theta]
    for t in leaves:
        t.requires_grad_(True)
    lam = torch.softmax(theta, -1)
    scale = q[0].shape[-1] ** -0.5
    out = fn(list(q), list(k), v, lam, stride, causal, mask, scale, 0.0, **kw)
    if mask is not None:
        out = out.masked_fill(~mask[:, None, :, None], 0.0)
    # the same upstream gradient in every precision: drawn in float64, then rounded
    g = torch.Generator().manual_seed(1)
    upstream = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    return out, torch.autograd.grad(out, leaves, upstream)


def _reference(q, k, v, theta, mask, stride, causal):
    return _run(ATTENTION_IMPLS["reference"], q, k, v, theta, mask, stride, causal)


# ---- C++ kernel -------------------------------------------------------------------------------


@pytest.mark.parametrize("tiles", [(4, 4), (8, 16), (16, 8), (12, 20)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize(("T", "n_levels", "stride"), [(37, 3, 2), (61, 2, 3), (45, 1, 2)])
def test_cpp_small_tiles_match_reference(T, n_levels, stride, causal, tiles):
    """Tiles far smaller than T: every boundary, the ragged last tile, unequal q/k tiles (the
    kernel rounds tiles up to multiples of stride^(L-1))."""
    require("fused_cpp")
    q, k, v, theta, mask = make_inputs(T, n_levels, stride, padded=True, seed=T)
    ref_out, ref_grads = _reference(q, k, v, theta, mask, stride, causal)
    out, grads = _run(
        ck.cpp_hkt_attention, q, k, v, theta, mask, stride, causal, tile_q=tiles[0],
        tile_k=tiles[1],
    )  # fmt: skip
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def _head_major(x, gap=0):
    """The same values in (B, T, H, d + gap) memory, seen as (B, H, T, d): what a projection
    followed by ``view(B, T, H, d).transpose(1, 2)`` gives (``gap`` > 0: rows further apart)."""
    B, H, T, d = x.shape
    mem = torch.zeros(B, T, H, d + gap, dtype=x.dtype)
    mem[..., :d] = x.transpose(1, 2)
    return mem.transpose(1, 2)[..., :d]


@pytest.mark.parametrize("gap", [0, 3])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_cpp_reads_strided_heads_without_copies(causal, gap):
    """q, k, v and the output gradient in (B, T, H, d) memory: the kernel reads them through
    their strides, returns the output in the same layout (so the layer's reshape to (B, T, D)
    is free) and gives the same values and gradients as contiguous inputs."""
    require("fused_cpp")
    q, k, v, theta, mask = make_inputs(45, 3, 2, B=2, H=3, padded=True)
    lam = torch.softmax(theta, -1)
    ref_out, ref_grads = _reference(q, k, v, theta, mask, 2, causal)
    sq, sk, sv = [_head_major(x, gap) for x in q], [_head_major(x, gap) for x in k], _head_major(v)
    leaves = [t.detach().requires_grad_(True) for t in (*sq, *sk, sv)]
    out = ck.cpp_hkt_attention(leaves[:3], leaves[3:6], leaves[6], lam, 2, causal, mask, 0.5, 0.0)
    assert out.transpose(1, 2).is_contiguous()  # (B, T, H, dv) memory, like v
    torch.testing.assert_close(out.masked_fill(~mask[:, None, :, None], 0.0), ref_out, rtol=1e-10,
                               atol=1e-10)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    upstream = _head_major(torch.randn(out.shape, generator=g, dtype=out.dtype))
    upstream = upstream.masked_fill(~mask[:, None, :, None], 0.0)
    grads = torch.autograd.grad(out, leaves, upstream)
    out_c = ck.cpp_hkt_attention(
        [x.detach().contiguous().requires_grad_(True) for x in sq], [x.contiguous() for x in sk],
        sv.contiguous(), lam, 2, causal, mask, 0.5, 0.0,
    )  # fmt: skip
    torch.testing.assert_close(out, out_c, rtol=1e-13, atol=1e-13)  # BLAS may round by lda
    assert all(torch.isfinite(gr).all() for gr in grads)
    contiguous = [x.detach().contiguous().requires_grad_(True) for x in (*q, *k, v)]
    ref = ck.cpp_hkt_attention(contiguous[:3], contiguous[3:6], contiguous[6], lam, 2, causal,
                               mask, 0.5, 0.0)  # fmt: skip
    ref_g = torch.autograd.grad(ref, contiguous, upstream.contiguous())
    for a, b in zip(grads, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize(("T", "n_levels", "stride"), [(1, 3, 2), (37, 3, 2), (300, 3, 2),
                                                       (97, 2, 3), (130, 4, 2)])  # fmt: skip
def test_cpp_float32_matches_float64_reference(T, n_levels, stride, causal):
    """The vectorised float32 code (AVX-512 or AVX2, row lengths not multiples of the vector width)
    stays within float32 rounding of the float64 reference, like the SDPA fast path does."""
    require("fused_cpp")
    q, k, v, theta, mask = make_inputs(T, n_levels, stride, d=16, d_v=8, padded=True, seed=7)
    ref_out, ref_grads = _reference(q, k, v, theta, mask, stride, causal)

    def low(t):
        return t.detach().float()

    args = ([low(x) for x in q], [low(x) for x in k], low(v), low(theta), mask, stride, causal)
    out, grads = _run(ck.cpp_hkt_attention, *args, tile_q=32, tile_k=64)
    fast_out, fast_grads = _run(ATTENTION_IMPLS["sdpa"], *args)
    assert out.dtype == torch.float32

    def err(a, b):
        return (a.double() - b).abs().max().item()

    eps = torch.finfo(torch.float32).eps
    assert err(out, ref_out) <= 4 * err(fast_out, ref_out) + 64 * eps
    for g, fg, rg in zip(grads, fast_grads, ref_grads):
        scale = rg.abs().max().item() + 1
        assert err(g, rg) <= 4 * err(fg, rg) + 256 * eps * scale


# Awkward shapes for the reduced-precision kernel: odd head dims (the GEMM's K is padded to even),
# T = 1, ragged tiles, stride 3, one to four levels, bidirectional, padded keys.
LOWP_CASES = [
    # T, L, s, d, d_v, causal, padded, tiles
    (1, 3, 2, 4, 4, True, False, None),
    (37, 3, 2, 5, 7, True, True, (8, 16)),
    (64, 3, 2, 16, 16, True, False, None),
    (100, 2, 3, 8, 3, False, True, (9, 18)),
    (130, 4, 2, 16, 8, False, False, (16, 32)),
    (300, 1, 2, 33, 17, True, True, None),
    (513, 3, 2, 32, 32, True, True, None),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("T", "L", "stride", "d", "d_v", "causal", "padded", "tiles"), LOWP_CASES)
def test_cpp_reduced_precision_within_twice_sdpa(dtype, T, L, stride, d, d_v, causal, padded,
                                                 tiles):  # fmt: skip
    """bfloat16 / float16 inputs (the batch-reduce GEMM kernel where this CPU runs it, else
    float32 compute): the error against the float64 reference on the same (rounded) inputs is
    at most twice SDPA's in the same dtype, for the output and every gradient (q, k and v of
    every level, the level logits) -- the test flash-attention applies to reduced precision."""
    require("fused_cpp")
    # 64 heads, so that each tensor's largest error is a stable statistic, not one element's
    # luck (with 16, one element of one seed decided it: both kernels' rms errors were far apart
    # in HKT's favour while its largest error was 2.2x SDPA's)
    q, k, v, theta, mask = make_inputs(T, L, stride, B=8, H=8, d=d, d_v=d_v, padded=padded,
                                       seed=T + d)  # fmt: skip
    low = [[x.to(dtype) for x in q], [x.to(dtype) for x in k], v.to(dtype), theta.to(dtype)]
    same = [[x.double() for x in low[0]], [x.double() for x in low[1]], low[2].double(),
            low[3].double()]  # fmt: skip
    ref_out, ref_grads = _reference(*same, mask, stride, causal)
    kw = {} if tiles is None else {"tile_q": tiles[0], "tile_k": tiles[1]}
    out, grads = _run(ck.cpp_hkt_attention, *low, mask, stride, causal, **kw)
    low = [[x.detach() for x in low[0]], [x.detach() for x in low[1]], low[2].detach(),
           low[3].detach()]  # fmt: skip
    sd_out, sd_grads = _run(ATTENTION_IMPLS["sdpa"], *low, mask, stride, causal)
    assert out.dtype == dtype

    def err(a, b):
        return (a.double() - b).abs().max().item()

    def resolution(ref):  # one unit in the last place of the tensor's largest value
        return torch.finfo(dtype).eps * ref.abs().max().item()

    names = ["out", *(f"dq{l}" for l in range(L)), *(f"dk{l}" for l in range(L)), "dv", "dtheta"]
    for name, g, sg, rg in zip(names, [out, *grads], [sd_out, *sd_grads], [ref_out, *ref_grads]):
        # below the dtype's resolution twice SDPA's error is not a meaningful bound (the level
        # logits' gradient has only H x L elements, each off by rounding alone)
        assert err(g, rg) <= max(2 * err(sg, rg), resolution(rg)), name


def test_lowp_route_is_the_kernel_that_runs():
    """lowp_route names what the kernel does with bfloat16 / float16: the reduced-precision
    kernel (float32 log-sum-exp, outputs in the input dtype) or, where this CPU's batch-reduce
    GEMM does not run the dtype, a refusal that sends the inputs to float32."""
    require("fused_cpp")
    q, k, v, theta, _ = make_inputs(40, 3, 2, d=8, d_v=8)
    lam = torch.softmax(theta, -1).float()
    for dtype in (torch.bfloat16, torch.float16):
        route = ck.lowp_route(dtype)
        assert route in ("brgemm-amx", "brgemm-avx512", "float32")
        args = ([x.to(dtype) for x in q], [x.to(dtype) for x in k], v.to(dtype), lam, None, True,
                2, 0.5, 16, 16)  # fmt: skip
        if route == "float32":
            with pytest.raises(RuntimeError, match="batch-reduce GEMM"):
                ext.cpu_kernel().forward(*args)
        else:
            out, lse = ext.cpu_kernel().forward(*args)
            assert out.dtype == dtype and lse.dtype == torch.float32
    if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
        assert ck.lowp_route(torch.bfloat16) != "float32"
    assert ck.lowp_route(torch.float32) == "float32"


def test_cpp_is_deterministic():
    require("fused_cpp")
    q, k, v, theta, mask = make_inputs(300, 3, 2, B=2, H=3, d=8, padded=True)
    a = _run(ck.cpp_hkt_attention, q, k, v, theta, mask, 2, True, tile_q=32, tile_k=32)
    b = _run(ck.cpp_hkt_attention, q, k, v, theta, mask, 2, True, tile_q=32, tile_k=32)
    assert torch.equal(a[0], b[0])
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def test_cpp_rejects_dropout_and_other_devices():
    require("fused_cpp")
    q, k, v, theta, _ = make_inputs(8, 2, 2)
    lam = torch.softmax(theta, -1)
    with pytest.raises(ValueError, match="dropout"):
        hkt_attention(q, k, v, lam, impl="fused_cpp", dropout_p=0.1)
    meta = [x.to("meta") for x in q]
    with pytest.raises(RuntimeError, match="runs on the CPU"):
        ck.cpp_hkt_attention(meta, meta, v.to("meta"), lam, 2, True, None, 0.5, 0.0)


def test_cpp_kernel_checks_shapes_itself():
    """The kernel indexes raw pointers: wrong shapes must raise, also when called directly."""
    require("fused_cpp")
    q, k, v, theta, _ = make_inputs(20, 3, 2)
    lam = torch.softmax(theta, -1)
    mod = ext.cpu_kernel()
    args = (None, True, 2, 0.5, 4, 4)
    mod.forward(q, k, v, lam, *args)  # the valid call
    bad_q = [q[0], q[1], q[2][:, :, :-1].contiguous()]
    with pytest.raises(RuntimeError, match=r"level 2 queries and keys must have shape"):
        mod.forward(bad_q, k, v, lam, *args)
    with pytest.raises(RuntimeError, match=r"lam must be \(H, L\)"):
        mod.forward(q, k, v, lam[:1], *args)
    with pytest.raises(RuntimeError, match="key_mask must be"):
        mod.forward(q, k, v, lam, torch.ones(2, 19, dtype=torch.bool), *args[1:])
    with pytest.raises(RuntimeError, match="tiles must be positive multiples"):
        mod.forward(q, k, v, lam, None, True, 2, 0.5, 6, 4)


def test_import_never_builds_the_kernel():
    """Importing the package, the models and the training code never calls the JIT loader (it
    is replaced by one that records the call, so a build attempt cannot hide in a failure)."""
    code = (
        "import torch.utils.cpp_extension as ce\n"
        "calls = []\n"
        "ce.load = lambda *a, **k: calls.append(k.get('name')) or (_ for _ in ()).throw("
        "RuntimeError('build attempted'))\n"
        "import structattn, structattn.hkt, structattn.hkt.interface, structattn.hkt.model\n"
        "import structattn.engine, structattn.experiments.lra, structattn.cli\n"
        "assert calls == [], calls\n"
        "from structattn.hkt.kernels.extension import _state\n"
        "assert _state == {}, _state\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.fixture
def no_kernel(monkeypatch):
    """A machine without a compiler: the kernel state reset, CXX pointing nowhere."""
    monkeypatch.setattr(ext, "_state", {})
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    return ext


def test_without_compiler_fused_and_auto_fall_back_with_one_warning(no_kernel):
    q, k, v, theta, mask = make_inputs(37, 3, 2, padded=True)
    lam = torch.softmax(theta, -1)
    with pytest.warns(RuntimeWarning, match="C.. HKT kernel unavailable.*no C.. compiler"):
        fused = hkt_attention(q, k, v, lam, key_padding_mask=mask, impl="fused")
    assert "no C++ compiler" in no_kernel.cpu_kernel_error()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning is said once, not per call
        auto = hkt_attention(q, k, v, lam, key_padding_mask=mask, impl="auto")
        torch_loop = hkt_attention(q, k, v, lam, key_padding_mask=mask, impl="fused_torch")
        fast = hkt_attention(q, k, v, lam, key_padding_mask=mask, impl="sdpa")
    assert torch.equal(fused, torch_loop)
    assert torch.equal(auto, fast)
    with pytest.raises(RuntimeError, match="C\\+\\+ HKT kernel is unavailable: no C\\+\\+"):
        hkt_attention(q, k, v, lam, impl="fused_cpp")


def test_auto_and_fused_pick_the_cpp_kernel_on_cpu(monkeypatch):
    require("fused_cpp")
    calls = []
    real = ck.cpp_hkt_attention

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    import structattn.hkt.interface as fn

    monkeypatch.setitem(fn.ATTENTION_IMPLS, "fused_cpp", spy)
    q, k, v, theta, _ = make_inputs(20, 3, 2)
    lam = torch.softmax(theta, -1)
    ref = hkt_attention(q, k, v, lam, impl="reference")
    for impl in ("auto", "fused"):
        torch.testing.assert_close(hkt_attention(q, k, v, lam, impl=impl), ref)
    assert len(calls) == 2
    # attention dropout is only on the SDPA path: auto takes it there
    torch.manual_seed(0)
    hkt_attention(q, k, v, lam, impl="auto", dropout_p=0.5)
    assert len(calls) == 2


# ---- Triton kernel (Triton's interpreter on CPU tensors) -----------------------------------------

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)


@pytest.fixture
def interpreter():
    """Triton's interpreter, switched on for the session by conftest.py (it has to be on before
    triton is first imported)."""
    if os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available():
        pytest.skip("Triton interpreter tests run on CPU-only sessions (see conftest.py)")


TRITON_CASES = [  # (T, L, s, causal, padded, dtype)
    (1, 3, 2, True, False, torch.float64),
    (37, 3, 2, True, True, torch.float64),
    (37, 3, 2, False, False, torch.float64),
    (29, 2, 4, False, True, torch.float64),
    (50, 4, 2, True, True, torch.float64),
    (13, 1, 2, True, False, torch.float64),
    (40, 3, 2, True, True, torch.float32),
]


@needs_triton
@pytest.mark.parametrize(("T", "n_levels", "stride", "causal", "padded", "dtype"), TRITON_CASES)
def test_triton_matches_reference(interpreter, T, n_levels, stride, causal, padded, dtype):
    """Tiles of 16-32 rows (several per sequence, the last ragged), forward and backward."""
    from structattn.hkt.kernels.fused_triton import triton_hkt_attention

    q, k, v, theta, mask = make_inputs(T, n_levels, stride, d=8, d_v=5, padded=padded, seed=T)
    ref_out, ref_grads = _reference(q, k, v, theta, mask, stride, causal)
    low = [t.detach().to(dtype) for t in (*q, *k, v, theta)]
    L = n_levels
    out, grads = _run(
        triton_hkt_attention, low[:L], low[L : 2 * L], low[2 * L], low[2 * L + 1], mask, stride,
        causal,
    )  # fmt: skip
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.double(), b, rtol=10 * tol, atol=10 * tol)


@needs_triton
def test_triton_causality_by_perturbation(interpreter):
    T, L, s = 40, 3, 2
    q, k, v, theta, _ = make_inputs(T, L, s, d=8)
    lam = torch.softmax(theta, -1)
    base = hkt_attention(q, k, v, lam, impl="fused_triton")
    t = 21
    q2, k2, v2 = [x.clone() for x in q], [x.clone() for x in k], v.clone()
    for l in range(L):
        first_future = (t - 1) // s**l + 1
        q2[l][:, :, first_future:] += 10.0
        k2[l][:, :, first_future:] -= 10.0
    v2[:, :, t:] *= -3.0
    out = hkt_attention(q2, k2, v2, lam, impl="fused_triton")
    torch.testing.assert_close(out[:, :, :t], base[:, :, :t], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(out[:, :, t:], base[:, :, t:])


@needs_triton
def test_triton_refuses_what_it_does_not_support(interpreter, monkeypatch):
    q, k, v, theta, _ = make_inputs(12, 2, 3)
    lam = torch.softmax(theta, -1)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        hkt_attention(q, k, v, lam, stride=3, impl="fused_triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="powers of two"):
        hkt_attention(q, k, v, lam, stride=3, impl="fused_triton")
    q, k, v, theta, _ = make_inputs(12, 2, 2)
    with pytest.raises(ValueError, match="multiple of"):
        from structattn.hkt.kernels.fused_triton import triton_hkt_attention

        triton_hkt_attention(q, k, v, torch.softmax(theta, -1), 2, True, None, 0.5, 0.0, block=24)


def test_single_level_fused_paths_equal_sdpa():
    """L = 1 through the C++ kernel is standard attention (the paper's exact special case)."""
    require("fused_cpp")
    q, k, v, _, _ = make_inputs(70, 1, 2)
    lam = torch.ones(1, dtype=torch.float64)
    for causal in (True, False):
        out = hkt_attention(q, k, v, lam, causal=causal, impl="fused_cpp")
        expected = F.scaled_dot_product_attention(q[0], k[0], v, is_causal=causal)
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_a_build_killed_midway_does_not_hang_the_next_load(tmp_path, monkeypatch):
    """torch marks a build with a ``lock`` file and waits for it without limit: one left by a
    process killed mid-build is cleared (with a warning), while a build that another live
    process holds is waited for, not broken into."""
    import signal
    import time

    import torch.utils.cpp_extension as cpp

    seen = []
    monkeypatch.setattr(ext, "_build_directory", lambda: tmp_path)
    monkeypatch.setattr(cpp, "load", lambda **kw: seen.append((tmp_path / "lock").exists()))
    monkeypatch.setenv("CXX", sys.executable)  # any program on PATH passes the compiler check
    monkeypatch.delenv("STRUCTATTN_NO_CPP_KERNEL", raising=False)

    (tmp_path / "lock").write_text("")  # left by a killed build
    with pytest.warns(RuntimeWarning, match="stale build lock"):
        ext._build()
    assert seen == [False]

    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, pathlib, time\n"
        f"d = pathlib.Path({str(tmp_path)!r})\n"
        "fd = os.open(d / 'structattn-build.lock', os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "(d / 'lock').write_text('')\n"
        "(d / 'ready').write_text('')\n"
        "time.sleep(1.0)\n"
        "(d / 'lock').unlink()\n"
    )])  # fmt: skip
    try:
        while not (tmp_path / "ready").exists():
            assert holder.poll() is None, "the holder process ended early"
            time.sleep(0.01)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no stale lock is reported: the build was live
            ext._build()
        assert seen == [False, False]
    finally:
        if holder.poll() is None:
            holder.send_signal(signal.SIGTERM)
        holder.wait()
