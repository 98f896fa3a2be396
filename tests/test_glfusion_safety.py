"""GL-Fusion given files it should not trust or a run it did not make: label names matched by
name, a handed run's folders never written, no code from a model folder run or asked about,
pickled weights refused, the GGUF cache keyed by the whole file, layer indices checked before
the LLM loads, and a stop during validation honoured between batches."""

from __future__ import annotations

import builtins
import dataclasses
import hashlib
import json
import os
import signal

import pytest
import torch
from helpers import tiny_glfusion_models, tiny_llama, word_tokenizer, write_wordnet

from structattn.errors import ConfigError, DataError, RunError
from structattn.experiments.glfusion import build_glfusion_config, train_glfusion

TINY = dict(dataset="wordnet", max_nodes=4, text_tokens=8, lora_r=2, lora_alpha=4)


def tiny_cfg(data_dir, run_dir, train, **kw):
    return build_glfusion_config(
        {**TINY, "data_dir": data_dir, "run_dir": run_dir, **kw, "train": train}
    )


def _files(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


@pytest.fixture(scope="module")
def handed_run(tmp_path_factory):
    """A finished tiny run whose config's data_dir is someone else's folder ("theirs")."""
    root = tmp_path_factory.mktemp("handed")
    write_wordnet(root / "theirs" / "wordnet" / "data.noun")
    llm, encoder = tiny_glfusion_models(root)
    cfg = tiny_cfg(root / "theirs", root / "run", {"max_steps": 2, "batch_size": 2,
                   "eval_every": 2}, max_train=4, max_val=3, max_test=3, eval_batch_size=3,
                   baseline_epochs=2)  # fmt: skip
    train_glfusion(cfg, progress=False, llm=llm, encoder=encoder)
    return root, cfg, encoder


# ------------------------------------------------------------------ label names matched by name


def test_predict_matches_the_graphs_label_names_to_the_runs_by_name(
    handed_run, tmp_path, monkeypatch
):
    from structattn.experiments.glfusion import load_graph, predict_nodes

    root, cfg, encoder = handed_run
    graph = load_graph(cfg)
    monkeypatch.setenv("STRUCTATTN_DATA_DIR", str(tmp_path / "mine"))

    def predict(g):
        llm = tiny_glfusion_models(tmp_path)[0]
        return predict_nodes(root / "run", [0, 5, 20], llm=llm, encoder=encoder, graph=g)

    reference = predict(graph)
    names = list(graph.label_names)
    shuffled = names[::-1]  # the same names in another order, each node keeping its label name
    order = torch.tensor([shuffled.index(n) for n in names])
    permuted = dataclasses.replace(graph, label_names=shuffled, labels=order[graph.labels])
    assert predict(permuted) == reference  # the GNN head's classes under their own names
    renamed = dataclasses.replace(graph, label_names=[*names[:-2], "zeta", names[-2] + "s"])
    with pytest.raises(ConfigError, match="do not match the run's") as err:
        predict(renamed)
    message = str(err.value)
    assert "\n" not in message and "zeta" in message and repr(names[-1]) in message


# ------------------------------------------------------------------ a handed run's data_dir


def test_predict_and_generate_never_write_where_a_handed_runs_config_points(
    handed_run, tmp_path, monkeypatch
):
    from structattn.experiments.glfusion import generate_about_node, predict_nodes

    root, _, encoder = handed_run
    theirs = root / "theirs"
    import shutil

    shutil.rmtree(theirs / "encodings")  # the cache of whoever trained it: not ours to fill
    before = _files(theirs)
    llm = tiny_glfusion_models(tmp_path)[0]
    rows = predict_nodes(root / "run", [0, 7], llm=llm, encoder=encoder,
                         data_dir=tmp_path / "mine")  # fmt: skip
    assert len(rows) == 2 and any((tmp_path / "mine" / "encodings").glob("*.keys.json"))
    monkeypatch.setenv("STRUCTATTN_DATA_DIR", str(tmp_path / "default"))  # no data_dir given
    text = generate_about_node(root / "run", 9, "What is this?",
                               llm=tiny_glfusion_models(tmp_path)[0], encoder=encoder,
                               max_new_tokens=2)  # fmt: skip
    assert isinstance(text, str)
    assert any((tmp_path / "default" / "encodings").glob("*.keys.json"))
    assert _files(theirs) == before


# ------------------------------------------------------------------ code shipped with a model


def _llm_folder(path, vocab_file):
    tok = word_tokenizer(vocab_file, ["alpha", "beta"])
    tok.save_pretrained(path)
    tiny_llama(len(tok), layers=2).save_pretrained(path)
    return path


def _encoder_folder(path):
    from transformers import BertConfig, BertModel

    path.mkdir(parents=True)
    word_tokenizer(path / "vocab.txt", ["alpha", "beta"]).save_pretrained(path)
    config = BertConfig(vocab_size=6, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=16)  # fmt: skip
    BertModel(config).save_pretrained(path)
    return path


def test_no_loader_runs_or_asks_about_code_shipped_with_a_model(tmp_path, monkeypatch):
    from structattn.glfusion.loading import load_llm, load_text_encoder

    asked = []
    monkeypatch.setattr(builtins, "input", lambda *a: asked.append(a) or "n")
    marker = tmp_path / "code-ran"
    code = f"open({str(marker)!r}, 'w').write('ran')\nfrom transformers import BertTokenizer\n"
    llm = _llm_folder(tmp_path / "llm", tmp_path / "vocab.txt")
    cfg_file = llm / "tokenizer_config.json"
    config = json.loads(cfg_file.read_text())
    config.pop("tokenizer_class", None)
    config["auto_map"] = {"AutoTokenizer": ["tokenization_x.XTokenizer", None]}
    cfg_file.write_text(json.dumps(config))
    (llm / "tokenization_x.py").write_text(code + "class XTokenizer(BertTokenizer): pass\n")
    with pytest.raises(DataError, match="code from a model folder is never run") as err:
        load_llm(llm)
    assert "\n" not in str(err.value)
    enc = _encoder_folder(tmp_path / "enc")
    config = json.loads((enc / "config.json").read_text())
    config["model_type"] = "x-encoder"  # a type transformers does not know: only its code reads it
    config["auto_map"] = {"AutoConfig": "configuration_x.XConfig", "AutoModel": "modeling_x.X"}
    (enc / "config.json").write_text(json.dumps(config))
    (enc / "configuration_x.py").write_text(code)
    (enc / "modeling_x.py").write_text(code)
    with pytest.raises(DataError, match="never run"):
        load_text_encoder(enc)
    assert asked == [] and not marker.exists()


def test_every_from_pretrained_call_refuses_remote_code(tmp_path, monkeypatch):
    import transformers

    from structattn.glfusion.loading import load_llm, load_text_encoder

    calls = []
    for cls in (transformers.AutoModel, transformers.AutoTokenizer, transformers.LlamaForCausalLM):
        original = cls.from_pretrained

        def spy(*args, _original=original, _cls=cls, **kwargs):
            calls.append((_cls.__name__, kwargs.get("trust_remote_code", "unset")))
            return _original(*args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", spy)
    load_llm(_llm_folder(tmp_path / "llm", tmp_path / "vocab.txt"))
    load_text_encoder(_encoder_folder(tmp_path / "enc"))
    assert sorted(calls) == sorted(
        [("LlamaForCausalLM", False), ("AutoTokenizer", False), ("AutoModel", False),
         ("AutoTokenizer", False)]
    )  # fmt: skip


# ------------------------------------------------------------------ pickled weights


class _RunsCode:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickled_weights_are_refused_in_one_line_naming_the_file(tmp_path):
    from structattn.glfusion.loading import load_llm, load_text_encoder

    marker = tmp_path / "unpickled"
    llm = _llm_folder(tmp_path / "llm", tmp_path / "vocab.txt")
    (llm / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": _RunsCode(marker)}, llm / "pytorch_model.bin")
    with pytest.raises(DataError, match="only safetensors weights are read") as err:
        load_llm(llm)
    assert str(err.value).startswith(str(llm / "pytorch_model.bin")) and "\n" not in str(err.value)
    with pytest.raises(DataError, match="only safetensors weights are read"):
        load_llm(llm / "pytorch_model.bin")  # the file itself as --llm
    enc = _encoder_folder(tmp_path / "enc")
    (enc / "model.safetensors").unlink()
    torch.save({"x": _RunsCode(marker)}, enc / "pytorch_model.bin")
    with pytest.raises(DataError, match="pytorch_model.bin: pickled weights are not read"):
        load_text_encoder(enc)
    assert not marker.exists()


# ------------------------------------------------------------------ the GGUF cache


def test_file_sha256_hashes_the_whole_file_in_chunks_and_reuses_an_unchanged_record(
    tmp_path, monkeypatch
):
    import structattn.utils.fingerprint as fp

    monkeypatch.setattr(fp, "CHUNK", 1000)
    path = tmp_path / "f"
    data = os.urandom(5500)
    path.write_bytes(data)
    digest, record = fp.file_sha256(path)
    assert digest == hashlib.sha256(data).hexdigest() == record["sha256"]
    monkeypatch.setattr(fp, "_sha256_stream", lambda p: pytest.fail("read again"))
    assert fp.file_sha256(path, record) == (digest, record)


def _fake_gguf(monkeypatch, tmp_path):
    """Replace the GGUF parser by one whose model's weights depend on the whole file."""
    import structattn.glfusion.loading as loading

    tok = word_tokenizer(tmp_path / "vocab.txt", ["alpha", "beta"])
    parsed = []

    def dequantise(path):
        parsed.append(path)
        seed = int(hashlib.sha256(path.read_bytes()).hexdigest()[:8], 16)
        return tiny_llama(len(tok), layers=1, seed=seed), tok

    monkeypatch.setattr(loading, "_dequantise_gguf", dequantise)
    reads = []
    import structattn.utils.fingerprint as fp

    stream = fp._sha256_stream
    monkeypatch.setattr(fp, "_sha256_stream", lambda p: reads.append(p) or stream(p))
    return parsed, reads


def _change_the_middle_keeping_size_and_mtime(path):
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


@pytest.mark.parametrize("explicit_cache", [True, False])
def test_gguf_cache_is_keyed_by_the_whole_content_hashed_once(
    explicit_cache, tmp_path, monkeypatch
):
    from structattn.glfusion.loading import load_llm

    monkeypatch.setenv("STRUCTATTN_DATA_DIR", str(tmp_path / "data"))
    parsed, reads = _fake_gguf(monkeypatch, tmp_path)
    path = tmp_path / "m.gguf"
    path.write_bytes(os.urandom(5 << 20))
    cache = tmp_path / "cache" if explicit_cache else None
    first, _ = load_llm(path, cache_dir=cache)
    assert len(parsed) == 1 and len(reads) == 1
    again, _ = load_llm(path, cache_dir=cache)
    assert len(parsed) == 1 and len(reads) == 1  # the cache, and no second read of the file
    torch.testing.assert_close(again.state_dict(), first.state_dict())
    _change_the_middle_keeping_size_and_mtime(path)
    changed, _ = load_llm(path, cache_dir=cache)
    assert len(parsed) == 2 and len(reads) == 2  # hashed again, parsed again: not the stale one
    w = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(changed.state_dict()[w], first.state_dict()[w])
    load_llm(path, cache_dir=cache)
    assert len(parsed) == 2 and len(reads) == 2
    if explicit_cache:
        source = json.loads((cache / "gguf-source.json").read_text())
        assert source["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------ layer indices


def test_layer_indices_are_checked_against_the_llms_config_before_it_loads(tmp_path, monkeypatch):
    import structattn.glfusion.build as build
    import structattn.glfusion.loading as loading
    from structattn.glfusion import build_glfusion

    llm = _llm_folder(tmp_path / "llm", tmp_path / "vocab.txt")  # 2 layers
    write_wordnet(tmp_path / "data" / "wordnet" / "data.noun")
    cfg = tiny_cfg(tmp_path / "data", tmp_path / "run", {"max_steps": 1}, llm=llm,
                   message_passing_layers=[0, 99])  # fmt: skip
    no_load = lambda *a, **k: pytest.fail("the LLM was loaded")  # noqa: E731
    monkeypatch.setattr(loading, "load_llm", no_load)
    monkeypatch.setattr(build, "load_llm", no_load)
    import structattn.experiments.glfusion.config as glf_config

    monkeypatch.setattr(glf_config, "load_llm", no_load)
    with pytest.raises(ConfigError, match=r"message_passing_layers \[99\]: .* 2 decoder layers"):
        train_glfusion(cfg, progress=False)
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match=r"cross_attention_layers \[2\]"):
        build_glfusion(llm, tmp_path / "enc", cross_attention_layers=[1, 2])
    from structattn.glfusion.loading import llm_layer_count

    assert llm_layer_count(llm) == 2


def test_the_layer_count_of_a_gguf_file_is_read_from_its_header(tmp_path):
    gguf = pytest.importorskip("gguf")
    from structattn.glfusion.loading import llm_layer_count

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(7)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert llm_layer_count(path) == 7
    (tmp_path / "broken.gguf").write_bytes(b"not a gguf file")
    assert llm_layer_count(tmp_path / "broken.gguf") is None


# ------------------------------------------------------------------ a stop during validation


def test_sigterm_during_validation_stops_between_batches_and_resumes(tmp_path, monkeypatch):
    import structattn.experiments.glfusion.evaluation as evaluation

    write_wordnet(tmp_path / "data" / "wordnet" / "data.noun")
    batches = []
    collate = evaluation.collate_examples

    def counting(*args, **kwargs):  # validation's batches only (training collates elsewhere)
        batches.append(1)
        if len(batches) == 5:  # the first batch of the second pass (step 4)
            os.kill(os.getpid(), signal.SIGTERM)
        return collate(*args, **kwargs)

    def cfg(**kw):
        train = {"max_steps": 4, "batch_size": 2, "eval_every": 2}
        return tiny_cfg(tmp_path / "data", tmp_path / "run", train, max_train=4, max_val=4,
                        max_test=2, eval_batch_size=1, baseline_epochs=2, **kw)  # fmt: skip

    llm, encoder = tiny_glfusion_models(tmp_path)
    with monkeypatch.context() as m:
        m.setattr(evaluation, "collate_examples", counting)
        with pytest.raises(SystemExit) as exc:
            train_glfusion(cfg(), progress=False, llm=llm, encoder=encoder)
    assert exc.value.code == 128 + signal.SIGTERM
    assert len(batches) == 5  # the pass stopped after its first batch, not after all four
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*"))
    assert checkpoints == ["step-00000002"]  # nothing of the stopped step was written
    rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()[1:]
    assert [r.split(",")[0] for r in rows if ",val," in r] == ["2"]
    llm, encoder = tiny_glfusion_models(tmp_path)
    results = train_glfusion(cfg(resume=True), progress=False, llm=llm, encoder=encoder)
    rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()[1:]
    assert [r.split(",")[0] for r in rows if ",val," in r] == ["2", "4"]
    assert results["best_step"] in (2, 4)
    # a stop requested before a pass: no batch at all
    from structattn.experiments.glfusion.evaluation import EvaluationStopped, gnn_accuracy

    model = tiny_glfusion_models(tmp_path)[0][0]
    with pytest.raises(EvaluationStopped):
        gnn_accuracy(model, ["never collated"], None, 1, stop=lambda: signal.SIGTERM)


# ------------------------------------------------------------------ files left behind


def test_no_generated_message_passing_file_is_left_in_the_temporary_folder(tmp_path):
    """torch_geometric writes a ``*_propagate_*.py`` per message-passing class and process to
    the temporary folder and never deletes it: structattn removes its own at exit."""
    import subprocess
    import sys

    code = (
        "import structattn, torch_geometric.nn as g\n"
        "g.GCNConv(4, 4); g.SAGEConv(4, 4); g.GINEConv(torch.nn.Linear(4, 4), edge_dim=4)\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", "import torch\n" + code], env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_run_of_the_other_kind_is_named_with_the_command_that_reads_it(handed_run, tmp_path):
    from structattn.cli import main
    from structattn.experiments.glfusion import predict_nodes

    root, _, _ = handed_run
    with pytest.raises(SystemExit) as err:
        main(["eval", str(root / "run")])
    message = str(err.value)
    assert "GL-Fusion node-classification run" in message and "glfusion predict" in message
    assert "\n" not in message and "unknown" not in message
    lra = tmp_path / "lra"
    lra.mkdir()
    (lra / "config.yaml").write_text("name: listops-hkt\ndata:\n  task: listops\nmodel: {}\n")
    with pytest.raises(RunError, match="HKT/MHA sequence-classification run.*structattn eval"):
        predict_nodes(lra, [0])
