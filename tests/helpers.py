"""Small models and tokenizers shared by the GL-Fusion tests (imported as ``helpers``)."""

from __future__ import annotations

import torch
from transformers import BertTokenizer, LlamaConfig, LlamaForCausalLM


def tiny_llama(vocab_size: int, *, layers: int = 4, seed: int = 0) -> LlamaForCausalLM:
    """A random Llama with hidden size 32 (float32, eval mode)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config).eval()


def word_tokenizer(path, words) -> BertTokenizer:
    """A word-level BERT tokenizer over ``words`` (special tokens first), vocab file at ``path``."""
    vocab = list(dict.fromkeys(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *words]))
    path.write_text("\n".join(vocab) + "\n")
    return BertTokenizer(str(path))
