"""Continuing a prompt, with its graph, on a key/value cache. A mixin of
:class:`~.modeling.GLFusionForCausalLM`, whose passes (``_pass``, ``_decoder``) it calls."""

from __future__ import annotations

import torch
from torch import Tensor

from .graph import GraphBatch
from .layers import GraphPass, inner_model, token_ids
from .masking import node_position_ids

__all__ = ["GraphGeneration"]


class GraphGeneration:
    """``generate`` and the prefill / decoding steps it is made of."""

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        graph: GraphBatch | None = None,
        *,
        max_new_tokens: int = 20,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int = 0,
        seed: int | None = None,
        return_logits: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Continue each prompt (a graph may sit in it) with a key/value cache.

        The prompt runs once (the prefill) as in :meth:`forward`; each new token reads the
        cache and, as text after the graph, cross-attends to its graph (what each layer reads
        is kept from the first step). Prompts may be padded on either side.

        Returns the new tokens ``(B, N)`` (``pad_token_id`` after a sequence's
        ``eos_token_id``, one id or a list: the tokenizer's end-of-text and end-of-turn), and
        with ``return_logits`` also the logits each was chosen from, ``(B, N, vocab)``.
        Greedy unless ``do_sample`` (with ``temperature`` and ``top_k``);
        ``<graph_start>``, ``<node>`` and ``<graph_end>`` are never chosen.
        """
        from transformers import DynamicCache

        B, dev = input_ids.shape[0], input_ids.device
        mask, next_pos = self._generation_start(input_ids, attention_mask, max_new_tokens)
        if do_sample and temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        generator = None if seed is None else torch.Generator(device=dev).manual_seed(seed)
        cache = DynamicCache(config=inner_model(self.base).config)
        memory: dict = {}  # what each cross-attention layer reads, for every step
        step_logits, after_graph = self._prefill(input_ids, mask, graph, cache, memory)
        cfg = self.config
        special = torch.tensor([cfg.graph_start_id, cfg.node_id, cfg.graph_end_id], device=dev)
        stops = token_ids(eos_token_id, dev)
        keys = mask.clone()
        tokens, chosen = [], []
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        for t in range(max_new_tokens):
            chosen.append(step_logits)
            # the graph's special tokens are never generated: a new <node> has no node
            allowed = step_logits.index_fill(-1, special, float("-inf"))
            tok = self._choose(allowed, do_sample, temperature, top_k, generator)
            tok = tok.masked_fill(done, pad_token_id)
            tokens.append(tok)
            if stops is not None:
                done = done | torch.isin(tok, stops)
            if t == max_new_tokens - 1 or bool(done.all()):
                break
            keys = torch.cat([keys, torch.ones_like(keys[:, :1])], dim=-1)
            step_logits = self._decode_step(
                tok[:, None], keys, next_pos + t, cache, graph, after_graph, memory
            )
        out = torch.stack(tokens, dim=1)
        return (out, torch.stack(chosen, dim=1)) if return_logits else out

    def _prefill(self, input_ids, mask, graph, cache, memory) -> tuple[Tensor, Tensor]:
        """The prompt's pass into ``cache`` (and, in the gated form, what cross-attention reads
        into ``memory``): the logits after each row's last real token ``(B, vocab)`` and which
        rows have a graph ``(B,)``."""
        B, S = input_ids.shape
        prefill_memory = memory if self.gated else None  # the paper's form projects it later
        logits = self._pass(input_ids, mask, graph, cache, prefill_memory).logits
        last = S - 1 - mask.bool().flip(-1).long().argmax(-1)  # (B,) last real column
        step_logits = logits[torch.arange(B, device=logits.device), last]
        if graph is None:
            return step_logits, torch.zeros(B, dtype=torch.bool, device=input_ids.device)
        has_graph = torch.bincount(graph.node_batch, minlength=B)[:B] > 0
        return step_logits, has_graph.to(input_ids.device)

    def _generation_start(self, input_ids, attention_mask, max_new_tokens: int):
        """The checked prompt mask ``(B, S)`` long and each row's next position ``(B,)``."""
        B, S = input_ids.shape
        if S == 0:
            raise ValueError("cannot generate from an empty prompt (no tokens)")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
        if tuple(mask.shape) != (B, S):
            raise ValueError(f"attention_mask must be (B, S) = {(B, S)}, got {tuple(mask.shape)}")
        if not bool(mask.bool().any(-1).all()):
            raise ValueError("cannot generate from an empty prompt (a row without real tokens)")
        limit = getattr(inner_model(self.base).config, "max_position_embeddings", None)
        positions = node_position_ids(input_ids == self.config.node_id, mask)
        next_pos = positions.max(-1).values + 1  # (B,)
        if limit is not None and int(next_pos.max()) + max_new_tokens > limit:
            raise ValueError(
                f"prompt + max_new_tokens reach position {int(next_pos.max()) + max_new_tokens}, "
                f"past the base model's max_position_embeddings={limit}"
            )
        return mask, next_pos

    @staticmethod
    def _choose(logits, do_sample, temperature, top_k, generator) -> Tensor:
        if not do_sample:
            return logits.argmax(-1)
        scores = logits.float() / temperature
        if top_k and top_k < scores.shape[-1]:
            kth = scores.topk(top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        return torch.multinomial(scores.softmax(-1), 1, generator=generator)[:, 0]

    def _decode_step(self, tok, keys, pos, cache, graph, after_graph, memory=None) -> Tensor:
        """Logits ``(B, vocab)`` after the text tokens ``tok (B, 1)`` at positions ``pos (B,)``;
        ``keys (B, K)`` marks the real cached keys plus the new one."""
        inner = inner_model(self.base)
        embeds = inner.get_input_embeddings()(tok)  # (B, 1, D)
        allowed = keys.bool()[:, None, None, :]  # (B, 1, 1, K): every real key so far
        graph_pass = None
        if graph is not None:
            empty = torch.zeros(0, 2, dtype=torch.long, device=tok.device)
            graph_pass = GraphPass(self, graph, empty, after_graph=after_graph, memory=memory)
        out = self._decoder(embeds, allowed, pos[:, None], graph_pass, cache)
        return out.logits[:, -1]
