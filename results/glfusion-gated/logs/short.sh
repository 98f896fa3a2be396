#!/bin/sh
# usage: short.sh NAME [extra flags...]: one 100-step code-names run on seed 1000 from the
# snapshot of the commit in /work/calib/src (one thread)
name=$1; shift
cd /work/main
OMP_NUM_THREADS=1 PYTHONPATH=/work/calib/src HF_HUB_OFFLINE=1 nice -n 5 .venv/bin/python -m structattn.cli \
  glfusion train --dataset code-names --preset cpu-llm --seed 1000 \
  --train.max-steps 100 --train.eval-every 25 --train.log-every 25 --max-test 100 \
  --optim.warmup-steps 10 --run-dir results/glfusion-gated/short/$name "$@" \
  > results/glfusion-gated/logs/short-$name.log 2>&1
