"""Plain functions shared by several test modules (imported as ``helpers``); fixtures live in
conftest.py. transformers and the GL-Fusion package are imported inside the functions that
need them, so that the kernel tests do not load them."""

from __future__ import annotations

import gzip
import os
import random
import shutil
import struct
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from structattn.hkt import level_lengths
from structattn.hkt.kernels.extension import cpu_kernel

if TYPE_CHECKING:
    from transformers import BertTokenizer, LlamaForCausalLM

# ------------------------------------------------------------------------------- data files


def write_idx(path, array: np.ndarray, gz=True):
    """``array`` as an IDX file (uint8), gzip-compressed unless ``gz`` is false."""
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(
        f">{array.ndim}I", *array.shape
    )
    data = header + array.astype(np.uint8).tobytes()
    (gzip.open if gz else open)(path, "wb").write(data)


#: the words of the generated WordNet graph and of the tiny GL-Fusion tokenizers
WORDS = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]


def write_wordnet(path, n=48, seed=0):
    """A tree of ``n`` synsets in data.noun format, labels from 4 lexicographer files."""
    rng = random.Random(seed)
    lines = ["  1 licence header line"]
    for i in range(n):
        offset = f"{10000000 + i:08d}"
        lex = 3 + (i % 4)
        word = f"{WORDS[i % len(WORDS)]}_{i}"
        if i == 0:
            ptrs = "000"
        else:
            parent = rng.randrange(i)
            ptrs = f"001 @ {10000000 + parent:08d} n 0000"
        gloss = " ".join(rng.choice(WORDS) for _ in range(5))
        lines.append(f"{offset} {lex:02d} n 01 {word} 0 {ptrs} | {gloss}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


# ------------------------------------------------------------------------------- HKT inputs


def require(impl):
    """Skip the C++ kernel only on a machine without a C++ compiler; any other build failure
    fails the test."""
    if impl == "fused_cpp":
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            pytest.skip("no C++ compiler on this machine")
        assert cpu_kernel() is not None, "the C++ HKT kernel failed to build"


def make_inputs(
    T, n_levels, stride, *, B=2, H=2, d=4, d_v=3, dtype=torch.float64, seed=0, padded=False
):
    """Random per-level queries and keys, values, level logits and (``padded``) a key mask."""
    g = torch.Generator().manual_seed(seed)
    lengths = level_lengths(T, n_levels, stride)
    q = [torch.randn(B, H, t, d, generator=g, dtype=dtype) for t in lengths]
    k = [torch.randn(B, H, t, d, generator=g, dtype=dtype) for t in lengths]
    v = torch.randn(B, H, T, d_v, generator=g, dtype=dtype)
    theta = torch.randn(H, n_levels, generator=g, dtype=dtype)
    mask = None
    if padded:
        # Row 0 is full, the others are right-padded to random lengths >= 1.
        real = torch.randint(1, T + 1, (B,), generator=g)
        real[0] = T
        mask = torch.arange(T)[None, :] < real[:, None]
    return q, k, v, theta, mask


# ------------------------------------------------------------------ tiny models and tokenizers


def tiny_llama(vocab_size: int, *, layers: int = 4, seed: int = 0) -> LlamaForCausalLM:
    """A random Llama with hidden size 32 (float32, eval mode)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config).eval()


def word_tokenizer(path, words) -> BertTokenizer:
    """A word-level BERT tokenizer over ``words`` (special tokens first), vocab file at ``path``."""
    from transformers import BertTokenizer

    vocab = list(dict.fromkeys(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *words]))
    path.write_text("\n".join(vocab) + "\n")
    return BertTokenizer(str(path))


def tiny_glfusion_models(tmp_path):
    """``(llm, tokenizer), (encoder, encoder_tokenizer)``: a tiny Llama and a one-layer BERT
    sharing one word vocabulary (written to ``tmp_path / "vocab.txt"``) that covers the
    generated WordNet graph, its class names and the prompt words."""
    from transformers import BertConfig, BertModel, BertTokenizer

    from structattn.data.graphs import WORDNET_NOUN_CLASSES

    names = sorted({n.removeprefix("noun.").lower() for n in WORDNET_NOUN_CLASSES})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[", "]", ":", ".", ","] + WORDS + names
    vocab += ["classify", "the", "first", "node", "of", "this", "graph", "answer", "category"]
    tokenizer = word_tokenizer(tmp_path / "vocab.txt", vocab)
    llm = tiny_llama(len(tokenizer))
    encoder = BertModel(
        BertConfig(
            vocab_size=len(tokenizer),
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
        )
    ).eval()
    return (llm, tokenizer), (encoder, BertTokenizer(str(tmp_path / "vocab.txt")))


#: the width of the node texts the tiny GL-Fusion models read
TEXT_DIM = 8


def tiny_glfusion_base(layers=4, seed=0):
    """The base the tiny GL-Fusion models wrap: a 40-token random Llama in float64."""
    return tiny_llama(40, layers=layers, seed=seed).double()


def tiny_glfusion_lm(layers=4, seed=0, **cfg):
    """A GL-Fusion model (float64, eval mode) on :func:`tiny_glfusion_base`, 3 node classes; the
    paper's form unless ``variant="gated"`` (the prompts of :func:`prompts` are the paper's)."""
    from structattn.glfusion import GLFusionConfig, GLFusionForCausalLM

    cfg.setdefault("variant", "paper")

    base = tiny_glfusion_base(layers, seed)
    config = GLFusionConfig(text_dim=TEXT_DIM, num_node_classes=3, **cfg)
    return GLFusionForCausalLM.from_base(base, config).double().eval()


def prompts(model, n_nodes=(3, 2)):
    """Two right-padded prompts: text, <graph_start>, nodes, <graph_end>, text."""
    c = model.config
    rows = []
    for b, n in enumerate(n_nodes):
        row = [5 + b, 6, 7, c.graph_start_id] + [c.node_id] * n + [c.graph_end_id, 9, 10]
        rows.append(row)
    S = max(map(len, rows)) + 1
    ids = torch.zeros(len(rows), S, dtype=torch.long)
    mask = torch.zeros(len(rows), S, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(row)
        mask[b, : len(row)] = 1
    return ids, mask


def graph_for(n_nodes=(3, 2), seed=0, edge_dim=0):
    """A ring graph per prompt of :func:`prompts`, random float64 node texts (and edge attrs)."""
    from structattn.glfusion import GraphBatch

    g = torch.Generator().manual_seed(seed)
    texts = [torch.randn(n, 4, TEXT_DIM, generator=g, dtype=torch.float64) for n in n_nodes]
    edges = [torch.tensor([[i, (i + 1) % n] for i in range(n)]).T for n in n_nodes]
    attrs = (
        [torch.randn(e.shape[1], edge_dim, generator=g, dtype=torch.float64) for e in edges]
        if edge_dim
        else None
    )
    return GraphBatch.from_graphs(texts, edges, attrs, targets=[0] * len(n_nodes))


def open_gates(model, value=0.7):
    """Set every gate of ``model`` to ``value`` (fresh gates are closed, at 0)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate"):
                p.fill_(value)


# ------------------------------------------------------------------------------ LRA configs

#: the one-layer width-16 model every tiny LRA run trains
TINY_MODEL = dict(d_model=16, n_layers=1, n_heads=2, mlp_ratio=1)


#: Generated ListOps small enough for a run of a few seconds.
TINY_LISTOPS = {"seq_len": 32, "listops_min_length": 4, "listops_sizes": [48, 8, 8]}


def tiny_listops(data_dir, run_dir, max_steps=6, **changes):
    """The quick ``listops-hkt`` preset on :data:`TINY_LISTOPS` and :data:`TINY_MODEL`: ``train``
    in ``changes`` updates a short train section, the rest are config overrides."""
    from structattn.experiments.lra import load_lra

    train_cfg = {"max_steps": max_steps, "batch_size": 8, "eval_every": 2, "log_every": 1}
    train_cfg.update(changes.pop("train", {}))
    return load_lra("listops-hkt", "quick", run_dir=str(run_dir),
                    data={**TINY_LISTOPS, "data_dir": str(data_dir)}, model=TINY_MODEL,
                    train=train_cfg, **changes)  # fmt: skip


def tiny_lra(task, attention, data_dir, run_dir, **train):
    """The quick ``{task}-{attention}`` preset shrunk to :data:`TINY_MODEL` and short sequences
    on the data in ``data_dir`` (see the ``lra_data_dir`` fixture), with ``train`` over the
    preset's train section."""
    from structattn.experiments.lra import load_lra

    data = {"data_dir": str(data_dir)}
    if task == "listops":
        data.update(seq_len=32, listops_min_length=4, listops_sizes=[64, 16, 16])
    if task == "image":
        data.update(image_pool=4)
    if task == "text":
        data.update(seq_len=40)
    return load_lra(
        f"{task}-{attention}",
        "quick",
        run_dir=str(run_dir),
        data=data,
        model=TINY_MODEL,
        train=train,
    )
