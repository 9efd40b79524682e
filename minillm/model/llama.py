"""A Llama-family decoder (Llama, Qwen2, Qwen3) over a *flattened* batch.

There is no padding and no batch dimension: the tokens of every scheduled
request are concatenated into one sequence of ``T`` tokens (decodes bring 1,
prefill chunks bring many). Every matrix multiply runs once over all ``T`` rows,
which is exactly why batching amortises the weight reads. Only attention needs
to know where one request ends and the next begins; it gets that from
``AttentionMetadata`` and reads earlier context from the paged KV cache.

Parameter names match Hugging Face's, so a checkpoint's ``state_dict`` loads as is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from minillm_kernels import ops  # the paged-attention kernels and their torch references
from .families import model_family
import torch.nn.functional as F
from torch import nn


@dataclass
class AttentionMetadata:
    """Where each request's tokens sit in the flat batch and in the paged cache."""

    slot_mapping: torch.Tensor  # int64 [T]: cache slot (block * block_size + offset) for each new token
    block_tables: torch.Tensor  # int32 [B, max_blocks]: each request's blocks, in order
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]: request i's new tokens are rows cu[i]:cu[i+1]
    context_lens: torch.Tensor  # int32 [B]: KV positions of request i after this step
    max_q_len: int
    backend: str = "torch"  # "torch" reference, "triton" kernel or "cpu" kernel (in place on the CPU)
    plan: Optional[list] = None  # torch backend: the step's attention plan, shared by all layers
    cpu_calls: Optional[object] = None  # cpu backend's fused layers: the step's C calls (cpu_attention.StepCalls)
    kv_quantizer: Optional[object] = None  # int8/fp8 cache, torch backend: the store's arithmetic
    # (EngineConfig.kv_quantizer; None = minillm_kernels.kv_quant)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Computed in float32 then cast back, as transformers does.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim**-0.5
        family = model_family(cfg)  # the family's switches (families.py)
        bias, o_bias = family.biases(cfg)
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=o_bias)
        self.qk_norm = family.qk_norm  # e.g. Qwen3 normalises q and k per head
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata):

        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + rotate_half(q) * sin  # RoPE at each token's own position
        k = k * cos + rotate_half(k) * sin
        # (k, v), or (k, v, k_scale, v_scale) for an int8/fp8 cache (quantized on store,
        # dequantized on load, one scale per block and KV head).
        k_cache, v_cache, *scales = kv_cache
        k_scale, v_scale = scales or (None, None)
        # 1) write this step's K/V into the paged cache, 2) attend over the cache.
        ops.store_kv(
            k,
            v,
            k_cache,
            v_cache,
            meta.slot_mapping,
            k_scale=k_scale,
            v_scale=v_scale,
            backend=meta.backend,
            quantizer=meta.kv_quantizer,
        )
        o = ops.paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.cu_seqlens_q,
            meta.context_lens,
            self.scale,
            max_q_len=meta.max_q_len,
            backend=meta.backend,
            plan=meta.plan,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, m = cfg.hidden_size, cfg.intermediate_size
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.gate_proj = nn.Linear(h, m, bias=bias)
        self.up_proj = nn.Linear(h, m, bias=bias)
        self.down_proj = nn.Linear(m, h, bias=bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Backbone(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaModel(nn.Module):
    """Decoder + LM head. ``forward`` returns logits only for the rows asked for."""

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.model = _Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if getattr(cfg, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        attn = self.model.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        # RoPE frequencies (with the config's theta and scaling) come from transformers'
        # own rotary-embedding class, so every rope_type it knows is handled identically.
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        rope = LlamaRotaryEmbedding(config=cfg)
        self.register_buffer("inv_freq", rope.inv_freq.float().clone(), persistent=False)
        self.attention_scaling = float(getattr(rope, "attention_scaling", 1.0))

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)[:, None, :]  # [T, 1, head_dim]
        sin = (emb.sin() * self.attention_scaling).to(dtype)[:, None, :]
        return cos, sin

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list,
        meta: AttentionMetadata,
        logits_indices: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T]. kv_caches[layer] = (k_cache, v_cache), or
        (k_cache, v_cache, k_scale, v_scale) for a quantized cache.
        Returns float32 logits [len(logits_indices), vocab] (all rows if None)."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        if meta.backend == "torch" and meta.plan is None and kv_caches:
            # Which requests pad together, and the gather indices and masks: the same in
            # every layer, so computed once per forward (the runner usually did it already).
            meta.plan = ops.plan_attention_ref(
                meta.block_tables,
                meta.cu_seqlens_q,
                meta.context_lens,
                kv_caches[0][0].shape[1],
                self.num_heads // self.num_kv_heads,
            )
        for layer, kv in zip(self.model.layers, kv_caches):
            x = layer(x, cos, sin, kv, meta)
        if logits_indices is not None:
            x = x[logits_indices]  # only rows that sample a token need the LM head
        x = self.model.norm(x)
        return self.lm_head(x).float()
