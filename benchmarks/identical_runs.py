"""Three tiny runs whose ``metrics.csv`` must not change when the code is reorganised.

A quick ListOps HKT run (``structattn train``), a quick byte-LM run (``structattn lm``) and a
tiny GL-Fusion run (tiny Llama + BERT built here, so no model files are needed) are trained
from scratch on one thread; every ``metrics.csv`` column except the wall-clock ``step_ms`` is
compared as text, and the sha256 of each run's best weights (names, shapes and bytes) where
the reference holds one: rounded metrics can hide a change of a few ulps in a kernel that a
1500-step run turns into another table.

    python benchmarks/identical_runs.py --save ref.json      # on the commit before a change
    python benchmarks/identical_runs.py --check ref.json     # after it: exit 1 on any difference

``benchmarks/identical_runs.json`` holds the runs as commit 54af103 wrote them on the 2-core
x86-64 CPU machine (float32 on one thread; another CPU may round differently); the weights of
the ListOps HKT run (through the default kernel, ``impl="auto"``, the C++ kernel) and the LM
run were added from commit a5c38f1, whose metrics are those of 54af103.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import random
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

DOCS = [
    "the cat sat on the mat. " * 6,
    "a dog ran in the park, then home. " * 5,
    "numbers: 1 2 3 4 5 6 7 8 9 10. " * 4,
    "hierarchical attention over levels. " * 5,
    "short one.",
    "the quick brown fox jumps over the lazy dog. " * 4,
    "last document of the toy corpus here. " * 4,
    "café, naïve, jalapeño — unicode text. " * 4,
]
WORDS = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return [{k: v for k, v in row.items() if k != "step_ms"} for row in csv.DictReader(f)]


def run_listops(root: Path) -> Path:
    from structattn.cli import main

    run = root / "listops"
    (root / "data").mkdir()
    main(
        [
            "train",
            "--config",
            "listops-hkt",
            "--preset",
            "quick",
            "--seed",
            "0",
            "--run-dir",
            str(run),
            "--data.data-dir",
            str(root / "data"),
            "--data.listops-sizes",
            "400",
            "60",
            "60",
            "--train.max-steps",
            "24",
            "--train.eval-every",
            "8",
            "--train.log-every",
            "4",
        ]
    )
    return run / "metrics.csv"


def run_lm(root: Path) -> Path:
    from structattn.cli import main

    corpus = root / "corpus.txt"
    corpus.write_text("\n\n".join(DOCS), encoding="utf-8")
    run = root / "lm"
    main(
        [
            "lm",
            "--model.attention",
            "hkt",
            "--seed",
            "0",
            "--run-dir",
            str(run),
            "--data.text-file",
            str(corpus),
            "--data.seq-len",
            "32",
            "--model.d-model",
            "16",
            "--model.n-layers",
            "1",
            "--model.n-heads",
            "2",
            "--train.max-steps",
            "12",
            "--train.eval-every",
            "4",
            "--train.log-every",
            "2",
            "--train.batch-size",
            "4",
            "--samples",
            "1",
            "--prompt-bytes",
            "8",
            "--sample-tokens",
            "5",
        ]
    )
    return run / "metrics.csv"


def _wordnet(path: Path, n: int = 48, seed: int = 0) -> None:
    rng = random.Random(seed)
    lines = ["  1 licence header line"]
    for i in range(n):
        ptrs = "000" if i == 0 else f"001 @ {10000000 + rng.randrange(i):08d} n 0000"
        gloss = " ".join(rng.choice(WORDS) for _ in range(5))
        word = f"{WORDS[i % len(WORDS)]}_{i}"
        lines.append(f"{10000000 + i:08d} {3 + i % 4:02d} n 01 {word} 0 {ptrs} | {gloss}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def run_glfusion(root: Path) -> Path:
    from transformers import BertConfig, BertModel, BertTokenizer, LlamaConfig, LlamaForCausalLM

    from structattn.data.graphs import WORDNET_NOUN_CLASSES
    from structattn.experiments.glfusion import build_glfusion_config, train_glfusion

    _wordnet(root / "gdata" / "wordnet" / "data.noun")
    names = sorted({n.removeprefix("noun.").lower() for n in WORDNET_NOUN_CLASSES})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[", "]", ":", ".", ","] + WORDS + names
    vocab += ["classify", "the", "first", "node", "of", "this", "graph", "answer", "category"]
    (root / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = BertTokenizer(str(root / "vocab.txt"))
    torch.manual_seed(0)
    llm = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            pad_token_id=tok.pad_token_id,
            bos_token_id=tok.cls_token_id,
            eos_token_id=tok.sep_token_id,
            tie_word_embeddings=True,
        )
    ).eval()
    encoder = BertModel(
        BertConfig(
            vocab_size=len(tok),
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
        )
    ).eval()
    cfg = build_glfusion_config(
        {
            "dataset": "wordnet",
            "variant": "paper",  # the form the reference was written with
            "max_nodes": 4,
            "text_tokens": 8,
            "lora_r": 2,
            "lora_alpha": 4,
            "data_dir": root / "gdata",
            "max_train": 12,
            "max_val": 6,
            "max_test": 6,
            "eval_batch_size": 6,
            "baseline_epochs": 20,
            "run_dir": root / "glfusion",
            "train": {"max_steps": 6, "batch_size": 3, "eval_every": 3},
        }
    )
    train_glfusion(cfg, progress=False, llm=(llm, tok), encoder=(encoder, tok))
    return root / "glfusion" / "metrics.csv"


RUNS = {"listops": run_listops, "lm": run_lm, "glfusion": run_glfusion}


def _weights_digest(run_dir: Path) -> str | None:
    """sha256 of the best weights' tensors (names, dtypes, shapes and bytes; metadata left
    out), or None when the run keeps no ``best.safetensors``."""
    from safetensors.torch import load_file

    path = run_dir / "best.safetensors"
    if not path.is_file():
        return None
    h = hashlib.sha256()
    for name, t in sorted(load_file(path).items()):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--save", type=Path, help="write the runs' metrics to this JSON file")
    g.add_argument("--check", type=Path, help="compare the runs' metrics with this JSON file")
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    args = p.parse_args()
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.runs:
            (Path(tmp) / name).mkdir()
            metrics = RUNS[name](Path(tmp) / name)
            rows = _rows(metrics)
            digest = hashlib.sha256(json.dumps(rows).encode()).hexdigest()
            weights = _weights_digest(metrics.parent)
            got[name] = {"sha256": digest, "weights_sha256": weights, "rows": rows}
            shown = (weights or "-")[:16]
            print(f"{name}: {len(rows)} rows, sha256 {digest[:16]}, weights {shown}")
    if args.save:
        args.save.write_text(json.dumps(got, indent=1) + "\n")
        return 0
    ref = json.loads(args.check.read_text())
    bad = [n for n in args.runs if ref.get(n, {}).get("sha256") != got[n]["sha256"]]
    for n in args.runs:  # the weights, where the reference has them
        want = ref.get(n, {}).get("weights_sha256")
        if want is not None and want != got[n]["weights_sha256"] and n not in bad:
            print(f"{n}: metrics identical, trained weights differ")
            bad.append(n)
    for n in bad:
        first = next(
            (
                i
                for i, (a, b) in enumerate(zip(ref.get(n, {}).get("rows", []), got[n]["rows"]))
                if a != b
            ),
            None,
        )
        print(f"{n}: metrics differ (first differing row: {first})")
    print("identical" if not bad else f"{len(bad)} of {len(args.runs)} runs differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
