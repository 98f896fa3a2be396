"""Text from a trained byte-level language model, and loading one from a run folder."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from structattn.data.corpus import EOD, VOCAB_SIZE, decode_ids, encode_text
from structattn.engine import RunDir, build_dataclass
from structattn.engine.experiment import check_data_decided
from structattn.errors import ConfigError, RunError
from structattn.hkt.model import CausalLM

from .config import LMConfig

__all__ = ["build_lm", "check_lm_shapes", "generate_text", "load_lm"]

#: The transformers-format copy of the best weights in a language-model run folder.
HF_DIR = "hf"


def check_lm_shapes(cfg: LMConfig, vocab_size: int) -> None:
    """The model's vocabulary is the corpus's (``vocab_size``), its longest sequence
    ``data.seq_len``: ``model.vocab_size`` / ``max_len`` set to other values are a ConfigError
    (left at their defaults, the data decides them)."""
    check_data_decided(cfg.model, {"vocab_size": (vocab_size, "the byte corpus"),
                                   "max_len": (cfg.data.seq_len, "data.seq_len")},
                       "model")  # fmt: skip


def build_lm(cfg: LMConfig, vocab_size: int) -> CausalLM:
    """The language model of ``cfg`` on a corpus of ``vocab_size`` tokens
    (:func:`check_lm_shapes`)."""
    check_lm_shapes(cfg, vocab_size)
    return CausalLM(cfg.model.replace(vocab_size=vocab_size, max_len=cfg.data.seq_len))


def generate_text(
    model: CausalLM,
    prompts: list[str],
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 40,
    do_sample: bool = True,
    seed: int = 0,
) -> list[str]:
    """Continuations of ``prompts`` through transformers' ``generate`` on the model's decoding
    cache (left-padded batch; stops at the end-of-document mark or ``max_len``)."""
    from structattn.hkt.hf import HKTForCausalLM

    if not prompts or any(not p for p in prompts):
        raise ConfigError("prompts must be non-empty strings")
    hf = model if isinstance(model, HKTForCausalLM) else HKTForCausalLM.from_causal_lm(model)
    hf.eval()
    lm = hf.lm
    encoded = [encode_text(p) for p in prompts]
    longest = max(len(e) for e in encoded)
    room = lm.config.max_len - longest
    if room < 1:
        raise ConfigError(
            f"the prompt ({longest} tokens) leaves no room in max_len={lm.config.max_len}"
        )
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, e in enumerate(encoded):
        ids[b, longest - len(e) :], mask[b, longest - len(e) :] = e, 1
    if max_new_tokens > room:
        warnings.warn(
            f"max_new_tokens={max_new_tokens} does not fit: a {longest}-token prompt leaves "
            f"{room} of max_len={lm.config.max_len}; generating at most {room} tokens",
            UserWarning,
            stacklevel=2,
        )
    device = next(hf.parameters()).device
    torch.manual_seed(seed)
    kwargs = dict(do_sample=do_sample)
    if do_sample:
        kwargs.update(temperature=temperature, top_k=top_k)
    out = hf.generate(
        ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=min(max_new_tokens, room),
        eos_token_id=EOD,
        pad_token_id=0,
        **kwargs,
    )
    return [decode_ids(row[longest:].tolist()) for row in out]


def load_lm(path: Path):
    """A trained language model as an ``HKTForCausalLM`` (eval mode) from a run directory (its
    ``hf/`` folder, else its config and best weights or latest checkpoint) or from a
    ``save_pretrained`` folder; ``model.lm`` is the :class:`CausalLM`."""
    from structattn.hkt.hf import HKTForCausalLM

    path = Path(path)
    for folder in (path, path / HF_DIR):
        if (folder / "config.json").is_file():
            try:
                return HKTForCausalLM.from_pretrained(folder, use_safetensors=True).eval()
            except Exception as err:  # damaged files: say which
                msg = f"{folder}: cannot load the model ({type(err).__name__}: {err})"
                raise RunError(msg) from None
    rd = RunDir(path)
    if not rd.config.is_file():
        raise RunError(f"{path} is neither a language-model run nor a save_pretrained folder")
    values = {k: v for k, v in rd.read_config().items() if k != "resume"}
    try:
        cfg = build_dataclass(LMConfig, values)
    except ConfigError as err:
        raise RunError(f"{rd.config}: {err}") from None
    model = build_lm(cfg, VOCAB_SIZE)
    rd.load_weights(model)
    return HKTForCausalLM.from_causal_lm(model).eval()
