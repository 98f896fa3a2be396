"""GL-Fusion's optimizer groups: gates, fresh modules, the GNN head and LoRA, each with its own
learning rate."""

from __future__ import annotations

from structattn.engine import param_groups
from structattn.glfusion.modeling import GLFusionForCausalLM

from .config import GLFusionTrainConfig

__all__ = ["glfusion_param_groups", "parameter_kind"]


def parameter_kind(name: str) -> str:
    """``gates``, ``head`` (the GNN head), ``modules`` (other GL-Fusion modules) or ``lora``."""
    if name.endswith("gate"):
        return "gates"
    if name.startswith("glf_gnn_head"):
        return "head"
    if name.startswith("glf_"):
        return "modules"
    return "lora"


def glfusion_param_groups(model: GLFusionForCausalLM, cfg: GLFusionTrainConfig) -> list[dict]:
    """AdamW groups with their own learning rates: gates, GL-Fusion modules, the GNN head and
    LoRA (each ``None`` takes ``optim.lr``); within each, the engine's decay rule. ``cfg`` is any
    config with ``optim`` and the four ``*_lr`` fields (code-names' too)."""
    lrs = {"gates": cfg.gate_lr, "modules": cfg.module_lr, "head": cfg.head_lr,
           "lora": cfg.lora_lr}  # fmt: skip
    out = []
    for group in param_groups(model, cfg.optim.weight_decay):
        split: dict[str, dict] = {}
        for p, name in zip(group["params"], group["names"]):
            k = parameter_kind(name)
            g = split.setdefault(k, {"params": [], "names": [], "group": f"{k}, {group['group']}",
                                     "weight_decay": group["weight_decay"]})  # fmt: skip
            g["params"].append(p)
            g["names"].append(name)
            g["lr"] = lrs[k] if lrs[k] is not None else cfg.optim.lr
        out.extend(split.values())
    return out
