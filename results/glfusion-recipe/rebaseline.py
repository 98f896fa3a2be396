"""Recompute the baselines of a finished GL-Fusion run with the current run_baselines (same
targets, subgraphs, encodings), and rewrite its results.json / results.md beside the originals."""
import json, sys
from pathlib import Path
import torch, yaml
from structattn.data.base import default_data_dir
from structattn.experiments.glfusion import (build_glfusion_config, load_graph, results_table,
                                             run_baselines, sample_targets)
from structattn.data.graphs import sample_subgraph
from structattn.glfusion.loading import EncodingCache, load_text_encoder
run = Path(sys.argv[1])
values = yaml.safe_load((run / "config.yaml").read_text()); values["resume"] = False
cfg = build_glfusion_config(values)
graph = load_graph(cfg)
targets = {s: sample_targets(graph, s, n, cfg.seed) for s, n in (("train", cfg.max_train), ("val", cfg.max_val), ("test", cfg.max_test))}
universe = sorted({int(v) for ts in targets.values() for t in ts
                   for v in sample_subgraph(graph, t, cfg.num_hops, cfg.max_nodes, cfg.seed)[0]})
enc_model, enc_tok = load_text_encoder(cfg.encoder)
root = Path(cfg.data_dir) if cfg.data_dir is not None else default_data_dir()
cache = EncodingCache(root / "encodings", enc_model, enc_tok, cfg.text_tokens)
enc, mask = cache.get([graph.node_texts[v] for v in universe])
m = mask.unsqueeze(-1).float()
pooled = (enc.float() * m).sum(1) / m.sum(1).clamp_min(1)
results = json.loads((run / "results.json").read_text())
results["baselines_first_run"] = results["baselines"]
results["baselines"] = run_baselines(graph, universe, pooled, targets, cfg.baseline_epochs, cfg.seed)
(run / "results.json").write_text(json.dumps(results, indent=2))
(run / "results.md").write_text(results_table(results) + "\n")
print(results_table(results))
