"""GL-Fusion examples: leakage rules, prompt layout, collation into a working forward pass."""

from __future__ import annotations

import torch
from helpers import tiny_llama, word_tokenizer

from structattn.data.graphs import read_wordnet_nouns
from structattn.experiments.glfusion.prompts import build_example, collate_examples, label_token_ids
from structattn.glfusion import GLFusionConfig, GLFusionForCausalLM

WORDNET = (
    "\n".join(
        [
            "00001740 03 n 01 entity 0 000 | that which is perceived",
            "00001930 03 n 01 physical_entity 0 001 @ 00001740 n 0000 | an entity that exists",
            "00002452 03 n 01 thing 0 001 @ 00001930 n 0000 | a separate and self-contained entity",
            "09000001 15 n 01 Paris 0 001 @i 00002452 n 0000 | the capital of France",
            "02084071 05 n 01 dog 0 001 @ 00002452 n 0000 | a member of the genus Canis",
            "02084072 05 n 01 cat 0 001 @ 00002452 n 0000 | a feline",
        ]
    )
    + "\n"
)


def _setup(tmp_path):
    (tmp_path / "data.noun").write_text(WORDNET)
    graph = read_wordnet_nouns(tmp_path / "data.noun", seed=0)
    words = sorted(
        {w for text in graph.node_texts for w in text.lower().replace(",", " ").split()}
        | {w for name in graph.label_names for w in name.lower().split()}
        | {
            "classify",
            "the",
            "first",
            "node",
            "of",
            "this",
            "graph",
            ".",
            "graph:",
            "answer",
            ":",
            "[",
            "]",
            "category",
        }
    )
    tokenizer = word_tokenizer(tmp_path / "vocab.txt", words)
    base = tiny_llama(len(tokenizer))
    model = GLFusionForCausalLM.from_base(
        base, GLFusionConfig(text_dim=6, num_node_classes=26, variant="paper"), tokenizer=tokenizer
    )
    return graph, tokenizer, model


def _encode(texts):
    g = torch.Generator().manual_seed(len(" ".join(texts)))
    enc = torch.randn(len(texts), 5, 6, generator=g).half()
    mask = torch.ones(len(texts), 5, dtype=torch.bool)
    mask[:, 3:] = False
    return enc, mask


def test_target_label_never_shown_and_train_neighbours_may_be(tmp_path):
    graph, tokenizer, model = _setup(tmp_path)
    train = {0, 1, 2, 3, 4, 5}  # every node "in train": only the target must stay hidden
    for target in range(graph.num_nodes):
        ex = build_example(graph, target, tokenizer, model.config, max_nodes=4, train_nodes=train)
        assert "[category:" not in ex.texts[0]
        assert all("[category:" in t for t in ex.texts[1:])
        hidden = build_example(
            graph, target, tokenizer, model.config, max_nodes=4, train_nodes=set()
        )
        assert not any("[category:" in t for t in hidden.texts)
        assert ex.label == int(graph.labels[target])
        assert ex.prompt_ids.count(model.config.node_id) == len(ex.nodes) <= 4


def test_collated_batch_runs_through_the_model(tmp_path):
    graph, tokenizer, model = _setup(tmp_path)
    examples = [build_example(graph, t, tokenizer, model.config, max_nodes=3) for t in (4, 3)]
    batch = collate_examples(examples, _encode)
    assert batch["node_labels"].tolist()[0] == examples[0].label
    n0 = len(examples[0].nodes)
    assert batch["node_labels"].tolist()[1:n0] == [-100] * (n0 - 1)
    label_positions = (batch["labels"][0] != -100).nonzero().flatten().tolist()
    assert [batch["input_ids"][0, p].item() for p in label_positions] == examples[0].label_ids
    out = model(
        batch["input_ids"],
        batch["attention_mask"],
        batch["graph"],
        labels=batch["labels"],
        node_labels=batch["node_labels"],
    )
    assert torch.isfinite(out.loss)
    prompts = collate_examples(examples, _encode, with_labels=False)
    pred = model.predict(
        prompts["input_ids"],
        prompts["attention_mask"],
        prompts["graph"],
        label_token_ids(graph, tokenizer),
    )
    assert pred["ensemble"].shape == (2, 26)


def test_chat_framing_puts_the_prompt_in_the_users_turn_and_ends_the_answer(tmp_path):
    """``chat``: the prompt is the user's turn of the chat template, the cue the assistant's
    opening, and the label the answer closed by the end-of-turn token, which is a target (so a
    trained run stops after answering); label scoring reads the same answer. A tokenizer with
    no end token cannot close an answer: one clear error."""
    import pytest

    from structattn.errors import ConfigError
    from structattn.experiments.glfusion.prompts import chat_parts, framing

    graph, tokenizer, _ = _setup(tmp_path)
    gated = GLFusionConfig(text_dim=6, num_node_classes=26)
    with pytest.raises(ConfigError, match="no end-of-text or end-of-turn token"):
        build_example(graph, 4, tokenizer, gated, max_nodes=3, chat=True)
    tokenizer.eos_token = "[SEP]"
    end = tokenizer.convert_tokens_to_ids("[SEP]")
    ids = lambda t: tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    plain = build_example(graph, 4, tokenizer, gated, max_nodes=3)
    no_template = build_example(graph, 4, tokenizer, gated, max_nodes=3, chat=True)
    assert no_template.prompt_ids == plain.prompt_ids  # no template: the plain prompt
    assert no_template.label_ids == plain.label_ids + [end]
    tokenizer.chat_template = (
        "{% for m in messages %}[CLS] {{ m['content'] }} [SEP]{% endfor %}"
        "{% if add_generation_prompt %} answer :{% endif %}"
    )
    before, after = chat_parts(tokenizer)
    ex = build_example(graph, 4, tokenizer, gated, max_nodes=3, chat=True)
    assert ex.prompt_ids[: len(before)] == before and ex.prompt_ids[-len(after) :] == after
    name = graph.label_names[ex.label]
    assert ex.label_ids == ids(name) + [end]
    for (a, b), text in zip(ex.spans, ex.texts):  # the node lines moved by the template's opening
        assert ex.prompt_ids[a:b] == ids(text)[: b - a]
    batch = collate_examples([ex], _encode)
    targets = batch["labels"][0][batch["labels"][0] != -100].tolist()
    assert targets == ex.label_ids and targets[-1] == end
    choices = label_token_ids(graph, tokenizer, chat=True)
    assert choices[ex.label] == ex.label_ids
    assert framing(tokenizer)[2](name) == ids(" " + name)  # plain: " <name>", no end
