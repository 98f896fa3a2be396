"""Configuration of GL-Fusion (arXiv 2412.06849) on top of a Llama-architecture causal LM.

Two variants share the modules and differ in how the graph reaches the text:

* ``gated`` (the default): the node texts are part of the prompt as plain text and each
  node's slot is the last token of its text; graph information enters only through residual
  writes whose output projections start at 0 (the slot's input, message passing on the slots,
  cross-attention from the text after the graph to them), so as initialised the model's logits
  are exactly its base LLM's on that prompt. It always normalises inside message passing
  (``message_passing_norm`` is set).
* ``paper``: the paper's form: node tokens carry the node texts (pooled encodings), the text
  after the graph attends to them directly, and cross-attention reads the node texts' token
  encodings.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["GLFusionConfig", "GRAPH_TOKENS", "VARIANTS"]

#: The forms of GL-Fusion (see the module docstring).
VARIANTS = ("gated", "paper")

#: The special tokens of the prompt ``... <graph_start><node>...<node><graph_end> ...``.
GRAPH_TOKENS = ("<graph_start>", "<node>", "<graph_end>")


@dataclass
class GLFusionConfig:
    """What GL-Fusion adds to a base LM; ``None`` layer lists take the every-4th defaults."""

    text_dim: int = 384  # width of the frozen node-text encoder's token encodings
    num_node_classes: int = 2  # outputs of the GNN head
    edge_dim: int = 0  # width of edge features (0: one learned edge embedding for all edges)
    message_passing_layers: list[int] | None = None  # after these decoder layers (0, 4, 8, ...)
    cross_attention_layers: list[int] | None = None  # after these decoder layers (3, 7, 11, ...)
    cross_attention_heads: int = 4  # heads of the graph-text cross-attention
    graph_start_id: int = -1  # token id of <graph_start> (set by add_graph_tokens / from_base)
    node_id: int = -1  # token id of <node>
    graph_end_id: int = -1  # token id of <graph_end>
    lm_loss_weight: float = 1.0  # loss = CE(GNN) + lm_loss_weight * CE(LM)
    message_passing_norm: bool = False  # LayerNorm on [h, agg] before the update (not in paper)
    target_marker: bool = False  # a learned vector added to the target node's token (not in paper)
    extra: dict = field(default_factory=dict)  # free-form metadata saved with the model
    variant: str = "gated"  # gated | paper (see the module docstring)

    def resolve(self, num_layers: int) -> GLFusionConfig:
        """Fill the default layer lists for a base with ``num_layers`` decoder layers and check
        every index."""
        if self.message_passing_layers is None:
            self.message_passing_layers = list(range(0, num_layers, 4))
        if self.cross_attention_layers is None:
            self.cross_attention_layers = list(range(3, num_layers, 4))
        for name in ("message_passing_layers", "cross_attention_layers"):
            bad = [i for i in getattr(self, name) if not 0 <= i < num_layers]
            if bad:
                raise ValueError(f"{name} {bad} out of range for a base with {num_layers} layers")
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.variant == "gated":
            self.message_passing_norm = True  # the gated form always normalises messages
        if self.text_dim < 1 or self.num_node_classes < 1 or self.edge_dim < 0:
            raise ValueError("text_dim and num_node_classes must be >= 1, edge_dim >= 0")
        return self

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> GLFusionConfig:
        """Read a saved config; options added since it was written take their defaults, except
        ``variant``: a config saved before the gated form existed is the paper's form."""
        values = json.loads(Path(path).read_text())
        values.setdefault("variant", "paper")
        return cls(**values)
