"""A randomized differential run of the engine: random configurations, workloads, aborts and
injected faults, with the invariants checked after every step and every finished request's
tokens compared with the same request run without contention. Most requests are greedy; some
are parallel-sampling groups (``SamplingParams.n`` > 1, sampled with a seed), and each of a
group's samples must equal the request run alone with that sample's seed (``completion_seed``).

``fuzz_run(seed)`` makes one run and returns its counts; ``tests/test_fuzz.py`` runs a bounded
number under hypothesis, and ``make fuzz`` (``scripts/fuzz.py``) a long campaign.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from minillm import LLM, SamplingParams
from minillm.core.invariants import check_all_free, check_invariants
from minillm.core.parallel_sampling import completion_seed
from minillm.core.policies import make_policy

MODEL = dict(model="random", max_model_len=96)
POLICIES = ("fcfs", "sjf", "priority", "mlfq", "fair")


class InjectedFault(Exception):
    """Raised on purpose inside a step (a policy bug, a failing forward)."""


@dataclass
class FuzzStats:
    runs: int = 0
    steps: int = 0
    requests: int = 0
    groups: int = 0                 # of the requests, parallel-sampling groups (n > 1)
    aborts: int = 0
    faults: int = 0
    mismatches: int = 0
    lost: int = 0
    leaks: int = 0
    problems: list = field(default_factory=list)

    def add(self, other: "FuzzStats") -> None:
        for f in ("runs", "steps", "requests", "groups", "aborts", "faults", "mismatches", "lost", "leaks"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        self.problems += other.problems

    def line(self) -> str:
        return (f"runs {self.runs}, steps {self.steps}, requests {self.requests}, groups {self.groups}, "
                f"aborts {self.aborts}, faults {self.faults}, mismatches {self.mismatches}, lost {self.lost}, "
                f"leaks {self.leaks}")


class FaultyPolicy:
    """Wraps a built-in policy; each hook call raises with probability ``p``."""

    def __init__(self, inner, rng: random.Random, p: float):
        self.inner, self.rng, self.p = inner, rng, p
        self.name = inner.name

    def _maybe(self, hook):
        if self.rng.random() < self.p:
            raise InjectedFault(hook)

    def order_waiting(self, waiting, now):
        self._maybe("order_waiting")
        return self.inner.order_waiting(waiting, now)

    def pick_victim(self, candidates, now):
        self._maybe("pick_victim")
        return self.inner.pick_victim(candidates, now)

    def preempt_for(self, request, running, now):
        victim = self.inner.preempt_for(request, running, now)
        if victim is not None:
            self._maybe("preempt_for")
        return victim

    def on_step(self, scheduled, now):
        self._maybe("on_step")
        self.inner.on_step(scheduled, now)


def random_config(rng: random.Random) -> dict:
    allocation = rng.choice(["paged", "paged", "paged", "reserved"])
    block_size = rng.choice([1, 2, 4]) if allocation == "paged" else rng.choice([1, 2])
    cfg = dict(MODEL, block_size=block_size, kv_allocation=allocation,
               num_kv_blocks=rng.randint(40, 120) // block_size + 8,
               max_num_seqs=rng.randint(2, 8), max_num_batched_tokens=rng.choice([16, 32, 64]),
               enable_chunked_prefill=True, policy=rng.choice(POLICIES),
               clock="modeled", cost_model=0.01, record=rng.choice(["full", "summary", "none"]))
    if allocation == "paged":
        cfg["preemption_mode"] = rng.choice(["recompute", "swap", "swap"])
        if cfg["preemption_mode"] == "swap":
            cfg["num_swap_blocks"] = rng.randint(0, 2 * cfg["num_kv_blocks"])
        cfg["enable_prefix_caching"] = rng.random() < 0.5
        if rng.random() < 0.3:
            cfg.update(speculative_model="ngram", num_speculative_tokens=rng.randint(1, 3))
    r = rng.random()
    if r < 0.15:
        cfg["schedule_every"] = 2
    elif r < 0.25:
        cfg["batching"] = "static"
    if rng.random() < 0.2:
        cfg["max_queue_len"] = rng.randint(1, 6)
    if rng.random() < 0.2:
        cfg["watermark"] = 0.05
    return cfg


def random_workload(rng: random.Random, n: int, cfg: dict) -> list[dict]:
    bases = [[rng.randrange(3, 500) for _ in range(16)] for _ in range(3)]     # shared prefixes
    reqs = []
    for i in range(n):
        plen = rng.randint(1, 24)
        if rng.random() < 0.4:
            prompt = rng.choice(bases)[:plen] + [rng.randrange(3, 500) for _ in range(rng.randint(0, 4))]
        else:
            prompt = [rng.randrange(3, 500) for _ in range(plen)]
        max_tokens = rng.randint(1, 20)
        if cfg["kv_allocation"] == "reserved":
            max_tokens = min(max_tokens, 40 - len(prompt))
        reqs.append(dict(prompt=prompt, max_tokens=max(1, max_tokens), arrival=rng.choice([0.0, rng.uniform(0, 0.3)]),
                         priority=rng.randint(0, 2), tenant=rng.choice("abc"),
                         expected_output_len=rng.randint(1, 20)))
    return reqs


def make_groups(rng: random.Random, reqs: list[dict], cfg: dict, rate: float) -> None:
    """Turn about ``rate`` of the requests into parallel-sampling groups of 2 or 3 samples, sampled
    (temperature 0.8) with a seed of their own; only where the configuration serves them (paged KV,
    no speculation, room for the group's seats)."""
    if cfg["kv_allocation"] != "paged" or "speculative_model" in cfg:
        return
    for r in reqs:
        if rng.random() < rate:
            r.update(n=rng.randint(2, min(3, cfg["max_num_seqs"])), seed=rng.randrange(2**31))


def sampling_params(r: dict, n: int = None, seed: int = None) -> SamplingParams:
    """Request ``r``'s parameters: greedy, or for a group sampled with its seed (``n``, ``seed``:
    those of one of its samples run alone)."""
    n = r.get("n", 1) if n is None else n
    seed = r.get("seed") if seed is None else seed
    return SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, n=n, seed=seed,
                          temperature=0.0 if seed is None else 0.8)


def references(reqs: list[dict]) -> list[list[list[int]]]:
    """Each request's tokens with the engine to itself (plenty of KV, no contention): one list per
    sample, a group's sample i run as a request of its own seeded with ``completion_seed(seed, i)``."""
    llm = LLM(**MODEL, block_size=16, num_kv_blocks=512, max_num_seqs=64, max_num_batched_tokens=4096)
    alone = [(r, sampling_params(r, 1, completion_seed(r.get("seed"), i))) for r in reqs for i in range(r.get("n", 1))]
    outs = iter(llm.generate([r["prompt"] for r, _ in alone], [sp for _, sp in alone], use_tqdm=False))
    return [[next(outs).token_ids for _ in range(r.get("n", 1))] for r in reqs]


def fuzz_run(seed: int, num_requests: int = 10, fault_rate: float = 0.05, abort_rate: float = 0.03,
             max_steps: int = 3000, config=random_config, group_rate: float = 0.3) -> FuzzStats:
    """One run: ``config(rng)`` draws the engine configuration (``random_config`` by default);
    about ``group_rate`` of the requests are parallel-sampling groups (drawn from a random stream
    of their own, so the configuration, workload and faults of a seed do not depend on it)."""
    rng = random.Random(seed)
    cfg = config(rng)
    reqs = random_workload(rng, num_requests, cfg)
    make_groups(random.Random(f"groups {seed}"), reqs, cfg, group_rate)
    want = references(reqs)
    policy = cfg.pop("policy")
    cfg["policy"] = FaultyPolicy(make_policy(policy), rng, fault_rate)
    llm = LLM(**cfg)
    eng = llm.engine
    real_execute = eng.executor.execute

    def execute(out):                     # a forward that fails before or after it ran
        if rng.random() < fault_rate:
            raise InjectedFault("before execute")
        res = real_execute(out)
        if rng.random() < fault_rate:
            raise InjectedFault("after execute")
        return res
    eng.executor.execute = execute

    stats = FuzzStats(runs=1, requests=len(reqs), groups=sum(r.get("n", 1) > 1 for r in reqs))
    ids = []
    for r in reqs:
        try:
            ids.append(eng.add_request(r["prompt"], sampling_params(r), arrival_time=r["arrival"],
                                       priority=r["priority"], tenant=r["tenant"],
                                       expected_output_len=r["expected_output_len"]))
        except ValueError:
            ids.append(None)                 # does not fit this configuration at all: rejected at the door
    where = f"seed {seed} ({policy}, {cfg})"
    while eng.has_unfinished_requests():
        if stats.steps >= max_steps:
            stats.lost += 1
            stats.problems.append(f"{where}: no end after {max_steps} steps")
            break
        if rng.random() < abort_rate:
            live = [i for i in ids if i is not None and not eng.is_finished(i)]
            if live:
                eng.abort_request(rng.choice(live))
                stats.aborts += 1
        stats.steps += 1
        try:
            rec = eng.step()
        except InjectedFault:
            stats.faults += 1
            rec = None
        try:
            check_invariants(eng, rec)
        except AssertionError as e:
            stats.problems.append(f"{where}, step {stats.steps}: {e}")
            stats.leaks += 1
            return stats
    try:
        check_all_free(eng)
    except AssertionError as e:
        stats.leaks += 1
        stats.problems.append(f"{where}: {e}")
    for rid, refs in zip(ids, want):
        if rid is None:
            continue
        parent = eng.parents.get(rid)
        for r, ref in zip(parent.members if parent is not None else [eng.requests[rid]], refs):
            got = r.output_token_ids
            ok = got == ref if r.finish_reason == "length" else got == ref[:len(got)]
            if not ok:
                stats.mismatches += 1
                stats.problems.append(f"{where}: request {r.request_id} ({r.finish_reason}) got {got}, "
                                      f"alone {ref}")
    return stats
