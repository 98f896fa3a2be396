#!/bin/sh
# usage: wordnet.sh TAG SEEDS... -- VARIANTS...: the WordNet (stand-in) node-classification table
# (recipe preset) from the snapshot in /work/wordnet-src/src, one thread
tag=$1; shift
cd /work/main
OMP_NUM_THREADS=1 PYTHONPATH=/work/wordnet-src/src HF_HUB_OFFLINE=1 nice -n 5 .venv/bin/python -m structattn.cli \
  glfusion ablate --preset recipe "$@" --no-progress \
  --out-dir results/glfusion-gated/wordnet >> results/glfusion-gated/logs/wordnet-$tag.log 2>&1
