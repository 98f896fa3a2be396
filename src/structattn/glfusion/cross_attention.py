"""Graph-text cross-attention: LM hidden states read the full node texts in two stages.

Stage 1, over one node's text: a query ``q_t`` attends over the text tokens of node ``n``
(frozen encoder outputs) giving ``r_tn``. Stage 2, over nodes: ``q_t`` attends over the
``r_tn`` of the nodes it may read. Visibility:

* a node token reads only its own node's text (stage 2 is then that node alone);
* text after the graph reads every node text of its graph;
* text before the graph, ``<graph_start>`` included, reads nothing (its output is 0).

The result enters through a gated residual ``h <- h + tanh(g) * W_o(out)``, ``g = 0`` at init.
Shapes: ``hidden (B, S, D)``, ``node_text (M, Lt, text_dim)`` -> ``(B, S, D)``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch_geometric.utils import to_dense_batch

__all__ = ["GraphTextCrossAttention", "NodeStateCrossAttention"]


def _read_graphs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dead: Tensor,
    after: Tensor,
    counts: Tensor,
    scale: float,
    low: float,
    rows: list[Tensor],
    values: list[Tensor],
) -> None:
    """Both stages for the positions ``after (B, S)`` that follow their graph, over every node
    of it: append their flat rows ``b * S + pos`` to ``rows`` and outputs ``(A, H, hd)`` to
    ``values``, one sequence at a time."""
    S = after.shape[1]
    starts = torch.cumsum(counts, 0) - counts
    for b in torch.nonzero(after.any(-1)).flatten().tolist():
        pos = torch.nonzero(after[b]).flatten()
        lo, n = int(starts[b]), int(counts[b])
        qa, kb, vb = q[b, pos], k[lo : lo + n], v[lo : lo + n]  # (A, H, hd), (n, Lt, H, hd)
        s1 = torch.einsum("ahd,nlhd->ahnl", qa, kb) * scale
        s1 = s1.masked_fill(dead[lo : lo + n][None, None], low)
        r = torch.einsum("ahnl,nlhd->ahnd", s1.softmax(-1), vb)  # (A, H, n, hd)
        s2 = torch.einsum("ahd,ahnd->ahn", qa, r) * scale
        rows.append(b * S + pos)
        values.append(torch.einsum("ahn,ahnd->ahd", s2.softmax(-1), r))


def _scatter_rows(
    rows: list[Tensor], values: list[Tensor], q: Tensor, shape: tuple[int, int, int]
) -> Tensor:
    """The outputs of every position, ``shape = (B * S, H, hd)``: ``values`` at their flat
    ``rows``, 0 elsewhere (in ``q``'s dtype when nothing is read)."""
    if rows:
        values = torch.cat(values)  # autocast may have made them another dtype than hidden
        return values.new_zeros(*shape).index_put((torch.cat(rows),), values)
    return q.new_zeros(*shape)


class GraphTextCrossAttention(nn.Module):
    """Two-stage multi-head cross-attention from LM states to node texts (see module).

    Args:
        hidden_size: ``D`` of the LM.
        text_dim: width of the node-text encodings.
        num_heads: attention heads (``D % num_heads == 0``).
    """

    def __init__(self, hidden_size: int, text_dim: int, num_heads: int = 4):
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.norm = nn.LayerNorm(hidden_size)
        self.query = nn.Linear(hidden_size, hidden_size, bias=False)
        self.key = nn.Linear(text_dim, hidden_size, bias=False)
        self.value = nn.Linear(text_dim, hidden_size, bias=False)
        self.out = nn.Linear(hidden_size, hidden_size, bias=False)
        self.gate = nn.Parameter(torch.zeros(()))

    def forward(
        self,
        hidden: Tensor,
        node_text: Tensor,
        node_text_mask: Tensor,
        node_batch: Tensor,
        node_slots: Tensor,
        attention_mask: Tensor | None = None,
        after_graph: Tensor | None = None,
        text_kv: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """``node_slots (M, 2)``: (sequence, position) of each node's token, in node order.

        ``after_graph (B,)`` bool, for decoding: ``hidden`` holds only new text tokens, all after
        their sequence's graph where True (they read every node text), with no node token among
        them (``node_slots`` is then empty). ``text_kv``: :meth:`project_text` of these node
        texts, computed once and passed to every decoding step (the texts do not change).

        Computes what :meth:`forward_reference` computes, only where something is read: a node
        token's stage 1 over its own node's text (its stage 2 over that one node has weight 1),
        and the positions after a graph over that graph's nodes; other positions add 0. The
        dense form's cost and memory grow with ``S x Nmax x Lt`` per head; this one's with
        ``(M + A x n) x Lt`` (``A`` positions after the graph, ``n`` nodes of their graph)."""
        B, S, D = hidden.shape
        H, hd = self.num_heads, D // self.num_heads
        M, Lt, _ = node_text.shape
        counts = torch.bincount(node_batch, minlength=B)
        n_max = int(counts.max()) if M else 0
        node_valid = torch.arange(n_max, device=hidden.device)[None] < counts[:, None]
        visible = self._visibility(B, S, M, n_max, node_batch, node_slots, node_valid,
                                   attention_mask, after_graph, hidden.device)  # fmt: skip
        q = self.query(self.norm(hidden)).view(B, S, H, hd)
        k, v = text_kv if text_kv is not None else self.project_text(node_text, hidden.dtype)
        k, v = k.view(M, Lt, H, hd), v.view(M, Lt, H, hd)
        dead = ~node_text_mask.to(hidden.device)  # (M, Lt) padding of each node's text
        scale = 1.0 / math.sqrt(hd)
        low = torch.finfo(q.dtype).min
        rows, values = [], []
        if node_slots.numel():  # node tokens: their own node's text
            qn = q[node_slots[:, 0], node_slots[:, 1]]  # (M, H, hd)
            s1 = torch.einsum("mhd,mlhd->mhl", qn, k) * scale
            s1 = s1.masked_fill(dead[:, None], low)
            rows.append(node_slots[:, 0] * S + node_slots[:, 1])
            values.append(torch.einsum("mhl,mlhd->mhd", s1.softmax(-1), v))
        # positions after their graph read every node of it (the node tokens are not among them)
        is_node = torch.zeros(B, S, dtype=torch.bool, device=hidden.device)
        if node_slots.numel():
            is_node[node_slots[:, 0], node_slots[:, 1]] = True
        after = visible.any(-1) & ~is_node  # (B, S)
        _read_graphs(q, k, v, dead, after, counts, scale, low, rows, values)
        out = _scatter_rows(rows, values, q, (B * S, H, hd))
        reads = visible.any(-1, keepdim=True)  # (B, S, 1): positions that read anything
        return hidden + torch.tanh(self.gate) * self.out(out.view(B, S, D)) * reads

    def project_text(self, node_text: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The keys and values of every node-text token, ``(M, Lt, D)`` each."""
        text = node_text.to(dtype)
        return self.key(text), self.value(text)

    def forward_reference(
        self,
        hidden: Tensor,
        node_text: Tensor,
        node_text_mask: Tensor,
        node_batch: Tensor,
        node_slots: Tensor,
        attention_mask: Tensor | None = None,
        after_graph: Tensor | None = None,
    ) -> Tensor:
        """The readable form of :meth:`forward`: every position's query against every node's
        text tokens (stage 1, dense over ``(B, S, Nmax, Lt)``), then masked to what it may read
        (stage 2). Same arguments and result; :meth:`forward` computes only the visible part."""
        B, S, D = hidden.shape
        H, hd = self.num_heads, D // self.num_heads
        M, Lt, _ = node_text.shape
        text, node_valid = to_dense_batch(node_text.flatten(1), node_batch, batch_size=B)
        text = text.view(B, -1, Lt, node_text.shape[-1])  # (B, Nmax, Lt, text_dim)
        tmask, _ = to_dense_batch(node_text_mask, node_batch, batch_size=B)  # (B, Nmax, Lt)
        n_max = text.shape[1]
        q = self.query(self.norm(hidden)).view(B, S, H, hd)
        k = self.key(text.to(hidden.dtype)).view(B, n_max, Lt, H, hd)
        v = self.value(text.to(hidden.dtype)).view(B, n_max, Lt, H, hd)
        # Stage 1: every query over every node's text tokens.
        s1 = torch.einsum("bshd,bnlhd->bshnl", q, k) / math.sqrt(hd)
        s1 = s1.masked_fill(~tmask[:, None, None], torch.finfo(s1.dtype).min)
        r = torch.einsum("bshnl,bnlhd->bshnd", s1.softmax(-1), v)  # (B, S, H, Nmax, hd)
        # Stage 2 visibility (B, S, Nmax): own node for node tokens, all nodes after the graph.
        visible = self._visibility(B, S, M, n_max, node_batch, node_slots, node_valid,
                                   attention_mask, after_graph, hidden.device)  # fmt: skip
        s2 = torch.einsum("bshd,bshnd->bshn", q, r) / math.sqrt(hd)
        s2 = s2.masked_fill(~visible[:, :, None], torch.finfo(s2.dtype).min)
        out = torch.einsum("bshn,bshnd->bshd", s2.softmax(-1), r).reshape(B, S, D)
        reads = visible.any(-1, keepdim=True)  # (B, S, 1): positions that read anything
        return hidden + torch.tanh(self.gate) * self.out(out) * reads

    @staticmethod
    def _visibility(
        B, S, M, n_max, node_batch, node_slots, node_valid, attention_mask, after_graph, device
    ) -> Tensor:
        """``(B, S, Nmax)`` bool: which nodes' texts each position reads in stage 2."""
        if after_graph is not None:
            if node_slots.numel():
                raise ValueError("after_graph is for decoding text tokens (no node slots)")
            after = after_graph.to(device)[:, None].expand(B, S)
            return after[:, :, None] & node_valid[:, None, :]
        idx = torch.arange(S, device=device)
        local = torch.arange(M, device=device) - torch.searchsorted(
            node_batch, node_batch, right=False
        )  # node index within its sequence
        node_of_pos = torch.full((B, S), -1, dtype=torch.long, device=device)
        node_of_pos[node_slots[:, 0], node_slots[:, 1]] = local
        last_node = torch.full((B,), S, dtype=torch.long, device=device)
        last_node.scatter_reduce_(
            0, node_slots[:, 0], node_slots[:, 1], reduce="amax", include_self=False
        )
        has_graph = torch.bincount(node_slots[:, 0], minlength=B) > 0
        after = (idx[None] > last_node[:, None]) & has_graph[:, None]  # (B, S)
        if attention_mask is not None:
            after = after & attention_mask.bool()
        nodes = torch.arange(n_max, device=device)
        return (after[:, :, None] & node_valid[:, None, :]) | (
            node_of_pos[:, :, None] == nodes[None, None, :]
        )


class NodeStateCrossAttention(nn.Module):
    """The gated form's cross-attention: text after its graph reads the graph's node-token states.

    ``h <- h + tanh(g) * W_o(attention(q(norm h), k(norm n), v(norm n)))`` over the nodes ``n``
    of the position's graph, only at positions after the graph (others add 0). ``W_o`` starts
    at 0 and ``g`` at 1, so this path adds nothing until ``W_o`` learns and learns from the
    first step.

    Args:
        hidden_size: ``D`` of the LM.
        num_heads: attention heads (``D % num_heads == 0``).
    """

    def __init__(self, hidden_size: int, num_heads: int = 4):
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.norm = nn.LayerNorm(hidden_size)
        self.node_norm = nn.LayerNorm(hidden_size)
        self.query = nn.Linear(hidden_size, hidden_size, bias=False)
        self.key = nn.Linear(hidden_size, hidden_size, bias=False)
        self.value = nn.Linear(hidden_size, hidden_size, bias=False)
        self.out = nn.Linear(hidden_size, hidden_size, bias=False)
        nn.init.zeros_(self.out.weight)
        self.gate = nn.Parameter(torch.ones(()))

    def project_nodes(self, nodes: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values ``(M, D)`` of the node-token states ``nodes (M, D)``."""
        n = self.node_norm(nodes)
        return self.key(n), self.value(n)

    def forward(
        self, hidden: Tensor, node_kv: tuple[Tensor, Tensor], node_batch: Tensor, reads: Tensor
    ) -> Tensor:
        """``hidden (B, S, D)``; ``node_kv``: :meth:`project_nodes` of the batch's node states;
        ``node_batch (M,)`` each node's sequence; ``reads (B, S)`` bool: the positions after
        their graph, which read every node of it."""
        B, S, D = hidden.shape
        H, hd = self.num_heads, D // self.num_heads
        rows, cols = torch.nonzero(reads, as_tuple=True)
        if rows.numel() == 0:
            return hidden
        k, v = node_kv
        k, valid = to_dense_batch(k, node_batch, batch_size=B)  # (B, Nmax, D), (B, Nmax)
        v, _ = to_dense_batch(v, node_batch, batch_size=B)
        q = self.query(self.norm(hidden[rows, cols])).view(-1, H, hd)  # (A, H, hd)
        kr, vr = k[rows].view(rows.numel(), -1, H, hd), v[rows].view(rows.numel(), -1, H, hd)
        scores = torch.einsum("ahd,anhd->ahn", q, kr) / math.sqrt(hd)
        scores = scores.masked_fill(~valid[rows][:, None], torch.finfo(scores.dtype).min)
        read = torch.einsum("ahn,anhd->ahd", scores.softmax(-1), vr).reshape(-1, D)
        update = torch.tanh(self.gate) * self.out(read)
        return hidden.index_put((rows, cols), update.to(hidden.dtype), accumulate=True)
