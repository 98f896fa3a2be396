"""Byte-level causal language models, HKT against its MHA twin, on the training engine.

    structattn lm --model.attention hkt --seed 0      # bits per byte on held-out text + samples
    structattn lm --model.attention mha --seed 0      # the same budget with flat attention
    structattn generate runs/lm-hkt/seed0 --prompt "Hello" --max-new-tokens 200

The corpus is :mod:`structattn.data.corpus` (the SpamAssassin bodies by default, a **stand-in**;
IMDB reviews when present, or a text file of your own). The run directory holds what
``structattn train`` writes (config, metrics, checkpoints, ``best.safetensors``) plus ``hf/``
(the best weights as a transformers model: ``HKTForCausalLM.from_pretrained(run_dir / "hf")``),
``final.json`` (validation and test bits per byte) and ``samples.md`` (texts generated from the
first bytes of test documents).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.utils.data import DataLoader

from structattn.data.corpus import EOD, CorpusSpec, decode_ids, encode_text, load_corpus
from structattn.errors import ConfigError, RunError
from structattn.hkt.model import CausalLM, ModelConfig, count_parameters

from .checkpoint import atomic_write_text, load_run_weights
from .config import OptimConfig, TrainConfig, build_dataclass
from .engine import Engine, json_safe

__all__ = ["LMExperimentConfig", "bits_per_byte", "generate_text", "load_lm", "train_lm"]


def _default_model() -> ModelConfig:
    return ModelConfig(d_model=128, n_layers=2, n_heads=4, causal=True, dropout=0.1)


def _default_train() -> TrainConfig:
    return TrainConfig(max_steps=1000, batch_size=16, eval_every=100, eval_batches=50)


@dataclass
class LMExperimentConfig:
    """One byte-level language-model run."""

    name: str = "lm-hkt"  # run name (runs/<name>/seed<seed> unless run_dir is given)
    seed: int = 0  # model init, data order, dropout and sampling
    run_dir: Path | None = None  # output folder
    resume: bool = False  # continue from the run directory's latest checkpoint
    data: CorpusSpec = field(default_factory=CorpusSpec)
    model: ModelConfig = field(default_factory=_default_model)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=_default_train)
    samples: int = 3  # texts generated at the end, from the first bytes of test documents
    prompt_bytes: int = 64  # bytes of each test document used as the prompt
    sample_tokens: int = 200  # tokens generated per sample
    temperature: float = 0.8  # sampling temperature of the samples
    top_k: int = 40  # sampling from the top-k tokens

    def __post_init__(self) -> None:
        if not self.model.causal:
            self.model = self.model.replace(causal=True)
        for name in ("samples", "prompt_bytes", "sample_tokens", "top_k"):
            if getattr(self, name) < (0 if name == "samples" else 1):
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")

    def resolved_run_dir(self) -> Path:
        if self.run_dir is not None:
            return Path(self.run_dir)
        return Path("runs") / self.name / f"seed{self.seed}"


def _collate(windows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    tokens = torch.stack(windows)
    return {"tokens": tokens, "labels": tokens}


@torch.no_grad()
def bits_per_byte(
    model: CausalLM,
    windows,
    batch_size: int,
    device,
    max_batches: int | None = None,
    autocast=contextlib.nullcontext,
) -> dict[str, float]:
    """Mean next-token loss (nats) and bits per token over ``windows`` (every token after the
    first of each window is predicted; a token is one byte, or the end-of-document mark)."""
    if len(windows) == 0:
        raise RunError("cannot evaluate on an empty split")
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    loader = DataLoader(windows, batch_size=batch_size, shuffle=False, collate_fn=_collate)
    for i, batch in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        tokens = batch["tokens"].to(device)
        with autocast():
            logits = model(tokens).logits
        total += F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]),
            tokens[:, 1:].reshape(-1),
            reduction="sum",
        ).item()
        count += tokens[:, 1:].numel()
    model.train(was_training)
    loss = total / count
    return {"loss": loss, "bpb": loss / math.log(2), "neg_loss": -loss, "tokens": count}


def build_lm(cfg: LMExperimentConfig, vocab_size: int) -> CausalLM:
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


def train_lm(cfg: LMExperimentConfig, progress: bool = True) -> dict:
    """Train ``cfg``; write ``final.json``, ``samples.md`` and ``hf/``; return the metrics."""
    run_dir = cfg.resolved_run_dir()
    engine = Engine.for_experiment(cfg, run_dir, cfg.name, progress, select="neg_loss")
    corpus = load_corpus(cfg.data)
    model = build_lm(cfg, corpus.vocab_size)
    acc = engine.accelerator
    tc = cfg.train

    def validate(m: nn.Module) -> dict[str, float]:
        return bits_per_byte(
            m, corpus.val, tc.batch_size, engine.device, tc.eval_batches, acc.autocast
        )

    result = engine.fit(model, corpus.train, _collate, validate)
    if result.paused:
        return {"name": cfg.name, "paused_at": result.step, "run_dir": str(run_dir)}
    raw = result.model
    engine.load_best(raw)
    val = bits_per_byte(raw, corpus.val, tc.batch_size, engine.device, autocast=acc.autocast)
    test = bits_per_byte(raw, corpus.test, tc.batch_size, engine.device, autocast=acc.autocast)
    samples = []
    if engine.is_main and cfg.samples:
        from structattn.hkt.hf import HKTForCausalLM

        hf = HKTForCausalLM.from_causal_lm(raw)
        hf.save_pretrained(run_dir / "hf")
        keep = min(cfg.prompt_bytes, cfg.data.seq_len // 2)  # room left to generate
        prompts = [decode_ids(d[:keep].tolist()) for d in corpus.test_docs]
        prompts = [p for p in prompts if p][: cfg.samples]
        texts = generate_text(
            hf, prompts, cfg.sample_tokens, cfg.temperature, cfg.top_k, seed=cfg.seed
        )
        samples = [{"prompt": p, "continuation": t} for p, t in zip(prompts, texts)]
        lines = [f"# Samples of {cfg.name} (seed {cfg.seed}), {corpus.source}", ""]
        lines += [
            f"temperature {cfg.temperature}, top-k {cfg.top_k}, {cfg.sample_tokens} tokens; "
            "the prompt is the first bytes of a test document.",
            "",
        ]
        for i, s in enumerate(samples):
            lines += [f"## Sample {i + 1}", "", "Prompt:", "", "```", s["prompt"], "```", ""]
            lines += ["Continuation:", "", "```", s["continuation"], "```", ""]
        atomic_write_text(run_dir / "samples.md", "\n".join(lines))
    final = {
        "name": cfg.name,
        "attention": cfg.model.attention,
        "seed": cfg.seed,
        "data_source": corpus.source,
        "stand_in": corpus.stand_in,
        "seq_len": cfg.data.seq_len,
        "steps": result.step,
        "best_step": result.best["step"],
        "val_bpb": val["bpb"],
        "test_bpb": test["bpb"],
        "test_tokens": test["tokens"],
        "median_step_ms": result.median_step_ms,
        "parameters": count_parameters(raw),
        "samples": samples,
    }
    engine.write_json("final.json", final)
    return json_safe(final)


def load_lm(path: Path):
    """A trained language model as an ``HKTForCausalLM`` (eval mode) from a run directory (its
    ``hf/`` folder, else its config and best weights or latest checkpoint) or from a
    ``save_pretrained`` folder; ``model.lm`` is the :class:`CausalLM`."""
    from structattn.hkt.hf import HKTForCausalLM

    path = Path(path)
    for folder in (path, path / "hf"):
        if (folder / "config.json").is_file():
            try:
                return HKTForCausalLM.from_pretrained(folder).eval()
            except Exception as err:  # damaged files: say which
                msg = f"{folder}: cannot load the model ({type(err).__name__}: {err})"
                raise RunError(msg) from None
    config = path / "config.yaml"
    if not config.is_file():
        raise RunError(f"{path} is neither a language-model run nor a save_pretrained folder")
    try:
        values = yaml.safe_load(config.read_text())
    except yaml.YAMLError as err:
        raise RunError(f"{config} is not valid YAML ({err})") from None
    values = {k: v for k, v in (values or {}).items() if k != "resume"}
    cfg = build_dataclass(LMExperimentConfig, values, "")
    from structattn.data.corpus import VOCAB_SIZE

    model = build_lm(cfg, VOCAB_SIZE)
    load_run_weights(model, path)
    return HKTForCausalLM.from_causal_lm(model).eval()
