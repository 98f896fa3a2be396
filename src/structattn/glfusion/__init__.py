"""GL-Fusion (arXiv 2412.06849): graph-aware Llama with in-layer message passing."""

from .build import GLFusionParts, build_glfusion, stop_token_ids
from .configuration import GRAPH_TOKENS, GLFusionConfig
from .cross_attention import GraphTextCrossAttention
from .graph import GraphBatch
from .masking import build_structure_mask, node_position_ids, to_additive_mask
from .message_passing import NodeMessagePassing
from .modeling import GLFusionForCausalLM, GLFusionOutput, add_graph_tokens, apply_lora

__all__ = [
    "GRAPH_TOKENS",
    "GLFusionConfig",
    "GLFusionForCausalLM",
    "GLFusionOutput",
    "GLFusionParts",
    "GraphBatch",
    "GraphTextCrossAttention",
    "NodeMessagePassing",
    "add_graph_tokens",
    "apply_lora",
    "build_glfusion",
    "build_structure_mask",
    "node_position_ids",
    "stop_token_ids",
    "to_additive_mask",
]
