#!/bin/bash
# One one-thread process of the code-names table: GL-Fusion without edge texts (seeds 0-2),
# then the LLM reading the node texts in source order (seeds 0-2).
cd "$(dirname "$0")/../../.."
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
T="--dataset code-names --preset cpu-llm --gnn-preset cpu-gnn --out-dir results/glfusion-code/table
   --lr-sweep 0.001 0.002 --llm-lr-sweep 0.001 --threads 1 --no-progress"
for S in 0 1 2; do
  .venv/bin/structattn glfusion ablate $T --rows glfusion no-edge-texts --seeds $S || exit 1
done
for S in 0 1 2; do
  .venv/bin/structattn glfusion ablate $T --rows llm-tree --seeds $S || exit 1
done
