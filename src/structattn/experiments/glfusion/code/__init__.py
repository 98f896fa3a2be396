"""Method naming on ``code-names`` (Python syntax trees, built like ogbg-code2): the config, the
OGB GNN baselines, the F1 metric, the experiment on the shared engine and its report."""

from .config import MODELS, CodeNamesConfig, load_code_config
from .experiment import MethodNaming, train_code_names
from .metrics import name_scores

__all__ = ["MODELS", "CodeNamesConfig", "MethodNaming", "load_code_config", "name_scores",
           "train_code_names"]  # fmt: skip
