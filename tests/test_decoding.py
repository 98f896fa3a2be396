"""Streaming decoding of causal HKT and MHA language models: prefill + one token at a time
equals one forward pass over the whole text, at every position (float64)."""

from __future__ import annotations

import itertools

import pytest
import torch

from structattn.hkt import CausalLM, ModelConfig
from structattn.hkt.decoding.cache import HKTLayerCache, KVLayerCache, LMCache

VOCAB = 31


def make_lm(attention="hkt", n_levels=3, stride=2, kd=3, kc=3, hybrid=True, max_len=96, seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=VOCAB,
        max_len=max_len,
        d_model=16,
        n_layers=2,
        n_heads=2,
        attention=attention,
        dropout=0.0,
        hkt=dict(
            n_levels=n_levels,
            stride=stride,
            downsample_kernel=kd,
            conv_kernel=kc,
            hybrid=hybrid,
            beta_init=0.6,
            level_logits_init=0.3,
        ),
    )
    return CausalLM(cfg).double().eval()


def left_padded(texts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(len(t) for t in texts)
    ids = torch.zeros(len(texts), P, dtype=torch.long)
    mask = torch.zeros(len(texts), P, dtype=torch.bool)
    for b, t in enumerate(texts):
        ids[b, P - len(t) :] = t
        mask[b, P - len(t) :] = True
    return ids, mask


def decode_errors(model, lens, extra, seed=1):
    """Max |logit difference| of (prefill of left-padded prompts of lengths ``lens`` + ``extra``
    single-token steps) against (a) the full forward of each text alone and (b) the full
    forward of the left-padded batch of whole texts."""
    g = torch.Generator().manual_seed(seed)
    full = [torch.randint(1, VOCAB, (n + extra,), generator=g) for n in lens]
    ids, mask = left_padded([t[:n] for t, n in zip(full, lens)])
    P = ids.shape[1]
    cache = model.new_cache()
    out = model(ids, mask, cache=cache)
    assert out.cache is cache
    alone = [model(t[None]).logits[0] for t in full]
    whole_ids, whole_mask = left_padded(full)
    batch = model(whole_ids, whole_mask).logits
    err_alone = err_batch = 0.0
    Q = whole_ids.shape[1]
    for b, n in enumerate(lens):
        got = out.logits[b, P - n :]
        err_alone = max(err_alone, (got - alone[b][:n]).abs().max().item())
        err_batch = max(err_batch, (got - batch[b, Q - n - extra : Q - extra]).abs().max().item())
    for t in range(extra):
        nxt = torch.stack([full[b][n + t] for b, n in enumerate(lens)])[:, None]
        step = model(nxt, cache=cache).logits[:, 0]
        for b, n in enumerate(lens):
            err_alone = max(err_alone, (step[b] - alone[b][n + t]).abs().max().item())
            err_batch = max(err_batch, (step[b] - batch[b, Q - extra + t]).abs().max().item())
    return err_alone, err_batch


GRID = list(itertools.product([1, 2, 3, 4], [2, 3], [1, 2, 4], [True, False]))


@pytest.mark.parametrize("n_levels,stride,kernel,hybrid", GRID)
def test_hkt_decode_equals_full_forward(n_levels, stride, kernel, hybrid):
    model = make_lm("hkt", n_levels, stride, kd=kernel, kc=5 - kernel, hybrid=hybrid)
    # prompts that do (8, 9 = s^l) and do not (5, 11) align with block boundaries; 13 steps
    # cross several coarse-token births at every level
    lens = [8, 5, 11] if stride == 2 else [9, 5, 11]
    err_alone, err_batch = decode_errors(model, lens, extra=13)
    assert err_alone <= 1e-10
    assert err_batch <= 1e-10


def test_mha_decode_equals_full_forward():
    model = make_lm("mha")
    err_alone, err_batch = decode_errors(model, [7, 1, 12], extra=10)
    assert err_alone <= 1e-10 and err_batch <= 1e-10


def test_decode_several_tokens_per_call_and_one_token_prompts():
    model = make_lm("hkt", n_levels=3, stride=2)
    g = torch.Generator().manual_seed(3)
    text = torch.randint(1, VOCAB, (2, 20), generator=g)
    ref = model(text).logits
    cache = model.new_cache()
    got = [model(text[:, :1], cache=cache).logits]
    got.append(model(text[:, 1:6], cache=cache).logits)  # five at once
    for t in range(6, 20):
        got.append(model(text[:, t : t + 1], cache=cache).logits)
    assert torch.allclose(torch.cat(got, 1), ref, atol=1e-10, rtol=0)
    assert cache.get_seq_length() == 20


@pytest.mark.parametrize("n_levels,stride", [(3, 2), (4, 2), (3, 3)])
def test_coarse_scores_are_reused_between_coarse_tokens(n_levels, stride):
    """A step recomputes level l's scores only where level l got a new query (every s^l
    tokens); otherwise it reuses the cached ones, and stays exact through capacity growth."""
    model = make_lm("hkt", n_levels=n_levels, stride=stride, max_len=128)
    g = torch.Generator().manual_seed(6)
    text = torch.randint(1, VOCAB, (2, 70), generator=g)  # equal lengths: the aligned path
    ref = model(text).logits
    cache = model.new_cache()
    got = [model(text[:, :5], cache=cache).logits]
    layer = cache.layers[1]
    for t in range(5, 70):
        before = list(layer.scores or [None] * n_levels)
        got.append(model(text[:, t : t + 1], cache=cache).logits)
        for l in range(1, n_levels):
            # (a step that extends the rows, t % s^(L-1) == 0, makes new queries at every level)
            if t % stride**l and before[l] is not None:
                assert layer.scores[l] is before[l], (t, l)
            else:
                assert layer.scores[l] is not before[l], (t, l)
    assert torch.allclose(torch.cat(got, 1), ref, atol=1e-10, rtol=0)


def test_left_padding_gives_each_row_its_own_outputs():
    """A left-padded row is run left-aligned: its logits are those of the row alone (HKT's block
    boundaries sit at the row's own multiples of s^l)."""
    model = make_lm("hkt", n_levels=3, stride=2)
    g = torch.Generator().manual_seed(4)
    texts = [torch.randint(1, VOCAB, (n,), generator=g) for n in (3, 10, 6)]
    ids, mask = left_padded(texts)
    logits = model(ids, mask).logits
    for b, t in enumerate(texts):
        alone = model(t[None]).logits[0]
        assert torch.allclose(logits[b, -len(t) :], alone, atol=1e-12, rtol=0)
    # and the same for the loss with labels (-100 on padding)
    labels = ids.masked_fill(~mask, -100)
    loss = model(ids, mask, labels=labels).loss
    right = torch.zeros_like(ids)
    for b, t in enumerate(texts):
        right[b, : len(t)] = t
    rmask = right != 0
    rloss = model(right, rmask, labels=right.masked_fill(~rmask, -100)).loss
    assert torch.allclose(loss, rloss, atol=1e-12, rtol=0)


def test_cache_holds_what_the_design_says():
    model = make_lm("hkt", n_levels=3, stride=2, kd=3, kc=3)
    cache = model.new_cache()
    model(torch.randint(1, VOCAB, (2, 11)), cache=cache)
    layer = cache.layers[0]
    assert isinstance(layer, HKTLayerCache)
    assert layer.lengths.tolist() == [11, 11]
    assert [k.shape[2] >= -(-11 // 2**l) for l, k in enumerate(layer.keys)] == [True] * 3
    assert [tuple(w.shape) for w in layer.windows] == [(2, 2, 16), (2, 2, 16)]
    assert tuple(layer.conv_window.shape) == (2, 2, 16)
    # bytes in use: keys at every level (11 + 6 + 3 rows) + values (11 rows), per layer
    mha = make_lm("mha")
    mcache = mha.new_cache()
    mha(torch.randint(1, VOCAB, (2, 11)), cache=mcache)
    assert isinstance(mcache.layers[0], KVLayerCache)
    row = 2 * 2 * 8 * 8  # B * H * d * bytes
    assert mcache.nbytes() == 2 * (2 * 11 * row)
    extra = 2 * (3 * 2 * 2 * 8 * 8 + 3 * 2 * 2 * 16 * 8)  # queries + 3 windows, per layer
    assert cache.nbytes() == 2 * ((11 + 6 + 3 + 11) * row) + extra


def test_reorder_cache_keeps_and_repeats_sequences():
    model = make_lm("hkt", n_levels=3, stride=2)
    g = torch.Generator().manual_seed(5)
    text = torch.randint(1, VOCAB, (3, 14), generator=g)
    cache = model.new_cache()
    model(text[:, :9], cache=cache)
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    picked = text[[2, 2, 0]]
    steps = [model(picked[:, t : t + 1], cache=cache).logits[:, 0] for t in range(9, 14)]
    ref = model(picked).logits[:, 9:]
    assert torch.allclose(torch.stack(steps, 1), ref, atol=1e-10, rtol=0)


@pytest.mark.parametrize("attention", ["hkt", "mha"])
def test_bad_input_is_named(attention):
    model = make_lm(attention, max_len=16)
    with pytest.raises(ValueError, match="exceeds max_len"):
        model(torch.ones(1, 17, dtype=torch.long), cache=model.new_cache())
    cache = model.new_cache()
    model(torch.ones(1, 15, dtype=torch.long), cache=cache)
    model(torch.ones(1, 1, dtype=torch.long), cache=cache)  # position 15: the last one
    with pytest.raises(ValueError, match="past max_len"):
        model(torch.ones(1, 1, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="empty prompt"):
        model(torch.ones(1, 0, dtype=torch.long), cache=model.new_cache())
    with pytest.raises(ValueError, match="empty prompt"):
        ids = torch.ones(2, 4, dtype=torch.long)
        mask = torch.tensor([[True] * 4, [False] * 4])
        model(ids, mask, cache=model.new_cache())
    with pytest.raises(ValueError, match="no holes"):
        mask = torch.tensor([[True, False, True, True]])
        model(torch.ones(1, 4, dtype=torch.long), mask, cache=model.new_cache())
    other = make_lm(attention, n_levels=2, max_len=16)
    cache = other.new_cache()
    other(torch.ones(1, 3, dtype=torch.long), cache=cache)
    wanted = "another configuration" if attention == "hkt" else "another configuration|sequences"
    if attention == "hkt":
        with pytest.raises(ValueError, match=wanted):
            model(torch.ones(1, 1, dtype=torch.long), cache=cache)
    cache = model.new_cache()
    model(torch.ones(2, 3, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="holds 2 sequences"):
        model(torch.ones(3, 1, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="must all be real"):
        model(torch.ones(2, 1, dtype=torch.long), torch.zeros(2, 1, dtype=torch.bool), cache=cache)
    with pytest.raises(ValueError, match="LMCache"):
        model(torch.ones(1, 3, dtype=torch.long), cache={})


def test_cache_of_another_width_is_refused_for_mha():
    a, b = make_lm("mha"), make_lm("mha", max_len=50)
    cache = b.new_cache()
    b(torch.ones(1, 3, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="another configuration"):
        a(torch.ones(1, 1, dtype=torch.long), cache=cache)


def test_bidirectional_models_cannot_decode():
    from structattn.hkt.model import Encoder

    enc = Encoder(ModelConfig(vocab_size=VOCAB, d_model=16, n_heads=2, causal=False))
    with pytest.raises(ValueError, match="causal"):
        enc.new_cache()


def test_cache_repr_and_lengths():
    cache = LMCache(("x",), 2)
    assert cache.is_empty and cache.lengths is None and cache.get_seq_length() == 0
    assert "empty" in repr(cache) and len(cache) == 2


def test_decoding_follows_parameter_updates_and_dtype_changes():
    """The decode step caches its concatenated weights; a changed parameter or dtype is seen."""
    model = make_lm("hkt", n_levels=3, stride=2)
    text = torch.randint(1, VOCAB, (1, 12))

    def decoded():
        cache = model.new_cache()
        model(text[:, :6], cache=cache)
        return torch.cat([model(text[:, t : t + 1], cache=cache).logits for t in range(6, 12)], 1)

    assert torch.allclose(decoded(), model(text).logits[:, 6:], atol=1e-10, rtol=0)
    with torch.no_grad():
        for block in model.encoder.blocks:
            block.attn.v_proj.weight.mul_(1.5)
            block.attn.level_logits.add_(torch.randn_like(block.attn.level_logits))
            block.attn.beta_logits.sub_(0.5)
    assert torch.allclose(decoded(), model(text).logits[:, 6:], atol=1e-10, rtol=0)
    model.float()
    assert torch.allclose(decoded(), model(text).logits[:, 6:], atol=1e-4, rtol=0)


def test_a_model_built_under_inference_mode_decodes():
    """Inference tensors have no version counter; decoding must not need one."""
    with torch.inference_mode():
        model = make_lm("hkt", n_levels=2, stride=2)
        text = torch.randint(1, VOCAB, (1, 9))
        ref = model(text).logits
        cache = model.new_cache()
        got = [model(text[:, :4], cache=cache).logits]
        got += [model(text[:, t : t + 1], cache=cache).logits for t in range(4, 9)]
    assert torch.allclose(torch.cat(got, 1), ref, atol=1e-10, rtol=0)


@pytest.mark.parametrize("n_levels,stride,kernel,hybrid", GRID)
def test_compiled_decode_step_equals_full_forward(n_levels, stride, kernel, hybrid, monkeypatch):
    """Without gradients and with every sequence at one position, the steps run the compiled
    step (counted here); prefill + steps still equal the full forward at every position, and
    the caches they leave equal the PyTorch step's."""
    from structattn.hkt import use_compiled_step
    from structattn.hkt.decoding import step as step_module
    from structattn.hkt.kernels.extension import cpu_kernel

    if cpu_kernel() is None:
        pytest.skip("the C++ kernel could not be built here")
    calls = []
    real = step_module.step_cpp

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(step_module, "step_cpp", counted)
    model = make_lm("hkt", n_levels, stride, kd=kernel, kc=5 - kernel, hybrid=hybrid)
    for lens in ([8, 8], [11], [5, 5]):
        with torch.no_grad():
            err_alone, err_batch = decode_errors(model, lens, extra=13)
        assert err_alone <= 1e-10 and err_batch <= 1e-10, lens
    assert len(calls) == 3 * 13 * 2  # every step of both layers

    # the cache after compiled steps equals the cache after PyTorch steps
    text = torch.randint(1, VOCAB, (2, 30), generator=torch.Generator().manual_seed(5))
    caches = []
    for compiled in (True, False):
        cache = model.new_cache()
        with torch.no_grad(), use_compiled_step(compiled):
            model(text[:, :7], cache=cache)
            for t in range(7, 30):
                model(text[:, t : t + 1], cache=cache)
        caches.append(cache.layers[1])
    a, b = caches
    n = 30
    for l in range(n_levels):
        rows = -(-n // stride**l)
        assert torch.allclose(a.keys[l][:, :, :rows], b.keys[l][:, :, :rows], atol=1e-12)
        assert torch.allclose(a.queries[l], b.queries[l], atol=1e-12)
    for wa, wb in zip(a.windows, b.windows):
        assert torch.allclose(wa, wb, atol=1e-12)
    assert torch.allclose(a.values[:, :, :n], b.values[:, :, :n], atol=1e-12)
    if hybrid:
        assert torch.allclose(a.conv_window, b.conv_window, atol=1e-12)
    assert torch.equal(a.lengths, b.lengths)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e300])
def test_compiled_step_treats_odd_input_like_the_pytorch_step(bad):
    """NaN, inf or huge values in one step's input: the compiled step gives what the PyTorch
    step gives (NaN where it has NaN), and the steps after it too."""
    from structattn.hkt import attention as attention_module
    from structattn.hkt.attention import EMPTY
    from structattn.hkt.kernels.extension import cpu_kernel

    if cpu_kernel() is None:
        pytest.skip("the C++ kernel could not be built here")
    torch.manual_seed(0)
    cfg = attention_module.HKTConfig(d_model=8, n_heads=2, n_levels=3, stride=2)
    compiled_layer = attention_module.HKTAttention(cfg).double().eval()
    x = torch.randn(2, 20, 8, dtype=torch.float64)
    x[:, 9, 3] = bad  # read by the coarse tokens made at positions 10 and 12
    x[1, 12, 0] = bad
    torch_layer = attention_module.HKTAttention(cfg, cpp_decode=False).double().eval()
    torch_layer.load_state_dict(compiled_layer.state_dict())  # the same weights
    outs = []
    for layer in (compiled_layer, torch_layer):
        with torch.no_grad():
            _, cache = layer(x[:, :7], cache=EMPTY)
            outs.append(
                torch.cat([layer(x[:, t : t + 1], cache=cache)[0] for t in range(7, 20)], 1)
            )
    got, ref = outs
    assert torch.equal(got.isnan(), ref.isnan())
    # outputs reach 1e299 for the huge input: equal to rounding, relative to their size
    assert torch.allclose(got, ref, atol=1e-10, rtol=1e-12, equal_nan=True)


def test_an_empty_batch_gives_empty_outputs_on_every_path():
    """Batch size 0 raised reshape / max() errors in the layer, the LM, its cache and
    generate; the functional form already handled it."""
    from structattn.hkt import CausalLM, HKTAttention, HKTConfig, ModelConfig
    from structattn.hkt.hf import HKTForCausalLM, HKTLMConfig

    layer = HKTAttention(HKTConfig(d_model=16, n_heads=2, n_levels=3, causal=True))
    x = torch.randn(0, 10, 16, requires_grad=True)
    y = layer(x, key_padding_mask=torch.ones(0, 10, dtype=torch.bool))
    assert y.shape == (0, 10, 16)
    y.sum().backward()
    assert x.grad.shape == x.shape
    lm = CausalLM(ModelConfig(vocab_size=20, max_len=32, d_model=16, n_heads=2, dropout=0.0))
    lm = lm.eval()
    none = torch.zeros(0, 5, dtype=torch.long)
    assert lm(none).logits.shape == (0, 5, 20)
    cache = lm.new_cache()
    assert lm(none, cache=cache).logits.shape == (0, 5, 20)
    assert lm(none[:, :1], cache=cache).logits.shape == (0, 1, 20)
    model = HKTForCausalLM(HKTLMConfig(vocab_size=20, max_len=32, d_model=16, n_heads=2))
    out = model.generate(none[:, :3], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (0, 3)


@pytest.mark.parametrize("hybrid", [True, False])
def test_decoding_under_bfloat16_autocast_follows_the_full_pass(hybrid):
    """Under autocast the projections are bfloat16 while the layer is float32: the step falls
    back from the one-dtype compiled step, and each decoded output matches the full pass's to
    bfloat16 rounding (the prompt's outputs exactly)."""
    from structattn.hkt.attention import EMPTY, HKTAttention, HKTConfig

    torch.manual_seed(0)
    layer = HKTAttention(HKTConfig(d_model=16, n_heads=2, n_levels=3, hybrid=hybrid)).eval()
    with torch.no_grad():
        layer.level_logits.normal_()
    x = torch.randn(2, 40, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        full = layer(x)
        prompt, cache = layer(x[:, :9], cache=EMPTY)
        steps = [layer(x[:, t : t + 1], cache=cache)[0] for t in range(9, 40)]
    assert torch.equal(prompt, full[:, :9])
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 9:], atol=4e-3, rtol=1e-2)
