#!/bin/bash
# The LLM reading the node texts, seed $1, in a fresh checkout: the earlier runs of seeds 1 and 2
# were cut off with their checkpoints (which are not committed), so these start again.
cd "$(dirname "$0")/../../.."
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
.venv/bin/structattn glfusion ablate --dataset code-names --preset cpu-llm --gnn-preset cpu-gnn \
  --out-dir results/glfusion-code/table --lr-sweep 0.001 0.002 --llm-lr-sweep 0.001 --threads 1 \
  --no-progress --rows llm-tree --seeds "$1"
