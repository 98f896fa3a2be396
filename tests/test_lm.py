"""Byte-level language models: the corpus, bits per byte, the `lm` and `generate` commands."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from structattn.cli import main  # noqa: E402
from structattn.data.corpus import (  # noqa: E402
    EOD,
    VOCAB_SIZE,
    CorpusSpec,
    decode_ids,
    encode_text,
    load_corpus,
)
from structattn.errors import ConfigError, DataError, RunError  # noqa: E402
from structattn.experiments.lm import (  # noqa: E402
    LMConfig,
    bits_per_byte,
    generate_text,
    load_lm,
    train_lm,
)
from structattn.hkt import CausalLM, ModelConfig  # noqa: E402

DOCS = [
    "the cat sat on the mat. " * 6,
    "a dog ran in the park, then home. " * 5,
    "numbers: 1 2 3 4 5 6 7 8 9 10. " * 4,
    "café, naïve, jalapeño — unicode text. " * 4,
    "hierarchical attention over levels. " * 5,
    "short one.",
    "the quick brown fox jumps over the lazy dog. " * 4,
    "last document of the toy corpus here. " * 4,
]


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(DOCS), encoding="utf-8")
    return path


def test_bytes_roundtrip_and_special_ids():
    text = "héllo → wörld"
    ids = encode_text(text)
    assert ids.dtype == torch.long and int(ids.min()) >= 1 and int(ids.max()) <= 256
    assert decode_ids(ids.tolist()) == text
    assert decode_ids([0, *ids.tolist(), EOD, 0]) == text  # padding and EOD dropped
    assert VOCAB_SIZE == EOD + 1


def test_corpus_split_is_fixed_and_windows_cover_the_streams(text_file):
    a = load_corpus(CorpusSpec(text_file=text_file, seq_len=16))
    b = load_corpus(CorpusSpec(text_file=text_file, seq_len=16))
    assert torch.equal(a.train.stream, b.train.stream)
    total = sum(len(encode_text(d.strip())) + 1 for d in DOCS)  # + EOD per document
    assert sum(len(getattr(a, s).stream) for s in ("train", "val", "test")) == total
    assert len(a.train) == len(a.train.stream) // 16
    assert torch.equal(a.train[1], a.train.stream[16:32])
    with pytest.raises(IndexError):
        a.train[len(a.train)]
    assert not a.stand_in and "corpus.txt" in a.summary()


def test_corpus_bad_input_is_named(tmp_path, text_file):
    with pytest.raises(FileNotFoundError, match="text file not found"):
        load_corpus(CorpusSpec(text_file=tmp_path / "missing.txt"))
    two = tmp_path / "two.txt"
    two.write_text("one\n\ntwo")
    with pytest.raises(DataError, match="at least 3 documents"):
        load_corpus(CorpusSpec(text_file=two))
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"caf\xe9\n\nx\n\ny")
    with pytest.raises(DataError, match="not UTF-8"):
        load_corpus(CorpusSpec(text_file=latin))
    with pytest.raises(ConfigError, match="fewer than seq_len"):
        load_corpus(CorpusSpec(text_file=text_file, seq_len=5000))
    with pytest.raises(ValueError, match="seq_len"):
        CorpusSpec(seq_len=1)


def test_bits_per_byte_of_a_uniform_model_is_log2_vocab(text_file):
    corpus = load_corpus(CorpusSpec(text_file=text_file, seq_len=16))
    model = CausalLM(ModelConfig(vocab_size=VOCAB_SIZE, max_len=16, d_model=8, n_heads=2))
    with torch.no_grad():
        model.lm_head.weight.zero_()  # tied: every logit 0
    out = bits_per_byte(model, corpus.val, batch_size=4, device="cpu")
    assert out["bpb"] == pytest.approx(math.log2(VOCAB_SIZE), abs=1e-6)
    assert out["tokens"] == len(corpus.val) * 15


def test_lm_run_generate_and_reload(tmp_path, text_file, capsys):
    run = tmp_path / "run"
    cfg = LMConfig(
        run_dir=run,
        data=CorpusSpec(text_file=text_file, seq_len=32),
        model=ModelConfig(d_model=16, n_layers=1, n_heads=2, dropout=0.0),
        samples=2,
        prompt_bytes=8,
        sample_tokens=10,
    )
    cfg.train.max_steps, cfg.train.eval_every, cfg.train.batch_size = 6, 3, 4
    final = train_lm(cfg, progress=False)
    assert final["steps"] == 6 and math.isfinite(final["test_bpb"])
    assert 1 <= len(final["samples"]) <= 2 and (run / "samples.md").is_file()
    assert json.loads((run / "final.json").read_text())["val_bpb"] == final["val_bpb"]

    model = load_lm(run)
    ids = torch.randint(1, 257, (2, 20))
    ref = model(ids).logits
    shutil.rmtree(run / "hf")  # from config.yaml and best.safetensors instead
    assert torch.allclose(load_lm(run)(ids).logits, ref)

    greedy = generate_text(model, ["the cat", "a"], max_new_tokens=5, do_sample=False)
    again = generate_text(model, ["the cat"], max_new_tokens=5, do_sample=False)
    assert greedy[0] == again[0]

    main(["generate", str(run), "--prompt", "the ", "--max-new-tokens", "5", "--greedy"])
    printed = capsys.readouterr().out
    assert printed.startswith("the ")
    with pytest.raises(SystemExit, match="max_new_tokens"):
        main(["generate", str(run), "--max-new-tokens", "0"])
    with pytest.raises(SystemExit, match="neither"):
        main(["generate", str(tmp_path)])
    with pytest.raises(ConfigError, match="non-empty"):
        generate_text(model, [""])
    with pytest.raises(ConfigError, match="no room"):
        generate_text(model, ["x" * 40])


def test_lm_damaged_weights_are_named(tmp_path, text_file):
    run = tmp_path / "run"
    cfg = LMConfig(
        run_dir=run,
        data=CorpusSpec(text_file=text_file, seq_len=32),
        model=ModelConfig(d_model=16, n_layers=1, n_heads=2),
        samples=0,
    )
    cfg.train.max_steps, cfg.train.eval_every, cfg.train.batch_size = 2, 2, 4
    train_lm(cfg, progress=False)
    (run / "best.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(RunError, match="cannot load weights"):
        load_lm(run)
