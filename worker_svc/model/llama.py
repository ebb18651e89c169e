"""Llama-family decoder over the paged KV cache.

forward(input_ids [T], positions [T], attn metadata, kv cache, logits_indices [S]):
    h = embed(input_ids)
    per layer: h += o_proj(paged_attention(rope(q), write_kv(rope(k), v)))  on norm(h)
               h += mlp(norm(h))
    return lm_head(norm(h[logits_indices]))     # logits only for the rows that sample

Parameter names follow transformers' LlamaForCausalLM, except q/k/v and gate/up, which
are stacked into one matmul each (`qkv_proj`, `gate_up_proj`); `load_weights` maps the
checkpoint's separate tensors into their slices.
"""

from collections.abc import Iterable

import torch
from torch import nn

from kernels.backend import AttentionBackend
from worker_svc.batch import AttentionMetadata
from worker_svc.model.config import DecoderConfig
from worker_svc.model.layers import GatedMLP, RMSNorm, RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, cfg: DecoderConfig, rotary: RotaryEmbedding, backend: AttentionBackend):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.rotary = rotary  # shared by all layers; not a submodule (no weights)
        self.backend = backend

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, attn: AttentionMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """`rope`: the step's RotaryEmbedding.tables, shared by every layer."""
        num_tokens = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = self.rotary.rotate(qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim), rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        self.backend.write_kv(k, v, k_cache, v_cache, attn.slot_mapping)
        out = self.backend.paged_attention(
            q, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc,
            self.scale, plan=attn.plan)
        return self.o_proj(out.view(num_tokens, self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, rotary: RotaryEmbedding, backend: AttentionBackend):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, rotary, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.hidden_act)

    def forward(self, rope, h, attn, k_cache, v_cache):
        h = h + self.self_attn(rope, self.input_layernorm(h), attn, k_cache, v_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, cfg: DecoderConfig, rotary: RotaryEmbedding, backend: AttentionBackend):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, rotary, backend) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    # (our parameter, checkpoint's parameter, slice index in the stacked weight)
    STACKED = (("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1), ("qkv_proj", "v_proj", 2),
               ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))

    def __init__(self, cfg: DecoderConfig, backend: AttentionBackend, max_positions: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.cfg = cfg
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta,
                                      cfg.rope_scaling, dtype, device)
        self.model = LlamaModel(cfg, self.rotary, backend)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_caches: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]],
                logits_indices: torch.Tensor) -> torch.Tensor:
        """Logits [S, vocab] of the rows `logits_indices`; kv_caches = (K per layer, V per layer)."""
        k_caches, v_caches = kv_caches
        h = self.model.embed_tokens(input_ids)
        rope = self.rotary.tables(positions)
        for layer, k_cache, v_cache in zip(self.model.layers, k_caches, v_caches):
            h = layer(rope, h, attn, k_cache, v_cache)
        # The final norm is per row, so it may follow the row selection.
        return self.lm_head(self.model.norm(h.index_select(0, logits_indices)))

    def _stacked_slice(self, param: torch.Tensor, name: str, index: int) -> torch.Tensor:
        if name == "qkv_proj":
            q, kv = self.cfg.num_heads * self.cfg.head_dim, self.cfg.num_kv_heads * self.cfg.head_dim
            bounds = [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][index]
        else:
            inter = self.cfg.intermediate_size
            bounds = [(0, inter), (inter, 2 * inter)][index]
        return param.data[bounds[0] : bounds[1]]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into the parameters; raise if any parameter (or slice of
        a stacked one) is left unfilled or a tensor has nowhere to go."""
        params = dict(self.named_parameters())  # a tied lm_head appears once, as embed_tokens
        expected = set()
        for name in params:
            parts = [i for s, _, i in self.STACKED if f".{s}." in name]
            expected.update([f"{name}#{i}" for i in parts] if parts else [name])
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue  # derived, stored by some old checkpoints
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue  # tied: the embedding is the head
            if not name.startswith(("model.", "lm_head.")):
                name = "model." + name  # a bare LlamaModel checkpoint
            key, target = name, None
            for stacked, original, index in self.STACKED:
                if f".{original}." in name:
                    name = name.replace(f".{original}.", f".{stacked}.")
                    key = f"{name}#{index}"
                    if name in params:
                        target = self._stacked_slice(params[name], stacked, index)
                    break
            else:
                target = params[name].data if name in params else None
            if target is None:
                raise KeyError(f"checkpoint tensor {name!r} matches no parameter")
            if target.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, "
                                 f"model expects {tuple(target.shape)}")
            target.copy_(tensor)
            expected.discard(key)
        if expected:
            raise ValueError(f"checkpoint lacks {len(expected)} tensors, e.g. {sorted(expected)[:4]}")
