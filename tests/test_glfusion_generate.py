"""GL-Fusion generation with a graph in the prompt: prefill once, then one token at a time on the
key/value cache; every step's logits equal a full forward pass over prompt + generated text."""

from __future__ import annotations

import pytest
import torch
from helpers import graph_for, open_gates, prompts, tiny_glfusion_lm


def full_forward_logits(model, ids, mask, graph, new):
    """Logits that chose each new token, from one forward pass over prompt + new tokens."""
    B, S = ids.shape
    N = new.shape[1]
    all_ids = torch.cat([ids, new], 1)
    all_mask = torch.cat([mask, torch.ones(B, N, dtype=mask.dtype)], 1)
    logits = model(all_ids, all_mask, graph).logits
    last = S - 1 - mask.bool().flip(-1).long().argmax(-1)
    rows = torch.arange(B)
    first = logits[rows, last][:, None]  # after the prompt's last real token
    return torch.cat([first, logits[:, S : S + N - 1]], 1)


@pytest.mark.parametrize("gates", [False, True])
@pytest.mark.parametrize("edge_dim", [0, 3])
def test_decoding_equals_the_full_forward(gates, edge_dim):
    model = tiny_glfusion_lm(edge_dim=edge_dim)
    if gates:
        open_gates(model, 0.8)
    ids, mask = prompts(model, n_nodes=(3, 2))
    graph = graph_for((3, 2), edge_dim=edge_dim)
    new, logits = model.generate(ids, mask, graph, max_new_tokens=7, return_logits=True)
    assert new.shape == (2, 7) and logits.shape[:2] == (2, 7)
    ref = full_forward_logits(model, ids, mask, graph, new)
    assert (logits - ref).abs().max().item() <= 1e-10
    c = model.config
    allowed = logits.index_fill(-1, torch.tensor([c.graph_start_id, c.node_id, c.graph_end_id]),
                                float("-inf"))  # fmt: skip
    assert torch.equal(new, allowed.argmax(-1))  # greedy, never a graph token


def test_gates_change_generation_and_left_padding_works():
    model = tiny_glfusion_lm()
    open_gates(model, 0.9)
    ids, mask = prompts(model, n_nodes=(3, 2))
    graph = graph_for((3, 2))
    # the same prompts, left-padded
    left_ids, left_mask = torch.zeros_like(ids), torch.zeros_like(mask)
    for b in range(2):
        n = int(mask[b].sum())
        left_ids[b, -n:], left_mask[b, -n:] = ids[b, :n], 1
    a, la = model.generate(ids, mask, graph, max_new_tokens=5, return_logits=True)
    b, lb = model.generate(left_ids, left_mask, graph, max_new_tokens=5, return_logits=True)
    assert torch.equal(a, b) and torch.allclose(la, lb, atol=1e-10, rtol=0)
    ref = full_forward_logits(model, left_ids, left_mask, graph, b)
    assert (lb - ref).abs().max().item() <= 1e-10


def test_cross_attention_reaches_generated_tokens():
    """Changing a node's text changes what the generated tokens see (gates open)."""
    model = tiny_glfusion_lm()
    open_gates(model, 0.9)
    ids, mask = prompts(model, n_nodes=(3, 2))
    graph = graph_for((3, 2))
    _, base = model.generate(ids, mask, graph, max_new_tokens=3, return_logits=True)
    graph.node_text[1] = graph.node_text[1] + torch.randn_like(graph.node_text[1])
    _, moved = model.generate(ids, mask, graph, max_new_tokens=3, return_logits=True)
    assert (base[0] - moved[0]).abs().max() > 1e-6  # sequence 0 holds node 1


def test_without_graph_generation_is_the_base_models():
    model = tiny_glfusion_lm()
    ids = torch.tensor([[5, 6, 7, 9, 10], [0, 0, 5, 8, 11]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    new = model.generate(ids, mask, max_new_tokens=6)
    c = model.config
    base = model.base.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
        suppress_tokens=[c.graph_start_id, c.node_id, c.graph_end_id],
    )
    assert torch.equal(new, base[:, 5:])


def test_sampling_is_seeded_and_eos_stops_a_row():
    model = tiny_glfusion_lm()
    open_gates(model)
    ids, mask = prompts(model)
    graph = graph_for()
    a = model.generate(ids, mask, graph, max_new_tokens=6, do_sample=True, top_k=5, seed=3)
    b = model.generate(ids, mask, graph, max_new_tokens=6, do_sample=True, top_k=5, seed=3)
    assert torch.equal(a, b)
    greedy = model.generate(ids, mask, graph, max_new_tokens=6)
    eos = int(greedy[0, 1])
    stopped = model.generate(ids, mask, graph, max_new_tokens=6, eos_token_id=eos, pad_token_id=0)
    first = int((greedy[0] == eos).nonzero()[0])
    assert torch.all(stopped[0, first + 1 :] == 0)
    # several stop ids (end of text, end of turn): the first of either stops the row
    other = int(greedy[0, 3])
    both = model.generate(ids, mask, graph, max_new_tokens=6, eos_token_id=[other, eos])
    first = min(int((greedy[0] == t).nonzero()[0]) for t in (other, eos))
    assert torch.equal(both[0, : first + 1], greedy[0, : first + 1])
    assert torch.all(both[0, first + 1 :] == 0)


def test_bad_input_is_named():
    model = tiny_glfusion_lm()
    ids, mask = prompts(model)
    graph = graph_for()
    with pytest.raises(ValueError, match="empty prompt"):
        model.generate(ids[:, :0], mask[:, :0], graph)
    with pytest.raises(ValueError, match="empty prompt"):
        model.generate(ids, torch.zeros_like(mask), graph)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(ids, mask, graph, max_new_tokens=0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.generate(ids, mask, graph, max_new_tokens=500)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(ids, mask, graph, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="no graph"):
        model.generate(ids, mask, None)


def test_decoding_is_exact_with_lora_adapters():
    from structattn.glfusion import apply_lora

    model = apply_lora(tiny_glfusion_lm(), r=2, alpha=4).double().eval()
    open_gates(model, 0.6)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # zero at init: give the adapters an effect
                p.normal_(0, 0.1)
    ids, mask = prompts(model)
    graph = graph_for()
    new, logits = model.generate(ids, mask, graph, max_new_tokens=5, return_logits=True)
    assert (logits - full_forward_logits(model, ids, mask, graph, new)).abs().max() <= 1e-10


def test_question_prompts_go_through_the_chat_template_and_point_at_each_nodes_line(tmp_path):
    from helpers import tiny_glfusion_models

    from structattn.experiments.glfusion.generate import question_prompt
    from structattn.experiments.glfusion.prompts import chat_parts
    from structattn.glfusion import GLFusionConfig

    (_, tok), _ = tiny_glfusion_models(tmp_path)
    assert chat_parts(tok) == ([], [])  # no template: the question alone
    tok.chat_template = (
        "{% for m in messages %}[CLS] {{ m['content'] }} [SEP]{% endfor %}"
        "{% if add_generation_prompt %} answer :{% endif %}"
    )
    before, after = chat_parts(tok)
    ids = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert before == ids("[CLS] ") and after == ids(" [SEP] answer :")
    texts = ["alpha beta", "gamma", "delta omega sigma"]
    prompt, spans = question_prompt(tok, GLFusionConfig(), texts, "what is it ?", 3)
    assert prompt[: len(before)] == before and prompt[-len(after) :] == after
    for text, (a, b) in zip(texts, spans):
        assert prompt[a:b] == ids(text)[:3]  # cut to the per-node budget (no newline token)
    paper = GLFusionConfig(variant="paper", graph_start_id=90, node_id=91, graph_end_id=92)
    prompt, spans = question_prompt(tok, paper, texts, "what is it ?", 3)
    assert spans is None and prompt.count(91) == 3 and prompt[len(before)] == 90
    # a run trained in the chat template is asked inside its training instruction
    from structattn.experiments.glfusion.prompts import GATED_INSTRUCTION

    asked, spans = question_prompt(tok, GLFusionConfig(), texts, "what is it ?", 3,
                                   trained_chat=True)  # fmt: skip
    head = before + ids(GATED_INSTRUCTION)
    assert asked[: len(head)] == head and asked[-len(after) :] == after
    assert all(asked[a:b] == ids(t)[:3] for t, (a, b) in zip(texts, spans))


def test_an_empty_continuation_is_named_not_printed_as_a_blank_line(monkeypatch, capsys):
    from structattn.cli import main
    from structattn.experiments.glfusion import commands, generate

    monkeypatch.setattr(generate, "generate_about_node", lambda *a, **k: "")
    main(["glfusion", "generate", "some-run", "--node", "3", "--prompt", "What is it?"])
    assert capsys.readouterr().out.strip() == commands.EMPTY_CONTINUATION
