"""Byte-level causal language models, HKT against its MHA twin, as an :class:`Experiment`.

    structattn lm --model.attention hkt --seed 0      # bits per byte on held-out text + samples
    structattn lm --model.attention mha --seed 0      # the same budget with flat attention
    structattn generate runs/lm-hkt/seed0 --prompt "Hello" --max-new-tokens 200

The corpus is :mod:`structattn.data.corpus` (the SpamAssassin bodies by default, a **stand-in**;
IMDB reviews when present, or a text file of your own). The run folder holds what every run
writes (config, metrics, checkpoints, ``best.safetensors``, ``final.json`` with validation and
test bits per byte) plus ``hf/`` (the best weights as a transformers model:
``HKTForCausalLM.from_pretrained(run_dir / "hf")``) and ``samples.md`` (texts generated from the
first bytes of test documents).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from structattn.data.corpus import decode_ids, encode_text, load_corpus
from structattn.engine import Experiment, FitResult
from structattn.errors import RunError
from structattn.hkt.model import CausalLM, count_parameters
from structattn.utils.fingerprint import fingerprint

from .config import LMConfig
from .generate import HF_DIR, build_lm, check_lm_shapes, generate_text

__all__ = ["ByteLM", "bits_per_byte", "train_lm"]


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


class ByteLM(Experiment):
    """A causal LM over bytes: validation loss picks the best weights; bits per byte on the
    validation and test windows, and a few samples, are the report."""

    select = "neg_loss"

    def build_data(self) -> None:
        self.corpus = load_corpus(self.cfg.data)
        check_lm_shapes(self.cfg, self.corpus.vocab_size)  # before data.json is written
        self.train_set = self.corpus.train

    def data_identity(self) -> dict[str, Any]:
        c = self.corpus
        streams = [(w.stream, w.seq_len) for w in (c.train, c.val, c.test)]
        return {"source": c.source, "sha256": fingerprint(*streams, c.test_docs)}

    def build_model(self) -> CausalLM:
        return build_lm(self.cfg, self.corpus.vocab_size)

    def collate(self, items) -> dict[str, torch.Tensor]:
        return _collate(items)

    def _bpb(self, model, windows, max_batches: int | None = None) -> dict[str, float]:
        engine = self.engine
        return bits_per_byte(model, windows, self.cfg.train.batch_size, engine.device,
                             max_batches, engine.accelerator.autocast)  # fmt: skip

    def validate(self, model) -> dict[str, float]:
        return self._bpb(model, self.corpus.val, self.cfg.train.eval_batches)

    def report(self, model: CausalLM, fit: FitResult) -> dict[str, Any]:
        cfg, corpus = self.cfg, self.corpus
        val, test = self._bpb(model, corpus.val), self._bpb(model, corpus.test)
        samples = self._samples(model) if self.engine.is_main and cfg.samples else []
        return {
            "name": cfg.name,
            "attention": cfg.model.attention,
            "seed": cfg.seed,
            "data_source": corpus.source,
            "stand_in": corpus.stand_in,
            "seq_len": cfg.data.seq_len,
            "steps": fit.step,
            "best_step": fit.best["step"],
            "val_bpb": val["bpb"],
            "test_bpb": test["bpb"],
            "test_tokens": test["tokens"],
            "median_step_ms": fit.median_step_ms,
            "parameters": count_parameters(model),
            "samples": samples,
        }

    def _samples(self, model: CausalLM) -> list[dict[str, str]]:
        """``hf/`` written, then continuations of test-document openings into ``samples.md``."""
        from structattn.hkt.hf import HKTForCausalLM

        cfg, rd = self.cfg, self.engine.dir
        hf = HKTForCausalLM.from_causal_lm(model)
        hf.save_pretrained(rd.file(HF_DIR))
        keep = min(cfg.prompt_bytes, cfg.data.seq_len // 2)  # room left to generate
        prompts = [decode_ids(d[:keep].tolist()) for d in self.corpus.test_docs]
        prompts = [p for p in prompts if p][: cfg.samples]
        room = cfg.data.seq_len - max((len(encode_text(p)) for p in prompts), default=0)
        n_new = min(cfg.sample_tokens, room)  # what fits after the longest prompt
        texts = generate_text(hf, prompts, n_new, cfg.temperature, cfg.top_k, seed=cfg.seed)
        samples = [{"prompt": p, "continuation": t} for p, t in zip(prompts, texts)]
        lines = [f"# Samples of {cfg.name} (seed {cfg.seed}), {self.corpus.source}", ""]
        lines += [
            f"temperature {cfg.temperature}, top-k {cfg.top_k}, {cfg.sample_tokens} tokens; "
            "the prompt is the first bytes of a test document.",
            "",
        ]
        for i, s in enumerate(samples):
            lines += [f"## Sample {i + 1}", "", "Prompt:", "", "```", s["prompt"], "```", ""]
            lines += ["Continuation:", "", "```", s["continuation"], "```", ""]
        rd.write_text("samples.md", "\n".join(lines))
        return samples


def train_lm(cfg: LMConfig, progress: bool = True) -> dict:
    """Train ``cfg``; write ``final.json``, ``samples.md`` and ``hf/``; return the metrics."""
    return ByteLM(cfg, progress).run()
