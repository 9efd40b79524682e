"""The CPU fast path's step inputs and greedy sampling: what ``flat_batch.py`` and ``sampler.py`` compute,
with less work per step. A reader can skip this module.

:class:`InputBuffers` builds the flattened batch of ``flat_batch.flat_batch`` (input ids, positions,
slot mapping, block tables, ``cu_seqlens_q``, context lengths) in tensors allocated once and reused
from step to step (grown when a step needs more room), written through numpy views of the same
memory: no tensor is allocated per step, and the block tables are padded in one vectorized
assignment instead of a list per request. The tensors a step gets are views of the buffers, valid
until the next step's ``flat_batch``: nothing keeps them longer (the forward reads them, then the step
is over). The block tables are a contiguous ``[batch, width]`` view, as the attention kernel takes them.

:func:`sample_plain` is ``sampler.sample_plain`` with a shortcut for the common batch of an
offline run: every row greedy, with no penalty, ``min_tokens``, logprobs or parallel sampling,
and every row's logits usable: then the tokens are one ``argmax`` over the batch (numpy's, on the
logits' memory: a tenth of torch's on this shape); any other
batch goes to ``sampler.sample_plain``.

``ModelRunner`` uses both when ``attention_backend="cpu"`` (tests/test_cpu_step.py holds them
equal to the references).
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from ..model.llama import AttentionMetadata
from . import sampler


class InputBuffers:
    """``flat_batch``'s tensors in memory reused from step to step (CPU)."""

    def __init__(self) -> None:
        self.tokens = self.seqs = self.table_size = 0  # capacities, grown on demand

    def _room(self, tokens: int, seqs: int, table_size: int) -> None:
        if tokens > self.tokens:
            self.tokens = max(tokens, 2 * self.tokens)
            self.ids, self.positions, self.slots = (torch.empty(self.tokens, dtype=torch.long) for _ in range(3))
            self.ids_np, self.positions_np, self.slots_np = self.ids.numpy(), self.positions.numpy(), self.slots.numpy()
        if seqs > self.seqs:
            self.seqs = max(seqs, 2 * self.seqs)
            self.cu = torch.zeros(self.seqs + 1, dtype=torch.int32)
            self.context_lens = torch.empty(self.seqs, dtype=torch.int32)
            self.cu_np, self.context_lens_np = self.cu.numpy(), self.context_lens.numpy()
        if table_size > self.table_size:
            self.table_size = max(table_size, 2 * self.table_size)
            self.tables = torch.empty(self.table_size, dtype=torch.int32)
            self.tables_np = self.tables.numpy()

    def flat_batch(
        self,
        ids: list[int],
        q_lens: list[int],
        starts: list[int],
        tables: list[list[int]],
        attn_block_size: int,
        device: torch.device,
        backend: str,
    ):
        """``flat_batch.flat_batch``'s contract and results (on the CPU), in the reused buffers."""
        n, b = len(ids), len(tables)
        widths = np.fromiter(map(len, tables), dtype=np.int64, count=b)
        width = int(widths.max())
        self._room(n, b, b * width)
        q = np.asarray(q_lens, dtype=np.int64)
        cu = self.cu_np[: b + 1]
        np.cumsum(q, out=cu[1:])  # cu[0] stays 0
        req_idx = np.repeat(np.arange(b), q)  # which request each token is
        start = np.asarray(starts, dtype=np.int64)
        positions = self.positions_np[:n]
        np.subtract(np.arange(n), cu[:-1][req_idx], out=positions)
        positions += start[req_idx]
        bt = self.tables_np[: b * width].reshape(b, width)
        bt.fill(0)
        bt[np.arange(width) < widths[:, None]] = np.fromiter(
            itertools.chain.from_iterable(tables), dtype=np.int32, count=int(widths.sum())
        )  # the padded block tables, row by row
        slots = self.slots_np[:n]
        np.multiply(bt[req_idx, positions // attn_block_size], attn_block_size, out=slots)
        slots += positions % attn_block_size
        np.add(start, q, out=self.context_lens_np[:b])
        self.ids_np[:n] = ids
        meta = AttentionMetadata(
            slot_mapping=self.slots[:n],
            block_tables=self.tables[: b * width].view(b, width),
            cu_seqlens_q=self.cu[: b + 1],
            context_lens=self.context_lens[:b],
            max_q_len=int(q.max()),
            backend=backend,
        )
        return self.ids[:n], self.positions[:n], meta, self.cu[: b + 1]


def plain_greedy(s) -> bool:
    """Whether a ScheduledRequest's next token is the argmax of its logits and nothing else."""
    req = s.request
    sp = req.sampling_params
    return (
        sp.temperature == 0.0
        and sp.logprobs is None
        and not sp.min_tokens
        and not sp.penalized
        and (req.parent is None or req.parent.forked)
    )


def sample_plain(sampler_: sampler.Sampler, logits: torch.Tensor, plain: list, res) -> None:
    """``sampler.sample_plain``'s contract; a batch of plain greedy rows, all usable, is one ``argmax``."""
    if all(map(plain_greedy, (s for _, _, s in plain))):
        rows = [r for r, _, _ in plain]
        picked = (logits if rows == list(range(len(logits))) else logits[rows]).numpy()
        if np.isfinite(picked.max(axis=1)).all():  # else: the reference says why a row fails
            # numpy's argmax, as torch's, picks the first of equal maxima; on a CPU batch it is the faster
            for (_, g, _), tok in zip(plain, picked.argmax(axis=1).tolist()):
                res.sampled[g] = [tok]
            return
    sampler.sample_plain(sampler_, logits, plain, res)
