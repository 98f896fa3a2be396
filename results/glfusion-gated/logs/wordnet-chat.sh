#!/bin/sh
# usage: wordnet-chat.sh SEED: the recipe trained in the chat template (token loss), WordNet
# stand-in, one thread, from the snapshot of commit c90abfb's src/ in /work/chat-src
seed=$1
cd /work/main
OMP_NUM_THREADS=1 PYTHONPATH=/work/chat-src/src HF_HUB_OFFLINE=1 nice -n 5 .venv/bin/python -m structattn.cli \
  glfusion train --preset recipe --chat --lm-loss tokens --seed $seed \
  --run-dir results/glfusion-gated/wordnet/chat/seed$seed >> /tmp/wordnet-chat-$seed.log 2>&1
