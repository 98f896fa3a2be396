"""GL-Fusion (arXiv 2412.06849): a Llama-architecture causal LM made graph-aware from inside.

The prompt holds node tokens, one per node of the graph. Inside the decoder, after configured
layers, message passing (:class:`NodeMessagePassing`) updates the node tokens' states and
cross-attention carries graph information to the text; a GNN head over the final node-token
states and the LM head form the twin predictor, trained with ``CE(GNN) + CE(LM)``. Two forms
(:data:`~.configuration.VARIANTS`):

* ``gated`` (default): the prompt holds every node's text as plain text instead of node
  tokens (``GraphBatch.text_spans``); the last token of a node's text is its slot. The mask and
  positions are the base LLM's own. Graph information enters through residual writes whose
  output projections start at 0: the node-text encoding added to the slot's input, message
  passing on the slot states (later text reads them through ordinary self-attention), and
  cross-attention from the text after the graph to them (:class:`NodeStateCrossAttention`).
  As initialised, the logits are exactly the base LLM's on the same prompt.
* ``paper``: ``<graph_start> <node> ... <graph_end>``; each ``<node>`` token's input embedding
  is its node text's pooled encoding through a learned projection, node tokens share one
  position, the structure-aware mask lets node tokens see the text before the graph and each
  other, text after the graph attends to them, and cross-attention
  (:class:`GraphTextCrossAttention`) reads the node texts' token encodings.

The base model's weights are untouched: the GL-Fusion modules live beside it (``glf_*`` names,
outside the base, so LoRA's module matching never reaches them). Each decoder layer becomes a
:class:`GraphAwareLayer` (its class is swapped for a subclass; parameter names are unchanged)
whose forward runs base layer -> message passing -> cross-attention when the pass's
:class:`GraphPass` comes with it, and the base layer alone otherwise. With no graph, outputs
are exactly the base model's.

One method per purpose: :meth:`~GLFusionForCausalLM.forward` is the training pass (losses, the
transformers contract), :meth:`~GLFusionForCausalLM.node_logits` the GNN head,
:meth:`~GLFusionForCausalLM.score_labels` the LM head over label names,
:meth:`~GLFusionForCausalLM.predict` both heads and their ensemble, and
:meth:`~GLFusionForCausalLM.generate` continues a prompt on a key/value cache. The model and
its passes live here, the layer wrapper in :mod:`.layers`, the heads in :mod:`.heads` and
generation in :mod:`.generation`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from .configuration import GRAPH_TOKENS, GLFusionConfig
from .cross_attention import GraphTextCrossAttention, NodeStateCrossAttention
from .generation import GraphGeneration
from .graph import GraphBatch
from .heads import TwinHeads
from .layers import (
    GLFusionOutput,
    GraphAwareLayer,
    GraphPass,
    inner_model,
    make_graph_aware,
)
from .loading import quiet_library_warnings
from .masking import build_structure_mask, node_position_ids, to_additive_mask
from .message_passing import NodeMessagePassing

__all__ = [
    "GLFusionForCausalLM",
    "GLFusionOutput",
    "GraphAwareLayer",
    "GraphPass",
    "add_graph_tokens",
    "apply_lora",
]


def _fit_vocabulary(lm: nn.Module, config: GLFusionConfig) -> None:
    """Resize ``lm``'s embeddings so the graph-token ids exist."""
    needed = max(config.graph_start_id, config.node_id, config.graph_end_id) + 1
    if lm.get_input_embeddings().weight.shape[0] < needed:
        lm.resize_token_embeddings(needed, mean_resizing=False)


def add_graph_tokens(tokenizer) -> dict[str, int]:
    """Add ``<graph_start>``, ``<node>``, ``<graph_end>`` to a Hugging Face tokenizer."""
    tokenizer.add_special_tokens({"additional_special_tokens": list(GRAPH_TOKENS)})
    ids = tokenizer.convert_tokens_to_ids(list(GRAPH_TOKENS))
    return dict(zip(("graph_start_id", "node_id", "graph_end_id"), ids))


class GLFusionForCausalLM(TwinHeads, GraphGeneration, nn.Module):
    """GL-Fusion around a base causal LM. Build with :meth:`from_base`."""

    def __init__(self, base: nn.Module, config: GLFusionConfig):
        super().__init__()
        inner = inner_model(base)
        self.base = base
        self.config = config.resolve(inner.config.num_hidden_layers)
        D = inner.config.hidden_size
        gated = self.config.variant == "gated"
        self.glf_node_proj = nn.Linear(config.text_dim, D)
        emb = inner.get_input_embeddings().weight.detach()
        self.glf_graph_tokens = nn.Parameter(emb.mean(0).repeat(2, 1).clone())  # start, end
        if gated:  # added to the input of each node's slot, from 0
            nn.init.zeros_(self.glf_node_proj.weight)
            nn.init.zeros_(self.glf_node_proj.bias)
        self.glf_message_passing = nn.ModuleDict(
            {
                str(i): NodeMessagePassing(
                    D, config.edge_dim, config.message_passing_norm, zero_update=gated
                )
                for i in self.config.message_passing_layers
            }
        )
        self.glf_cross_attention = nn.ModuleDict(
            {
                str(i): NodeStateCrossAttention(D, config.cross_attention_heads)
                if gated
                else GraphTextCrossAttention(D, config.text_dim, config.cross_attention_heads)
                for i in self.config.cross_attention_layers
            }
        )
        self.glf_gnn_head = nn.Linear(D, config.num_node_classes)
        if config.target_marker:  # zero at init: the prompt means what it meant without it
            self.glf_target_marker = nn.Parameter(torch.zeros(D))
        for i, layer in enumerate(inner.model.layers):
            make_graph_aware(layer, i)
        self.to(emb.device, emb.dtype)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_base(
        cls, base_lm: nn.Module, config: GLFusionConfig | None = None, tokenizer=None
    ) -> GLFusionForCausalLM:
        """Wrap ``base_lm`` (a ``LlamaForCausalLM``, possibly peft-wrapped). Unset graph-token ids
        are created: through ``tokenizer`` when given, else as three new ids past the vocabulary;
        the base's embeddings are resized to hold them."""
        config = config or GLFusionConfig()
        inner = inner_model(base_lm)
        if min(config.graph_start_id, config.node_id, config.graph_end_id) < 0:
            if tokenizer is not None:
                ids = add_graph_tokens(tokenizer)
            else:
                v = inner.get_input_embeddings().weight.shape[0]
                ids = {"graph_start_id": v, "node_id": v + 1, "graph_end_id": v + 2}
            for key, value in ids.items():
                setattr(config, key, value)
        _fit_vocabulary(inner, config)
        return cls(base_lm, config)

    # ------------------------------------------------------------------ inside the layers

    @property
    def gated(self) -> bool:
        return self.config.variant == "gated"

    def _message_passing(self, index: int, p: GraphPass, hidden: Tensor) -> Tensor:
        """Message passing over the node tokens' states after decoder layer ``index`` (where
        set; decoding has no node token)."""
        key = str(index)
        if key not in self.glf_message_passing or p.decoding:
            return hidden
        rows, cols = p.slots[:, 0], p.slots[:, 1]
        nodes = self.glf_message_passing[key](hidden[rows, cols], p.graph.edge_index,
                                              p.graph.edge_attr)  # fmt: skip
        return hidden.index_put((rows, cols), nodes)

    def _cross_attention(self, index: int, p: GraphPass, hidden: Tensor) -> Tensor:
        """Cross-attention after decoder layer ``index`` (where set)."""
        key, graph = str(index), p.graph
        if key not in self.glf_cross_attention:
            return hidden
        layer = self.glf_cross_attention[key]
        if self.gated:
            if p.decoding:
                kv = p.memory[key]
                reads = p.after_graph.to(hidden.device)[:, None].expand(hidden.shape[:2])
            else:
                kv = layer.project_nodes(hidden[p.slots[:, 0], p.slots[:, 1]])
                if p.memory is not None:
                    p.memory[key] = kv
                reads = p.reads
            return layer(hidden, kv, graph.node_batch, reads)
        kv = None
        if p.memory is not None:
            if key not in p.memory:
                p.memory[key] = layer.project_text(graph.node_text, hidden.dtype)
            kv = p.memory[key]
        return layer(hidden, graph.node_text, graph.node_text_mask, graph.node_batch, p.slots,
                     p.attention_mask, after_graph=p.after_graph, text_kv=kv)  # fmt: skip

    def gradient_checkpointing_enable(self) -> None:
        """Recompute the base LM's layers in backward (non-reentrant checkpointing); a
        recomputed layer gets the same GraphPass as the first pass."""
        inner_model(self.base).gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )

    # ------------------------------------------------------------------ forward

    def _embed(self, input_ids: Tensor, graph: GraphBatch, slots: Tensor) -> Tensor:
        """Input embeddings: the paper's form replaces each node token's with its node text's
        projected encoding; the gated form adds that (normalised, through a projection that
        starts at 0) to the embedding of each node's slot, its text's last token."""
        embeds = inner_model(self.base).get_input_embeddings()(input_ids)  # (B, S, D)
        mask = graph.node_text_mask.unsqueeze(-1).to(graph.node_text.dtype)
        pooled = (graph.node_text * mask).sum(1) / mask.sum(1).clamp_min(1.0)  # (M, text_dim)
        if self.gated:
            pooled = F.layer_norm(pooled.float(), pooled.shape[-1:])
        node_emb = self.glf_node_proj(pooled.to(self.glf_node_proj.weight.dtype))
        if self.config.target_marker and graph.target_nodes is not None:
            # every layer can tell which node the prompt asks about (node tokens share one
            # position and attend to each other symmetrically otherwise)
            has = graph.target_nodes >= 0
            marker = torch.zeros_like(node_emb[:, :1]).expand_as(node_emb).clone()
            marker[graph.target_nodes[has]] = self.glf_target_marker.to(node_emb.dtype)
            node_emb = node_emb + marker
        index = (slots[:, 0], slots[:, 1])
        if self.gated:
            return embeds.index_put(index, node_emb.to(embeds.dtype), accumulate=True)
        embeds = embeds.index_put(index, node_emb.to(embeds.dtype))
        cfg = self.config
        for row, token_id in enumerate((cfg.graph_start_id, cfg.graph_end_id)):
            embeds = torch.where(
                (input_ids == token_id)[..., None],
                self.glf_graph_tokens[row].to(embeds.dtype),
                embeds,
            )
        return embeds

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        graph: GraphBatch | None = None,
        labels: Tensor | None = None,
        node_labels: Tensor | None = None,
        label_choices: list[list[int]] | None = None,
        classes: Tensor | None = None,
    ) -> GLFusionOutput:
        """The twin predictor's pass with its training loss (transformers' contract:
        ``model(**batch).loss``): ``CE(GNN) + lm_loss_weight * CE(LM)`` over the targets given.

        ``node_labels (M,)``: the GNN head's targets (-100 ignored). The LM head's target is
        either ``labels (B, S)``, next tokens (-100 ignored, shifted inside like HF), or
        ``classes (B,)`` with ``label_choices`` (token ids of every label name): the
        cross-entropy over the label names' scores (:meth:`score_labels`, with gradients);
        ``input_ids`` then end at the prompt and ``logits`` are only the rows that predict the
        label names' tokens, ``(B, n, vocab)``. Without a graph the output is the base model's."""
        if label_choices is not None:
            if classes is None or labels is not None:
                raise ValueError("label_choices needs classes (and no labels)")
            scores, out = self._score_pass(input_ids, attention_mask, graph, label_choices)
            lm_loss = F.cross_entropy(scores, classes.to(scores.device))
        else:
            out = self._pass(input_ids, attention_mask, graph)
            lm_loss = self.lm_loss(out.logits, labels) if labels is not None else None
        gnn_loss = None
        if node_labels is not None and out.node_logits is not None:
            gnn_loss = self._gnn_loss(out.node_logits, node_labels)
        parts = [gnn_loss, None if lm_loss is None else self.config.lm_loss_weight * lm_loss]
        parts = [x for x in parts if x is not None]
        loss = sum(parts) if parts else None
        return dataclasses.replace(out, loss=loss, lm_loss=lm_loss, gnn_loss=gnn_loss)

    def _pass(self, input_ids, attention_mask, graph, cache=None, memory=None) -> GLFusionOutput:
        """The base model itself without a graph; the graph-aware pass with one."""
        if graph is None:
            return self._base_pass(input_ids, attention_mask, cache)
        return self._prompt_pass(input_ids, attention_mask, graph, cache=cache, memory=memory)

    def _check_no_nodes(self, input_ids: Tensor) -> None:
        if bool((input_ids == self.config.node_id).any()):
            raise ValueError("input_ids hold <node> tokens but no graph was given")

    def _base_pass(self, input_ids, attention_mask, cache=None) -> GLFusionOutput:
        """No graph: exactly the base model's logits (``cache``, a transformers
        ``DynamicCache``, is filled with the keys and values)."""
        self._check_no_nodes(input_ids)
        positions = None  # left padding: positions count the real tokens, as decoding does
        if attention_mask is not None and not bool(attention_mask[:, 0].bool().all()):
            positions = node_position_ids(torch.zeros_like(input_ids, dtype=torch.bool),
                                          attention_mask)  # fmt: skip
        out = self.base(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            use_cache=cache is not None,
            **({"cache": cache} if cache is not None else {}),
        )
        return GLFusionOutput(logits=out.logits)

    def _prompt_pass(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None,
        graph: GraphBatch | None,
        *,
        blocks: Tensor | None = None,
        cache=None,
        logits_to_keep: Tensor | int | None = None,
        memory: dict | None = None,
    ) -> GLFusionOutput:
        """Prompts through the structure-aware mask and node positions; with a graph,
        node-token embeddings, message passing, cross-attention and the GNN head.

        ``blocks (B, S)`` long packs continuations of one prompt into one pass: 0 marks the
        prompt, ``k >= 1`` the k-th continuation (contiguous). A continuation's tokens see the
        prompt and the earlier tokens of their own continuation only, and their positions start
        after the prompt's, so each is exactly the prompt followed by it alone.
        ``logits_to_keep`` (transformers' option): the vocabulary logits of those positions
        only, ``(B, k, vocab)``. ``memory``: filled with what cross-attention reads, for
        decoding (:attr:`GraphPass.memory`)."""
        graph_pass = None
        node_mask = input_ids == self.config.node_id
        if graph is None:
            self._check_no_nodes(input_ids)
            embeds = inner_model(self.base).get_input_embeddings()(input_ids)
            allowed = build_structure_mask(node_mask, attention_mask)
            positions = node_position_ids(node_mask, attention_mask)
        else:
            if (graph.text_spans is not None) != self.gated:
                raise ValueError(
                    "the gated form's graphs give each node's text_spans in the prompt; the "
                    "paper's form's give none (its prompts hold <node> tokens)"
                )
            slots = graph.validate(input_ids, self.config.node_id, attention_mask)
            if blocks is not None and bool((blocks[slots[:, 0], slots[:, 1]] != 0).any()):
                raise ValueError("every node's text must sit in the prompt (block 0)")
            embeds = self._embed(input_ids, graph, slots)
            graph_pass = GraphPass(self, graph, slots, attention_mask, memory=memory)
            allowed, positions = self._layout(input_ids, attention_mask, graph, slots, graph_pass)
        if blocks is not None:
            if bool((node_mask & (blocks != 0)).any()):
                raise ValueError("node tokens must sit in the prompt (block 0)")
            allowed = self._block_mask(allowed, blocks)
            positions = self._block_positions(positions, blocks)
        keep = {} if logits_to_keep is None else {"logits_to_keep": logits_to_keep}
        out = self._decoder(embeds, allowed, positions, graph_pass, cache, **keep)
        if graph_pass is None:
            return GLFusionOutput(logits=out.logits)
        final = graph_pass.final_hidden
        node_logits = self.glf_gnn_head(final[slots[:, 0], slots[:, 1]])  # (M, classes)
        return GLFusionOutput(logits=out.logits, node_logits=node_logits)

    def _layout(self, input_ids, attention_mask, graph, slots, graph_pass):
        """The mask ``(B, 1, S, S)`` and positions ``(B, S)`` of graph prompts: the paper's
        structure-aware ones, or for the gated form the base LLM's own (its prompts hold no
        node token), where the text after each graph (``graph_pass.reads``) reads it."""
        node_mask = input_ids == self.config.node_id
        allowed = build_structure_mask(node_mask, attention_mask)
        positions = node_position_ids(node_mask, attention_mask)
        if self.gated:
            cfg = self.config
            if bool(((input_ids == cfg.graph_start_id) | (input_ids == cfg.graph_end_id)).any()):
                raise ValueError(
                    "the gated form's prompts hold no <graph_start>/<graph_end> (those would "
                    "reach the text outside the gates)"
                )
            B, S = input_ids.shape
            last = torch.full((B,), S, dtype=torch.long, device=input_ids.device)
            last.scatter_reduce_(0, slots[:, 0], slots[:, 1], reduce="amax", include_self=False)
            reads = torch.arange(S, device=input_ids.device)[None] > last[:, None]
            if attention_mask is not None:
                reads = reads & attention_mask.bool()
            graph_pass.reads = reads
        return allowed, positions

    def _decoder(self, embeds, allowed, positions, graph_pass, cache, **keep):
        """The base LM on input embeddings under the boolean mask ``allowed (B, 1, S, K)``;
        ``graph_pass`` goes to every decoder layer, and a prompt pass collects the final norm's
        output into it."""
        kwargs = {} if cache is None else {"cache": cache}
        hook = None
        if graph_pass is not None:
            kwargs["glf_pass"] = graph_pass
            if not graph_pass.decoding:
                norm = inner_model(self.base).model.norm
                hook = norm.register_forward_hook(graph_pass.keep_final)
        try:
            return self.base(
                inputs_embeds=embeds,
                attention_mask=to_additive_mask(allowed, embeds.dtype),
                position_ids=positions,
                use_cache=cache is not None,
                **kwargs,
                **keep,
            )
        finally:
            if hook is not None:
                hook.remove()

    # ------------------------------------------------------------------ save / load

    def glfusion_state_dict(self) -> dict[str, Tensor]:
        """The GL-Fusion modules plus the base's rows for the graph tokens."""
        state = {
            k: v.detach().contiguous().cpu()
            for k, v in self.state_dict().items()
            if k.startswith("glf_")
        }
        inner = inner_model(self.base)
        ids = torch.tensor(
            [self.config.graph_start_id, self.config.node_id, self.config.graph_end_id]
        )
        state["base_rows.embed_tokens"] = inner.get_input_embeddings().weight.detach()[ids].cpu()
        state["base_rows.lm_head"] = inner.get_output_embeddings().weight.detach()[ids].cpu()
        return state

    def save_pretrained(self, path: str | Path) -> None:
        """``glfusion_config.json``, ``glfusion_modules.safetensors`` and, when the base carries
        LoRA adapters, ``adapter/`` (peft's safetensors)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.config.save(path / "glfusion_config.json")
        save_file(self.glfusion_state_dict(), str(path / "glfusion_modules.safetensors"))
        if hasattr(self.base, "peft_config"):
            # LoRA weights alone: peft would otherwise copy the frozen base's whole (resized)
            # embedding and output matrices; their graph-token rows are saved above and every
            # other row is the base LLM's, which loading is given
            self.base.save_pretrained(str(path / "adapter"), save_embedding_layers=False)

    @classmethod
    def from_pretrained(cls, path: str | Path, base_lm: nn.Module) -> GLFusionForCausalLM:
        """Rebuild around a fresh copy of the same base LM (adapters loaded when saved)."""
        path = Path(path)
        config = GLFusionConfig.load(path / "glfusion_config.json")
        if (path / "adapter").is_dir():
            from peft import PeftModel

            if not (path / "adapter" / "adapter_model.safetensors").is_file():
                raise ValueError(
                    f"{path / 'adapter'} holds no adapter_model.safetensors: only safetensors "
                    "adapters are loaded (a pickled .bin file can run code when read)"
                )

            _fit_vocabulary(base_lm, config)  # the adapter was saved on the resized base
            with quiet_library_warnings():
                base_lm = PeftModel.from_pretrained(
                    base_lm, str(path / "adapter"), is_trainable=True
                )
        model = cls.from_base(base_lm, config)
        state = load_file(str(path / "glfusion_modules.safetensors"))
        rows = {k: state.pop(k) for k in list(state) if k.startswith("base_rows.")}
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if k.startswith("glf_")]
        if missing or unexpected:
            raise ValueError(f"{path}: missing {missing}, unexpected {unexpected}")
        inner = inner_model(model.base)
        ids = torch.tensor([config.graph_start_id, config.node_id, config.graph_end_id])
        with torch.no_grad():
            inner.get_input_embeddings().weight[ids] = rows["base_rows.embed_tokens"].to(
                inner.get_input_embeddings().weight.dtype
            )
            inner.get_output_embeddings().weight[ids] = rows["base_rows.lm_head"].to(
                inner.get_output_embeddings().weight.dtype
            )
        return model


def apply_lora(
    model: GLFusionForCausalLM,
    r: int = 8,
    alpha: int = 16,
    dropout: float = 0.0,
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"),
) -> GLFusionForCausalLM:
    """Put LoRA adapters (peft) on the base LM; the base is frozen, GL-Fusion stays trainable."""
    from peft import LoraConfig, get_peft_model

    if hasattr(model.base, "peft_config"):
        raise ValueError("the base already carries adapters")
    lora = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(target_modules),
        task_type="CAUSAL_LM",
    )
    with quiet_library_warnings():
        model.base = get_peft_model(model.base, lora)
    for name, p in model.named_parameters():
        if name.startswith("glf_"):
            p.requires_grad_(True)
    return model
