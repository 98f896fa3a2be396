"""The config of one byte-level language-model run."""

from __future__ import annotations

from dataclasses import dataclass, field

from structattn.data.corpus import CorpusSpec
from structattn.engine.config import RunConfig, TrainConfig
from structattn.hkt.model import ModelConfig

__all__ = ["LMConfig"]


def _default_model() -> ModelConfig:
    return ModelConfig(d_model=128, n_layers=2, n_heads=4, causal=True, dropout=0.1)


def _default_train() -> TrainConfig:
    return TrainConfig(max_steps=1000, batch_size=16, eval_every=100, eval_batches=50)


@dataclass
class LMConfig(RunConfig):
    """One byte-level language-model run."""

    name: str = "lm-hkt"  # run name (runs/<name>/seed<seed> unless run_dir is given)
    train: TrainConfig = field(default_factory=_default_train)  # steps, batch, eval, stop_at
    data: CorpusSpec = field(default_factory=CorpusSpec)  # the text corpus and window length
    model: ModelConfig = field(default_factory=_default_model)  # always causal
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
