"""A randomized differential run of the engine: random configurations, workloads, aborts and
injected faults, with the invariants checked after every step and every finished request's
tokens compared with the same request run without contention. Most requests are greedy; some
are parallel-sampling groups (``SamplingParams.n`` > 1, sampled with a seed), and each of a
group's samples must equal the request run alone with that sample's seed (``completion_seed``).
Others are sampled with a seed (temperature, top-p, top-k), ask for logprobs, carry penalties,
or end at a stop string or stop token id; their text, finish reason and logprobs must match too.

Each feature's knob is drawn by a function of its own from a random stream of its own
(``random.Random(f"<feature> {seed}")``), so adding a feature leaves the configuration,
workload, aborts and faults that earlier features drew for a seed as they were.

With an int8 / fp8 KV cache (``draw_kv_cache_dtype``) a block's bytes depend on the pieces it
was written in (its scale only grows, and earlier rows are re-quantized when it does), so a
sequence is compared with the run alone only when it was written in the same pieces
(``written_like_alone``); the others are counted in ``FuzzStats.quantized_skipped``.

``fuzz_run(seed)`` makes one run and returns its counts; ``async_fuzz_run(seed)`` serves a
workload through ``AsyncLLM`` with cancelled streams and aborts; ``tests/test_fuzz.py`` runs a
bounded number under hypothesis, and ``make fuzz`` (``scripts/fuzz.py``) a long campaign.
"""

from __future__ import annotations

import asyncio
import functools
import random
from dataclasses import dataclass, field, fields
from pathlib import Path

from minillm import LLM, SamplingParams
from minillm.async_llm import AsyncLLM
from minillm.core.invariants import check_all_free, check_invariants
from minillm.core.parallel_sampling import completion_id, completion_seed
from minillm.core.policies import make_policy
from minillm.model.loader import load_tokenizer
from minillm_kernels.kv_quant import fp8_available

MODEL = dict(model="random", max_model_len=96)
POLICIES = ("fcfs", "sjf", "priority", "mlfq", "fair")
# The random model has no tokenizer; runs with stop strings borrow the shipped model's (its first
# 512 token ids, the random model's vocabulary, decode to text).
TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "minillm" / "checkpoints" / "shakespeare"


@functools.cache
def tokenizer():
    return load_tokenizer(str(TOKENIZER_DIR))


class InjectedFault(Exception):
    """Raised on purpose inside a step (a policy bug, a failing forward)."""


@dataclass
class FuzzStats:
    runs: int = 0
    steps: int = 0
    requests: int = 0
    groups: int = 0  # of the requests, parallel-sampling groups (n > 1)
    sampled: int = 0  # single requests sampled with a seed (temperature, top-p, top-k)
    logprobs: int = 0  # requests asking for logprobs
    penalties: int = 0  # requests with a repetition, presence or frequency penalty
    stops: int = 0  # requests with a stop string or a stop token id
    stopped: int = 0  # sequences one of those ended ("stop")
    quantized: int = 0  # runs with an int8 / fp8 KV cache
    quantized_compared: int = 0  # their sequences compared with the run alone
    quantized_skipped: int = 0  # their sequences written in other pieces than alone: not compared
    tp_runs: int = 0  # runs on 2 tensor-parallel ranks
    draft_runs: int = 0  # speculative runs with a draft model (the others: n-gram lookup)
    cpu_attention_runs: int = 0  # runs on the CPU attention kernel (the references: the torch reference)
    exercise_pool_runs: int = 0  # runs whose blocks live in exercise 04's pool (a subclass that moves them its own way)
    async_runs: int = 0  # AsyncLLM runs
    async_streams: int = 0  # their streams (a group's samples: one each)
    async_cancels: int = 0  # streams cancelled (task.cancel) or aborted (whole request or one sample)
    aborts: int = 0
    faults: int = 0
    sampler_faults: int = 0  # rows made unsamplable (NaN logits) on purpose
    sampling_failed: int = 0  # sequences that ended "abort" because their row could not be sampled
    mismatches: int = 0
    lost: int = 0
    leaks: int = 0
    problems: list = field(default_factory=list)

    def add(self, other: "FuzzStats") -> None:
        for f in fields(self):
            if f.name != "problems":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        self.problems += other.problems

    def line(self) -> str:
        return ", ".join(
            f"{f.name.replace('_', ' ')} {getattr(self, f.name)}" for f in fields(self) if f.name != "problems"
        )


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
    cfg = dict(
        MODEL,
        block_size=block_size,
        kv_allocation=allocation,
        num_kv_blocks=rng.randint(40, 120) // block_size + 8,
        max_num_seqs=rng.randint(2, 8),
        max_num_batched_tokens=rng.choice([16, 32, 64]),
        enable_chunked_prefill=True,
        policy=rng.choice(POLICIES),
        clock="modeled",
        cost_model=0.01,
        record=rng.choice(["full", "summary", "none"]),
    )
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


def draw_kv_cache_dtype(rng: random.Random, cfg: dict, rate: float) -> None:
    """About ``rate`` of the paged configurations store KV as int8 or fp8 (fp8 where this torch has
    the dtype); a quantized cache needs paged KV."""
    if cfg["kv_allocation"] == "paged" and rng.random() < rate:
        cfg["kv_cache_dtype"] = rng.choice(["int8", "fp8"] if fp8_available() is None else ["int8"])


def draw_block_pool(rng: random.Random, cfg: dict, rate: float) -> bool:
    """About ``rate`` of the prefix-caching runs keep their blocks in exercise 04's reference pool
    (``solutions/ex04_prefix_cache.py``'s ``EvictingBlockPool``), a ``BlockPool`` subclass that hands
    blocks out and takes them back with its own code, plugged in as a student's is (``block_pool=``)."""
    if cfg.get("enable_prefix_caching") and rng.random() < rate:
        from minillm import impl

        cfg["block_pool"] = impl.load("ex04_prefix_cache", "solutions").EvictingBlockPool
        return True
    return False


def draw_attention_backend(rng: random.Random, cfg: dict, rate: float) -> bool:
    """About ``rate`` of the runs compute attention with the CPU kernel that reads the paged KV in place
    (``attention_backend="cpu"``, ``kernels/cpu_attention.py``) where the references use the torch
    reference: the two must give the same tokens. (A quantized cache runs the reference either way.)"""
    if rng.random() < rate:
        cfg["attention_backend"] = "cpu"
        return True
    return False


def draw_draft_model(rng: random.Random, cfg: dict, rate: float) -> bool:
    """About ``rate`` of the speculative configurations propose with a draft model instead of n-gram
    lookup: the shipped Shakespeare model and its 1-layer draft (the random model has no draft). The
    workload's token ids (below 500) are in the shipped vocabulary."""
    if cfg.get("speculative_model") == "ngram" and rng.random() < rate:
        cfg.update(model=None, speculative_model="default-draft")
        return True
    return False


def random_workload(rng: random.Random, n: int, cfg: dict) -> list[dict]:
    bases = [[rng.randrange(3, 500) for _ in range(16)] for _ in range(3)]  # shared prefixes
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
        reqs.append(
            dict(
                prompt=prompt,
                max_tokens=max(1, max_tokens),
                arrival=rng.choice([0.0, rng.uniform(0, 0.3)]),
                priority=rng.randint(0, 2),
                tenant=rng.choice("abc"),
                expected_output_len=rng.randint(1, 20),
            )
        )
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


def draw_sampling(rng: random.Random, reqs: list[dict], cfg: dict, rate: float) -> None:
    """Each of seeded sampling (temperature, top-p, top-k: single requests; a group is sampled
    already), logprobs and penalties goes to about ``rate`` of the requests, into ``r["params"]``
    (extra SamplingParams fields); only without speculation: logprobs and penalties are refused
    there, and a seeded request's tokens depend on how many guesses each step verified (the
    acceptance rule's draws), which contention changes: the same distribution, not the same tokens."""
    spec = "speculative_model" in cfg
    for r in reqs:
        params = r.setdefault("params", {})
        if not spec and r.get("n", 1) == 1 and rng.random() < rate:
            r["seed"] = rng.randrange(2**31)
            # top_k -1 (vLLM's "all") and one far past the vocabulary (it once overflowed the sampler)
            params.update(
                temperature=rng.choice([0.5, 0.8, 1.2]),
                top_p=rng.choice([1.0, 0.9, 0.5]),
                top_k=rng.choice([0, 0, 5, 50, -1, 2**97]),
                min_p=rng.choice([0.0, 0.0, 0.1]),
            )
        if not spec and rng.random() < rate:
            params["logprobs"] = rng.choice([0, 1, 3])
        if not spec and rng.random() < rate:
            if rng.random() < 0.5:
                params["repetition_penalty"] = rng.choice([0.8, 1.3, 2.0])
            else:
                params.update(presence_penalty=rng.uniform(-1, 1), frequency_penalty=rng.uniform(-1, 1))


def draw_stops(rng: random.Random, reqs: list[dict], refs: list, rate: float) -> bool:
    """Give about ``rate`` of the requests a stop token id or a stop string, taken from what the
    request's first sample produces alone (``refs``, before any stop), so that most do stop.
    Returns whether any request got one (the references must then be made again)."""
    drew = False
    for r, ref in zip(reqs, refs):
        tokens = ref[0]["tokens"]
        if rng.random() >= rate or len(tokens) < 2:
            continue
        tok = tokens[rng.randrange(1, len(tokens))]
        piece = tokenizer().decode([tok]).strip()
        if rng.random() < 0.5 or not piece:
            r["params"]["stop_token_ids"] = [tok]
        else:
            r["params"].update(stop=[piece[: rng.randint(1, 2)]], include_stop_str_in_output=rng.random() < 0.5)
        drew = True
    return drew


def sampling_params(r: dict, n: int = None, seed: int = None) -> SamplingParams:
    """Request ``r``'s parameters: greedy, or sampled with its seed (``n``, ``seed``: those of one
    sample of a group run alone), with the extra fields ``draw_sampling`` and ``draw_stops`` gave it."""
    n = r.get("n", 1) if n is None else n
    seed = r.get("seed") if seed is None else seed
    params = dict(r.get("params", {}))
    temperature = params.pop("temperature", 0.8)
    return SamplingParams(
        max_tokens=r["max_tokens"],
        ignore_eos=True,
        n=n,
        seed=seed,
        temperature=0.0 if seed is None else temperature,
        **params,
    )


def needs_tokenizer(reqs: list[dict]) -> bool:
    return any(r.get("params", {}).get("stop") for r in reqs)


def references(reqs: list[dict], cfg: dict) -> list[list[dict]]:
    """Each request's outcome with the engine to itself (plenty of KV, no contention, every prompt
    prefilled whole): one dict (tokens, finish_reason, text, logprobs) per sample, a group's
    sample i run as a request of its own seeded with ``completion_seed(seed, i)``. A quantized
    cache is run alone with the run's dtype and block size (a block's scale covers its positions)."""
    kv = dict(block_size=16, num_kv_blocks=512)
    if cfg.get("kv_cache_dtype", "auto") != "auto":
        kv = dict(
            block_size=cfg["block_size"], num_kv_blocks=8192 // cfg["block_size"], kv_cache_dtype=cfg["kv_cache_dtype"]
        )
    llm = LLM(
        **{k: cfg[k] for k in MODEL},
        **kv,
        max_num_seqs=64,
        max_num_batched_tokens=4096,
        tokenizer=tokenizer() if needs_tokenizer(reqs) else None,
    )
    alone = [(r, sampling_params(r, 1, completion_seed(r.get("seed"), i))) for r in reqs for i in range(r.get("n", 1))]
    outs = iter(llm.generate([r["prompt"] for r, _ in alone], [sp for _, sp in alone], use_tqdm=False))
    return [[outcome(next(outs)) for _ in range(r.get("n", 1))] for r in reqs]


def outcome(out) -> dict:
    return dict(tokens=out.token_ids, finish_reason=out.finish_reason, text=out.text, logprobs=out.outputs[0].logprobs)


def written_like_alone(writes: list[tuple[int, int]], prompt_len: int, block_size: int) -> bool:
    """Were a sequence's positions written (``writes``: the ranges each step's forward wrote, in
    order) in the pieces the run alone writes them in: from position 0 (no prefix-cache hit), each
    position once (no recompute, no speculative guess written and then rejected, no retried step),
    the prompt cut only at block boundaries? Alone, the prompt is written whole and then one
    position per decode; a cut at a block boundary leaves every block's pieces as they were."""
    done = 0
    for start, end in writes:
        if start != done or (0 < start < prompt_len and start % block_size):
            return False
        if start >= prompt_len and end - start > 1:  # a verify step's guesses (speculation)
            return False
        done = end
    return True


def check_sequence(seq, ref: dict, text) -> list[str]:
    """What differs between a finished (or aborted) sequence and its run alone."""
    got = seq.output_token_ids
    complete = seq.finish_reason in ("length", "stop")
    if complete and (got, seq.finish_reason) != (ref["tokens"], ref["finish_reason"]):
        return [f"got {got} ({seq.finish_reason}), alone {ref['tokens']} ({ref['finish_reason']})"]
    if not complete and got != ref["tokens"][: len(got)]:
        return [f"got {got} ({seq.finish_reason}), alone {ref['tokens']}"]
    if complete and text is not None and text != ref["text"]:
        return [f"text {text!r}, alone {ref['text']!r}"]
    if seq.output_logprobs is not None:
        for i, (a, b) in enumerate(zip(seq.output_logprobs, ref["logprobs"])):
            if a.keys() != b.keys() or any(abs(a[t].logprob - b[t].logprob) > 1e-4 for t in a):
                return [f"logprobs at {i}: {a}, alone {b}"]
    return []


def install_faults(
    eng,
    rng: random.Random,
    fault_rate: float,
    sampler_rng: random.Random,
    sampler_fault_rate: float,
    writes: dict,
    stats: "FuzzStats",
) -> None:
    """Faults in the forward (before or after it ran) and rows the sampler cannot sample (NaN
    logits: the sampler's own failure path, which ends that request alone). Each forward's writes
    are noted in ``writes`` (sequence id -> ranges), for ``written_like_alone``."""
    real_execute = eng.executor.execute
    sampler = eng.executor.sampler
    real_sample = sampler.sample

    def execute(out):
        if rng.random() < fault_rate:
            raise InjectedFault("before execute")
        for s in out.scheduled:
            writes.setdefault(s.request.request_id, []).append(
                (s.num_computed_before, s.num_computed_before + s.num_new_tokens)
            )
        res = real_execute(out)
        if rng.random() < fault_rate:
            raise InjectedFault("after execute")
        return res

    def sample(logits, params, request_ids, probs=None):
        if sampler_fault_rate and sampler_rng.random() < sampler_fault_rate:
            logits = logits.clone()
            logits[sampler_rng.randrange(len(logits))] = float("nan")
            stats.sampler_faults += 1
        return real_sample(logits, params, request_ids, probs)

    eng.executor.execute = execute
    sampler.sample = sample


def fuzz_run(
    seed: int,
    num_requests: int = 10,
    fault_rate: float = 0.05,
    abort_rate: float = 0.03,
    max_steps: int = 3000,
    config=random_config,
    group_rate: float = 0.3,
    feature_rate: float = 0.15,
    quantized_rate: float = 0.25,
    sampler_fault_rate: float = 0.02,
    draft_rate: float = 0.05,
    cpu_attention_rate: float = 0.2,
    exercise_pool_rate: float = 0.25,
    tensor_parallel: bool = False,
) -> FuzzStats:
    """One run: ``config(rng)`` draws the engine configuration (``random_config`` by default);
    about ``group_rate`` of the requests are parallel-sampling groups, ``feature_rate`` of them get
    each sampling feature (``draw_sampling``, ``draw_stops``), ``quantized_rate`` of the paged runs
    an int8 / fp8 KV cache, ``draft_rate`` of the speculative ones a draft model (``draw_draft_model``),
    ``cpu_attention_rate`` the CPU attention kernel (``draw_attention_backend``), ``exercise_pool_rate`` of
    the prefix-caching ones exercise 04's block pool (``draw_block_pool``), and each sampling
    call fails one row with probability ``sampler_fault_rate``; each is drawn from a random stream
    of its own, so the configuration, workload and faults of a seed do not depend on them.
    ``tensor_parallel``: on 2 gloo ranks."""
    rng = random.Random(seed)
    cfg = config(rng)
    reqs = random_workload(rng, num_requests, cfg)
    make_groups(random.Random(f"groups {seed}"), reqs, cfg, group_rate)
    draw_kv_cache_dtype(random.Random(f"kv dtype {seed}"), cfg, quantized_rate)
    drafted = draw_draft_model(random.Random(f"draft {seed}"), cfg, draft_rate)
    draw_sampling(random.Random(f"sampling {seed}"), reqs, cfg, feature_rate)
    want = references(reqs, cfg)
    cpu_attention = draw_attention_backend(random.Random(f"backend {seed}"), cfg, cpu_attention_rate)
    exercise_pool = not tensor_parallel and draw_block_pool(random.Random(f"pool {seed}"), cfg, exercise_pool_rate)
    if draw_stops(random.Random(f"stops {seed}"), reqs, want, feature_rate):
        want = references(reqs, cfg)
    if tensor_parallel:
        cfg["tensor_parallel_size"] = 2
    policy = cfg.pop("policy")
    cfg["policy"] = FaultyPolicy(make_policy(policy), rng, fault_rate)
    quantized = cfg.get("kv_cache_dtype", "auto") != "auto"
    stats = FuzzStats(
        runs=1,
        requests=len(reqs),
        groups=sum(r.get("n", 1) > 1 for r in reqs),
        quantized=int(quantized),
        tp_runs=int(tensor_parallel),
        draft_runs=int(drafted),
        cpu_attention_runs=int(cpu_attention),
        exercise_pool_runs=int(exercise_pool),
    )
    for r in reqs:
        p = r.get("params", {})
        stats.sampled += "temperature" in p
        stats.logprobs += "logprobs" in p
        stats.penalties += any(k in p for k in ("repetition_penalty", "presence_penalty"))
        stats.stops += "stop" in p or "stop_token_ids" in p
    tok = tokenizer() if needs_tokenizer(reqs) else None
    with LLM(**cfg, tokenizer=tok) as llm:
        eng = llm.engine
        writes: dict[str, list] = {}
        install_faults(eng, rng, fault_rate, random.Random(f"sampler faults {seed}"), sampler_fault_rate, writes, stats)
        ids = []
        for r in reqs:
            try:
                ids.append(
                    eng.add_request(
                        r["prompt"],
                        sampling_params(r),
                        arrival_time=r["arrival"],
                        priority=r["priority"],
                        tenant=r["tenant"],
                        expected_output_len=r["expected_output_len"],
                    )
                )
            except ValueError:
                ids.append(None)  # does not fit this configuration at all: rejected at the door
        where = f"seed {seed} ({policy}, {cfg})"
        if not drive(eng, rng, ids, abort_rate, max_steps, stats, where):
            return stats
        for rid, r, refs in zip(ids, reqs, want):
            if rid is not None:
                compare(eng, rid, r, refs, writes, quantized, cfg["block_size"], tok is not None, stats, where)
    return stats


def drive(eng, rng: random.Random, ids: list, abort_rate: float, max_steps: int, stats: FuzzStats, where: str) -> bool:
    """Step until done, aborting now and then, the invariants after every step and everything
    free at the end. False if the invariants broke (the run stops there)."""
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
            return False
    try:
        check_all_free(eng)
    except AssertionError as e:
        stats.leaks += 1
        stats.problems.append(f"{where}: {e}")
    return True


def compare(
    eng,
    rid: str,
    r: dict,
    refs: list[dict],
    writes: dict,
    quantized: bool,
    block_size: int,
    with_text: bool,
    stats: FuzzStats,
    where: str,
) -> None:
    """Request ``rid``'s sequences against their runs alone (a quantized run's: only those written
    in the same pieces); a sequence whose sampling failed must have had a row made unsamplable."""
    parent = eng.parents.get(rid)
    members = parent.members if parent is not None else [eng.requests[rid]]
    prompt_writes = [w for w in writes.get(members[0].request_id, []) if w[0] < len(r["prompt"])]
    for seq, ref in zip(members, refs):
        stats.stopped += seq.finish_reason == "stop"
        if (seq.finish_detail or "").startswith("sampling failed"):
            stats.sampling_failed += 1
            if not stats.sampler_faults:
                stats.problems.append(f"{where}: request {seq.request_id}: {seq.finish_detail}")
        if quantized and seq.output_token_ids:
            own = (
                writes.get(seq.request_id, []) if seq is members[0] else prompt_writes + writes.get(seq.request_id, [])
            )
            if not written_like_alone(own, len(r["prompt"]), block_size):
                stats.quantized_skipped += 1
                continue
            stats.quantized_compared += 1
        text = eng.output_text(seq.request_id) if with_text else None
        for why in check_sequence(seq, ref, text):
            stats.mismatches += 1
            stats.problems.append(f"{where}: request {seq.request_id}: {why}")


async def _serve_async(seed: int, num_requests: int, cancel_rate: float, stats: FuzzStats, timeout: float):
    """``async_fuzz_run``'s body: one stream per request, some cancelled or aborted on the way."""
    rng = random.Random(seed)
    cfg = dict(
        MODEL,
        block_size=rng.choice([1, 2, 4]),
        max_num_seqs=rng.randint(2, 6),
        max_num_batched_tokens=rng.choice([16, 32]),
        policy=rng.choice(POLICIES),
        preemption_mode=rng.choice(["recompute", "swap"]),
        enable_prefix_caching=rng.random() < 0.5,
        record="summary",
        kv_allocation="paged",
    )
    cfg["num_kv_blocks"] = rng.randint(40, 100) // cfg["block_size"] + 8
    cfg["num_swap_blocks"] = cfg["num_kv_blocks"]
    reqs = random_workload(rng, num_requests, cfg)
    make_groups(random.Random(f"groups {seed}"), reqs, cfg, 0.3)
    draw_sampling(random.Random(f"sampling {seed}"), reqs, cfg, 0.15)
    want = references(reqs, cfg)
    stats.groups += sum(r.get("n", 1) > 1 for r in reqs)
    where = f"async seed {seed} ({cfg})"
    llm = AsyncLLM.from_config(**cfg)

    async def consume(i: int, r: dict) -> dict:
        got = {}  # index -> [tokens, finish reason]
        async for out in llm.generate(r["prompt"], sampling_params(r), request_id=str(i)):
            seq = got.setdefault(out.index, [[], None])
            seq[0] += out.token_ids
            seq[1] = out.finish_reason
        return got

    async with llm:
        tasks = [asyncio.create_task(consume(i, r)) for i, r in enumerate(reqs)]
        cancelled = set()
        for _ in range(num_requests):  # cancels and aborts while the streams run
            await asyncio.sleep(rng.uniform(0, 0.02))
            if rng.random() < cancel_rate:
                i = rng.randrange(num_requests)
                how = rng.choice(["cancel", "abort", "abort one sample"])
                stats.async_cancels += 1
                if how == "cancel":
                    tasks[i].cancel()
                    cancelled.add(i)
                elif how == "abort" or reqs[i].get("n", 1) == 1:
                    await llm.abort(str(i))
                else:
                    await llm.abort(completion_id(str(i), rng.randrange(reqs[i]["n"])))
        done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout)
        for i, (r, refs, got) in enumerate(zip(reqs, want, done)):
            stats.async_streams += r.get("n", 1)
            if isinstance(got, asyncio.CancelledError) and i in cancelled:
                continue
            if isinstance(got, BaseException):
                stats.problems.append(f"{where}: stream {i} raised {got!r}")
                continue
            for k, ref in enumerate(refs):
                tokens, reason = got.get(k, ([], None))
                if reason == "abort" and tokens == ref["tokens"][: len(tokens)]:
                    continue
                if (tokens, reason) != (ref["tokens"], ref["finish_reason"]):
                    stats.mismatches += 1
                    stats.problems.append(f"{where}: stream {i}.{k} got {tokens} ({reason}), alone {ref['tokens']}")
        for _ in range(200):  # a cancelled stream's abort reaches the engine soon
            if not await llm.engine_call(lambda e: e.has_unfinished_requests()):
                break
            await asyncio.sleep(0.01)
        try:
            await llm.engine_call(lambda e: (check_invariants(e, None), check_all_free(e)))
        except AssertionError as e:
            stats.leaks += 1
            stats.problems.append(f"{where}: {e}")
        if llm._sent or llm._streams or llm.num_in_flight():
            stats.leaks += 1
            stats.problems.append(f"{where}: AsyncLLM still holds {dict(llm._sent)}, {list(llm._streams)}")
        stats.steps += llm.num_steps


def async_fuzz_run(seed: int, num_requests: int = 8, cancel_rate: float = 0.4, timeout: float = 60.0) -> FuzzStats:
    """Serve a random workload through ``AsyncLLM`` (greedy, seeded, groups, logprobs, penalties),
    cancelling some streams (``task.cancel``) and aborting some requests or single samples of a
    group while they run. Every stream that was not cancelled must end: with the tokens of its
    run alone, or with ``finish_reason="abort"`` and a prefix of them; nothing may hang (``timeout``
    seconds); afterwards the engine holds nothing and AsyncLLM has no stream or sent output left."""
    stats = FuzzStats(runs=1, async_runs=1, requests=num_requests)
    try:
        asyncio.run(_serve_async(seed, num_requests, cancel_rate, stats, timeout))
    except asyncio.TimeoutError:
        stats.lost += 1
        stats.problems.append(f"async seed {seed}: streams still open after {timeout} s")
    return stats
