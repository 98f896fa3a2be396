"""Generating names on code-names: GL-Fusion with the tree in the prompt against the same LLM
with text prompts, and the key/value cache against recomputing the prompt.

One GL-Fusion model (SmolLM2-135M + the GL-Fusion modules of the code-names runs: message
passing and cross-attention with gates opened, so the graph paths do their full work) generates
``--new-tokens`` tokens greedily for each of ``--functions`` test functions (batch 1, no early
stop), from three prompts of the same function:

* ``graph``: the tree as node tokens (node and edge texts through MiniLM, encoded beforehand);
* ``tree-text``: the node texts as text (the ``llm-tree`` prompt), no graph;
* ``code``: the masked source (the ``llm-code`` prompt), no graph.

Each is timed with the cache (``generate``: one prefill, then one forward per new token) and the
graph prompt also without it (a full forward over prompt + generated tokens per new token, what
generation costs without a cache). Reported: medians of prefill time, per-token decoding time and
tokens/s over the functions, the prompts' lengths, and ratios against ``graph`` measured in the
same run (the prompts alternate function by function).

Usage::

    python benchmarks/glfusion_generate.py --functions 8 --new-tokens 12 --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--functions", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from structattn.data.base import default_data_dir
    from structattn.data.code import MAX_SUBTOKENS, load_code_names
    from structattn.experiments.glfusion.code.llm import PromptSpec, build_prompt, collate_prompts
    from structattn.glfusion.configuration import GLFusionConfig
    from structattn.glfusion.loading import encode_texts, load_llm, load_text_encoder
    from structattn.glfusion.modeling import GLFusionForCausalLM

    data = load_code_names(default_data_dir() / "code-names" / "dataset")
    base, tok = load_llm()
    enc, enc_tok = load_text_encoder()
    dim = enc.config.hidden_size
    n_layers = base.config.num_hidden_layers
    cfg = GLFusionConfig(text_dim=dim, num_node_classes=MAX_SUBTOKENS * 5002, edge_dim=dim,
                         message_passing_layers=list(range(0, n_layers, 4)),
                         cross_attention_layers=list(range(3, n_layers, 4)),
                         variant="paper")  # fmt: skip
    torch.manual_seed(0)
    model = GLFusionForCausalLM.from_base(base, cfg, tokenizer=tok).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate"):
                p.fill_(0.5)
    c = model.config
    special = [c.graph_start_id, c.node_id, c.graph_end_id]
    spec = PromptSpec(c.node_id, c.graph_start_id, c.graph_end_id, variant="paper")
    encode = lambda texts: encode_texts(texts, enc, enc_tok, 12, progress=False)  # noqa: E731
    exs = data.test[: args.functions]
    modes = {"graph": "glfusion", "tree-text": "llm-tree", "code": "llm-code"}
    rows: dict[str, dict[str, list[float]]] = {
        k: {"prefill_s": [], "token_s": [], "prompt_tokens": []} for k in [*modes, "graph-no-cache"]
    }
    N = args.new_tokens
    with torch.no_grad():
        for ex in exs:
            for label, mode in modes.items():
                p = build_prompt(ex, mode, tok, spec)
                batch = collate_prompts([p], encode, with_targets=False)
                ids, mask, graph = batch["input_ids"], batch["attention_mask"], batch.get("graph")
                t0 = time.perf_counter()
                model.generate(ids, mask, graph, max_new_tokens=1)
                prefill = time.perf_counter() - t0
                t0 = time.perf_counter()
                out = model.generate(ids, mask, graph, max_new_tokens=N)
                total = time.perf_counter() - t0
                rows[label]["prefill_s"].append(prefill)
                rows[label]["token_s"].append((total - prefill) / (N - 1))
                rows[label]["prompt_tokens"].append(ids.shape[1])
                if label == "graph":  # the same tokens without a cache: a full pass per token
                    t0 = time.perf_counter()
                    seq, m = ids, mask
                    for t in range(N):
                        logits = model(seq, m, graph).logits[:, -1]
                        nxt = out[:, t : t + 1]
                        if t == 0:  # the cached path chose the same first token (a check;
                            # generate never picks the three graph tokens)
                            logits[:, special] = float("-inf")
                            assert int(logits.argmax(-1)) == int(nxt), "no-cache pass disagrees"
                        seq = torch.cat([seq, nxt], 1)
                        m = torch.cat([m, torch.ones_like(nxt)], 1)
                    per = (time.perf_counter() - t0) / N
                    rows["graph-no-cache"]["prefill_s"].append(float("nan"))
                    rows["graph-no-cache"]["token_s"].append(per)
                    rows["graph-no-cache"]["prompt_tokens"].append(ids.shape[1])

    med = {k: {m: statistics.median(v) for m, v in r.items()} for k, r in rows.items()}
    ref = med["graph"]["token_s"]
    print(f"GL-Fusion name generation, SmolLM2-135M, {len(exs)} code-names test functions, "
          f"{N} new tokens, batch 1, {args.threads} thread(s); medians")  # fmt: skip
    print("| prompt | prompt tokens | prefill s | per token ms | tokens/s | token time / graph |")
    print("|---|---:|---:|---:|---:|---:|")
    for k, m in med.items():
        pre = "" if k == "graph-no-cache" else f"{m['prefill_s']:.3f}"
        print(f"| {k} | {m['prompt_tokens']:.0f} | {pre} | {1e3 * m['token_s']:.1f} | "
              f"{1 / m['token_s']:.1f} | {m['token_s'] / ref:.2f} |")  # fmt: skip
    if args.json:
        payload = {"args": vars(args), "machine": platform.processor() or platform.machine(),
                   "torch": torch.__version__, "medians": med, "raw": rows}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2, default=lambda x: None)


if __name__ == "__main__":
    main()
