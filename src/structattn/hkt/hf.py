"""HKT and MHA causal language models as transformers models.

:class:`HKTForCausalLM` wraps :class:`~structattn.hkt.CausalLM` (HKT attention, or the flat
multi-head-attention twin with ``attention="mha"``) as a ``PreTrainedModel``: ``save_pretrained``
/ ``from_pretrained`` (safetensors), ``labels=`` loss, and transformers' ``generate`` with its
sampling, beam search, stopping criteria and streamers.

The cache is this project's :class:`~structattn.hkt.decoding.cache.LMCache`, not a transformers
``Cache``: transformers' caches hold one key/value pair per layer, while an HKT layer holds keys
at every level, the current coarse queries and the convolution windows. The model therefore
tells ``generate`` not to build a ``DynamicCache`` and creates its own cache on the first
forward pass; ``generate`` hands it back on every step (the same route transformers' recurrent
models take) and reorders it for beam search through ``LMCache.reorder_cache``.

Left-padded prompts (what ``generate`` expects for batches of different lengths) are run
left-aligned, so every prompt in a batch gives the tokens it gives alone.

Example::

    from structattn.hkt.hf import HKTLMConfig, HKTForCausalLM
    model = HKTForCausalLM(HKTLMConfig(vocab_size=260, d_model=128, n_layers=4))
    out = model.generate(prompt_ids, attention_mask=mask, max_new_tokens=50, do_sample=True)
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .attention import HKTConfig
from .decoding.cache import LMCache
from .model import CausalLM, ModelConfig

__all__ = ["HKTLMConfig", "HKTForCausalLM"]

_MODEL_FIELDS = ("vocab_size", "max_len", "d_model", "n_layers", "n_heads", "mlp_ratio")
_MODEL_FIELDS += ("attention", "dropout")


class HKTLMConfig(PretrainedConfig):
    """Configuration of :class:`HKTForCausalLM`: the fields of
    :class:`~structattn.hkt.ModelConfig` (``hkt`` as a dict of :class:`HKTConfig` options)."""

    model_type = "structattn_hkt_lm"

    def __init__(
        self,
        vocab_size: int = 257,
        max_len: int = 1024,
        d_model: int = 128,
        n_layers: int = 2,
        n_heads: int = 4,
        mlp_ratio: int = 2,
        attention: str = "hkt",
        dropout: float = 0.1,
        hkt: dict | None = None,
        pad_token_id: int | None = 0,
        tie_word_embeddings: bool = True,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.max_len = max_len
        self.d_model = d_model
        self.n_layers = n_layers
        self.n_heads = n_heads
        self.mlp_ratio = mlp_ratio
        self.attention = attention
        self.dropout = dropout
        self.hkt = dict(hkt or {})
        # transformers reads these names
        self.hidden_size = d_model
        self.num_hidden_layers = n_layers
        self.num_attention_heads = n_heads
        self.max_position_embeddings = max_len
        super().__init__(
            pad_token_id=pad_token_id, tie_word_embeddings=tie_word_embeddings, **kwargs
        )
        self.model_config()  # validate now, not at the first forward pass

    def model_config(self) -> ModelConfig:
        """The :class:`ModelConfig` of the wrapped :class:`CausalLM`."""
        fields = {name: getattr(self, name) for name in _MODEL_FIELDS}
        return ModelConfig(**fields, causal=True, hkt=HKTConfig(**self.hkt))

    @classmethod
    def from_model_config(cls, config: ModelConfig, **kwargs) -> HKTLMConfig:
        hkt = dataclasses.asdict(config.hkt)
        for name in ("d_model", "n_heads", "causal"):  # the model's own
            hkt.pop(name)
        fields = {name: getattr(config, name) for name in _MODEL_FIELDS}
        return cls(**fields, hkt=hkt, **kwargs)


class HKTForCausalLM(PreTrainedModel, GenerationMixin):
    """A causal HKT (or MHA) language model with transformers' interface (see the module
    docstring). ``model.lm`` is the wrapped :class:`CausalLM`."""

    config_class = HKTLMConfig
    base_model_prefix = "lm"
    main_input_name = "input_ids"
    _tied_weights_keys = {"lm.lm_head.weight": "lm.encoder.tok.weight"}

    def __init__(self, config: HKTLMConfig):
        super().__init__(config)
        self.lm = CausalLM(config.model_config())
        self.post_init()

    def _init_weights(self, module) -> None:
        """The wrapped modules initialise themselves (the same as :class:`CausalLM`)."""

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model brings its own multi-level cache (see the module docstring)

    @classmethod
    def from_causal_lm(cls, model: CausalLM, **config_kwargs) -> HKTForCausalLM:
        """Wrap trained weights: a model of the same configuration holding ``model``'s."""
        wrapped = cls(HKTLMConfig.from_model_config(model.config, **config_kwargs))
        wrapped.lm.load_state_dict(model.state_dict())
        return wrapped.to(next(model.parameters()).dtype)

    def get_input_embeddings(self):
        return self.lm.encoder.tok

    def set_input_embeddings(self, value) -> None:
        self.lm.encoder.tok = value

    def get_output_embeddings(self):
        return self.lm.lm_head

    def generate(self, inputs=None, *args, **kwargs):
        """``GenerationMixin.generate``; an empty batch (0 prompts) returns its empty input
        (transformers' stopping criteria cannot reduce over zero sequences)."""
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        if isinstance(ids, torch.Tensor) and ids.ndim == 2 and ids.shape[0] == 0:
            return ids
        return super().generate(inputs, *args, **kwargs)

    def new_cache(self) -> LMCache:
        return self.lm.new_cache()

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        cache: LMCache | None = None,
        labels: Tensor | None = None,
        use_cache: bool | None = None,
        past_key_values: LMCache | None = None,
        inputs_embeds: Tensor | None = None,
        position_ids: Tensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits ``(B, T, vocab)``, ``loss`` with ``labels`` (shifted inside, ``-100``
        ignored) and, with ``use_cache``, the cache: the first call runs the prompt (padding
        on either side), later calls take the next tokens of every sequence.

        ``position_ids`` are accepted for compatibility and must be the ones the padding
        implies (each row's real tokens numbered from 0); other positions are refused."""
        if inputs_embeds is not None:
            raise ValueError("HKTForCausalLM takes input_ids, not inputs_embeds")
        if input_ids is None:
            raise ValueError("input_ids are required")
        cache = cache if cache is not None else past_key_values
        if use_cache is None:
            use_cache = cache is not None
        if cache is None and use_cache:
            cache = self.lm.new_cache()
        mask = None
        if attention_mask is not None:
            if cache is not None and not cache.is_empty:
                new = attention_mask[:, -input_ids.shape[1] :]
                if not bool(new.bool().all()):
                    raise ValueError("tokens decoded with a cache must be real (attention_mask 1)")
            else:
                mask = attention_mask.bool()
                if bool(mask.all()):
                    mask = None
        if position_ids is not None:
            self._check_positions(position_ids, mask, cache, input_ids)
        out = self.lm(input_ids, mask, labels=labels, cache=cache)
        return CausalLMOutputWithPast(loss=out.loss, logits=out.logits, cache=out.cache)

    @staticmethod
    def _check_positions(position_ids, mask, cache, input_ids) -> None:
        B, T = input_ids.shape
        if cache is not None and not cache.is_empty:
            implied = cache.lengths[:, None] + torch.arange(T, device=input_ids.device)
            rows = torch.ones_like(implied, dtype=torch.bool)
        elif mask is None:
            implied = torch.arange(T, device=input_ids.device).expand(B, T)
            rows = torch.ones(B, T, dtype=torch.bool, device=input_ids.device)
        else:
            implied = mask.long().cumsum(1) - 1
            rows = mask
        got = position_ids.expand(B, T).to(implied.device)
        if bool(((got != implied) & rows).any()):
            raise ValueError(
                "position_ids must number each row's real tokens from 0 (the model derives "
                "them from the padding); other positions are not supported"
            )
