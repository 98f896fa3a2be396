#!/bin/bash
# After tableD.sh: the LLM reading the node texts, seed 2 (tableE.sh runs seeds 0 and 1 first
# and reads this run back when it gets there; one writer per run folder).
cd "$(dirname "$0")/../../.."
while kill -0 7002 2>/dev/null; do sleep 30; done
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
.venv/bin/structattn glfusion ablate --dataset code-names --preset cpu-llm --gnn-preset cpu-gnn \
  --out-dir results/glfusion-code/table --lr-sweep 0.001 0.002 --llm-lr-sweep 0.001 --threads 1 \
  --no-progress --rows llm-tree --seeds 2
