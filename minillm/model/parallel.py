"""Tensor parallelism's layers: one rank's shard of the model, Megatron style.

``N`` ranks each hold a slice of every weight matrix and run the *same* layer on the
*same* tokens; two collectives per decoder layer keep their residual streams equal:

- **Column-parallel** (``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj``): the
  output features are split. Rank ``r`` holds rows ``[a, b)`` of ``W`` ``[out, in]`` and
  computes ``y[:, a:b]`` from the full input; no communication. For attention, the split
  falls on whole heads: each rank computes ``num_heads / N`` query heads and
  ``num_kv_heads / N`` KV heads, stores only those KV heads in its slice of every cache
  block, and attends with them (a grouped-query group never straddles two ranks).
- **Row-parallel** (``o_proj``, ``down_proj``): the *input* features are split, matching
  the column split before it, so rank ``r`` holds columns ``[a, b)`` and computes a partial
  sum ``x[:, a:b] @ W[:, a:b].T`` of the full output. An **all-reduce** adds the ``N``
  partial sums; every rank then holds the layer's whole output. The bias is added once,
  after the sum.
- **Embedding and LM head: vocab-parallel**, as nano-vllm and vLLM do. Each rank holds
  ``ceil(V / N)`` rows of the vocabulary. The embedding looks up the ids it owns, writes
  zeros for the others, and an all-reduce sums the ``N`` partial lookups (exactly one is
  not zero, so the sum is exact). The LM head computes the logits of its own vocabulary
  slice and rank 0 *gathers* the slices into whole rows. Replicating them instead would be
  simpler, but the ``[V, hidden]`` matrices are among the largest of a small model (Qwen3-0.6B's
  tied embedding alone is a quarter of its weights): each rank would hold them whole, and
  compute the whole LM head, for nothing.
- Norms, RoPE and the residual adds are tiny and replicated: every rank does them all.

A rank's shard is a ``LlamaModel`` built from a *per-rank config* (``num_heads / N`` heads,
its slice of ``intermediate_size``), whose row-parallel layers, embedding and LM head are
then swapped for the classes below; attention, the KV cache and the forward are the
single-device code, unchanged. ``load_shard`` fills it from a full checkpoint, reading
only this rank's slice of each tensor from the safetensors files.
"""

from __future__ import annotations

import copy
import glob
import os
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .llama import LlamaModel
from .loader import check_heads, choose_triton_mode

# This process's collectives (one rank's): calls and bytes by kind, for the reader to inspect
# (``TPExecutor.collective_rpc(Worker.comm)``): per forward, 2 all-reduces per layer + 1 for
# the embedding, each of the ``[T, hidden]`` activations, and 1 gather of the logits.
COMM: dict[str, int] = {"all_reduce": 0, "all_reduce_bytes": 0, "gather": 0, "gather_bytes": 0}


def _all_reduce(t: torch.Tensor) -> None:
    COMM["all_reduce"] += 1
    COMM["all_reduce_bytes"] += t.numel() * t.element_size()
    dist.all_reduce(t)  # in place: the sum over every rank


# --- how a dimension is split ----------------------------------------------------------


def split(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s range ``[a, b)`` of ``n`` items split as evenly as possible (the first
    ``n % world`` ranks take one more)."""
    size, extra = divmod(n, world)
    a = rank * size + min(rank, extra)
    return a, a + size + (rank < extra)


def rank_config(cfg, rank: int, world: int):
    """The config of rank ``rank``'s shard: its heads, its slice of the MLP. ``head_dim`` is
    written out, since ``hidden_size / num_attention_heads`` no longer gives it."""
    check_heads(cfg, world)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    c = copy.deepcopy(cfg)
    c.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    c.num_attention_heads = heads // world
    c.num_key_value_heads = kv_heads // world
    a, b = split(cfg.intermediate_size, rank, world)
    c.intermediate_size = b - a
    return c


# --- the sharded layers -----------------------------------------------------------------


class ColumnParallelLinear(nn.Linear):
    """``y[:, a:b] = x @ W[a:b].T + bias[a:b]``: rank ``rank`` holds output features ``[a, b)``.
    The forward is a plain ``nn.Linear`` (no communication); only loading differs."""

    def __init__(self, in_features: int, a: int, b: int, bias: bool):
        super().__init__(in_features, b - a, bias=bias)
        self.a, self.b = a, b

    def shard(self, name: str, full) -> torch.Tensor:
        return full[self.a : self.b]  # weight [out, in] and bias [out] alike


def column_parallel_heads(linear: nn.Linear, total_heads: int, head_dim: int, rank: int, world: int):
    """The column-parallel twin of a q/k/v projection: this rank's whole heads."""
    per = total_heads // world
    return ColumnParallelLinear(
        linear.in_features, rank * per * head_dim, (rank + 1) * per * head_dim, linear.bias is not None
    )


class RowParallelLinear(nn.Linear):
    """``y = all_reduce(x[:, a:b] @ W[:, a:b].T) + bias``: rank ``rank`` holds input features
    ``[a, b)`` (the output of the column-parallel layer before it) and the whole bias."""

    def __init__(self, a: int, b: int, out_features: int, bias: bool):
        super().__init__(b - a, out_features, bias=bias)
        self.a, self.b = a, b

    def shard(self, name: str, full) -> torch.Tensor:
        return full[:, self.a : self.b] if name.endswith("weight") else full[:]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)  # this rank's partial sum
        _all_reduce(y)  # + every other rank's: the whole output
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Rank ``rank`` holds embedding rows ``[start, start + per_rank)`` (the last rank's tail
    past the vocabulary is zero padding, so every rank's slice has the same shape)."""

    def __init__(self, vocab_size: int, hidden: int, rank: int, world: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // world)
        self.start = rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden))

    def shard(self, name: str, full) -> torch.Tensor:
        rows = full[self.start : min(self.start + self.per_rank, self.vocab_size)]
        return F.pad(rows, (0, 0, 0, self.per_rank - rows.shape[0]))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.per_rank)
        y = F.embedding(local.clamp(0, self.per_rank - 1), self.weight) * mine[:, None]
        _all_reduce(y)  # exactly one rank contributes each row
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """Logits of this rank's vocabulary slice; rank 0 gathers every slice into whole rows
    ``[R, vocab_size]``. The other ranks return their own slice (already sent to rank 0)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight)
        world = dist.get_world_size()
        COMM["gather"] += 1
        COMM["gather_bytes"] += logits.numel() * logits.element_size()
        if dist.get_rank() == 0:
            parts = [torch.empty_like(logits) for _ in range(world)]
            dist.gather(logits, parts, dst=0)
            return torch.cat(parts, dim=-1)[:, : self.vocab_size]
        dist.gather(logits, None, dst=0)
        return logits


# --- one rank's shard ---------------------------------------------------------------------


def build_shard(cfg, rank: int, world: int) -> LlamaModel:
    """Rank ``rank``'s shard of the model described by ``cfg`` (weights uninitialised, on the
    meta device; ``load_shard`` fills them)."""
    rc = rank_config(cfg, rank, world)
    hd = rc.head_dim
    with torch.device("meta"):
        m = LlamaModel(rc)
        m.config = cfg  # the whole model's config, for the reader
        a, b = split(cfg.intermediate_size, rank, world)
        for layer in m.model.layers:
            at, mlp = layer.self_attn, layer.mlp
            at.q_proj = column_parallel_heads(at.q_proj, cfg.num_attention_heads, hd, rank, world)
            kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
            at.k_proj = column_parallel_heads(at.k_proj, kv_heads, hd, rank, world)
            at.v_proj = column_parallel_heads(at.v_proj, kv_heads, hd, rank, world)
            heads_a = rank * rc.num_attention_heads * hd
            at.o_proj = RowParallelLinear(
                heads_a, heads_a + rc.num_attention_heads * hd, cfg.hidden_size, at.o_proj.bias is not None
            )
            mlp.gate_proj = ColumnParallelLinear(cfg.hidden_size, a, b, mlp.gate_proj.bias is not None)
            mlp.up_proj = ColumnParallelLinear(cfg.hidden_size, a, b, mlp.up_proj.bias is not None)
            mlp.down_proj = RowParallelLinear(a, b, cfg.hidden_size, mlp.down_proj.bias is not None)
        m.model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, rank, world)
        m.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, rank, world)
        if getattr(cfg, "tie_word_embeddings", False):
            m.lm_head.weight = m.model.embed_tokens.weight  # same vocabulary rows on this rank
    return m


def _shard_of(model: nn.Module, name: str, full) -> torch.Tensor:
    """This rank's slice of the full tensor ``full`` (a tensor, or a lazy safetensors slice)
    of parameter ``name``: the owning module's ``shard`` decides; other modules are replicated."""
    owner = model.get_submodule(name.rsplit(".", 1)[0])
    return owner.shard(name, full) if hasattr(owner, "shard") else full[:]


def load_shard(model: LlamaModel, names: list[str], get: Callable[[str], object], source: str) -> None:
    """Fill ``model`` (from ``build_shard``) with its slices of the full tensors ``get(name)``
    for every checkpoint tensor name in ``names``; a name missing on either side raises."""
    cfg = model.config
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    want = {n for n, _ in model.named_parameters(remove_duplicate=False) if not (tied and n == "lm_head.weight")}
    have = {n for n in names if "rotary_emb" not in n and not (tied and n == "lm_head.weight")}
    if want != have:
        raise ValueError(
            f"model={source!r}: checkpoint does not match the architecture; "
            f"missing={sorted(want - have)[:5]} unexpected={sorted(have - want)[:5]}"
        )
    model.to_empty(device="cpu")
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n in sorted(want):
            p = params[n]
            part = _shard_of(model, n, get(n))
            if tuple(part.shape) != tuple(p.shape):
                raise ValueError(
                    f"model={source!r}: {n} has shape {tuple(part.shape)} on this rank, expected {tuple(p.shape)}"
                )
            p.copy_(part)


def load_shard_model(
    model: str, cfg, rank: int, world: int, dtype: torch.dtype, device: str, seed: int = 0, random_overrides=None
) -> LlamaModel:
    """Rank ``rank``'s shard of ``model``: a checkpoint directory (only this rank's slice of each
    tensor is read from the safetensors files) or "random" (the same seeded random model as
    ``load_model``, built whole, then sliced)."""
    choose_triton_mode()  # (a rank process: before its first import of transformers)
    shard = build_shard(cfg, rank, world)
    if model == "random":
        from .loader import load_model

        full, _ = load_model("random", "float32", "cpu", seed, random_overrides)
        state = full.state_dict()
        load_shard(shard, list(state), state.__getitem__, model)
    else:
        from safetensors import safe_open

        files = sorted(glob.glob(os.path.join(model, "*.safetensors")))
        if not files:
            raise ValueError(f"model={model!r}: no *.safetensors weights found")
        handles = [safe_open(f, framework="pt") for f in files]
        where = {name: h for h in handles for name in h.keys()}
        load_shard(shard, list(where), lambda n: where[n].get_slice(n), model)
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    shard.inv_freq = LlamaRotaryEmbedding(config=cfg).inv_freq.float().clone()  # to_empty left it unset
    shard = shard.to(device=device, dtype=dtype)
    shard.inv_freq = shard.inv_freq.float()
    return shard.eval()
