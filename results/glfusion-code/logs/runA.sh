#!/bin/bash
cd /work/main
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
for S in "0" "0 1" "0 1 2"; do
  .venv/bin/structattn glfusion ablate --dataset code-names --preset cpu-llm --gnn-preset cpu-gnn \
    --rows glfusion no-message-passing no-cross-attention no-edge-texts --seeds $S \
    --llm-lr-sweep 0.0002 0.0005 --threads 1 --no-progress || exit 1
done
