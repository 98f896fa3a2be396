#!/bin/sh
# three generations about WordNet test nodes from the --chat run (greedy, one thread), the same
# nodes and questions as generations.sh asked the run trained without --chat
cd /work/main
run=results/glfusion-gated/wordnet/chat/seed0
out=results/glfusion-gated/wordnet/generations-chat.md
echo "# Generations from \`$run\` (WordNet nouns, a stand-in; commit $(git rev-parse --short HEAD))" > $out
for spec in "43419|What kind of thing is this node?" "12859|Describe this node." "45773|Which category does this node belong to, and why?"; do
  node=${spec%%|*}; prompt=${spec#*|}
  printf '\n`structattn glfusion generate %s --node %s --prompt "%s" --greedy`\n\n' "$run" "$node" "$prompt" >> $out
  OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python -m structattn.cli glfusion generate $run \
    --node $node --prompt "$prompt" --greedy --max-new-tokens 60 2>/dev/null | sed 's/^/> /' >> $out
done
