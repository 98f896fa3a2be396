#!/bin/bash
# Three times the table's LLM budget, one seed (1000, the sweep seed): 750 steps of 4 functions
# (three passes over the 1,000), for GL-Fusion ($1 = glfusion) or the LLM reading the code
# ($1 = llm-code), to see whether GL-Fusion's floor at 250 steps is a plateau or a slow start.
cd "$(dirname "$0")/../../.."
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
EXTRA=""
[ "$1" = glfusion ] && EXTRA="--gate-lr 0.02"
RUN="results/glfusion-code/longer/$1"
[ -n "$(ls "$RUN/checkpoints" 2>/dev/null)" ] && EXTRA="$EXTRA --resume"
.venv/bin/structattn glfusion train --dataset code-names --preset cpu-llm --model "$1" \
  --optim.lr 0.001 $EXTRA --seed 1000 --train.max-steps 750 --train.eval-every 75 \
  --run-dir "$RUN"
