"""Parallel sampling: ``n`` completions of one prompt, sharing the prompt's KV blocks.

``SamplingParams(n=k)`` asks for k samples of one prompt. The prompt's KV is the same for
all k, so it is computed once and stored once (Kwon et al. 2023, "Efficient Memory
Management for Large Language Model Serving with PagedAttention", section 4.4):

1. **One sequence runs the prompt.** The group enters the scheduler as its first sequence
   (completion 0). It is admitted only if ``max_num_seqs`` has room for all k sequences
   (``Request.num_seqs``) and the KV cache for the prompt plus one block per other sample
   (the block each will need at its first decode step).
2. **Fork.** When the prompt's last position is computed, its logits are sampled k times,
   completion i with its own random stream (``completion_seed(seed, i)``). The k - 1 new
   sequences are *forks*: they get the first sequence's block table, and every block's
   reference count goes up by k - 1. Nothing is copied.
3. **Copy-on-write.** A full block is never written again, so sharing it is free forever.
   The last block is partly filled: the first sample to decode would write its next token's
   KV into a block the others still read. So a sequence that must write into a block whose
   reference count is above 1 gets a fresh block first, and the block's contents are copied
   (``minillm_kernels.ops.copy_blocks``, before the forward); the shared block loses one reference. The
   last sequence still holding it (count 1) writes in place. At the first decode step the k
   samples hold the prompt's blocks once, plus at most one block each.

From then on each sequence is an ordinary request in the running set (counted once against
``max_num_seqs``), except that the group is preempted together, and a group preempted to
recompute comes back with the seats of all its members claimed at once (each member's
memory is checked as it is admitted: the whole group at its longest may not fit at once,
every member alone does). A recomputed member prefills its own prompt and output; with
prefix caching its full prompt blocks are shared again through the cache.
``LLMEngine.get_output`` gathers the k completions into one ``RequestOutput``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ..checks import MAX_SEED
from ..sampling_params import SamplingParams
from .request import Request, RequestStatus

# A large odd constant (2**64 / golden ratio): consecutive completions start random streams far apart.
_SEED_STRIDE = 0x9E3779B97F4A7C15


def completion_seed(seed, index: int):
    """Completion ``index``'s random seed, for a request seeded with ``seed``: ``seed`` itself for
    completion 0 (so ``n=1`` is unchanged), then ``seed + index * 0x9E3779B97F4A7C15`` mod 2**64.
    A request ``SamplingParams(seed=completion_seed(s, i), n=1)`` reproduces completion i."""
    if seed is None:
        return None
    return (seed + index * _SEED_STRIDE) % (MAX_SEED + 1)


def completion_id(request_id: str, index: int) -> str:
    """The id of completion ``index``'s sequence: ``"<request_id>#<index>"``."""
    return f"{request_id}#{index}"


def id_clash(request_id: str, n: int, requests, parents) -> Optional[str]:
    """Why a new request with ``n`` samples cannot be called ``request_id`` (None if it can): that id,
    or one its samples would get, is a request's or a sequence's (``requests``), a group's
    (``parents``: id -> ``ParentRequest``), or the id a group gives a sample at its fork."""

    def taken(seq_id: str) -> bool:
        if seq_id in requests or seq_id in parents:
            return True
        group, sep, index = seq_id.rpartition("#")
        parent = parents.get(group) if sep else None
        return (
            parent is not None
            and index.isdigit()
            and completion_id(group, int(index)) == seq_id
            and int(index) < parent.n
        )

    if taken(request_id):
        return "already used"
    for i in range(n if n > 1 else 0):
        if taken(completion_id(request_id, i)):
            return f"its sample {i} would be {completion_id(request_id, i)!r}, an id already used"
    return None


class ParentRequest:
    """The group of ``n`` sequences of one request (vLLM's ``ParentRequest``)."""

    def __init__(self, request_id: str, params: SamplingParams):
        self.request_id = request_id
        self.n = params.n
        # Completion i samples with its own seed and counts only itself (n=1).
        self.params = [dataclasses.replace(params, n=1, seed=completion_seed(params.seed, i)) for i in range(self.n)]
        self.members: list = []  # the sequences (Request), by completion index
        self.forked = False  # have the n - 1 other sequences been created?

    def fork(self) -> None:
        """The prompt is computed: the other n - 1 sequences are created (``Scheduler.fork``)."""
        self.forked = True

    def unfork(self) -> None:
        """The step that forked the group was rolled back: only the first sequence exists."""
        self.forked = False
        del self.members[1:]

    @property
    def finished(self) -> bool:
        return all(m.is_finished for m in self.members)

    def __repr__(self) -> str:
        return f"ParentRequest({self.request_id!r}, n={self.n}, forked={self.forked})"


def first_sequence(request_id: str, params: SamplingParams, **fields) -> Request:
    """The sequence a new request enters the scheduler as: the request itself for n = 1; for n > 1
    completion 0 of a new ``ParentRequest`` (its ``parent``), which forks the others once the prompt
    is computed. ``fields``: the rest of ``Request``'s fields."""
    if params.n == 1:
        return Request(request_id, sampling_params=params, **fields)
    parent = ParentRequest(request_id, params)
    req = Request(completion_id(request_id, 0), sampling_params=parent.params[0], parent=parent, **fields)
    parent.members.append(req)
    return req


def group_need(req: Request) -> tuple[int, int]:
    """(seats, extra blocks) admitting ``req`` must find room for. A parallel-sampling group
    that has not forked needs n seats, and keeps one block per other sample free (each may
    need one at its first decode step). The first waiting member of a forked group that was
    preempted together claims the seats of all its waiting members; their memory is
    checked one by one (the whole group may never fit at once, each member does)."""
    p = req.parent
    if p is None:
        return 1, 0
    if not p.forked:
        return p.n, p.n - 1
    return sum(1 for m in p.members if m.status is RequestStatus.PREEMPTED), 0
