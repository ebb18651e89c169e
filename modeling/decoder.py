"""The decoder every family runs, over the paged KV cache; DecoderConfig's switches say how
a family differs (modeling/config.py).

forward(input_ids [T], positions [T], attn metadata, kv cache, logits_indices [S]):
    h = embed(input_ids) (* embedding_scale)     or the caller's `inputs_embeds` [T, hidden]
    per layer i:
        a = o_proj(paged_attention(rope_i(norm_q(q)), write_kv(rope_i(norm_k(k)), v),
                                   window_i, soft_cap))          on input_layernorm(h)
        h += a                        (Gemma: h += post_attention_layernorm(a))
        h += mlp(post_attention_layernorm(h))
                                      (Gemma: h += post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h))))
    logits = lm_head(norm(h[logits_indices]))  (* final soft-cap: c * tanh(logits / c))

computed as `hidden_states` (the layers) then `logits`. Each add is fused with the norm
after it, and q/k norms, RoPE and the K/V cache write are one call, through the backend's
layer ops (kernels/torch_layer_ops.py on the CPU, kernels/triton_layer_ops.py on CUDA):
on a GPU a layer is nine launches (norm, QKV, RoPE + cache write, attention, O, norm,
gate-up, activation, down).

Parameter names follow transformers' <Family>ForCausalLM, except q/k/v and gate/up, which
are stacked into one matmul each (`qkv_proj`, `gate_up_proj`); `load_weights` maps the
checkpoint's separate tensors into their slices. Every op is written in transformers'
order and precision, so greedy outputs agree token for token in fp32.

Vision-language checkpoints (Gemma3ForConditionalGeneration): `load_weights` takes the
language model's tensors under any of their layouts (modeling/weight_names.py) and
leaves the vision tower's and projector's to the vision encoder
(modeling/gemma3_vision.py). A step with image soft tokens passes `inputs_embeds`:
`embed(input_ids)` with the image embeddings written over the soft tokens' rows
(modeling/image_placement.py), the order transformers' Gemma3Model uses (scale the
text embeddings, then scatter the images' unscaled); without images the step is unchanged.
"""

from collections.abc import Iterable

import torch
from torch import nn

from kernels.backend import AttentionBackend
from kvstore.kv_cache_groups import group_layers
from modeling.attention_metadata import AttentionMetadata
from modeling.config import DecoderConfig
from modeling.layers import GatedMLP, RotaryEmbedding, rms_norm
from modeling.stacked_weights import StackedWeights
from modeling.weight_names import MULTIMODAL_ARCHITECTURES, TEXT, split_name


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int, rope_index: int, backend: AttentionBackend,
                 kv_group: int = 0):
        super().__init__()
        self.kv_group = kv_group  # the KV cache group whose block table this layer reads
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.scale
        self.window = cfg.sliding_windows[layer]
        self.soft_cap = cfg.attn_logit_softcap
        self.rope_index = rope_index  # which of the model's RoPE tables this layer rotates by
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = rms_norm(cfg, cfg.head_dim)
            self.k_norm = rms_norm(cfg, cfg.head_dim)
        self.qk_norm = cfg.qk_norm
        self.eps, self.gemma = cfg.rms_norm_eps, cfg.gemma_norms
        self.backend = backend

    def forward(self, ropes: list[tuple], x: torch.Tensor, attn: AttentionMetadata, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        """`ropes`: the step's (cos, sin, positions) of each RoPE spec (layer ops' rope_tables)."""
        num_tokens = x.shape[0]
        cos, sin, positions = ropes[self.rope_index]
        group = attn.groups[self.kv_group]
        q = self.backend.layer_ops.rope_write_kv(
            self.qkv_proj(x), positions, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim,
            k_cache, v_cache, group.slot_mapping, self.q_norm.weight if self.qk_norm else None,
            self.k_norm.weight if self.qk_norm else None, self.eps, self.gemma)
        out = self.backend.paged_attention(
            q, k_cache, v_cache, group.block_tables, attn.seq_lens, attn.query_start_loc,
            self.scale, sliding_window=self.window, soft_cap=self.soft_cap, plan=group.plan)
        return self.o_proj(out.view(num_tokens, self.q_size))


class DecoderLayer(nn.Module):
    """One layer in the residual-stream form: it takes the previous layer's output `y` (for
    the first layer the embeddings, with `residual` None) and the residual stream, and
    returns its own MLP output and the stream; each add is fused with the norm after it
    (kernels/torch_layer_ops.py `add_rms_norm`). Gemma's norm of a sublayer's output
    (`post_feedforward_layernorm`) is applied by whoever adds it: the next layer, or the
    final norm (`output_weight`)."""

    def __init__(self, cfg: DecoderConfig, layer: int, rope_index: int, backend: AttentionBackend,
                 kv_group: int = 0):
        super().__init__()
        self.input_layernorm = rms_norm(cfg, cfg.hidden_size)
        self.self_attn = Attention(cfg, layer, rope_index, backend, kv_group)
        self.post_attention_layernorm = rms_norm(cfg, cfg.hidden_size)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.hidden_act, backend.layer_ops)
        self.sandwich = cfg.gemma_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = rms_norm(cfg, cfg.hidden_size)
            self.post_feedforward_layernorm = rms_norm(cfg, cfg.hidden_size)
        self.eps, self.gemma = cfg.rms_norm_eps, cfg.gemma_norms
        self.ops = backend.layer_ops

    @property
    def output_weight(self) -> torch.Tensor | None:
        """The norm on this layer's output before it joins the residual stream (Gemma)."""
        return self.post_feedforward_layernorm.weight if self.sandwich else None

    def forward(self, ropes, y, residual, y_weight, attn, k_cache, v_cache):
        ops, eps, gemma = self.ops, self.eps, self.gemma
        if residual is None:
            residual = y
            x = ops.rms_norm(y, self.input_layernorm.weight, eps, gemma)
        else:
            x, residual = ops.add_rms_norm(y, residual, self.input_layernorm.weight, eps, gemma, y_weight)
        a = self.self_attn(ropes, x, attn, k_cache, v_cache)
        if self.sandwich:  # h += post_attention_layernorm(a); x = pre_feedforward_layernorm(h)
            x, residual = ops.add_rms_norm(a, residual, self.pre_feedforward_layernorm.weight, eps, gemma,
                                           self.post_attention_layernorm.weight)
        else:
            x, residual = ops.add_rms_norm(a, residual, self.post_attention_layernorm.weight, eps, gemma)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: DecoderConfig, rope_indices: list[int], backend: AttentionBackend,
                 kv_groups: list[int]):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rope_indices[i], backend, kv_groups[i])
                                    for i in range(cfg.num_layers))
        self.norm = rms_norm(cfg, cfg.hidden_size)


class DecoderForCausalLM(nn.Module):
    # (our parameter, checkpoint's parameter, slice index in the stacked weight)
    STACKED = (("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1), ("qkv_proj", "v_proj", 2),
               ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))

    def __init__(self, cfg: DecoderConfig, backend: AttentionBackend, max_positions: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.cfg = cfg
        self.ops = backend.layer_ops
        specs = list(dict.fromkeys(cfg.rope))  # distinct RoPE specs, in first-use order
        # not submodules: no weights, one table per spec shared by its layers
        self.rotaries = [RotaryEmbedding(cfg.head_dim, max_positions, s.theta, s.scaling, dtype, device)
                         for s in specs]
        # KV cache groups (kvstore/kv_cache_groups.py): each layer's group and cache slot
        self.kv_layout = group_layers(cfg.sliding_windows)
        places = self.kv_layout.layer_places(cfg.num_layers)
        self.kv_slots = [slot for _, slot in places]
        self.model = DecoderModel(cfg, [specs.index(s) for s in cfg.rope], backend, [g for g, _ in places])
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.embedding_scale = None
        if cfg.embedding_scale is not None:  # rounded to the weights' dtype, as transformers does
            with torch.device(device):
                self.embedding_scale = torch.tensor(cfg.embedding_scale).to(dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings [T, hidden] of `input_ids`, times the family's embedding scale
        (rounded to the weights' dtype first, as transformers' Gemma3TextScaledWordEmbedding)."""
        h = self.model.embed_tokens(input_ids)
        if self.embedding_scale is not None:
            h = h * self.embedding_scale
        return h

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_caches: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]],
                logits_indices: torch.Tensor, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [S, vocab] of the rows `logits_indices`; kv_caches = (K per layer slot, V
        per layer slot: `kv_layout.group_size` of each, layer i reading slot `kv_slots[i]`).
        `inputs_embeds` [T, hidden], when given, is the step's input instead of
        `embed(input_ids)` (a step carrying image embeddings)."""
        return self.logits(*self.hidden_states(input_ids, positions, attn, kv_caches, inputs_embeds),
                           logits_indices)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                      kv_caches: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]],
                      inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers: (the last layer's output, the residual stream before it is added),
        each [T, hidden]; what a decode step's CUDA graph captures."""
        k_caches, v_caches = kv_caches
        y = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        ropes = [self.ops.rope_tables(rotary.cos, rotary.sin, positions) for rotary in self.rotaries]
        residual, y_weight = None, None
        for layer, slot in zip(self.model.layers, self.kv_slots):
            y, residual = layer(ropes, y, residual, y_weight, attn, k_caches[slot], v_caches[slot])
            y_weight = layer.output_weight
        return y, residual

    def logits(self, y: torch.Tensor, residual: torch.Tensor,
               logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the rows `logits_indices` (all rows: None) of `hidden_states`' output:
        the last add, the final norm (per row, so after the row selection), the LM head."""
        if logits_indices is not None:
            y, residual = y.index_select(0, logits_indices), residual.index_select(0, logits_indices)
        last = self.model.layers[-1]
        h, _ = self.ops.add_rms_norm(y, residual, self.model.norm.weight, self.cfg.rms_norm_eps,
                                     self.cfg.gemma_norms, last.output_weight)
        logits = self.lm_head(h)
        cap = self.cfg.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _stacked_slice(self, param: torch.Tensor, name: str, index: int) -> torch.Tensor:
        if name == "qkv_proj":
            q, kv = self.cfg.num_heads * self.cfg.head_dim, self.cfg.num_kv_heads * self.cfg.head_dim
            bounds = [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][index]
        else:
            inter = self.cfg.intermediate_size
            bounds = [(0, inter), (inter, 2 * inter)][index]
        return param[bounds[0] : bounds[1]]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into the parameters; raise if any parameter (or slice of
        a stacked one) is left unfilled or a tensor has nowhere to go."""
        # a tied lm_head appears once, as embed_tokens
        loader = StackedWeights(dict(self.named_parameters()), self.STACKED, self._stacked_slice,
                                owner=self.cfg.architecture)
        multimodal = self.cfg.architecture in MULTIMODAL_ARCHITECTURES
        for name, tensor in weights:
            part, local = split_name(name)
            if part != TEXT:
                if multimodal:
                    continue  # the vision encoder's (modeling/gemma3_vision.py)
                raise KeyError(f"checkpoint tensor {name!r} is a {part} weight, but "
                               f"{self.cfg.architecture} is a text decoder")
            name = local
            if "rotary_emb.inv_freq" in name:
                continue  # derived, stored by some old checkpoints
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue  # tied: the embedding is the head
            if not name.startswith(("model.", "lm_head.")):
                name = "model." + name  # a bare <Family>Model checkpoint
            loader.copy(name, tensor)
        expected = loader.unfilled
        if expected:
            raise ValueError(f"checkpoint lacks {len(expected)} tensors, e.g. {sorted(expected)[:4]}")
