"""GL-Fusion node classification on a text-attributed graph, on the shared engine, beside graph
baselines.

    structattn glfusion train --dataset wordnet --preset quick          # offline, ~minutes on CPU
    structattn glfusion train --preset paper --dataset arxiv \\
        --arxiv-root DATA/ogbn_arxiv --arxiv-titleabs DATA/titleabs.tsv --llm PATH/Llama-3-8B \\
        --llm-dtype bfloat16 --gradient-checkpointing
    accelerate launch -m structattn.cli glfusion train ...              # several GPUs
    structattn glfusion predict RUN_DIR --nodes 0 5 47
    structattn glfusion ablate --preset recipe --seeds 0 1 2
    structattn glfusion baselines --preset recipe --seeds 0 1 2

Training is :class:`structattn.engine.Engine` (device placement, AdamW with warmup + cosine,
clipping, step-addressed batches, atomic checkpoints of the trainable weights + optimizer /
scheduler / RNG, exact ``--resume``, SIGINT/SIGTERM, CSV + TensorBoard logs, tqdm). LoRA adapters
sit on the LLM and the GL-Fusion modules train fully, on ``CE(GNN) + CE(LM)``. Evaluation
reports the accuracy of the GNN head, of the LM head (every label name scored by the LM after
" Answer:") and of their ensemble, beside an MLP and GraphSAGE trained on the same cached
node-text encodings (mean-pooled), in one results table.

Modules: ``config`` (the config, presets, loaders), ``targets`` (target sampling, prompts),
``baselines``, ``evaluation`` (heads, ensemble), ``groups`` (optimizer groups), ``run`` (the
task and the run), ``report`` (tables), ``predict``, ``ablate``, ``commands`` (the CLI).
"""

from .ablate import GLFUSION_ABLATIONS, ablate_glfusion, ablation_statistics
from .baselines import BASELINE_NAMES, run_baselines
from .config import (
    GLFusionTrainConfig,
    build_glfusion_config,
    encoding_cache,
    load_glfusion,
    load_graph,
)
from .evaluation import (
    choose_ensemble_weight,
    evaluate_heads,
    gnn_accuracy,
    head_accuracies,
    head_probabilities,
)
from .generate import generate_about_node
from .groups import glfusion_param_groups
from .label_baselines import baselines_over_seeds, baselines_table
from .predict import predict_nodes
from .report import PAPER_ARXIV, ablation_table, results_table
from .run import NodeClassification, train_glfusion
from .targets import prompt_examples, sample_targets, split_targets

__all__ = [
    "BASELINE_NAMES",
    "GLFUSION_ABLATIONS",
    "GLFusionTrainConfig",
    "NodeClassification",
    "PAPER_ARXIV",
    "ablate_glfusion",
    "ablation_statistics",
    "ablation_table",
    "baselines_over_seeds",
    "baselines_table",
    "build_glfusion_config",
    "choose_ensemble_weight",
    "encoding_cache",
    "evaluate_heads",
    "glfusion_param_groups",
    "generate_about_node",
    "gnn_accuracy",
    "head_accuracies",
    "head_probabilities",
    "load_glfusion",
    "load_graph",
    "predict_nodes",
    "prompt_examples",
    "results_table",
    "run_baselines",
    "sample_targets",
    "split_targets",
    "train_glfusion",
]
