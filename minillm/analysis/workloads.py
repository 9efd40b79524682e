"""Workloads: who arrives when, asking for how many tokens.

A trace is a list of ``TraceRequest``: an arrival time, a prompt (token ids or text) and
the number of tokens the request will generate. Scheduling only shows its character
under a workload: FCFS's head-of-line blocking needs a long prompt in front of short
ones, preemption needs more demand than KV capacity, fair queuing needs a tenant that
floods, prefix caching needs shared prefixes (system prompts and multi-turn
conversations). This module builds such traces, seeded and deterministic, saves and
loads them as JSONL, and submits them to an engine.

Arrival processes: ``poisson_arrivals`` (independent users, exponential gaps),
``gamma_arrivals`` (bursty: the same mean rate with coefficient of variation cv > 1),
``all_at_once`` (a batch of requests that arrive together).
Length distributions: ``Fixed``, ``Uniform``, ``LogNormal`` (chat traffic's long tail).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

__all__ = [
    "TraceRequest",
    "Fixed",
    "Uniform",
    "LogNormal",
    "Choice",
    "LengthDist",
    "poisson_arrivals",
    "gamma_arrivals",
    "all_at_once",
    "make_arrivals",
    "synthetic_trace",
    "shared_prefix_trace",
    "multi_turn_trace",
    "flood_trace",
    "merge_traces",
    "save_jsonl",
    "load_jsonl",
    "submit_trace",
]


@dataclass
class TraceRequest:
    """One request of a workload."""

    request_id: str
    arrival_time: float  # seconds from the start of the trace
    prompt_len: int  # prompt tokens
    output_len: int  # tokens it will generate (max_tokens, ignore_eos)
    prompt_token_ids: Optional[list[int]] = None
    prompt: Optional[str] = None
    priority: int = 0  # lower value = more urgent (vLLM's convention)
    tenant: Optional[str] = None  # who sent it (fair queuing)
    conversation_id: Optional[str] = None  # multi-turn: which conversation
    turn: Optional[int] = None  # multi-turn: 0, 1, 2, ...

    def __post_init__(self) -> None:
        if self.prompt_token_ids is not None:
            self.prompt_token_ids = [int(t) for t in self.prompt_token_ids]
            if len(self.prompt_token_ids) != self.prompt_len:
                raise ValueError(
                    f"TraceRequest {self.request_id!r}: prompt_len={self.prompt_len} "
                    f"but {len(self.prompt_token_ids)} prompt_token_ids"
                )
        if self.prompt_len < 0 or self.output_len < 1:
            raise ValueError(
                f"TraceRequest {self.request_id!r}: need prompt_len >= 0 and "
                f"output_len >= 1, got {self.prompt_len}, {self.output_len}"
            )


# =====================================================================================
# Length distributions
# =====================================================================================


class LengthDist:
    """A distribution of token counts: ``sample(n, rng) -> np.ndarray`` of ints >= 1."""

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        raise NotImplementedError

    @property
    def mean(self) -> float:
        raise NotImplementedError


@dataclass(frozen=True)
class Fixed(LengthDist):
    """Every request has ``n`` tokens."""

    n: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"Fixed(n={self.n!r}): must be >= 1")

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.full(n, self.n, dtype=np.int64)

    @property
    def mean(self) -> float:
        return float(self.n)


@dataclass(frozen=True)
class Uniform(LengthDist):
    """Integers uniform on [lo, hi], both ends included."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not 1 <= self.lo <= self.hi:
            raise ValueError(f"Uniform(lo={self.lo!r}, hi={self.hi!r}): need 1 <= lo <= hi")

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return rng.integers(self.lo, self.hi + 1, size=n, dtype=np.int64)

    @property
    def mean(self) -> float:
        return (self.lo + self.hi) / 2


@dataclass(frozen=True)
class LogNormal(LengthDist):
    """A long tail like chat traffic: log(length) ~ Normal(log(median), sigma), clipped to [lo, hi].

    sigma ~ 1 gives a p99 about 10x the median (exp(2.33 sigma)).
    """

    median: float
    sigma: float = 1.0
    lo: int = 1
    hi: Optional[int] = None

    def __post_init__(self) -> None:
        if self.median <= 0 or self.sigma < 0 or self.lo < 1 or (self.hi is not None and self.hi < self.lo):
            raise ValueError(
                f"LogNormal(median={self.median!r}, sigma={self.sigma!r}, lo={self.lo!r}, "
                f"hi={self.hi!r}): need median > 0, sigma >= 0, 1 <= lo <= hi"
            )

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        x = rng.lognormal(mean=math.log(self.median), sigma=self.sigma, size=n)
        x = np.rint(x)
        return np.clip(x, self.lo, self.hi if self.hi is not None else np.inf).astype(np.int64)

    @property
    def mean(self) -> float:
        """Of the unclipped distribution: median * exp(sigma^2 / 2)."""
        return self.median * math.exp(self.sigma**2 / 2)


@dataclass(frozen=True)
class Choice(LengthDist):
    """A few lengths with given probabilities, e.g. 8 x 100 tokens and 2 x 1000."""

    values: tuple
    probs: Optional[tuple] = None

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        p = None if self.probs is None else np.asarray(self.probs, dtype=float) / sum(self.probs)
        return rng.choice(np.asarray(self.values, dtype=np.int64), size=n, p=p)

    @property
    def mean(self) -> float:
        p = np.ones(len(self.values)) if self.probs is None else np.asarray(self.probs, dtype=float)
        return float(np.dot(self.values, p / p.sum()))


def _as_dist(x: Union[int, LengthDist, Sequence[int]], what: str) -> LengthDist:
    if isinstance(x, LengthDist):
        return x
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return Fixed(int(x))
    raise TypeError(f"{what}={x!r}: expected an int or a length distribution (Fixed, Uniform, LogNormal, Choice)")


# =====================================================================================
# Arrival processes
# =====================================================================================


def _rng(seed: int, stream: int) -> np.random.Generator:
    """Independent streams per component, so changing the lengths keeps the arrivals."""
    return np.random.default_rng([int(seed), int(stream)])


def poisson_arrivals(n: int, rate: float, seed: int = 0, start: float = 0.0) -> np.ndarray:
    """Arrival times of a Poisson process at ``rate`` requests/s: exponential gaps of mean 1/rate.

    The first request arrives at ``start`` (as a benchmark client sends its first at once).
    """
    return gamma_arrivals(n, rate, cv=1.0, seed=seed, start=start)


def gamma_arrivals(n: int, rate: float, cv: float = 2.0, seed: int = 0, start: float = 0.0) -> np.ndarray:
    """Bursty arrivals: gamma-distributed gaps with mean 1/rate and coefficient of variation cv.

    cv = 1 is Poisson; cv > 1 bunches requests into bursts separated by lulls (shape
    1/cv^2 < 1). vLLM's benchmark calls 1/cv^2 the "burstiness".
    """
    if n < 0:
        raise ValueError(f"n={n!r}: must be >= 0")
    if not rate > 0 or not cv > 0:
        raise ValueError(f"rate={rate!r} and cv={cv!r}: must be > 0")
    if n == 0:
        return np.zeros(0)
    shape = 1.0 / cv**2
    gaps = np.random.default_rng([int(seed), 0]).gamma(shape, 1.0 / (rate * shape), size=n - 1)
    return start + np.concatenate([[0.0], np.cumsum(gaps)])


def all_at_once(n: int, t: float = 0.0) -> np.ndarray:
    """Everyone arrives at time ``t``: a batch of requests arriving together."""
    return np.full(n, float(t))


def make_arrivals(
    n: int, rate: Optional[float] = None, arrival: str = "poisson", cv: float = 2.0, seed: int = 0, start: float = 0.0
) -> np.ndarray:
    """Dispatch on ``arrival``; ``rate=None`` (or infinite) means all at once."""
    if arrival in ("all-at-once", "all_at_once") or rate is None or math.isinf(rate):
        return all_at_once(n, start)
    if arrival == "poisson":
        return poisson_arrivals(n, rate, seed, start)
    if arrival == "gamma":
        return gamma_arrivals(n, rate, cv, seed, start)
    raise ValueError(f"arrival={arrival!r}: choose 'poisson', 'gamma' or 'all-at-once'")


# =====================================================================================
# Traces
# =====================================================================================


def _random_tokens(rng: np.random.Generator, n: int, vocab_size: int, token_low: int) -> list[int]:
    if not 0 <= token_low < vocab_size:
        raise ValueError(f"token_low={token_low!r} must be in [0, vocab_size={vocab_size!r})")
    return rng.integers(token_low, vocab_size, size=int(n)).tolist()


def _sample_mix(mix: Optional[Mapping], n: int, rng: np.random.Generator, default: Any) -> list:
    if not mix:
        return [default] * n
    keys = list(mix)
    p = np.asarray([mix[k] for k in keys], dtype=float)
    if (p < 0).any() or p.sum() <= 0:
        raise ValueError(f"mix {dict(mix)!r}: weights must be >= 0 and not all 0")
    idx = rng.choice(len(keys), size=n, p=p / p.sum())
    return [keys[i] for i in idx]


def synthetic_trace(
    n: int,
    rate: Optional[float] = None,
    arrival: str = "poisson",
    cv: float = 2.0,
    prompt_len: Union[int, LengthDist] = 128,
    output_len: Union[int, LengthDist] = 128,
    vocab_size: Optional[int] = None,
    priority_mix: Optional[Mapping[int, float]] = None,
    tenant_mix: Optional[Mapping[str, float]] = None,
    seed: int = 0,
    *,
    token_low: int = 10,
    start: float = 0.0,
    id_prefix: str = "r",
) -> list[TraceRequest]:
    """``n`` independent requests.

    ``rate=None`` (or ``arrival="all-at-once"``) puts every arrival at ``start``.
    With ``vocab_size``, prompts are random token ids in [token_low, vocab_size) (low ids
    are often special tokens); without it the trace carries lengths only.
    ``priority_mix={0: 0.2, 1: 0.8}`` / ``tenant_mix={"a": 0.9, "b": 0.1}`` draw each
    request's class from the given weights.
    """
    arrivals = make_arrivals(n, rate, arrival, cv, seed, start)
    plens = _as_dist(prompt_len, "prompt_len").sample(n, _rng(seed, 1))
    olens = _as_dist(output_len, "output_len").sample(n, _rng(seed, 2))
    prios = _sample_mix(priority_mix, n, _rng(seed, 3), 0)
    tenants = _sample_mix(tenant_mix, n, _rng(seed, 4), None)
    tok_rng = _rng(seed, 5)
    out = []
    for i in range(n):
        ids = None if vocab_size is None else _random_tokens(tok_rng, plens[i], vocab_size, token_low)
        out.append(
            TraceRequest(
                request_id=f"{id_prefix}{i}",
                arrival_time=float(arrivals[i]),
                prompt_len=int(plens[i]),
                output_len=int(olens[i]),
                prompt_token_ids=ids,
                priority=int(prios[i]),
                tenant=tenants[i],
            )
        )
    return out


def shared_prefix_trace(
    n: int,
    prefix_len: int,
    suffix_len: Union[int, LengthDist],
    output_len: Union[int, LengthDist],
    vocab_size: int,
    rate: Optional[float] = None,
    num_prefixes: int = 1,
    seed: int = 0,
    *,
    arrival: str = "poisson",
    token_low: int = 10,
    id_prefix: str = "r",
) -> list[TraceRequest]:
    """Requests that share a system prompt: ``prefix_len`` identical token ids, then a unique suffix.

    With ``num_prefixes > 1``, request i uses prefix ``i % num_prefixes`` (several
    applications, each with its own system prompt). The prefix cache should serve every
    full block of the prefix after its first request.
    """
    if num_prefixes < 1 or prefix_len < 0:
        raise ValueError(f"num_prefixes={num_prefixes!r} must be >= 1 and prefix_len={prefix_len!r} >= 0")
    arrivals = make_arrivals(n, rate, arrival, seed=seed)
    prefix_rng = _rng(seed, 6)
    prefixes = [_random_tokens(prefix_rng, prefix_len, vocab_size, token_low) for _ in range(num_prefixes)]
    slens = _as_dist(suffix_len, "suffix_len").sample(n, _rng(seed, 1))
    olens = _as_dist(output_len, "output_len").sample(n, _rng(seed, 2))
    tok_rng = _rng(seed, 5)
    out = []
    for i in range(n):
        ids = prefixes[i % num_prefixes] + _random_tokens(tok_rng, slens[i], vocab_size, token_low)
        out.append(
            TraceRequest(
                request_id=f"{id_prefix}{i}",
                arrival_time=float(arrivals[i]),
                prompt_len=len(ids),
                output_len=int(olens[i]),
                prompt_token_ids=ids,
            )
        )
    return out


def multi_turn_trace(
    num_conversations: int,
    turns: int,
    system_len: int,
    user_len: Union[int, LengthDist],
    answer_len: Union[int, LengthDist],
    vocab_size: int,
    think_time: float = 1.0,
    seed: int = 0,
    *,
    rate: Optional[float] = None,
    shared_system: bool = True,
    token_low: int = 10,
) -> list[TraceRequest]:
    """Conversations: turn k's prompt = turn k-1's prompt + a scripted answer + a new user message.

    Turn 0 is system prompt + user message. The scripted answer (``answer_len`` tokens,
    also the turn's ``output_len``) stands in for what the assistant said; the engine
    generates its own tokens, so across turns the prefix cache can reuse the previous
    *prompt* (prefill O(n_total) -> O(n_new)), not the previous generated output.
    Turn k of a conversation starting at s arrives at s + k * think_time (a trace cannot
    know when the previous answer finished). Conversations start together, or as a
    Poisson process at ``rate`` conversations/s. ``shared_system``: one system prompt for
    all conversations (else one each). Sorted by arrival time.
    """
    if turns < 1 or num_conversations < 0 or think_time < 0:
        raise ValueError(
            f"need turns >= 1, num_conversations >= 0, think_time >= 0; got "
            f"{turns!r}, {num_conversations!r}, {think_time!r}"
        )
    starts = make_arrivals(num_conversations, rate, "poisson", seed=seed)
    udist, adist = _as_dist(user_len, "user_len"), _as_dist(answer_len, "answer_len")
    len_rng, tok_rng = _rng(seed, 1), _rng(seed, 5)
    system_rng = _rng(seed, 6)
    shared = _random_tokens(system_rng, system_len, vocab_size, token_low) if shared_system else None
    out = []
    for c in range(num_conversations):
        history = list(shared) if shared_system else _random_tokens(system_rng, system_len, vocab_size, token_low)
        ulens, alens = udist.sample(turns, len_rng), adist.sample(turns, len_rng)
        for k in range(turns):
            if k > 0:  # the previous turn's answer, scripted, becomes context
                history = history + _random_tokens(tok_rng, alens[k - 1], vocab_size, token_low)
            history = history + _random_tokens(tok_rng, ulens[k], vocab_size, token_low)
            out.append(
                TraceRequest(
                    request_id=f"c{c}t{k}",
                    arrival_time=float(starts[c] + k * think_time),
                    prompt_len=len(history),
                    output_len=int(alens[k]),
                    prompt_token_ids=list(history),
                    conversation_id=f"c{c}",
                    turn=k,
                )
            )
    out.sort(key=lambda r: r.arrival_time)  # stable: ties keep conversation order
    return out


def merge_traces(*traces: Sequence[TraceRequest]) -> list[TraceRequest]:
    """One trace from several, by arrival time (stable); request ids must be unique."""
    merged = sorted((r for t in traces for r in t), key=lambda r: r.arrival_time)
    ids = [r.request_id for r in merged]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"merge_traces: duplicate request ids {dup[:5]}; give each trace an id_prefix")
    return merged


def flood_trace(
    flood_tenant: str = "flood",
    num_flood: int = 64,
    polite_tenants: Sequence[str] = ("a", "b"),
    num_polite: int = 8,
    polite_rate: float = 2.0,
    flood_rate: Optional[float] = None,
    prompt_len: Union[int, LengthDist] = 64,
    output_len: Union[int, LengthDist] = 64,
    vocab_size: Optional[int] = None,
    seed: int = 0,
    *,
    flood_priority: int = 0,
    polite_priority: int = 0,
) -> list[TraceRequest]:
    """One tenant floods, the others send politely: the fair-queuing workload.

    ``flood_tenant`` sends ``num_flood`` requests at t=0 (or at ``flood_rate``/s); each
    polite tenant sends ``num_polite`` at ``polite_rate``/s (Poisson). Under FCFS the
    polite tenants wait behind the whole flood; fair queuing gives each tenant a share.
    Ids are ``"<tenant>-<i>"``.
    """
    parts = [
        synthetic_trace(
            num_flood,
            rate=flood_rate,
            prompt_len=prompt_len,
            output_len=output_len,
            vocab_size=vocab_size,
            seed=seed,
            id_prefix=f"{flood_tenant}-",
        )
    ]
    for r in parts[0]:
        r.tenant, r.priority = flood_tenant, flood_priority
    for j, t in enumerate(polite_tenants):
        tr = synthetic_trace(
            num_polite,
            rate=polite_rate,
            prompt_len=prompt_len,
            output_len=output_len,
            vocab_size=vocab_size,
            seed=seed * 1000 + j + 1,
            id_prefix=f"{t}-",
        )
        for r in tr:
            r.tenant, r.priority = t, polite_priority
        parts.append(tr)
    return merge_traces(*parts)


# =====================================================================================
# JSONL and the engine
# =====================================================================================


def _to_json(r: TraceRequest) -> dict:
    d: dict[str, Any] = {"request_id": r.request_id, "arrival_time": r.arrival_time}
    # What vLLM's benchmark tooling reads: "prompt" (text) when there is one, else token ids.
    if r.prompt is not None:
        d["prompt"] = r.prompt
    if r.prompt_token_ids is not None:
        d["prompt_token_ids"] = r.prompt_token_ids
    d.update(prompt_len=r.prompt_len, output_len=r.output_len, priority=r.priority, tenant=r.tenant)
    if r.conversation_id is not None or r.turn is not None:
        d.update(conversation_id=r.conversation_id, turn=r.turn)
    return d


def save_jsonl(trace: Sequence[TraceRequest], path: Union[str, Path]) -> None:
    """One JSON object per line: ``request_id, arrival_time, prompt | prompt_token_ids,
    prompt_len, output_len, priority, tenant`` (+ ``conversation_id, turn``)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in trace:
            f.write(json.dumps(_to_json(r), ensure_ascii=False) + "\n")


def load_jsonl(path: Union[str, Path]) -> list[TraceRequest]:
    """Read ``save_jsonl``'s format back (also lines with only ``prompt`` + ``output_len``)."""
    names = {f.name for f in fields(TraceRequest)}
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            d = json.loads(line)
            d.setdefault("request_id", f"r{i}")
            d.setdefault("arrival_time", 0.0)
            if "prompt_len" not in d:
                if d.get("prompt_token_ids") is not None:
                    d["prompt_len"] = len(d["prompt_token_ids"])
                elif d.get("prompt") is not None:
                    d["prompt_len"] = 0  # text only (vLLM's datasets): its token count is the server's
                else:
                    raise ValueError(f"{path}:{i + 1}: no prompt_len and no prompt_token_ids")
            if "output_len" not in d and "output_tokens" in d:
                d["output_len"] = d.pop("output_tokens")
            out.append(TraceRequest(**{k: v for k, v in d.items() if k in names}))
    return out


def submit_trace(
    engine: Any, trace: Sequence[TraceRequest], *, vocab_size: Optional[int] = None, seed: int = 0, token_low: int = 10
) -> list[str]:
    """Add every request of ``trace`` to ``engine`` (greedy, exactly ``output_len`` tokens).

    Calls ``engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=output_len,
    ignore_eos=True), request_id=, arrival_time=, priority=, tenant=, expected_output_len=)``
    where ``prompt`` is the token ids, else the text. A length-only trace needs ``vocab_size``
    to draw random ids. Returns the request ids in trace order.
    """
    from ..sampling_params import SamplingParams

    rng = _rng(seed, 7)
    ids = []
    params: dict[int, SamplingParams] = {}  # one per output length (the engine copies each request's own)
    for r in trace:
        if r.prompt_token_ids is not None:
            prompt: Union[list[int], str] = list(r.prompt_token_ids)
        elif r.prompt is not None:
            prompt = r.prompt
        elif vocab_size is not None:
            prompt = _random_tokens(rng, r.prompt_len, vocab_size, token_low)
        else:
            raise ValueError(
                f"trace request {r.request_id!r} has neither prompt_token_ids nor prompt; "
                f"build the trace with vocab_size=... or pass submit_trace(..., vocab_size=...)"
            )
        sp = params.get(r.output_len)
        if sp is None:
            sp = params[r.output_len] = SamplingParams(temperature=0.0, max_tokens=int(r.output_len), ignore_eos=True)
        engine.add_request(
            prompt,
            sp,
            request_id=r.request_id,
            arrival_time=r.arrival_time,
            priority=r.priority,
            tenant=r.tenant,
            expected_output_len=r.output_len,
        )
        ids.append(r.request_id)
    return ids
