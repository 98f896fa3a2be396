#!/bin/sh
# three generations about WordNet test nodes from the trained gated run (greedy, one thread)
cd /work/main
run=results/glfusion-gated/wordnet/recipe/full/seed0
out=results/glfusion-gated/wordnet/generations.md
echo "# Generations from \`$run\` (WordNet nouns, a stand-in; commit $(git rev-parse --short HEAD))" > $out
for spec in "43419|What kind of thing is this node?" "12859|Describe this node." "45773|Which category does this node belong to, and why?"; do
  node=${spec%%|*}; prompt=${spec#*|}
  echo "\n\`structattn glfusion generate $run --node $node --prompt \"$prompt\" --greedy\`\n" >> $out
  OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python -m structattn.cli glfusion generate $run \
    --node $node --prompt "$prompt" --greedy --max-new-tokens 60 2>/dev/null | sed 's/^/> /' >> $out
done
