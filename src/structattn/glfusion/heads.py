"""The twin predictor's heads: the GNN head over the final node states and the LM head scoring
label names as continuations of the prompt, their losses, and both heads' class distributions
with their ensemble. A mixin of :class:`~.modeling.GLFusionForCausalLM`, whose prompt pass
(``_prompt_pass``) it calls."""

from __future__ import annotations

import torch
from torch import Tensor

from .graph import GraphBatch
from .layers import mean_ce

__all__ = ["TwinHeads"]


class TwinHeads:
    """GNN head, LM head over label names, losses and ``predict``."""

    def node_logits(
        self, input_ids: Tensor, attention_mask: Tensor | None, graph: GraphBatch
    ) -> Tensor:
        """The GNN head over every node token, ``(M, num_node_classes)``, from one pass that
        projects no vocabulary logits but the last position's."""
        return self._prompt_pass(input_ids, attention_mask, graph, logits_to_keep=1).node_logits

    @staticmethod
    def _gnn_loss(node_logits: Tensor, node_labels: Tensor) -> Tensor:
        M, C = node_logits.shape
        if tuple(node_labels.shape) != (M,):
            raise ValueError(
                f"node_labels must be (M,) = ({M},), one per node, got {tuple(node_labels.shape)}"
            )
        bad = (node_labels != -100) & ((node_labels < 0) | (node_labels >= C))
        if bool(bad.any()):
            raise ValueError(
                f"node_labels {sorted(set(node_labels[bad].tolist()))} outside 0..{C - 1} "
                "(use -100 to ignore a node)"
            )
        return mean_ce(node_logits, node_labels)

    @staticmethod
    def lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
        """Next-token cross-entropy (labels shifted inside, -100 ignored; 0 when all are)."""
        if labels.shape != logits.shape[:2]:
            raise ValueError(
                f"labels must be (B, S) = {tuple(logits.shape[:2])}, got {tuple(labels.shape)}"
            )
        return mean_ce(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())

    @staticmethod
    def _block_mask(allowed: Tensor, blocks: Tensor) -> Tensor:
        """``allowed (B, 1, S, S)`` restricted so that a continuation sees only the prompt and
        itself."""
        same = blocks[:, :, None] == blocks[:, None, :]  # (B, S query, S key)
        prompt_key = (blocks == 0)[:, None, :]
        return allowed & (same | prompt_key)[:, None]

    @staticmethod
    def _block_positions(positions: Tensor, blocks: Tensor) -> Tensor:
        """Positions with every continuation numbered on from the prompt's last position."""
        B, S = blocks.shape
        idx = torch.arange(S, device=blocks.device).expand(B, S)
        in_prompt = blocks == 0
        next_pos = positions.masked_fill(~in_prompt, -1).max(-1, keepdim=True).values + 1
        change = torch.ones_like(in_prompt)
        change[:, 1:] = blocks[:, 1:] != blocks[:, :-1]
        start = torch.where(change, idx, torch.zeros_like(idx)).cummax(-1).values
        return torch.where(in_prompt, positions, next_pos + idx - start)

    def _score_pass(self, input_ids, attention_mask, graph, label_ids):
        """One forward pass of each prompt followed by every label name (as continuations):
        ``(scores (B, K), output)``."""
        if not label_ids:
            raise ValueError("label_ids is empty")
        for k, tokens in enumerate(label_ids):
            if len(tokens) == 0:
                raise ValueError(f"label {k} has no tokens")
        B, S = input_ids.shape
        dev = input_ids.device
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
        real = mask.bool()
        if not bool(real.any(-1).all()):
            raise ValueError("every prompt needs at least one real token")
        flat = torch.tensor([t for tokens in label_ids for t in tokens], device=dev)
        block = torch.tensor(
            [k + 1 for k, tokens in enumerate(label_ids) for _ in tokens], device=dev
        )
        n = flat.numel()
        ids = torch.cat([input_ids, flat.expand(B, n)], 1)
        full_mask = torch.cat([mask, torch.ones(B, n, dtype=mask.dtype, device=dev)], 1)
        blocks = torch.cat([torch.zeros(B, S, dtype=torch.long, device=dev), block.expand(B, n)], 1)
        last = S - 1 - real.flip(-1).long().argmax(-1)  # (B,) the prompt's last real token
        # the token at column S + j is predicted by the column before it, or for a label's
        # first token by the prompt's last real token
        first = torch.ones(n, dtype=torch.bool, device=dev)
        first[1:] = block[1:] != block[:-1]
        cols = S + torch.arange(n, device=dev) - 1
        pred = torch.where(first[None, :], last[:, None], cols[None, :])  # (B, n)
        # vocabulary logits of the predicting positions only: (B, n, vocab), not (B, S + n, vocab)
        out = self._prompt_pass(ids, full_mask, graph, blocks=blocks, logits_to_keep=pred)
        dtype = torch.promote_types(out.logits.dtype, torch.float32)
        logp = out.logits.to(dtype).log_softmax(-1)  # (B, n, vocab)
        token_logp = logp.gather(2, flat.expand(B, n)[..., None])[..., 0]  # (B, n)
        scores = torch.zeros(B, len(label_ids), dtype=dtype, device=dev)
        scores.index_add_(1, block - 1, token_logp)
        return scores, out

    @torch.no_grad()
    def score_labels(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None,
        graph: GraphBatch | None,
        label_ids: list[list[int]],
    ) -> Tensor:
        """Log-probability of each label name (token ids) right after each prompt: ``(B, K)``.

        One forward pass: the label names follow the prompt as separate continuations (each sees
        the prompt and itself only: ``blocks`` of :meth:`_prompt_pass`), so a name of several tokens
        is scored exactly as the prompt followed by that name alone. Prompts may be padded on
        either side."""
        return self._score_pass(input_ids, attention_mask, graph, label_ids)[0]

    @torch.no_grad()
    def predict(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None,
        graph: GraphBatch,
        label_ids: list[list[int]],
        weight: float = 0.5,
    ) -> dict[str, Tensor]:
        """GNN, LM and combined class distributions for each sequence's target node:
        ``ensemble = weight * p_gnn + (1 - weight) * p_lm``; each ``(B, K)``."""
        if graph.target_nodes is None:
            raise ValueError("graph.target_nodes is required for predict")
        if bool((graph.target_nodes < 0).any()):
            rows = torch.nonzero(graph.target_nodes < 0).flatten().tolist()
            raise ValueError(f"sequences {rows} have no graph (no target node) to predict for")
        scores, out = self._score_pass(input_ids, attention_mask, graph, label_ids)
        p_gnn = out.node_logits[graph.target_nodes].float().softmax(-1)  # one pass for both
        p_lm = scores.softmax(-1)
        if p_gnn.shape[-1] != p_lm.shape[-1]:
            raise ValueError(f"{p_gnn.shape[-1]} GNN classes but {p_lm.shape[-1]} label names")
        return {"gnn": p_gnn, "lm": p_lm, "ensemble": weight * p_gnn + (1 - weight) * p_lm}
