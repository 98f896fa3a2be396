"""The gated form of GL-Fusion: as initialised it is its base LLM on the same prompt (logits,
generation, label scores); graph information enters through the gated paths only, at the
nodes' slots (each node text's last token) and after them, never reaching back into the text
before the graph or from the answer into the node states."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import TEXT_DIM, tiny_glfusion_base

from structattn.glfusion import GLFusionConfig, GLFusionForCausalLM, GraphBatch
from structattn.glfusion.modeling import apply_lora

HEAD = [5, 6, 7]  # the instruction
CUE = [11, 12]  # the answer cue after the graph


def gated_lm(layers=4, seed=0, **cfg):
    config = GLFusionConfig(text_dim=TEXT_DIM, num_node_classes=3, variant="gated", **cfg)
    return GLFusionForCausalLM.from_base(tiny_glfusion_base(layers, seed), config).double().eval()


def gated_batch(model, sizes, seed=0, left_pad=False, edge_dim=0, cue=CUE):
    """Prompts ``HEAD, node texts (1-3 random tokens each), cue`` padded to one length and
    their graph (random node-text encodings, a ring of edges, each node's text span)."""
    g = torch.Generator().manual_seed(seed)
    rows, spans, enc, edges, attrs = [], [], [], [], []
    for n in sizes:
        body, span = [], []
        for _ in range(n):
            line = torch.randint(13, 30, (int(torch.randint(1, 4, (), generator=g)),), generator=g)
            span.append([len(HEAD) + len(body), len(HEAD) + len(body) + len(line)])
            body += line.tolist()
        rows.append(HEAD + body + cue)
        spans.append(torch.tensor(span))
        enc.append(torch.randn(n, 4, TEXT_DIM, generator=g, dtype=torch.float64))
        edges.append(torch.tensor([[i, (i + 1) % n] for i in range(n)]).T)
        if edge_dim:
            attrs.append(torch.randn(n, edge_dim, generator=g, dtype=torch.float64))
    ids, mask, shift = _pad(rows, left_pad)
    spans = [s + k for s, k in zip(spans, shift)]
    graph = GraphBatch.from_graphs(enc, edges, attrs or None, targets=[0] * len(sizes),
                                   text_spans=spans)  # fmt: skip
    return ids, mask, graph


def _pad(rows, left):
    S = max(map(len, rows))
    ids = torch.zeros(len(rows), S, dtype=torch.long)
    mask = torch.zeros(len(rows), S, dtype=torch.long)
    shift = []
    for b, row in enumerate(rows):
        k = S - len(row) if left else 0
        ids[b, k : k + len(row)] = torch.tensor(row)
        mask[b, k : k + len(row)] = 1
        shift.append(k)
    return ids, mask, shift


@pytest.mark.parametrize("left_pad", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_at_initialisation_the_logits_are_the_base_llms_on_the_same_prompt(seed, left_pad):
    model = gated_lm(seed=seed, edge_dim=5)
    sizes = [(3, 1, 4), (2, 5), (6,)][seed]
    ids, mask, graph = gated_batch(model, sizes, seed, left_pad, edge_dim=5)
    with torch.no_grad():
        out = model(ids, mask, graph=graph)
    for b in range(len(sizes)):
        real = mask[b].bool()
        with torch.no_grad():  # no graph: exactly the base LLM, on the row alone
            want = model(ids[b, real][None]).logits[0]
        got = out.logits[b, real]
        assert torch.allclose(got, want, atol=1e-10, rtol=0), (got - want).abs().max()
    assert out.node_logits.shape == (sum(sizes), 3)  # the GNN head reads every node's slot


def test_with_lora_and_any_gate_the_logits_are_still_the_base_llms():
    model = apply_lora(gated_lm(seed=3))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate"):
                p.fill_(-2.5)
    ids, mask, graph = gated_batch(model, (4, 2), seed=3)
    with torch.no_grad():
        out, base = model(ids, mask, graph=graph), model(ids, mask)
    real = mask.bool()
    assert torch.allclose(out.logits[real], base.logits[real], atol=1e-10, rtol=0)


def open_outputs(model, seed=0):
    """Random output projections for the cross-attention, message passing and node
    projection (a trained model's, in effect)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("glf_") and (".out." in name or ".update." in name
                                            or name.startswith("glf_node_proj")):  # fmt: skip
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)


def _other(graph):
    """The same nodes and spans with other encodings, reversed edges and other edge features."""
    return GraphBatch(graph.node_text.flip(0).clone(), graph.node_text_mask,
                      graph.edge_index.flip(0), graph.node_batch,
                      None if graph.edge_attr is None else graph.edge_attr * -1.0,
                      graph.target_nodes, graph.text_spans)  # fmt: skip


def test_the_graph_reaches_the_text_from_the_first_slot_on_and_only_through_the_paths():
    model = gated_lm(seed=4, edge_dim=5)
    open_outputs(model)
    ids, mask, graph = gated_batch(model, (3, 4), seed=4, edge_dim=5)
    with torch.no_grad():
        a, b = model(ids, mask, graph=graph).logits, model(ids, mask, graph=_other(graph)).logits
    slots = graph.text_spans[:, 1] - 1
    for row in range(2):
        first = int(slots[graph.node_batch == row].min())
        assert torch.equal(a[row, :first], b[row, :first])
        end = int(mask[row].sum())
        assert (a[row, end - 1] - b[row, end - 1]).abs().max() > 1e-6  # the cue reads it
    # with every path off and the slots' inputs at 0, no graph reaches any column
    off = gated_lm(seed=4, edge_dim=5, cross_attention_layers=[], message_passing_layers=[])
    with torch.no_grad():
        a, b = off(ids, mask, graph=graph).logits, off(ids, mask, graph=_other(graph)).logits
    assert torch.equal(a, b)


def test_the_answer_never_reaches_the_node_states():
    model = gated_lm(seed=8, edge_dim=5)
    open_outputs(model, seed=8)
    ids, mask, graph = gated_batch(model, (3, 2), seed=8, edge_dim=5, cue=CUE + [20, 21, 22])
    other = ids.clone()
    for b in range(2):
        end = int(mask[b].sum())
        other[b, end - 3 : end] = torch.tensor([25, 26, 27])  # another answer
    with torch.no_grad():
        a, b = model(ids, mask, graph=graph), model(other, mask, graph=graph)
    assert torch.equal(a.node_logits, b.node_logits)


def test_edges_matter_only_through_message_passing():
    ids_graph = None
    for layers, changes in (([], False), (None, True)):
        model = gated_lm(seed=9, message_passing_layers=layers)
        open_outputs(model, seed=9)
        if ids_graph is None:
            ids_graph = gated_batch(model, (4,), seed=9)
        ids, mask, graph = ids_graph
        star = torch.tensor([[0, 0, 0], [1, 2, 3]])
        rewired = GraphBatch(
            graph.node_text,
            graph.node_text_mask,
            star,
            graph.node_batch,
            target_nodes=graph.target_nodes,
            text_spans=graph.text_spans,
        )
        with torch.no_grad():
            a = model(ids, mask, graph=graph).logits
            b = model(ids, mask, graph=rewired).logits
        assert bool((a - b).abs().max() > 1e-9) == changes


def test_generation_at_initialisation_is_the_base_llms_and_the_cache_is_exact():
    model = gated_lm(seed=5)
    ids, mask, graph = gated_batch(model, (3, 2), seed=5, left_pad=True)
    new, logits = model.generate(ids, mask, graph, max_new_tokens=6, return_logits=True)
    for b in range(2):  # the base LLM on the row alone, without padding, and what it chose
        row = torch.cat([ids[b, mask[b].bool()], new[b, :5]])
        with torch.no_grad():
            want = model(row[None]).logits[0, -6:]
        assert torch.allclose(logits[b], want, atol=1e-10, rtol=0)
        c = model.config
        allowed = want.index_fill(-1, torch.tensor([c.graph_start_id, c.node_id, c.graph_end_id]),
                                  float("-inf"))  # never generated  # fmt: skip
        assert torch.equal(new[b], allowed.argmax(-1))
    # with the paths open, each cached step's logits are those of a full pass over the prompt
    # followed by the tokens generated so far
    open_outputs(model, seed=5)
    new, logits = model.generate(ids, mask, graph, max_new_tokens=4, return_logits=True)
    full_ids = torch.cat([ids, new], 1)
    full_mask = torch.cat([mask, torch.ones_like(new)], 1)
    with torch.no_grad():
        full = model(full_ids, full_mask, graph=graph).logits
    S = ids.shape[1]
    assert torch.allclose(logits, full[:, S - 1 : S + 3], atol=1e-9, rtol=0)


def test_label_scores_are_those_of_each_label_after_the_prompt():
    model = gated_lm(seed=6)
    open_outputs(model, seed=6)
    ids, mask, graph = gated_batch(model, (2, 3), seed=6)
    labels = [[20, 21], [22], [23, 24, 25]]
    scores = model.score_labels(ids, mask, graph, labels)
    for k, name in enumerate(labels):
        for b in range(2):
            row = torch.cat([ids[b, mask[b].bool()], torch.tensor(name)])
            one = GraphBatch.from_graphs(
                [graph.node_text[graph.node_batch == b]],
                [graph.edge_index[:, graph.node_batch[graph.edge_index[0]] == b]
                 - int((graph.node_batch < b).sum())],
                targets=[0], text_spans=[graph.text_spans[graph.node_batch == b]],
            )  # fmt: skip
            with torch.no_grad():
                logp = model(row[None], graph=one).logits[0].log_softmax(-1)
            n = len(row) - len(name)
            want = sum(float(logp[n - 1 + i, t]) for i, t in enumerate(name))
            assert abs(float(scores[b, k]) - want) < 1e-9


def test_one_training_step_opens_the_paths_from_zero():
    model = apply_lora(gated_lm(seed=7)).train()
    ids, mask, graph = gated_batch(model, (3, 3), seed=7)
    labels = torch.full_like(ids, -100)
    labels[:, -1] = 12
    node_labels = torch.tensor([1, -100, -100, 2, -100, -100])
    model(ids, mask, graph=graph, labels=labels, node_labels=node_labels).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if n.startswith("glf_")}
    # what writes into the text from 0 learns at once (through the LM loss and the GNN head);
    # what feeds a zero output (the gates, the cross-attention's query) starts after it moves
    for name in ("glf_cross_attention.3.out.weight", "glf_gnn_head.weight",
                 "glf_message_passing.0.update.weight", "glf_node_proj.weight"):  # fmt: skip
        assert grads[name] is not None and float(grads[name].abs().sum()) > 0, name
    assert float(grads["glf_cross_attention.3.gate"].abs()) == 0.0
    assert float(grads["glf_cross_attention.3.query.weight"].abs().sum()) == 0.0


def test_gated_prompts_and_spans_are_checked():
    model = gated_lm()
    ids, mask, graph = gated_batch(model, (2,), seed=0)
    for token in (model.config.graph_start_id, model.config.node_id):
        bad = ids.clone()
        bad[0, 0] = token
        with pytest.raises(ValueError, match="graph_start|<node>"):
            model(bad, mask, graph=graph)

    def spans(rows):
        return GraphBatch.from_graphs([graph.node_text], [graph.edge_index], targets=[0],
                                      text_spans=[torch.tensor(rows)])  # fmt: skip

    for rows, match in (([[3, 5], [4, 6]], "overlap"), ([[3, 4], [4, 4]], "non-empty"),
                        ([[3, 4], [5, 40]], "non-empty")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            model(ids, mask, graph=spans(rows))
    with pytest.raises(ValueError, match=r"\(2, 2\)"):
        GraphBatch.from_graphs([graph.node_text], [graph.edge_index],
                               text_spans=[torch.tensor([[3, 4]])])  # fmt: skip
    no_spans = GraphBatch(graph.node_text, graph.node_text_mask, graph.edge_index,
                          graph.node_batch, target_nodes=graph.target_nodes)  # fmt: skip
    with pytest.raises(ValueError, match="text_spans"):
        model(ids, mask, graph=no_spans)


def test_a_config_saved_before_the_gated_form_loads_as_the_papers(tmp_path):
    path = tmp_path / "glfusion_config.json"
    config = GLFusionConfig(variant="paper")
    config.save(path)
    values = json.loads(path.read_text())
    del values["variant"]
    path.write_text(json.dumps(values))
    assert GLFusionConfig.load(path).variant == "paper"
    assert GLFusionConfig().variant == "gated"
    with pytest.raises(ValueError, match="variant"):
        GLFusionConfig(variant="other").resolve(4)


def test_spans_over_padding_are_named_and_old_configs_mean_the_papers_form():
    from structattn.engine.config import default_config
    from structattn.experiments.glfusion.code.config import CodeNamesConfig
    from structattn.experiments.glfusion.config import GLFusionTrainConfig

    model = gated_lm()
    ids, mask, graph = gated_batch(model, (3, 1), seed=2, left_pad=True)
    assert not bool(mask[1, :2].any())  # row 1 is padded on the left
    spans = graph.text_spans.clone()
    spans[-1] = torch.tensor([0, 3])  # its node's text over the padding
    unshifted = GraphBatch(graph.node_text, graph.node_text_mask, graph.edge_index,
                           graph.node_batch, target_nodes=graph.target_nodes,
                           text_spans=spans)  # fmt: skip
    with pytest.raises(ValueError, match="padding"):
        model(ids, mask, graph=unshifted)
    # a saved run config without `variant` was written before the gated form: resuming,
    # predicting and reusing it read it as the paper's form
    for cls in (GLFusionTrainConfig, CodeNamesConfig):
        assert default_config(cls)["variant"] == "paper" and cls.__dataclass_fields__
