"""Sequence models: shapes, gradients, HKT vs MHA differ only in attention, padding, causality."""

from __future__ import annotations

import pytest
import torch

from structattn.hkt import (
    CausalLM,
    HKTAttention,
    HKTConfig,
    ModelConfig,
    MultiHeadAttention,
    SequenceClassifier,
    count_parameters,
)

HKT_KEYS = ("n_levels", "stride", "hybrid", "impl", "downsample_kernel", "conv_kernel")


def cfg(**kw):
    base = dict(
        vocab_size=20, num_classes=5, max_len=64, d_model=16, n_layers=2, n_heads=4, dropout=0.0
    )
    hkt = {k: kw.pop(k) for k in HKT_KEYS if k in kw}
    base.update(kw)
    return ModelConfig(**base, hkt=HKTConfig(**hkt))


def tokens(B=3, T=40, seed=0):
    return torch.randint(1, 20, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("attention", ["hkt", "mha"])
def test_classifier_shapes_and_gradients(attention):
    model = SequenceClassifier(cfg(attention=attention))
    x = tokens()
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[1, 25:] = False
    labels = torch.tensor([0, 1, 2])
    out = model(x, mask, labels=labels)
    assert out.logits.shape == (3, 5)
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(out.logits, labels))
    assert model(x, mask).loss is None
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    # Only the padding embedding row may stay at zero gradient.
    assert missing == [], missing


def test_hkt_and_mha_models_differ_only_in_attention():
    hkt = SequenceClassifier(cfg(attention="hkt"))
    mha = SequenceClassifier(cfg(attention="mha"))
    outside = {k: v.shape for k, v in hkt.state_dict().items() if ".attn." not in k}
    assert outside == {k: v.shape for k, v in mha.state_dict().items() if ".attn." not in k}
    assert all(isinstance(b.attn, HKTAttention) for b in hkt.encoder.blocks)
    assert all(isinstance(b.attn, MultiHeadAttention) for b in mha.encoder.blocks)
    assert count_parameters(hkt) > count_parameters(mha)


@pytest.mark.parametrize("causal, pooling", [(False, "mean"), (True, "last"), (True, "mean")])
@pytest.mark.parametrize("attention", ["hkt", "mha"])
def test_padding_does_not_change_logits(attention, causal, pooling):
    model = SequenceClassifier(cfg(attention=attention, causal=causal, pooling=pooling)).eval()
    lengths = [40, 17, 3]
    x = tokens()
    mask = torch.arange(40)[None] < torch.tensor(lengths)[:, None]
    x = x.masked_fill(~mask, 0)
    batched = model(x, mask).logits
    for b, n in enumerate(lengths):
        alone = model(x[b : b + 1, :n]).logits
        torch.testing.assert_close(batched[b : b + 1], alone, rtol=1e-5, atol=1e-5)


def test_last_pooling_reads_the_last_real_token_only_through_causal_context():
    model = SequenceClassifier(cfg(causal=True, pooling="last")).eval()
    x = tokens(B=1, T=30)
    base = model(x[:, :20]).logits
    x2 = x.clone()
    x2[:, 5] = (x2[:, 5] % 19) + 1  # change an earlier token: the pooled state sees it
    assert not torch.allclose(model(x2[:, :20]).logits, base)


@pytest.mark.parametrize("attention", ["hkt", "mha"])
def test_causal_lm_is_causal_and_learns(attention):
    torch.manual_seed(0)
    lm = CausalLM(cfg(attention=attention, causal=False))  # forced causal
    assert lm.config.causal
    x = tokens(B=2, T=32)
    logits = lm(x).logits
    assert logits.shape == (2, 32, 20)
    x2 = x.clone()
    x2[:, 20:] = 1
    torch.testing.assert_close(lm(x2).logits[:, :20], logits[:, :20], rtol=1e-5, atol=1e-5)
    # A periodic sequence is learnable: a few steps lower the loss clearly.
    seq = torch.arange(1, 9).repeat(4)[None].expand(4, -1)
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-2)
    first = lm.loss(seq).item()
    for _ in range(40):
        opt.zero_grad()
        loss = lm.loss(seq)
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first


def test_lm_loss_ignores_padding():
    lm = CausalLM(cfg()).eval()
    x = tokens(B=1, T=12)
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[:, 8:] = False
    padded = x.masked_fill(~mask, 0)
    torch.testing.assert_close(lm.loss(padded, mask), lm.loss(x[:, :8]), rtol=1e-5, atol=1e-6)


def test_lm_labels_are_shifted_inside():
    lm = CausalLM(cfg()).eval()
    x = tokens(B=2, T=12)
    out = lm(x, labels=x)
    logits = out.logits[:, :-1].reshape(-1, 20)
    manual = torch.nn.functional.cross_entropy(logits, x[:, 1:].flatten())
    torch.testing.assert_close(out.loss, manual)
    ignored = x.clone()
    ignored[:, 6:] = -100  # targets past position 5 are ignored
    part = torch.nn.functional.cross_entropy(out.logits[:, :5].reshape(-1, 20), x[:, 1:6].flatten())
    torch.testing.assert_close(lm(x, labels=ignored).loss, part)


def test_model_config_nests_the_hkt_layer_config():
    c = cfg(d_model=32, n_heads=2, causal=True, n_levels=2)
    assert (c.hkt.d_model, c.hkt.n_heads, c.hkt.causal, c.hkt.n_levels) == (32, 2, True, 2)
    r = c.replace(hkt={"attn_dropout": 0.1, "learn_beta": False}, d_model=64)
    assert r.hkt.attn_dropout == 0.1 and not r.hkt.learn_beta and r.hkt.d_model == 64
    layer = SequenceClassifier(r).encoder.blocks[0].attn
    assert layer.config.attn_dropout == 0.1 and layer.config.d_model == 64


def test_model_errors():
    model = SequenceClassifier(cfg(max_len=16))
    with pytest.raises(ValueError, match="exceeds max_len=16"):
        model(tokens(T=17))
    with pytest.raises(ValueError, match="mask must be bool"):
        model(tokens(T=10), torch.ones(3, 10))
    with pytest.raises(ValueError, match="attention must be one of"):
        cfg(attention="linear")
    with pytest.raises(ValueError, match="divisible by n_heads"):
        cfg(d_model=18)
    with pytest.raises(ValueError, match="stride must be >= 2"):
        cfg(stride=1)
