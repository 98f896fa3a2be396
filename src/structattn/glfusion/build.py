"""The one function that builds GL-Fusion from files on disk: a local Llama-style LLM (a
transformers folder or a GGUF file) and a sentence encoder, with the graph tokens added and,
optionally, LoRA adapters."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from structattn.errors import ConfigError

from .configuration import GLFusionConfig
from .loading import encode_texts, llm_layer_count, load_llm, load_text_encoder
from .modeling import GLFusionForCausalLM, apply_lora

__all__ = ["GLFusionParts", "build_glfusion", "check_layers", "stop_token_ids"]


def check_layers(num_layers: int | None, llm: object, **layers: list[int] | None) -> None:
    """Every index of ``layers`` (``message_passing_layers=[...]``, ``cross_attention_layers=
    [...]``; ``None``: the defaults, always in range) names a decoder layer of an LLM with
    ``num_layers`` layers (``llm`` names it in the error); ``None`` layers: not checked."""
    if num_layers is None:
        return
    for key, indices in layers.items():
        bad = [i for i in indices or () if not 0 <= i < num_layers]
        if bad:
            raise ConfigError(
                f"{key} {bad}: the LLM {llm} has {num_layers} decoder layers, so indices "
                f"must be in 0..{num_layers - 1}"
            )


@dataclass
class GLFusionParts:
    """What :func:`build_glfusion` returns: the model, the LLM's tokenizer, and ``encode``
    (node texts -> token encodings and masks, the form :class:`GraphBatch` takes)."""

    model: GLFusionForCausalLM
    tokenizer: object
    encoder: object
    encoder_tokenizer: object
    text_tokens: int = 32

    def encode(self, texts: list[str]) -> tuple[Tensor, Tensor]:
        """``(N, text_tokens, dim)`` encodings and ``(N, text_tokens)`` masks of ``texts``."""
        return encode_texts(texts, self.encoder, self.encoder_tokenizer, self.text_tokens,
                            progress=False)  # fmt: skip


def build_glfusion(
    llm: str | Path | None = None,
    encoder: str | Path | None = None,
    *,
    num_node_classes: int = 2,
    lora_r: int = 0,
    lora_alpha: int = 16,
    dtype: torch.dtype = torch.float32,
    text_tokens: int = 32,
    **config,
) -> GLFusionParts:
    """GL-Fusion around the LLM at ``llm`` (a folder or ``.gguf``; default: SmolLM2-135M of
    ``make models``) reading node texts with the encoder at ``encoder`` (default:
    all-MiniLM-L6-v2); ``config`` sets any :class:`GLFusionConfig` field (``text_dim`` comes
    from the encoder). ``lora_r > 0`` puts LoRA adapters on the (then frozen) LLM. Layer
    indices are checked against the LLM's ``config.json`` (or GGUF header) before any weight
    loads."""
    layers = {k: config.get(k) for k in ("message_passing_layers", "cross_attention_layers")}
    check_layers(llm_layer_count(llm), llm or "SmolLM2-135M", **layers)
    base, tokenizer = load_llm(llm, dtype=dtype)
    enc_model, enc_tok = load_text_encoder(encoder)
    gl_config = GLFusionConfig(text_dim=enc_model.config.hidden_size,
                               num_node_classes=num_node_classes, **config)  # fmt: skip
    model = GLFusionForCausalLM.from_base(base, gl_config, tokenizer=tokenizer)
    if lora_r > 0:
        model = apply_lora(model, r=lora_r, alpha=lora_alpha)
    return GLFusionParts(model.eval(), tokenizer, enc_model, enc_tok, text_tokens)


def stop_token_ids(tokenizer) -> list[int]:
    """The tokenizer's end-of-text id and, where its vocabulary has one, the end-of-turn token
    of chat models (``<|im_end|>``, ``<|eot_id|>``, ``<|end|>``, ``<end_of_turn>``), last."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    vocab = tokenizer.get_vocab()
    ids += [vocab[t] for t in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
            if t in vocab]  # fmt: skip
    return list(dict.fromkeys(ids))
