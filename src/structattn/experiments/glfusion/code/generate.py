"""Name a function with a finished code-names run (``structattn code-names generate RUN_DIR
--file F.py --function NAME``): the function's syntax tree is built exactly as
the dataset builds it (name and its uses masked, docstrings removed), and the run's best model
predicts the name's sub-tokens, an LLM model generating them greedily with a key/value cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from structattn.data.code import function_examples
from structattn.engine import RunDir
from structattn.engine.checkpoint import load_weights
from structattn.engine.config import build_dataclass, with_saved_defaults
from structattn.errors import ConfigError, RunError

from .config import GNN_MODELS, CodeNamesConfig
from .gnn import Vocabulary

__all__ = ["function_example", "name_function"]


def function_example(source: str, function: str, path: str = "<input>"):
    """The :class:`~structattn.data.code.CodeExample` of ``function`` (a name or a qualified
    name such as ``Class.method``) in ``source``; no size limit on the tree."""
    examples = function_examples(source, "<input>", path, min_nodes=1, max_nodes=10**9)
    found = [ex for ex in examples if function in (ex.qualname, ex.name)]
    if not found:
        names = sorted(ex.qualname for ex in examples)
        shown = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "")
        raise ConfigError(
            f"{path}: no function {function!r} (dunder and test names are left out as in the "
            f"dataset); it has: {shown or 'none'}"
        )
    if len(found) > 1:
        raise ConfigError(f"{path}: {function!r} names {len(found)} functions; give one of "
                          f"{[ex.qualname for ex in found]}")  # fmt: skip
    return found[0]


def _run(run_dir: Path) -> tuple[RunDir, CodeNamesConfig, Vocabulary]:
    rd = RunDir(run_dir)
    values = rd.read_config()
    if values.get("dataset") != "code-names":
        raise RunError(f"{run_dir} is not a code-names run (its config has no dataset: code-names)")
    if "variant" not in values and values.get("model") in ("llm-tree", "llm-code"):
        raise RunError(
            f'{run_dir} was trained on the earlier prompts (the cue "\\nName:", the '
            "target ending in the end-of-text token): retrain it to name functions"
        )
    values = with_saved_defaults(CodeNamesConfig, values)
    cfg = build_dataclass(CodeNamesConfig, values)
    if not rd.best.is_file():
        raise RunError(f"{run_dir} has no {rd.BEST} (did the run finish?)")
    try:
        vocab = Vocabulary(**json.loads(rd.file("vocabulary.json").read_text()))
    except (OSError, ValueError, TypeError) as err:
        raise RunError(f"{run_dir}: cannot read vocabulary.json ({err})") from None
    return rd, cfg, vocab


@torch.no_grad()
def name_function(run_dir: str | Path, source: str, function: str, path: str = "<input>",
                  llm=None, encoder=None, head: str | None = None,
                  data_dir: str | Path | None = None) -> dict[str, Any]:  # fmt: skip
    """The run's predicted sub-tokens for ``function`` of ``source``, beside its true name.

    ``head`` is ``"lm"`` or ``"gnn"`` for GL-Fusion (default: the head the run chose on
    validation); ``llm`` / ``encoder`` are ``(model, tokenizer)`` pairs (tests), else the run's
    own load offline. Node-text encodings are cached in ``data_dir`` (default
    ``$STRUCTATTN_DATA_DIR`` or ``~/.cache/structattn``), the caller's own folder: never in the
    ``data_dir`` of the run's config (a run folder may have been handed over)."""
    if head not in (None, "lm", "gnn"):
        raise ConfigError(f"head must be lm or gnn, got {head!r}")
    rd, cfg, vocab = _run(Path(run_dir))
    if head == "lm" and cfg.model in GNN_MODELS:
        raise ConfigError(f"{run_dir}: a {cfg.model} run has no LM head")
    if (
        head == "gnn"
        and cfg.model not in GNN_MODELS
        and not (cfg.model == "glfusion" and cfg.gnn_head)
    ):
        raise ConfigError(f"{run_dir}: a {cfg.model} run has no GNN head")
    ex = function_example(source, function, path)
    final = rd.read_final() if rd.is_finished() else {}
    if cfg.model in GNN_MODELS:
        from torch_geometric.data import Batch

        from .gnn import NameGNN, graph_data

        model = NameGNN(vocab, cfg.model, cfg.gnn_layers, cfg.emb_dim, cfg.virtual_node,
                        cfg.dropout, cfg.max_depth)  # fmt: skip
        _load(rd, model, partial=False)
        model.eval()
        batch = Batch.from_data_list([graph_data(ex, vocab, cfg.max_depth)])
        predicted, used = vocab.decode(model.predict_ids(batch)[0].tolist()), "gnn"
    else:
        predicted, used = _llm_name(
            rd, cfg, vocab, ex, llm, encoder, head or final.get("head"), data_dir
        )
    return {"function": ex.qualname, "true": ex.subtokens, "predicted": predicted,
            "model": cfg.model, "head": used, "nodes": ex.num_nodes}  # fmt: skip


def _load(rd: RunDir, model, partial: bool) -> None:
    try:
        load_weights(model, rd.best, partial=partial)
    except Exception as err:  # a damaged or foreign weights file
        raise RunError(f"{rd.path}: cannot load {rd.BEST} ({type(err).__name__}: {err})") from None


def _llm_name(rd, cfg, vocab, ex, llm, encoder, head, data_dir):
    from structattn.data.base import default_data_dir
    from structattn.glfusion.loading import EncodingCache

    from .experiment import build_naming_lm, prompt_spec
    from .llm import build_prompt, collate_prompts

    parts = build_naming_lm(cfg, len(vocab.subtokens), llm, encoder)
    model = parts.model
    _load(rd, model, partial=True)  # the run saved its trainable weights only
    model.eval()
    graph_mode = cfg.model == "glfusion"
    head = head or "lm"
    prompt = build_prompt(ex, cfg.model, parts.tokenizer, prompt_spec(cfg, model.glf.config),
                          vocab.encode_target(ex.subtokens) if graph_mode else None)  # fmt: skip
    encode = None
    if graph_mode:
        root = Path(data_dir) if data_dir is not None else default_data_dir()
        encode = EncodingCache(root / "encodings", *parts.encoder, cfg.text_tokens).get
    b = collate_prompts([prompt], encode, with_targets=False, edge_features=cfg.edge_texts)
    if head == "gnn":
        ids = model.head_ids(b["input_ids"], b["attention_mask"], b.get("graph"))[0]
        return vocab.decode(ids.tolist()), "gnn"
    names = model.generate_names(b["input_ids"], b["attention_mask"], b.get("graph"),
                                 parts.tokenizer, parts.stop_ids, cfg.max_new_tokens)  # fmt: skip
    return names[0], "lm"
