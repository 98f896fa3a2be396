#!/bin/sh
# usage: table.sh TAG ROWS...: the code-names table's rows (rate sweep on seed 1000, then seeds
# 0-2, or $SEEDS) from the snapshot of the commit in /work/table-src/src, one thread
tag=$1; shift
cd /work/main
OMP_NUM_THREADS=1 PYTHONPATH=/work/table-src/src HF_HUB_OFFLINE=1 nice -n 5 .venv/bin/python -m structattn.cli \
  glfusion ablate --dataset code-names --preset cpu-llm --gnn-preset cpu-gnn --rows "$@" \
  --seeds ${SEEDS:-0 1 2} --lr-sweep 0.001 0.002 --llm-lr-sweep ${RATES:-0.0003 0.001} --threads 1 --no-progress \
  --out-dir results/glfusion-gated/table >> results/glfusion-gated/logs/table-$tag.log 2>&1
