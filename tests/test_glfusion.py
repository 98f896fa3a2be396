"""GL-Fusion on tiny random Llama models: mask, faithfulness, message passing, cross-attention,
twin predictor, LoRA and save/load."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from helpers import (
    TEXT_DIM,
    graph_for,
    open_gates,
    prompts,
    tiny_glfusion_base,
    tiny_glfusion_lm,
)

from structattn.glfusion import (
    GLFusionConfig,
    GLFusionForCausalLM,
    GraphBatch,
    NodeMessagePassing,
    apply_lora,
    build_structure_mask,
    node_position_ids,
)

# ---------------------------------------------------------------------- mask


def _rule(node, real, i, j):
    if not (real[i] and real[j]):
        return False
    nodes = [k for k, x in enumerate(node) if x]
    if node[i]:
        return (bool(nodes) and j < nodes[0]) or node[j]
    return j <= i


def test_structure_mask_pair_by_pair_on_random_layouts():
    rng = random.Random(0)
    for _ in range(60):
        B, N = 3, rng.randint(1, 14)
        node = torch.zeros(B, N, dtype=torch.bool)
        real = torch.ones(B, N, dtype=torch.long)
        for b in range(B):
            if rng.random() < 0.8:
                start = rng.randrange(N)
                node[b, start : start + rng.randint(1, N - start)] = True
            real[b, rng.randint(1, N) :] = 0  # right padding
        mask = build_structure_mask(node, real)
        assert mask.shape == (B, 1, N, N) and mask.dtype == torch.bool
        for b in range(B):
            for i in range(N):
                for j in range(N):
                    expected = _rule(node[b].tolist(), real[b].tolist(), i, j)
                    assert bool(mask[b, 0, i, j]) == expected, (b, i, j)


def test_structure_mask_rejects_two_node_blocks_and_bad_shapes():
    node = torch.tensor([[False, True, False, True]])
    with pytest.raises(ValueError, match="one contiguous block"):
        build_structure_mask(node)
    with pytest.raises(ValueError, match="attention_mask must be"):
        build_structure_mask(torch.zeros(1, 4, dtype=torch.bool), torch.ones(1, 5))


def test_node_tokens_share_one_position():
    node = torch.tensor([[False, False, True, True, True, False, False]])
    assert node_position_ids(node).tolist() == [[0, 1, 2, 2, 2, 3, 4]]


# ---------------------------------------------------------------------- faithfulness


def test_no_graph_is_exactly_the_base_model():
    model = tiny_glfusion_lm()
    ids = torch.randint(0, 40, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    expected = model.base(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(model(ids, mask).logits, expected)
    fresh = tiny_glfusion_base()  # an untouched copy of the same base, before resizing
    torch.testing.assert_close(
        model(ids, mask).logits[..., :40], fresh(ids, attention_mask=mask).logits
    )


def test_text_before_the_graph_is_unchanged_with_closed_gates():
    model = tiny_glfusion_lm()
    ids, mask = prompts(model)
    out = model(ids, mask, graph_for())
    plain = model.base(input_ids=ids[:, :4]).logits  # the text up to <graph_start> excluded
    torch.testing.assert_close(out.logits[:, :3], plain[:, :3], rtol=1e-10, atol=1e-10)


def test_node_tokens_without_graph_is_an_error():
    model = tiny_glfusion_lm()
    ids, mask = prompts(model)
    with pytest.raises(ValueError, match="no graph"):
        model(ids, mask)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: graph_for((3, 3)), "node count != <node> tokens"),
        (
            lambda: GraphBatch.from_graphs(
                [torch.randn(3, 2, TEXT_DIM)], [torch.tensor([[0], [5]])]
            ),
            "outside 0..2",
        ),
        (
            lambda: GraphBatch.from_graphs([torch.randn(0, 2, TEXT_DIM)], [torch.zeros(2, 0)]),
            "empty",
        ),
    ],
)
def test_graph_batch_validation(make, match):
    model = tiny_glfusion_lm()
    ids, mask = prompts(model)
    with pytest.raises(ValueError, match=match):
        model(ids, mask, make().to("cpu"))


# ---------------------------------------------------------------------- message passing


def _direct_aggregates(h, edge_index, edge_vec):
    out = []
    for u in range(h.shape[0]):
        msgs = [h[v] * edge_vec for v, w in edge_index.T.tolist() if w == u]
        if not msgs:
            out.append(torch.zeros(3 * h.shape[1], dtype=h.dtype))
            continue
        m = torch.stack(msgs)
        var = m.var(0, unbiased=False)
        std = torch.where(var > 1e-5, var.clamp_min(1e-5).sqrt(), 0.0)  # PyG: 0 below sqrt(eps)
        out.append(torch.cat([m.mean(0), m.max(0).values, std]))
    return torch.stack(out)


def test_aggregators_match_a_direct_computation_and_isolated_nodes_are_zero():
    torch.manual_seed(0)
    mp = NodeMessagePassing(6).double()
    with torch.no_grad():
        mp.edge_embed.normal_()
    h = torch.randn(5, 6, dtype=torch.float64)
    edges = torch.tensor([[0, 1, 2, 3, 1], [1, 2, 1, 1, 0]])  # node 4 isolated
    agg = mp.aggregate(h, edges, None)
    expected = _direct_aggregates(h, edges, mp.edge_embed)
    torch.testing.assert_close(agg, expected)
    assert torch.isfinite(agg).all()
    assert (agg[4, :12] == 0).all()


def test_message_passing_is_permutation_equivariant_and_gated():
    torch.manual_seed(1)
    mp = NodeMessagePassing(6, edge_dim=3).double()
    h = torch.randn(6, 6, dtype=torch.float64)
    edges = torch.tensor([[0, 1, 2, 3, 4, 5, 0], [1, 2, 3, 4, 5, 0, 3]])
    attr = torch.randn(7, 3, dtype=torch.float64)
    assert torch.equal(mp(h, edges, attr), h)  # gate starts at 0
    with torch.no_grad():
        mp.gate.fill_(0.5)
    out = mp(h, edges, attr)
    perm = torch.randperm(6)
    inv = torch.argsort(perm)
    out_perm = mp(h[perm], inv[edges], attr)
    torch.testing.assert_close(out_perm, out[perm])


def test_node_order_does_not_change_gnn_outputs():
    """Permuting the nodes of a graph (texts and edges) permutes the GNN head's outputs."""
    model = tiny_glfusion_lm()
    open_gates(model)
    ids, mask = prompts(model, (4,))
    g = torch.Generator().manual_seed(3)
    text = torch.randn(4, 3, TEXT_DIM, generator=g, dtype=torch.float64)
    edges = torch.tensor([[0, 1, 2, 3, 0], [1, 2, 3, 0, 2]])
    a = model(ids[:1], mask[:1], GraphBatch.from_graphs([text], [edges])).node_logits
    perm = torch.tensor([2, 0, 3, 1])
    inv = torch.argsort(perm)
    b = model(ids[:1], mask[:1], GraphBatch.from_graphs([text[perm]], [inv[edges]])).node_logits
    torch.testing.assert_close(b, a[perm], rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------------- cross-attention


def _perturb_text_keep_mean(graph, node):
    """Change node ``node``'s text tokens but not their mean (so not its input embedding):
    only cross-attention can see the change."""
    graph2 = copy.deepcopy(graph)
    graph2.node_text[node, 0] += 3.0
    graph2.node_text[node, 1] -= 3.0
    return graph2


def test_cross_attention_visibility_by_perturbation():
    """Perturbing node 1's text changes node 1's token and the text after the graph only."""
    model = tiny_glfusion_lm(layers=4, message_passing_layers=[], cross_attention_layers=[0])
    open_gates(model)
    ids, mask = prompts(model, (3,))
    ids, mask = ids[:1], mask[:1]
    graph = graph_for((3,))
    base = model(ids, mask, graph).logits
    graph2 = _perturb_text_keep_mean(graph, node=1)
    changed = (model(ids, mask, graph2).logits - base).abs().amax(-1)[0]  # (S,)
    torch.testing.assert_close(  # same input embeddings, up to rounding of the mean
        model._embed(ids, graph, graph.validate(ids, model.config.node_id)),
        model._embed(ids, graph2, graph2.validate(ids, model.config.node_id)),
        rtol=0,
        atol=1e-14,
    )
    node_pos = (ids[0] == model.config.node_id).nonzero().flatten().tolist()  # [4, 5, 6]
    moved = {i for i, c in enumerate(changed.tolist()) if c > 1e-9}
    # Node 1's token changes; later positions through attention to it: other node tokens see it
    # in self-attention after layer 0, so only positions before the graph must stay fixed.
    assert node_pos[1] in moved
    assert all(i not in moved for i in range(4))
    real_after = [i for i in range(node_pos[-1] + 1, int(mask.sum()))]
    assert all(i in moved for i in real_after)


def test_cross_attention_reads_only_own_text_at_the_last_layer():
    """At the last layer nothing propagates further: only node 1 and text after the graph move."""
    model = tiny_glfusion_lm(layers=4, message_passing_layers=[], cross_attention_layers=[3])
    open_gates(model)
    ids, mask = prompts(model, (3,))
    ids, mask = ids[:1], mask[:1]
    graph = graph_for((3,))
    out = model(ids, mask, graph)
    graph2 = _perturb_text_keep_mean(graph, node=1)
    out2 = model(ids, mask, graph2)
    changed = (out2.logits - out.logits).abs().amax(-1)[0]
    real = int(mask.sum())
    moved = {i for i, c in enumerate(changed.tolist()[:real]) if c > 1e-9}
    assert moved == {5} | set(range(7, real))  # node 1 (position 5); <graph_end> and after
    node_change = (out2.node_logits - out.node_logits).abs().amax(-1)
    assert node_change[1] > 1e-9 and node_change[0] == 0 and node_change[2] == 0


# ---------------------------------------------------------------------- training


def test_tiny_training_step_reduces_the_joint_loss_and_lora_freezes_the_base():
    model = apply_lora(tiny_glfusion_lm(), r=4, alpha=8)
    model.train()
    base_before = {
        n: p.detach().clone() for n, p in model.base.named_parameters() if "lora_" not in n
    }
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert all(n.startswith("glf_") or "lora_" in n for n in trainable)
    assert any(n.startswith("glf_message_passing") for n in trainable)
    assert not any("glf_" in n and "lora_" in n for n in trainable)  # LoRA never matched ours
    ids, mask = prompts(model)
    graph = graph_for()
    labels = ids.masked_fill(mask == 0, -100)
    node_labels = torch.tensor([0, 1, 2, 0, 1])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    first = None
    for _ in range(15):
        opt.zero_grad()
        loss = model(ids, mask, graph, labels=labels, node_labels=node_labels).loss
        first = first if first is not None else loss.item()
        loss.backward()
        opt.step()
    assert loss.item() < 0.7 * first
    for n, p in model.base.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, base_before[n]), n


def test_predict_combines_gnn_and_label_scores():
    model = tiny_glfusion_lm()
    ids, mask = prompts(model)
    pred = model.predict(ids, mask, graph_for(), label_ids=[[11], [12, 13], [14]])
    for key in ("gnn", "lm", "ensemble"):
        assert pred[key].shape == (2, 3)
        torch.testing.assert_close(pred[key].sum(-1), torch.ones(2, dtype=pred[key].dtype))
    # the LM score of a label equals the log-probability computed by hand on prompt + label
    open_gates(model)
    scores = model.score_labels(ids, mask, graph_for(), [[12, 13]])
    L = int(mask[1].sum())
    full = torch.cat([ids[1, :L], torch.tensor([12, 13])])[None]
    second = GraphBatch.from_graphs([graph_for().node_text[3:5]], [torch.tensor([[0, 1], [1, 0]])])
    logp = model(full, torch.ones_like(full), second).logits.log_softmax(-1)[0]
    expected = logp[L - 1, 12] + logp[L, 13]
    torch.testing.assert_close(scores[1, 0].double(), expected.double(), rtol=1e-6, atol=1e-6)


def test_gnn_head_pass_equals_the_full_pass_and_a_rewrapped_base_uses_the_new_modules():
    """node_logits skips the vocabulary projection but not a bit of the node states; a base
    wrapped by a second GL-Fusion model runs the second model's modules, not the first's."""
    model = tiny_glfusion_lm(seed=1)
    open_gates(model, 0.6)
    ids, mask = prompts(model)
    graph = graph_for()
    full = model(ids, mask, graph).node_logits
    assert torch.equal(model.node_logits(ids, mask, graph), full)
    second = GLFusionForCausalLM(model.base, model.config).double().eval()
    open_gates(second, 0.6)  # its own fresh modules: other node logits
    assert not torch.allclose(second.node_logits(ids, mask, graph), full)
    second.load_state_dict(model.state_dict())  # the first model's modules: the same again
    torch.testing.assert_close(second.node_logits(ids, mask, graph), full, rtol=0, atol=1e-12)


def test_save_and_load_round_trip(tmp_path):
    model = apply_lora(tiny_glfusion_lm(edge_dim=2), r=4, alpha=8)
    open_gates(model, 0.3)
    with torch.no_grad():
        for n, p in model.base.named_parameters():
            if "lora_B" in n:
                p.normal_()
    model.eval()
    ids, mask = prompts(model)
    graph = graph_for(edge_dim=2)
    expected = model(ids, mask, graph)
    model.save_pretrained(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "ckpt" / "glfusion_modules.safetensors").is_file()
    reloaded = (
        GLFusionForCausalLM.from_pretrained(tmp_path / "ckpt", tiny_glfusion_base()).double().eval()
    )
    got = reloaded(ids, mask, graph)
    torch.testing.assert_close(got.logits, expected.logits)
    torch.testing.assert_close(got.node_logits, expected.node_logits)


def test_graph_tokens_are_added_to_a_tokenizer_and_the_embeddings_resized(tmp_path):
    from transformers import BertTokenizer

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + [f"w{i}" for i in range(36)]))
    tokenizer = BertTokenizer(str(vocab))
    before = len(tokenizer)
    model = GLFusionForCausalLM.from_base(
        tiny_glfusion_base(), GLFusionConfig(text_dim=TEXT_DIM), tokenizer=tokenizer
    )
    c = model.config
    ids = tokenizer.convert_tokens_to_ids(["<graph_start>", "<node>", "<graph_end>"])
    assert [c.graph_start_id, c.node_id, c.graph_end_id] == ids == [before, before + 1, before + 2]
    assert model.base.get_input_embeddings().weight.shape[0] == len(tokenizer) == before + 3
    encoded = tokenizer("w1 <graph_start> <node> <node> <graph_end> w2")["input_ids"]
    assert encoded.count(c.node_id) == 2 and c.graph_start_id in encoded


class _CallCheckpoint(torch.nn.Module):
    """Checkpoints a whole layer call, hooks included (what transformers 4.x did)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, *args, **kwargs):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.layer, *args, use_reentrant=False, **kwargs)


def _grads(model):
    ids, mask = prompts(model)
    labels = ids.masked_fill(mask == 0, -100)
    out = model(ids, mask, graph_for(), labels=labels, node_labels=torch.tensor([0, 1, 2, 0, 1]))
    out.loss.backward()
    return {  # names without the test wrapper's ".layer"
        n.replace(".layer.", "."): p.grad.clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


@pytest.mark.parametrize("how", ["transformers", "whole_layer_call"])
def test_gradient_checkpointing_gives_the_same_gradients(how):
    """Recomputed layers must run message passing and cross-attention again, with the graph."""
    plain = tiny_glfusion_lm()
    open_gates(plain)
    plain.train()
    reference = _grads(plain)
    ckpt = copy.deepcopy(plain)
    recomputed = []
    if how == "transformers":
        ckpt.gradient_checkpointing_enable()
        assert ckpt.base.model.layers[0].gradient_checkpointing
    else:
        ckpt.base.config.use_cache = False  # a replayed layer must not append to a KV cache
        layers = ckpt.base.model.layers
        for i, layer in enumerate(layers):
            layers[i] = _CallCheckpoint(layer)
    for layer in (m for m in ckpt.modules() if type(m).__name__ == "NodeMessagePassing"):
        layer.register_forward_hook(lambda *a: recomputed.append(1))
    grads = _grads(ckpt)
    if how == "whole_layer_call":  # message passing ran in the forward and again in backward
        assert len(recomputed) == 2 * len(ckpt.config.message_passing_layers)
    assert reference.keys() == grads.keys()
    assert any(k.startswith("glf_message_passing") for k in grads)
    for name in reference:
        torch.testing.assert_close(grads[name], reference[name], rtol=1e-10, atol=1e-12, msg=name)


# ---------------------------------------------------------------------- graph batches


def test_edge_lists_must_be_2_by_E_and_are_never_reshaped():
    texts = [torch.randn(3, 2, TEXT_DIM)]
    listed = torch.tensor([[0, 1], [1, 2], [2, 0]])  # (E, 2): would silently reshape before
    with pytest.raises(ValueError, match=r"\(E, 2\) edge list: pass edge_index.T"):
        GraphBatch.from_graphs(texts, [listed])
    g = GraphBatch.from_graphs(texts, [listed.T])
    assert g.edge_index.tolist() == [[0, 1, 2], [1, 2, 0]]
    with pytest.raises(ValueError, match="must hold integers"):
        GraphBatch.from_graphs(texts, [listed.T.float()])
    with pytest.raises(ValueError, match=r"must be \(2, E\)"):
        GraphBatch.from_graphs(texts, [torch.tensor([0, 1, 2])])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(node_texts=[[torch.randn(2, TEXT_DIM), torch.randn(0, TEXT_DIM)]]), "node 1"),
        (dict(targets=[3]), "target 3"),
        (dict(edge_attrs=[torch.randn(1, 2)]), "edge_attrs"),
        (dict(node_texts=[None], edge_indices=[None], targets=[None]), "no sequence"),
        (dict(node_texts=[None], edge_indices=[torch.tensor([[0], [0]])]), "edges but no node"),
    ],
)
def test_from_graphs_names_bad_input(kwargs, match):
    args = dict(
        node_texts=[torch.randn(3, 2, TEXT_DIM)],
        edge_indices=[torch.tensor([[0, 1], [1, 2]])],
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        GraphBatch.from_graphs(**args)


def test_a_batch_whose_first_sequence_has_no_graph():
    model = tiny_glfusion_lm()
    open_gates(model)
    ids, mask = prompts(model, n_nodes=(3, 2))
    c = model.config
    plain = torch.arange(ids.shape[1]) % 30 + 5  # text only, no graph tokens
    ids2 = torch.stack([plain, ids[1]])
    mask2 = torch.stack([torch.ones_like(plain), mask[1]])
    g = torch.Generator().manual_seed(0)
    text = torch.randn(2, 4, TEXT_DIM, generator=g, dtype=torch.float64)
    graph = GraphBatch.from_graphs(
        [None, text], [None, torch.tensor([[0, 1], [1, 0]])], targets=[None, 1]
    )
    assert graph.target_nodes.tolist() == [-1, 1] and graph.node_batch.tolist() == [1, 1]
    out = model(ids2, mask2, graph)
    alone = model(ids2[:1], mask2[:1]).logits  # the plain row is the base model's
    assert torch.allclose(out.logits[0], alone[0], atol=1e-10)
    assert c.node_id not in ids2[0].tolist()
    with pytest.raises(ValueError, match="no graph"):
        model.predict(ids2, mask2, graph, [[5], [6], [7]])


def test_node_labels_are_checked_and_all_ignored_gives_zero_loss():
    model = tiny_glfusion_lm()
    ids, mask = prompts(model)
    graph = graph_for()
    with pytest.raises(ValueError, match=r"node_labels \[3, 7\] outside 0..2"):
        model(ids, mask, graph, node_labels=torch.tensor([0, 3, 7, -100, 1]))
    with pytest.raises(ValueError, match="one per node"):
        model(ids, mask, graph, node_labels=torch.tensor([0, 1]))
    ignored = torch.full((5,), -100)
    labels = torch.full_like(ids, -100)
    out = model(ids, mask, graph, labels=labels, node_labels=ignored)
    assert out.loss.item() == 0.0 and out.gnn_loss.item() == 0.0 and out.lm_loss.item() == 0.0
    out.loss.backward()  # still connected, no NaN gradients
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def _score_one_pass_per_label(model, ids, mask, graph, label_ids):
    """The readable reference: one forward pass per label name appended to each prompt."""
    B, S = ids.shape
    lengths = mask.sum(-1)
    scores = torch.zeros(B, len(label_ids), dtype=torch.float64)
    for k, tokens in enumerate(label_ids):
        n = len(tokens)
        full = torch.zeros(B, S + n, dtype=torch.long)
        fmask = torch.zeros(B, S + n, dtype=torch.long)
        for b in range(B):
            L = int(lengths[b])
            full[b, :L], full[b, L : L + n], fmask[b, : L + n] = ids[b, :L], torch.tensor(tokens), 1
        logp = model(full, fmask, graph).logits.log_softmax(-1)
        for b in range(B):
            L = int(lengths[b])
            scores[b, k] = sum(logp[b, L - 1 + i, t] for i, t in enumerate(tokens))
    return scores


@pytest.mark.parametrize("with_graph", [True, False])
def test_label_scoring_in_one_pass_equals_one_pass_per_label(with_graph):
    model = tiny_glfusion_lm()
    open_gates(model, 0.8)
    ids, mask = prompts(model)
    graph = graph_for()
    if not with_graph:
        ids = ids.masked_fill(ids >= 40, 11)  # plain text prompts
        graph = None
    label_ids = [[5], [7, 8], [9, 10, 11], [12]]  # one- and multi-token names
    got = model.score_labels(ids, mask, graph, label_ids)
    ref = _score_one_pass_per_label(model, ids, mask, graph, label_ids)
    assert (got.double() - ref).abs().max() < 1e-10
    if with_graph:  # predict: GNN and LM distributions from the same single pass
        p = model.predict(ids, mask, graph, label_ids[:3], weight=0.3)
        node = model(ids, mask, graph).node_logits[graph.target_nodes].softmax(-1)
        assert torch.allclose(p["gnn"].double(), node, atol=1e-10)
        assert torch.allclose(p["lm"].double(), ref[:, :3].softmax(-1), atol=1e-10)
    with pytest.raises(ValueError, match="no tokens"):
        model.score_labels(ids, mask, graph, [[5], []])


# ---------------------------------------------------------------------- the recipe


def test_recipe_options_change_nothing_at_init():
    """Target marker (zero) and the message-passing LayerNorm (behind a closed gate) keep every
    output of the paper's model at initialisation."""
    ids, mask = prompts(tiny_glfusion_lm())
    graph = graph_for()
    plain = tiny_glfusion_lm(seed=3)
    recipe = tiny_glfusion_lm(seed=3, message_passing_norm=True, target_marker=True)
    a, b = plain(ids, mask, graph), recipe(ids, mask, graph)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.node_logits, b.node_logits)
    with torch.no_grad():
        recipe.glf_target_marker.normal_()
    moved = recipe(ids, mask, graph)
    target_rows = graph.target_nodes
    assert not torch.allclose(moved.node_logits[target_rows], a.node_logits[target_rows])
    text = ids.masked_fill(ids >= 40, 11)  # no graph: exactly the base model still
    assert torch.equal(recipe(text, mask).logits, plain(text, mask).logits)


def test_label_restricted_lm_loss_is_the_ce_over_label_scores():
    model = tiny_glfusion_lm(target_marker=True)
    open_gates(model, 0.5)
    ids, mask = prompts(model)
    graph = graph_for()
    choices = [[5], [7, 8], [9]]
    classes = torch.tensor([1, 2])
    out = model(ids, mask, graph, label_choices=choices, classes=classes,
                node_labels=torch.tensor([1, -100, -100, 2, -100]))  # fmt: skip
    scores = model.score_labels(ids, mask, graph, choices)
    ce = torch.nn.functional.cross_entropy(scores, classes)
    assert torch.allclose(out.lm_loss.detach(), ce, atol=1e-10)
    out.loss.backward()
    gates = [p for n, p in model.named_parameters() if n.endswith("gate")]
    assert all(p.grad is not None and p.grad.abs() > 0 for p in gates)
    assert model.glf_target_marker.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="needs classes"):
        model(ids, mask, graph, label_choices=choices)


def test_param_groups_and_the_ensemble_weight_chosen_on_validation():
    from structattn.experiments.glfusion import (
        GLFusionTrainConfig,
        choose_ensemble_weight,
        glfusion_param_groups,
        head_accuracies,
    )

    model = apply_lora(tiny_glfusion_lm(), r=2, alpha=4)
    cfg = GLFusionTrainConfig(gate_lr=0.05, module_lr=1e-3, head_lr=2e-3)
    groups = glfusion_param_groups(model, cfg)
    lr_of = {name: g["lr"] for g in groups for name in g["names"]}
    assert all(lr_of[n] == 0.05 for n in lr_of if n.endswith("gate"))
    assert all(lr_of[n] == 2e-3 for n in lr_of if n.startswith("glf_gnn_head"))
    assert all(lr_of[n] == cfg.optim.lr for n in lr_of if "lora_" in n)  # lora_lr None
    others = [n for n in lr_of if n.startswith("glf_") and not n.endswith("gate")]
    assert all(lr_of[n] == 1e-3 for n in others if not n.startswith("glf_gnn_head"))
    n_params = sum(p.numel() for g in groups for p in g["params"])
    assert n_params == sum(p.numel() for p in model.parameters() if p.requires_grad)
    from structattn.engine.optim import describe_groups

    for g in groups:  # each group says what it is, and the log line names it
        kind, rule = g["group"].split(", ")
        assert rule in ("decayed", "not decayed") and kind in ("gates", "head", "modules", "lora")
        assert all((n.endswith("gate")) == (kind == "gates") for n in g["names"])
        assert f"{g['group']}: weight_decay={g['weight_decay']}, lr={g['lr']:g}" in describe_groups(
            groups
        )

    classes = torch.tensor([0, 1, 1, 0])
    gnn = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.2, 0.8], [0.7, 0.3]])  # 3/4 right
    lm = torch.tensor([[0.4, 0.6], [0.1, 0.9], [0.45, 0.55], [0.6, 0.4]])  # 3/4 right
    probs = {"gnn": gnn, "lm": lm, "classes": classes}
    w = choose_ensemble_weight(probs)
    assert head_accuracies(probs, w)["ensemble"] == 1.0 and 0 < w < 1
    tie = {"gnn": gnn, "lm": gnn, "classes": classes}
    assert choose_ensemble_weight(tie) == 0.5  # every weight ties: the paper's 0.5


def _cross_attention_inputs(seed=0):
    """Three sequences (3 nodes, no graph, 2 nodes), right padding, ragged node texts."""
    g = torch.Generator().manual_seed(seed)
    B, S, D, Lt, T = 3, 12, 16, 5, 6
    hidden = torch.randn(B, S, D, generator=g, dtype=torch.float64, requires_grad=True)
    node_batch = torch.tensor([0, 0, 0, 2, 2])
    node_slots = torch.tensor([[0, 2], [0, 3], [0, 4], [2, 1], [2, 2]])
    node_text = torch.randn(5, Lt, T, generator=g, dtype=torch.float64, requires_grad=True)
    text_mask = torch.ones(5, Lt, dtype=torch.bool)
    text_mask[1, 2:] = False
    text_mask[4, 1:] = False
    attention_mask = torch.ones(B, S, dtype=torch.long)
    attention_mask[2, 9:] = 0
    return hidden, node_text, text_mask, node_batch, node_slots, attention_mask


@pytest.mark.parametrize("decoding", [False, True])
def test_cross_attention_fast_path_equals_the_dense_reference(decoding):
    """The sparse forward computes the dense two-stage attention exactly (float64), forward and
    backward, for node tokens, text after the graph, text before it, padding and a sequence
    without a graph; and in decoding (new tokens after the graph, no node slots)."""
    from structattn.glfusion.cross_attention import GraphTextCrossAttention

    torch.manual_seed(0)
    layer = GraphTextCrossAttention(16, 6, num_heads=4).double()
    with torch.no_grad():
        layer.gate.fill_(0.8)
    hidden, text, tmask, batch, slots, amask = _cross_attention_inputs()
    kwargs = {"attention_mask": amask}
    if decoding:
        hidden = hidden[:, :2].detach().requires_grad_(True)
        slots = slots[:0]
        kwargs = {"after_graph": torch.tensor([True, False, True])}
    outs, grads = [], []
    for fn in (layer.forward, layer.forward_reference):
        out = fn(hidden, text, tmask, batch, slots, **kwargs)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1),
                              dtype=out.dtype)  # fmt: skip
        g = torch.autograd.grad((out * weights).sum(), [hidden, text, *layer.parameters()])
        outs.append(out)
        grads.append(g)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-12)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert (outs[0] - hidden).abs().amax() > 1e-3  # the gate is open: something was read


def test_cross_attention_fast_path_under_autocast_and_odd_layouts():
    """bfloat16 autocast over float32 weights, left padding, a graph with no text after it and
    a node whose text is all padding: the fast path runs and matches the dense form."""
    from structattn.glfusion.cross_attention import GraphTextCrossAttention

    torch.manual_seed(0)
    layer = GraphTextCrossAttention(16, 6, num_heads=4)
    with torch.no_grad():
        layer.gate.fill_(0.8)
    hidden, text, tmask, batch, slots, _ = _cross_attention_inputs()
    hidden, text = hidden.detach().float(), text.detach().float()
    tmask[3] = False  # node 3's text: all padding
    amask = torch.ones(3, 12, dtype=torch.long)
    amask[0, :2] = 0  # left padding before sequence 0's graph
    slots = slots.clone()
    slots[3:, 1] = torch.tensor([10, 11])  # sequence 2's graph ends the sequence: nothing after
    args = (hidden, text, tmask, batch, slots, amask)
    torch.testing.assert_close(layer(*args), layer.forward_reference(*args), rtol=1e-5, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast, ref = layer(*args), layer.forward_reference(*args)
    assert fast.dtype == ref.dtype
    torch.testing.assert_close(fast.float(), ref.float(), rtol=2e-2, atol=2e-2)
