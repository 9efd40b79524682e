"""The flattened batch of one forward: every scheduled request's new tokens side by side, with their
positions, the cache slots their KV goes to and the attention metadata (shared by the target's step
and the draft model's proposals).
"""

from __future__ import annotations

import numpy as np
import torch

from ..model.llama import AttentionMetadata


def token_slice(req, start: int, end: int) -> list[int]:
    """req.all_token_ids[start:end] without building the whole list."""
    p = req.prompt_token_ids
    if end <= len(p):
        return p[start:end]
    o = req.output_token_ids
    if start >= len(p):
        return o[start - len(p) : end - len(p)]
    return p[start:] + o[: end - len(p)]


def flat_batch(
    ids: list[int],
    q_lens: list[int],
    starts: list[int],
    tables: list[list[int]],
    attn_block_size: int,
    device: torch.device,
    backend: str,
):
    """The flattened batch of one forward: request i brings ``q_lens[i]`` new tokens (its slice of
    ``ids``) at positions ``starts[i]...``, whose KV goes to the slots its block table maps them to.
    Returns (input_ids, positions, AttentionMetadata, cu_seqlens_q on the host). Shared by the
    target's step and the draft model's proposals (speculative decoding).

    The arithmetic runs on the host in numpy, whose calls cost about a microsecond where a
    torch call costs several; the results become tensors once, at the end (on a GPU this
    is where they would be copied over, as vLLM does)."""
    q = np.asarray(q_lens, dtype=np.int64)
    cu = np.zeros(len(tables) + 1, dtype=np.int64)
    np.cumsum(q, out=cu[1:])
    req_idx = np.repeat(np.arange(len(tables)), q)  # which request each token is
    positions = np.arange(cu[-1]) - cu[:-1][req_idx] + np.asarray(starts, dtype=np.int64)[req_idx]
    width = max(len(t) for t in tables)
    bt = np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int64)  # padded block tables
    slots = bt[req_idx, positions // attn_block_size] * attn_block_size + positions % attn_block_size
    cu_t = torch.from_numpy(cu.astype(np.int32))
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(device),
        block_tables=torch.from_numpy(bt.astype(np.int32)).to(device),
        cu_seqlens_q=cu_t.to(device),
        context_lens=torch.from_numpy((np.asarray(starts) + q).astype(np.int32)).to(device),
        max_q_len=int(q.max()),
        backend=backend,
    )
    return torch.tensor(ids, dtype=torch.long, device=device), torch.from_numpy(positions).to(device), meta, cu_t
