"""HKT and MHA causal LMs as transformers models: generate, save/load, labels."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer  # noqa: E402

from structattn.hkt import CausalLM, ModelConfig  # noqa: E402
from structattn.hkt.hf import HKTForCausalLM, HKTLMConfig  # noqa: E402

VOCAB = 40


def make(attention="hkt", **hkt):
    torch.manual_seed(0)
    cfg = HKTLMConfig(
        vocab_size=VOCAB,
        max_len=64,
        d_model=16,
        n_layers=2,
        n_heads=2,
        dropout=0.0,
        attention=attention,
        hkt=dict(n_levels=3, stride=2, level_logits_init=0.5, **hkt),
        bos_token_id=1,
        eos_token_id=None,
    )
    return HKTForCausalLM(cfg).double().eval()


def prompts():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :4], mask[0, :4] = 0, 0  # left padding, as generate expects
    ids[2, :7], mask[2, :7] = 0, 0
    return ids, mask


@pytest.mark.parametrize("attention", ["hkt", "mha"])
def test_greedy_generate_with_cache_equals_without(attention):
    model = make(attention)
    ids, mask = prompts()
    cached = model.generate(ids, attention_mask=mask, max_new_tokens=15, do_sample=False)
    plain = model.generate(
        ids, attention_mask=mask, max_new_tokens=15, do_sample=False, use_cache=False
    )
    assert cached.shape == (3, 25)
    assert torch.equal(cached, plain)
    for b in range(3):  # each prompt alone gives its batched continuation
        real = mask[b].bool()
        alone = model.generate(ids[b : b + 1, real], max_new_tokens=15, do_sample=False)
        assert torch.equal(alone[0, -15:], cached[b, -15:])


def test_generate_steps_are_the_full_forward_argmax():
    model = make()
    ids, mask = prompts()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    full_mask = torch.cat([mask, torch.ones(3, 8, dtype=mask.dtype)], 1)
    logits = model(out, attention_mask=full_mask).logits
    assert torch.equal(logits[:, 9:-1].argmax(-1), out[:, 10:])


def test_beam_search_and_sampling_run_on_the_cache():
    model = make()
    ids, mask = prompts()
    beams = model.generate(ids, attention_mask=mask, max_new_tokens=6, num_beams=3)
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=6, num_beams=3, use_cache=False)
    assert torch.equal(beams, plain)
    torch.manual_seed(7)
    a = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=5,
                       num_return_sequences=2)  # fmt: skip
    torch.manual_seed(7)
    b = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=5,
                       num_return_sequences=2, use_cache=False)  # fmt: skip
    assert a.shape == (6, 16) and torch.equal(a, b)


def test_stopping_criteria_and_eos():
    model = make()
    ids, mask = prompts()

    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 13, dtype=torch.bool)

    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=20,
        stopping_criteria=StoppingCriteriaList([StopAfter()]),
    )
    assert out.shape[1] == 13
    first = model.generate(ids[1:2], max_new_tokens=1)[0, -1].item()
    out = model.generate(ids[1:2], max_new_tokens=10, eos_token_id=first)
    assert out.shape[1] == 11


def test_streamer_receives_the_tokens():
    class Tok:  # the two methods the streamer needs
        def decode(self, ids, **kwargs):
            return "".join(chr(97 + int(i) % 26) for i in ids)

    model = make()
    ids, _ = prompts()
    streamer = TextIteratorStreamer(Tok(), skip_prompt=True)
    out = model.generate(ids[1:2], max_new_tokens=5, streamer=streamer)
    text = "".join(streamer)
    assert text == Tok().decode(out[0, 10:].tolist())


def test_save_and_load_roundtrip(tmp_path):
    model = make(hybrid=False).float()
    ids, mask = prompts()
    model.save_pretrained(tmp_path)
    loaded = HKTForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.hkt["hybrid"] is False
    assert loaded.lm.lm_head.weight is loaded.lm.encoder.tok.weight
    a = model(ids, attention_mask=mask).logits
    b = loaded(ids, attention_mask=mask).logits
    assert torch.equal(a, b)


def test_labels_loss_matches_the_wrapped_model_and_trains():
    model = make()
    ids, mask = prompts()
    labels = ids.masked_fill(mask == 0, -100)
    out = model(ids, attention_mask=mask, labels=labels)
    ref = model.lm(ids, mask.bool(), labels=labels).loss
    assert torch.allclose(out.loss, ref)
    out.loss.backward()
    assert model.lm.encoder.tok.weight.grad is not None


def test_from_causal_lm_wraps_trained_weights():
    torch.manual_seed(3)
    lm = CausalLM(ModelConfig(vocab_size=VOCAB, d_model=16, n_heads=2, n_layers=1, max_len=32))
    wrapped = HKTForCausalLM.from_causal_lm(lm)
    ids = torch.randint(1, VOCAB, (2, 9))
    lm.eval(), wrapped.eval()
    assert torch.equal(wrapped(ids).logits, lm(ids).logits)


def test_bad_input_is_named():
    model = make()
    ids, mask = prompts()
    with pytest.raises(ValueError, match="inputs_embeds"):
        model(inputs_embeds=torch.zeros(1, 3, 16))
    with pytest.raises(ValueError, match="position_ids"):
        model(ids, attention_mask=mask, position_ids=torch.arange(10).expand(3, 10))
    with pytest.raises(ValueError, match="max_len"):
        model.generate(torch.ones(1, 60, dtype=torch.long), max_new_tokens=10)
    with pytest.raises(ValueError, match="n_levels"):
        HKTLMConfig(hkt=dict(n_levels=0))
