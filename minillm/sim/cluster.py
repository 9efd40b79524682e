"""Beyond one model copy: data-parallel replicas behind a router, and disaggregated prefill/decode.

Every instance here is a simulated ``LLMEngine`` (``executor="simulated"``, ``clock="modeled"``) running
the engine's own scheduler; this module only decides which instance a request goes to, and when.

**Replicas and a router.** ``run_replicas(trace, router, num_replicas)`` replays a trace on N
replicas. At each arrival every replica is first advanced to that moment on its own modeled clock,
then the router picks one from the request and each replica's outstanding load (``Load``):

* ``RoundRobinRouter``: replica i, i+1, ... in turn; blind to load and to content.
* ``LeastOutstandingTokensRouter``: the replica with the fewest tokens still to compute
  (prompt tokens not yet prefilled + output tokens not yet generated).
* ``PrefixAwareRouter``: consistent hashing on the prompt's first KV blocks, so requests that share
  a prefix meet the replica whose prefix cache holds it, with a load bound ("consistent hashing
  with bounded loads", Mirrokni, Thorup and Zadimoghaddam, SODA 2018): a replica whose load exceeds
  ``load_factor`` x the mean is passed over for the next one on the ring.

**Disaggregated prefill/decode.** ``run_disaggregated(trace, num_prefill, num_decode)``: a prefill
pool whose requests get ``max_tokens=1``; when one finishes, its KV (``prompt_len x M_KV`` bytes)
crosses a link (``costmodel.LINKS``) and the request joins a decode pool instance's queue at
``finish + kv_transfer_time``. ``run_colocated`` is the baseline: the same number of instances,
each doing both phases with chunked prefill. The comparison follows DistServe (Zhong et al.,
OSDI 2024) and Splitwise (Patel et al., ISCA 2024). Where this model differs from DistServe:

* the decode pool re-admits the request through the ordinary scheduler: its prompt (and the first
  token) are granted as one step whose cost is priced like a decode step of that context (reading
  the arrived KV), not as a prefill (``KVArrivedCostModel``); a preemption in the decode pool
  therefore recomputes for the price of a decode step (DistServe would transfer again);
* the KV transfer is one copy over one link at ``bandwidth`` plus ``latency``, never contended,
  and does not overlap the prefill (DistServe pipelines it layer by layer);
* each pool's instances have the same tensor-parallel size and GPU; DistServe also searches
  per-phase parallelism and placement, which is where much of its published gain comes from.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import itertools
import math
import time
from typing import Any, NamedTuple, Optional, Sequence, Union

from .costmodel import CostModel, LinkSpec, get_link

__all__ = [
    "Load",
    "Router",
    "RoundRobinRouter",
    "LeastOutstandingTokensRouter",
    "PrefixAwareRouter",
    "ROUTERS",
    "make_router",
    "stable_hash",
    "prefix_key",
    "ring_points",
    "route_on_ring",
    "kv_transfer_time",
    "KVArrivedCostModel",
    "Instance",
    "run_replicas",
    "run_colocated",
    "run_disaggregated",
]


# =====================================================================================
# Routers
# =====================================================================================


class Load(NamedTuple):
    """What a router sees of one replica: requests it holds and tokens it still has to compute."""

    requests: int
    tokens: int


class Router:
    """Picks a replica for each request: ``route(prompt_token_ids, loads) -> index`` (0..N-1)."""

    name = "router"

    def route(self, prompt_token_ids: Sequence[int], loads: Sequence[Load]) -> int:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class RoundRobinRouter(Router):
    """Replica 0, 1, ..., N-1, 0, ...: spreads requests evenly by count, blind to everything else."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def route(self, prompt_token_ids, loads):
        i = self._next % len(loads)
        self._next = i + 1
        return i


class LeastOutstandingTokensRouter(Router):
    """The replica with the fewest outstanding tokens (ties: the lowest index)."""

    name = "least-tokens"

    def route(self, prompt_token_ids, loads):
        return min(range(len(loads)), key=lambda i: (loads[i].tokens, i))


def stable_hash(data: Union[str, Sequence[int]]) -> int:
    """A 64-bit hash that is the same in every process (Python's ``hash`` of a str is not):
    blake2b of the text, or of a token list written as ``repr(list(tokens))``."""
    text = data if isinstance(data, str) else repr([int(t) for t in data])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def prefix_key(prompt_token_ids: Sequence[int], block_size: int = 16, prefix_blocks: int = 4) -> int:
    """The ring position of a prompt: ``stable_hash`` of its first ``prefix_blocks`` full KV blocks
    (fewer if the prompt has fewer; the whole prompt if it has no full block). Two prompts that
    share those blocks share the key, so they go where those blocks are cached."""
    full = min(prefix_blocks, len(prompt_token_ids) // block_size)
    head = prompt_token_ids[: full * block_size] if full else prompt_token_ids
    return stable_hash(head)


def ring_points(num_replicas: int, virtual_nodes: int = 64) -> list[tuple[int, int]]:
    """The hash ring: ``virtual_nodes`` points per replica, ``(stable_hash("replica-i-vnode-v"), i)``,
    sorted. More virtual nodes spread the key space more evenly among replicas."""
    return sorted((stable_hash(f"replica-{i}-vnode-{v}"), i) for i in range(num_replicas) for v in range(virtual_nodes))


def route_on_ring(key: int, ring: Sequence[tuple[int, int]], loads: Sequence[float], load_factor: float = 1.25) -> int:
    """Consistent hashing with bounded loads: walk the ring clockwise from the first point at or
    after ``key`` (wrapping past the end), and take the first replica whose load is at most
    ``load_factor`` x the mean load. One replica is always at most the mean, so this ends."""
    bound = math.inf if load_factor == math.inf else load_factor * sum(loads) / len(loads)
    start = bisect.bisect_left(ring, (key, -1))
    seen = set()
    for j in range(len(ring)):
        replica = ring[(start + j) % len(ring)][1]
        if replica in seen:
            continue
        seen.add(replica)
        if loads[replica] <= bound:
            return replica
    return min(range(len(loads)), key=lambda i: (loads[i], i))  # unreachable for load_factor >= 1


class PrefixAwareRouter(Router):
    """Consistent hashing on the prompt's first ``prefix_blocks`` KV blocks, bounded at
    ``load_factor`` x the mean outstanding tokens. ``load_factor=math.inf`` is plain consistent
    hashing (best cache affinity, no protection against a hot prefix)."""

    name = "prefix-aware"

    def __init__(
        self, block_size: int = 16, prefix_blocks: int = 4, load_factor: float = 1.25, virtual_nodes: int = 64
    ):
        if load_factor < 1:
            raise ValueError(f"PrefixAwareRouter.load_factor={load_factor!r}: must be >= 1")
        self.block_size, self.prefix_blocks = block_size, prefix_blocks
        self.load_factor, self.virtual_nodes = load_factor, virtual_nodes
        self._ring: Optional[list] = None

    def route(self, prompt_token_ids, loads):
        if self._ring is None or len({i for _, i in self._ring}) != len(loads):
            self._ring = ring_points(len(loads), self.virtual_nodes)
        key = prefix_key(prompt_token_ids, self.block_size, self.prefix_blocks)
        return route_on_ring(key, self._ring, [ld.tokens for ld in loads], self.load_factor)


ROUTERS = {
    "round-robin": RoundRobinRouter,
    "least-tokens": LeastOutstandingTokensRouter,
    "prefix-aware": PrefixAwareRouter,
}


def make_router(router: Union[str, Router], **kwargs) -> Router:
    """A ``Router`` from itself or a name in ``ROUTERS`` (keywords go to its constructor)."""
    if isinstance(router, Router) or callable(getattr(router, "route", None)):
        return router
    if router not in ROUTERS:
        raise ValueError(f"router={router!r}: choose one of {sorted(ROUTERS)} or pass a Router")
    return ROUTERS[router](**kwargs)


# =====================================================================================
# KV transfer and the decode pool's cost model
# =====================================================================================


def kv_transfer_time(num_tokens: int, kv_bytes_per_token: int, link: Union[str, LinkSpec]) -> float:
    """Seconds to move ``num_tokens`` positions of KV from a prefill to a decode instance:
    ``latency + num_tokens x M_KV / bandwidth`` (one point-to-point copy, not an all-reduce)."""
    lk = get_link(link)
    return lk.latency + num_tokens * kv_bytes_per_token / lk.bandwidth


class KVArrivedCostModel(CostModel):
    """A decode instance's cost model: its requests arrive with their KV, so the step that admits
    one (the scheduler grants its whole prompt) is priced as one decode token over that context
    (the KV read), not as a prefill. Everything else is the wrapped model's."""

    def __init__(self, inner: CostModel):
        self.inner = inner
        self.name = f"kv-arrived({inner.name})"
        self.kv_bytes_per_token = inner.kv_bytes_per_token

    def step_time(self, num_new_tokens, context_lens):
        return self.inner.step_time([min(q, 1) for q in num_new_tokens], context_lens)

    def swap_time(self, num_bytes):
        return self.inner.swap_time(num_bytes)

    def schedule_time(self, num_running, num_waiting):
        return self.inner.schedule_time(num_running, num_waiting)

    def __getattr__(self, name):  # kv_capacity_tokens, hardware, model, ...
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


# =====================================================================================
# Instances and the event loop
# =====================================================================================


class Instance:
    """One simulated engine (one model copy on ``num_gpus`` tensor-parallel GPUs) and its
    outstanding load, kept up to date as its steps finish requests."""

    def __init__(self, engine, name: str):
        self.engine = engine
        self.name = name
        self.outstanding: dict[str, int] = {}  # request id -> tokens it brought
        self.tokens = 0
        self.num_routed = 0

    def load(self) -> Load:
        """Outstanding requests and tokens (prompt + output of every unfinished request: a
        request's progress inside the engine is not subtracted, which keeps this O(1))."""
        return Load(len(self.outstanding), self.tokens)

    def add(self, prompt_token_ids, max_tokens: int, request_id: str, arrival_time: float) -> None:
        from ..sampling_params import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=int(max_tokens), ignore_eos=True)
        self.engine.add_request(
            list(prompt_token_ids),
            sp,
            request_id=request_id,
            arrival_time=arrival_time,
            expected_output_len=int(max_tokens),
        )
        n = len(prompt_token_ids) + int(max_tokens)
        self.outstanding[request_id] = n
        self.tokens += n
        self.num_routed += 1

    def ready_time(self) -> float:
        """When this instance's next step would start (inf if it has nothing to do)."""
        s = self.engine.scheduler
        if s.waiting or s.running or s.swapped or s.held:
            return self.engine.clock.now()
        t = s.next_arrival()
        return math.inf if t is None else max(t, self.engine.clock.now())

    def step(self) -> list[str]:
        rec = self.engine.step()
        for rid in rec.finished:
            self.tokens -= self.outstanding.pop(rid, 0)
        return rec.finished


def _cost_model(model, hardware, num_gpus, link):
    from .costmodel import MODELS, RooflineCostModel
    from .simulated import gpus_needed, tensor_parallel

    num_gpus = num_gpus or gpus_needed(hardware, model)
    return RooflineCostModel(tensor_parallel(hardware, num_gpus, link), MODELS[model]), num_gpus


def _make_instances(n: int, cost_model, model: str, longest: int, name: str, **config) -> list[Instance]:
    from ..config import EngineConfig
    from ..engine import LLMEngine

    config.setdefault("max_num_seqs", 256)
    config.setdefault("max_num_batched_tokens", 8192)
    config.setdefault("max_model_len", max(2048, longest + 2))
    config.setdefault("record", "none")
    config.setdefault("record_history", 0)
    config.setdefault("record_max_waiting", 0)
    config.update(executor="simulated", clock="modeled", cost_model=cost_model)
    return [Instance(LLMEngine(model, EngineConfig.from_fields("cluster", **config)), f"{name}{i}") for i in range(n)]


def _advance(instances: Sequence[Instance], until, on_finish=None) -> None:
    """Step the instance whose next step starts first, until every next step starts at or after
    ``until`` (a time, ``math.inf`` for "until all are done", or a function returning one, read
    before each step). ``on_finish(instance, ids)`` sees each step's finished requests."""
    bound = until if callable(until) else (lambda: until)
    while True:
        ready = min(instances, key=Instance.ready_time)
        if ready.ready_time() >= bound():
            return
        done = ready.step()
        if done and on_finish is not None:
            on_finish(ready, done)


def _summary(metrics: dict, instances: Sequence[Instance], slo_ttft, slo_tpot) -> dict:
    from ..analysis.metrics import summarize

    hit = queried = 0
    for inst in instances:
        st = inst.engine.kv.stats()
        hit += st.get("hit_blocks", 0)
        queried += st.get("queried_blocks", 0)
    stats = {"hit_blocks": hit, "queried_blocks": queried, "hit_rate": hit / queried if queried else 0.0}
    s = summarize(metrics, None, slo_ttft=slo_ttft, slo_tpot=slo_tpot, prefix_cache_stats=stats)
    s["requests_per_instance"] = [inst.num_routed for inst in instances]
    s["steps"] = sum(inst.engine.step_count for inst in instances)
    s["preemptions"] = sum(
        n for inst in instances for k, n in inst.engine.stats().items() if k.startswith("preemptions_")
    )
    return s


def run_replicas(
    trace: Sequence,
    router: Union[str, Router] = "round-robin",
    num_replicas: int = 4,
    *,
    model: str = "llama-2-7b",
    hardware: Any = "H100-SXM",
    num_gpus: Optional[int] = None,
    link: Any = None,
    slo_ttft: Optional[float] = None,
    slo_tpot: Optional[float] = None,
    enable_prefix_caching: bool = True,
    keep_metrics: bool = False,
    **config,
) -> tuple[list[Instance], dict]:
    """Replay ``trace`` (``workloads.TraceRequest`` with ``prompt_token_ids``) on ``num_replicas``
    data-parallel replicas, each ``num_gpus`` GPUs (default ``gpus_needed``) of ``hardware``
    joined over ``link`` (None: ideal TP), behind ``router``. Returns ``(instances, summary)``:
    ``metrics.summarize`` over all requests, ``prefix_cache_hit_rate`` over every replica's
    lookups, ``requests_per_instance``, ``wall_time``, and with ``keep_metrics`` every request's
    ``RequestMetrics`` (``summary["metrics"]``, for ``metrics.summarize`` under other SLOs).
    Other keywords are ``EngineConfig`` fields."""
    t0 = time.perf_counter()
    trace = sorted(trace, key=lambda r: r.arrival_time)
    router = make_router(router)
    cm, num_gpus = _cost_model(model, hardware, num_gpus, link)
    longest = max((r.prompt_len + r.output_len for r in trace), default=0)
    insts = _make_instances(
        num_replicas, cm, model, longest, "replica", enable_prefix_caching=enable_prefix_caching, **config
    )
    for r in trace:
        _advance(insts, r.arrival_time)
        i = router.route(r.prompt_token_ids, [inst.load() for inst in insts])
        insts[i].add(r.prompt_token_ids, r.output_len, r.request_id, r.arrival_time)
    _advance(insts, math.inf)
    metrics = {rid: req.metrics for inst in insts for rid, req in inst.engine.requests.items()}
    s = _summary(metrics, insts, slo_ttft, slo_tpot)
    s.update(
        router=router.name, num_replicas=num_replicas, gpus_per_replica=num_gpus, wall_time=time.perf_counter() - t0
    )
    if keep_metrics:
        s["metrics"] = metrics
    return insts, s


def run_colocated(
    trace: Sequence, num_instances: int, *, router: Union[str, Router] = "least-tokens", **kwargs
) -> tuple[list[Instance], dict]:
    """The disaggregation baseline: ``num_instances`` instances each doing prefill and decode with
    chunked prefill (the engine's default), behind ``router``; no prefix caching."""
    kwargs.setdefault("enable_prefix_caching", False)
    return run_replicas(trace, router, num_instances, **kwargs)


def run_disaggregated(
    trace: Sequence,
    num_prefill: int,
    num_decode: int,
    *,
    model: str = "llama-2-7b",
    hardware: Any = "H100-SXM",
    num_gpus: Optional[int] = None,
    link: Any = None,
    kv_link: Any = "InfiniBand",
    slo_ttft: Optional[float] = None,
    slo_tpot: Optional[float] = None,
    prefill_config: Optional[dict] = None,
    decode_config: Optional[dict] = None,
    keep_metrics: bool = False,
) -> tuple[list[Instance], list[Instance], dict]:
    """Replay ``trace`` on ``num_prefill`` prefill instances and ``num_decode`` decode instances
    (each ``num_gpus`` GPUs joined over ``link``); the KV of each prefilled prompt crosses
    ``kv_link`` to the decode instance with the fewest outstanding tokens. Both pools route by
    least outstanding tokens. Returns ``(prefill, decode, summary)``; a request's metrics join its
    two halves: TTFT ends at the prefill pool's token, TPOT spans the transfer and the decode pool
    (``keep_metrics``: the joined ``RequestMetrics`` in ``summary["metrics"]``).
    """
    from ..core.request import RequestMetrics

    t0 = time.perf_counter()
    trace = sorted(trace, key=lambda r: r.arrival_time)
    cm, num_gpus = _cost_model(model, hardware, num_gpus, link)
    longest = max((r.prompt_len + r.output_len for r in trace), default=0)
    pre = _make_instances(num_prefill, cm, model, longest, "prefill", **dict(prefill_config or {}))
    dcfg = dict(decode_config or {})
    dcfg.setdefault("max_num_batched_tokens", max(65536, longest + 2))
    dec = _make_instances(num_decode, KVArrivedCostModel(cm), model, longest, "decode", **dcfg)
    lk = get_link(kv_link)
    by_id = {r.request_id: r for r in trace}
    handoffs: list = []  # (time the KV lands, seq, request id, prefill instance)
    seq = itertools.count()

    def on_prefilled(inst, ids):
        if not inst.name.startswith("prefill"):
            return  # a decode instance finished these: they are done
        for rid in ids:
            r = by_id[rid]
            if r.output_len > 1:
                t = inst.engine.requests[rid].metrics.finish_time
                heapq.heappush(
                    handoffs, (t + kv_transfer_time(r.prompt_len, cm.kv_bytes_per_token, lk), next(seq), rid)
                )

    lot = LeastOutstandingTokensRouter()
    arrivals = iter(trace)
    nxt = next(arrivals, None)
    everyone = pre + dec
    while True:
        t_arr = nxt.arrival_time if nxt is not None else math.inf
        t_kv = handoffs[0][0] if handoffs else math.inf
        t = min(t_arr, t_kv)
        _advance(everyone, lambda: min(t, handoffs[0][0]) if handoffs else t, on_prefilled)
        if handoffs and handoffs[0][0] < t:  # a prefill finished while advancing
            continue
        if t == math.inf:
            break
        if t_kv <= t_arr:
            t, _, rid = heapq.heappop(handoffs)
            r = by_id[rid]
            i = lot.route(r.prompt_token_ids, [d.load() for d in dec])
            dec[i].add(list(r.prompt_token_ids) + [0], r.output_len - 1, rid, t)
        else:
            i = lot.route(nxt.prompt_token_ids, [p.load() for p in pre])
            pre[i].add(nxt.prompt_token_ids, 1, nxt.request_id, nxt.arrival_time)
            nxt = next(arrivals, None)
    assert not handoffs, "a handoff was left behind"

    metrics = {}
    pm = {rid: req.metrics for p in pre for rid, req in p.engine.requests.items()}
    dm = {rid: req.metrics for d in dec for rid, req in d.engine.requests.items()}
    for r in trace:
        a, b = pm[r.request_id], dm.get(r.request_id)
        token_times = list(a.token_times) + (list(b.token_times) if b else [])
        metrics[r.request_id] = RequestMetrics(
            arrival_time=a.arrival_time,
            first_scheduled_time=a.first_scheduled_time,
            first_token_time=a.first_token_time,
            num_prompt_tokens=a.num_prompt_tokens,
            num_cached_tokens=a.num_cached_tokens,
            clock="modeled",
            token_times=token_times,
            num_output_tokens=len(token_times),
            finish_time=b.finish_time if b else a.finish_time,
            finish_reason=b.finish_reason if b else a.finish_reason,
            num_preemptions=a.num_preemptions + (b.num_preemptions if b else 0),
        )
    s = _summary(metrics, pre, slo_ttft, slo_tpot)
    s["requests_per_instance"] = [p.num_routed for p in pre] + [d.num_routed for d in dec]
    s["steps"] = sum(x.engine.step_count for x in everyone)
    s.update(
        num_prefill=num_prefill,
        num_decode=num_decode,
        gpus_per_instance=num_gpus,
        kv_link=lk.name,
        wall_time=time.perf_counter() - t0,
    )
    if keep_metrics:
        s["metrics"] = metrics
    return pre, dec, s
