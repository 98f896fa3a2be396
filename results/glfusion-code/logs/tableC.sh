#!/bin/bash
# After tableB.sh: the first ablation seed (GL-Fusion without message passing, seed 0).
cd "$(dirname "$0")/../../.."
while kill -0 3900 2>/dev/null; do sleep 20; done
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
.venv/bin/structattn glfusion ablate --dataset code-names --preset cpu-llm --gnn-preset cpu-gnn \
  --out-dir results/glfusion-code/table --llm-lr-sweep 0.001 --threads 1 --no-progress \
  --rows glfusion no-message-passing --seeds 0
