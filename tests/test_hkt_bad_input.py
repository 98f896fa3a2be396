"""Bad input to the HKT layer, the models, the transformers wrapper, the decoding caches and
the ListOps reader is refused with one line naming the problem (no internal error)."""

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
)
from structattn.hkt.attention import EMPTY

VOCAB = 20


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert message and "\n" not in message
    return message


def make_layer(causal=True) -> HKTAttention:
    torch.manual_seed(0)
    return HKTAttention(HKTConfig(d_model=16, n_heads=4, n_levels=3, causal=causal)).eval()


def model_config(attention="hkt", causal=True) -> ModelConfig:
    return ModelConfig(
        vocab_size=VOCAB, max_len=32, d_model=16, n_heads=4, n_layers=2, attention=attention,
        causal=causal, dropout=0.0, hkt=dict(n_levels=3),
    )  # fmt: skip


@pytest.mark.parametrize("attention", ["hkt", "mha"])
@pytest.mark.parametrize(
    "layer_dtype, x_dtype", [(torch.float32, torch.float64), (torch.float64, torch.float32)]
)
def test_layer_refuses_input_in_another_dtype(attention, layer_dtype, x_dtype):
    layer = make_layer() if attention == "hkt" else MultiHeadAttention(16, 4, causal=True)
    layer = layer.to(layer_dtype)
    with pytest.raises(ValueError) as err:
        layer(torch.randn(2, 9, 16, dtype=x_dtype))
    message = one_line(err)
    assert str(x_dtype) in message and str(layer_dtype) in message
    assert f"layer.to({x_dtype})" in message and f"x.to({layer_dtype})" in message


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_layer_refuses_input_that_is_not_floating_point(dtype):
    with pytest.raises(ValueError, match="x must be a floating-point tensor") as err:
        make_layer()(torch.ones(2, 9, 16, dtype=dtype))
    one_line(err)


def test_autocast_still_takes_reduced_input_and_refuses_float64():
    layer = make_layer()
    x = torch.randn(2, 9, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == layer(x.bfloat16()).dtype == torch.bfloat16
        with pytest.raises(ValueError, match="x is torch.float64"):
            layer(x.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_models_refuse_tokens_that_are_not_integers(dtype):
    tokens = torch.tensor([[1, 2, 3]], dtype=dtype)
    for model in (SequenceClassifier(model_config(causal=False)), CausalLM(model_config())):
        with pytest.raises(ValueError, match=f"integer token ids.*{dtype}") as err:
            model(tokens)
        one_line(err)


def _wrapped_lm():
    pytest.importorskip("transformers")
    from structattn.hkt.hf import HKTForCausalLM

    return HKTForCausalLM.from_causal_lm(CausalLM(model_config()).eval())


@pytest.mark.parametrize("bad", [-1, VOCAB, VOCAB + 7])
@pytest.mark.parametrize("model", ["classifier", "lm", "hf"])
@pytest.mark.parametrize("masked", [False, True])
def test_models_refuse_token_ids_outside_the_vocabulary(model, bad, masked):
    tokens = torch.tensor([[1, 2, 3, 4], [5, 6, bad, 7]])
    mask = torch.ones(2, 4, dtype=torch.bool) if masked else None
    if model == "classifier":
        run = lambda: SequenceClassifier(model_config(causal=False))(tokens, mask)  # noqa: E731
    elif model == "lm":
        run = lambda: CausalLM(model_config())(tokens, mask)  # noqa: E731
    else:
        run = lambda: _wrapped_lm()(input_ids=tokens, attention_mask=mask)  # noqa: E731
    with pytest.raises(ValueError) as err:
        run()
    message = one_line(err)
    assert f"0 .. {VOCAB - 1}" in message and f"got {bad} at tokens[1, 2]" in message


@pytest.mark.parametrize("attention", ["hkt", "mha"])
def test_decoding_refuses_token_ids_outside_the_vocabulary(attention):
    lm = CausalLM(model_config(attention)).eval()
    cache = lm.new_cache()
    with torch.no_grad():
        lm(torch.tensor([[1, 2, 3]]), cache=cache)
        with pytest.raises(ValueError, match=rf"got {VOCAB} at tokens\[0, 0\]") as err:
            lm(torch.tensor([[VOCAB]]), cache=cache)
        one_line(err)
        lm(torch.tensor([[4]]), cache=cache)  # the cache is still usable


@pytest.mark.parametrize("attention", ["hkt", "mha"])
def test_off_the_cpu_the_ids_ride_on_the_reads_made_anyway(attention, monkeypatch):
    """Where the ids' flag is not read back on its own (devices other than the CPU), a
    forward pass with a mask reads it with the mask's layout and a decoding step with its
    positions; the outputs stay the same."""
    from structattn.hkt import model as model_module

    lm = CausalLM(model_config(attention)).eval()
    tokens = torch.tensor([[1, 2, 3, 4], [0, 5, 6, 7]])
    mask = tokens != 0
    bad = tokens.masked_fill(tokens == 6, VOCAB)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        full = lm(tokens, mask).logits
        cache = lm.new_cache()
        lm(tokens[:, :2], cache=cache)
        step = lm(tokens[:, 2:3], cache=cache).logits
        with pytest.raises(ValueError, match=rf"got {VOCAB} at tokens\[1, 0\]"):
            lm(bad[:, 2:3], cache=cache)
        return full, step

    with torch.no_grad():
        expected = run()
        monkeypatch.setattr(model_module, "_read_ids_at_once", lambda tokens: False)
        got = run()
        with pytest.raises(ValueError, match=rf"got {VOCAB} at tokens\[1, 2\]"):
            lm(bad, mask)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("attention", ["hkt", "mha"])
def test_a_cache_is_refused_after_the_model_changes_dtype(attention):
    lm = CausalLM(model_config(attention)).eval()
    with torch.no_grad():
        cache = lm.new_cache()
        lm(torch.tensor([[1, 2, 3]]), cache=cache)
        lm.double()
        for _ in range(2):  # refused every time, nothing half-updated in between
            with pytest.raises(ValueError) as err:
                lm(torch.tensor([[4]]), cache=cache)
            message = one_line(err)
            assert "made for torch.float32 on cpu" in message and "new cache" in message
        lm.float()  # back to what the cache was made for: it decodes again
        lm(torch.tensor([[4]]), cache=cache)
        cache = lm.new_cache()  # a cache made empty before the change is filled after it
        lm.double()
        lm(torch.tensor([[1, 2, 3]]), cache=cache)
        lm(torch.tensor([[4]]), cache=cache)


def test_a_layer_cache_is_refused_after_the_layer_moves():
    layer = make_layer()
    with torch.no_grad():
        _, cache = layer(torch.randn(1, 5, 16), cache=EMPTY)
        layer.to("meta")
        with pytest.raises(ValueError, match="made for torch.float32 on cpu.*meta") as err:
            layer(torch.randn(1, 1, 16, device="meta"), cache=cache)
    one_line(err)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore::DeprecationWarning")
def test_torchscript_scripting_is_refused_with_what_to_use_instead():
    layer = make_layer()
    with pytest.raises(NotImplementedError) as err:
        torch.jit.script(layer)
    message = one_line(err)
    assert "torch.jit.script" in message and "torch.jit.trace" in message
    assert "torch.compile" in message
    with pytest.raises(NotImplementedError, match="TorchScript"):  # inside a model too
        torch.jit.script(SequenceClassifier(model_config(causal=False)))
    x = torch.randn(2, 12, 16)
    torch.testing.assert_close(torch.jit.trace(layer, (x,))(x), layer(x))


@pytest.mark.parametrize("target", ["²", "٣", "x"])
def test_listops_target_must_be_an_ascii_digit(tmp_path, target):
    from structattn.data.listops import read_listops_tsv
    from structattn.errors import DataError

    path = tmp_path / "bad.tsv"
    path.write_text(f"Source\tTarget\n( [MAX 1 ] )\t1\n( [MIN 2 ] )\t{target}\n", "utf-8")
    with pytest.raises(DataError, match="bad.tsv:3: target must be a digit 0-9") as err:
        read_listops_tsv(path)
    one_line(err)


def test_listops_evaluation_refuses_a_non_ascii_digit():
    from structattn.data.listops import evaluate_listops

    assert evaluate_listops("( [MAX 1 7 ] )") == 7
    with pytest.raises(ValueError, match="unknown ListOps token '²'"):
        evaluate_listops("( [MAX 1 ² ] )")
