"""A new attention is one module plus one registry line: a toy windowed attention, registered
the way a user's package would register it, builds every model of the library, trains on
ListOps through the engine, is counted by ``structattn params``, and is refused when unknown."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers import tiny_listops
from torch import Tensor, nn

from structattn.cli import main
from structattn.experiments.lra.experiment import train
from structattn.hkt.model import ATTENTIONS, CausalLM, ModelConfig, SequenceClassifier


class WindowAttention(nn.Module):
    """The toy variant: each token attends to itself and the ``window - 1`` tokens before it
    (and, when not causal, after it); outputs at padding are 0, as the library's layers give."""

    window = 3

    def __init__(self, d_model: int, n_heads: int, causal: bool):
        super().__init__()
        self.n_heads, self.causal = n_heads, causal
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    @classmethod
    def from_config(cls, config: ModelConfig) -> WindowAttention:
        return cls(config.d_model, config.n_heads, config.causal)

    def forward(self, x: Tensor, key_padding_mask=None, cache=None, right_padded=None) -> Tensor:
        if cache is not None:
            raise ValueError("the window attention does not decode")
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        i = torch.arange(T)
        gap = i[:, None] - i[None, :]
        allowed = (gap >= 0 if self.causal else gap.abs() >= 0) & (gap.abs() < self.window)
        allowed = allowed.expand(B, 1, T, T)
        if key_padding_mask is not None:
            allowed = allowed & key_padding_mask[:, None, None, :]
        o = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        y = self.out(o.nan_to_num().transpose(1, 2).reshape(B, T, D))
        return y if key_padding_mask is None else y.masked_fill(~key_padding_mask[..., None], 0)


@pytest.fixture
def window_registered(monkeypatch):
    monkeypatch.setitem(ATTENTIONS, "window", WindowAttention.from_config)  # the one line


def test_a_registered_attention_builds_the_models(window_registered):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=11, num_classes=3, max_len=16, d_model=16, n_heads=2,
                         n_layers=2, attention="window")  # fmt: skip
    classifier = SequenceClassifier(config)
    assert all(isinstance(b.attn, WindowAttention) for b in classifier.encoder.blocks)
    tokens = torch.randint(1, 11, (2, 9))
    assert classifier(tokens).logits.shape == (2, 3)
    lm = CausalLM(config.replace(causal=True)).eval()
    logits = lm(tokens).logits
    changed = tokens.clone()
    changed[:, 6:] = 1  # the future changes: the past's logits do not
    torch.testing.assert_close(lm(changed).logits[:, :6], logits[:, :6])


def test_a_registered_attention_trains_through_the_engine(window_registered, tmp_path):
    (tmp_path / "data").mkdir()
    cfg = tiny_listops(tmp_path / "data", tmp_path / "run", 4)
    cfg = dataclasses.replace(cfg, model=cfg.model.replace(attention="window"))
    results = train(cfg, progress=False)
    assert 0.0 <= results["test_acc"] <= 1.0
    assert "attention: window" in (tmp_path / "run" / "config.yaml").read_text()


def test_params_counts_every_registered_attention(window_registered, tmp_path):
    out = tmp_path / "params.json"
    main(["params", "--out", str(out)])
    counts = json.loads(out.read_text())["parameters"]
    assert set(counts) == {"hkt", "mha", "window"}
    assert counts["window"] == counts["mha"]  # the same projections, another pattern


def test_an_unknown_attention_names_the_registered_ones():
    with pytest.raises(ValueError, match="hkt, mha.*'windw'"):
        ModelConfig(attention="windw")


def test_reproduce_trains_a_registered_attention_by_name(window_registered, lra_data_dir,
                                                         tmp_path, capsys):  # fmt: skip
    """``reproduce --variants window`` needs no line of its own: a registered attention is the
    MHA experiment with ``model.attention`` set to it, a row of the table beside MHA."""
    out = tmp_path / "out"
    main([
        "reproduce", "--preset", "quick", "--tasks", "listops", "--seeds", "0", "--no-progress",
        "--variants", "mha", "window", "--out-dir", str(out), "--data-dir", str(lra_data_dir),
        "--set", "train.max_steps=2", "train.eval_every=2", "train.batch_size=4",
        "data.seq_len=32", "data.listops_min_length=4", "data.listops_sizes=[40,8,8]",
        "model.d_model=16", "model.n_layers=1",
    ])  # fmt: skip
    assert "window attention (registered)" in capsys.readouterr().out
    saved = (out / "quick" / "listops-window" / "seed0" / "config.yaml").read_text()
    assert "attention: window" in saved
    with pytest.raises(SystemExit, match=r"unknown variant\(s\) \['windw'\].*'window'"):
        main(["reproduce", "--variants", "windw", "--out-dir", str(out)])
