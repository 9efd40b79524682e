"""Graders of notebook 05's exercises (``exercises/ex05_preemption.py``): ``make grade EX=05``.

The recompute-or-swap rule is held against numbers worked by hand and against minillm's own
rule (``minillm.sim.costmodel.swap_or_recompute``), then run inside the engine through
``YourCostModel`` with ``preemption_mode="auto"``. The victims are checked at every preemption of
real runs (the candidates the scheduler offered, the one your policy gave up) and, for priority
preemption, against the engine's ``Priority`` policy request by request.

The rule is also graded with the engine's own version switched off, so an answer that hands the
decision to ``minillm.sim.costmodel`` does not pass.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
from dataclasses import replace

import pytest

from minillm import LLM, impl
from minillm.sim import costmodel
from minillm.sim.costmodel import HARDWARE, ConstantStepTime, RooflineCostModel, swap_or_recompute
from minillm.core.invariants import check_all_free, check_invariants
from minillm.core.policies import Priority
from minillm.analysis.workloads import TraceRequest, Uniform, submit_trace, synthetic_trace

STEP = 0.010


def ex():
    return impl.load("ex05_preemption")


def _engine(policy="fcfs", cost_model=None, **cfg):
    cfg.setdefault("max_model_len", 2048)
    cfg.setdefault("max_num_batched_tokens", 4096)
    cfg.setdefault("record", "summary")  # per-block maps are for the widgets; not needed here
    eng = LLM(
        model="random",
        executor="simulated",
        clock="modeled",
        policy=policy,
        cost_model=cost_model if cost_model is not None else ConstantStepTime(STEP),
        **cfg,
    ).engine
    return eng


def _run_checked(eng, trace):
    submit_trace(eng, trace, vocab_size=eng.vocab_size)
    while eng.has_unfinished_requests():
        check_invariants(eng, eng.step())
    check_all_free(eng)
    return {rid: r.metrics for rid, r in eng.requests.items()}


# --- Exercise 1: the recompute-or-swap rule ----------------------------------------------------------


def test_the_worked_numbers():
    t = ex().swap_time(1e9, 32e9)
    assert t == pytest.approx(1 / 32), f"1 GB over PCIe 4.0 x16 (32 GB/s): expected 31.25 ms, got {t * 1e3:.2f} ms"
    t = ex().recompute_time(2000, 4000.0)
    assert t == pytest.approx(0.5), f"2000 tokens at 4000 tokens/s: expected 500 ms, got {t * 1e3:.1f} ms"
    got = ex().swap_or_recompute(1e9, 2000, 32e9, 4000.0)
    assert got == "swap", (
        f"1 GB over 32 GB/s vs 2000 tokens at 4000 tokens/s (swap 31 ms, recompute 500 ms) should swap, got {got!r}"
    )
    got = ex().swap_or_recompute(8e9, 100, 32e9, 4000.0)
    assert got == "recompute", (
        f"8 GB to copy (250 ms) vs 100 tokens to prefill (25 ms): expected recompute, got {got!r}"
    )
    got = ex().swap_or_recompute(1e9, 1000, 1e9, 1000.0)
    assert got == "recompute", f"a tie (1 s either way) goes to recompute, got {got!r}"


def test_rule_agrees_with_the_engines_over_a_grid():
    for kv, n, bw, s in itertools.product(
        (1e6, 3e8, 1e9, 5e9, 4e10), (1, 100, 2000, 30000), (16e9, 32e9, 64e9), (500.0, 4000.0, 50000.0)
    ):
        want = swap_or_recompute(kv, n, bw, s)
        got = ex().swap_or_recompute(kv, n, bw, s)
        assert got == want, (
            f"M_KV={kv:g} B, n={n}, B_PCIe={bw:g} B/s, S_prefill={s:g} tok/s: swap takes "
            f"{kv / bw * 1e3:.3g} ms, recompute {n / s * 1e3:.3g} ms: expected {want!r}, got {got!r}"
        )


def _tripwire(*args, **kwargs):
    raise AssertionError(
        "your answer called the engine's own recompute-or-swap rule (minillm.sim.costmodel."
        "swap_or_recompute, or a cost model's preemption_mode / swap_time); the exercise is to "
        "write the rule yourself"
    )


@contextlib.contextmanager
def _engine_rule_switched_off():
    with pytest.MonkeyPatch.context() as mp:
        for f in (
            costmodel.swap_or_recompute,
            costmodel.CostModel.preemption_mode,
            costmodel.CostModel.swap_time,
            costmodel.RooflineCostModel.swap_time,
            costmodel.ConstantStepTime.swap_time,
        ):
            mp.setattr(f, "__code__", _tripwire.__code__)
        yield


def test_the_rule_is_your_own():
    cases = [(1e9, 2000, 32e9, 4000.0), (8e9, 100, 32e9, 4000.0), (1e9, 1000, 1e9, 1000.0), (3e8, 30000, 16e9, 500.0)]
    want = [swap_or_recompute(*c) for c in cases]
    with _engine_rule_switched_off():
        got = [ex().swap_or_recompute(*c) for c in cases]
        times = [t for c in cases for t in (ex().swap_time(c[0], c[2]), ex().recompute_time(c[1], c[3]))]
    assert got == want, f"cases {cases}: expected {want}, got {got}"
    assert times == pytest.approx([t for c in cases for t in (c[0] / c[2], c[1] / c[3])]), (
        f"swap_time and recompute_time on {cases}: got {times}"
    )


def _policy_tripwire(*args, **kwargs):
    raise AssertionError(
        "your policy called the engine's own Priority policy (minillm.core.policies.Priority); "
        "the exercise is to write the rule yourself"
    )


@contextlib.contextmanager
def _engine_policies_switched_off():
    """Every method of the engine's Priority policy raises while the block runs."""
    with pytest.MonkeyPatch.context() as mp:
        for f in vars(Priority).values():
            if inspect.isfunction(f) and not f.__code__.co_freevars:
                mp.setattr(f, "__code__", _policy_tripwire.__code__)
        yield


def _pressure_trace():
    return synthetic_trace(40, rate=60, prompt_len=Uniform(64, 400), output_len=Uniform(40, 300), seed=5)


def _modes(eng):
    return [(p.request_id, p.mode) for r in eng.step_records for p in r.preempted]


@pytest.mark.parametrize("hardware", ["H100-SXM", "slow-link"])
def test_your_rule_decides_inside_the_engine(hardware):
    """preemption_mode="auto": the engine asks the cost model at every preemption. With your rule
    (YourCostModel) it must decide as with its own, on the same run."""
    hw = (
        HARDWARE["H100-SXM"]
        if hardware == "H100-SXM"
        else replace(HARDWARE["H100-SXM"], name="slow-link", pcie_bandwidth=2e9)
    )
    cfg = dict(
        max_num_seqs=16,
        num_kv_blocks=160,
        block_size=16,
        max_num_batched_tokens=1024,
        preemption_mode="auto",
        num_swap_blocks=400,
    )
    ref = _engine(cost_model=RooflineCostModel(hw, "llama-2-7b"), **cfg)
    yours = _engine(cost_model=ex().YourCostModel(hw, "llama-2-7b"), **cfg)
    _run_checked(ref, _pressure_trace())
    _run_checked(yours, _pressure_trace())
    want, got = _modes(ref), _modes(yours)
    assert want, "the trace must cause preemptions"
    assert got == want, f"{hardware}: the engine's own rule preempted {want[:6]}..., with yours {got[:6]}..."
    expected = "swap" if hardware == "H100-SXM" else "recompute"
    assert {m for _, m in got} == {expected}, (
        f"on {hardware} every victim should be {expected!r}: got {sorted({m for _, m in got})}"
    )


# --- Exercise 2: LeastProgressVictim -----------------------------------------------------------------


class _Recording:
    """Wraps a policy and keeps, for every pick_victim call, what was offered and what it chose."""

    def __init__(self, policy):
        self.policy = policy
        self.calls = []

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def pick_victim(self, candidates, now):
        offered = [(r.request_id, r.num_computed_tokens, r.admit_seq) for r in candidates]
        victim = self.policy.pick_victim(candidates, now)
        self.calls.append((offered, victim.request_id))
        return victim


def test_least_progress_victim_by_hand():
    eng = _engine()
    submit_trace(eng, [TraceRequest(f"r{i}", 0.0, 8, 4) for i in range(4)], vocab_size=eng.vocab_size)
    r = [eng.requests[f"r{i}"] for i in range(4)]
    for req, computed, seq in zip(r, (40, 12, 12, 90), (1, 2, 3, 4)):
        req.num_computed_tokens, req.admit_seq = computed, seq
    got = ex().LeastProgressVictim().pick_victim(r, 0.0)
    assert got is r[2], (
        f"r1 and r2 hold the fewest positions (12); r2 was admitted more recently: expected r2, got {got.request_id}"
    )
    got = ex().LeastProgressVictim().pick_victim([r[0], r[3]], 0.0)
    assert got is r[0], f"40 positions vs 90: expected r0, got {got.request_id}"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_least_progress_victim_inside_the_engine(mode):
    rec = _Recording(ex().LeastProgressVictim())
    eng = _engine(
        rec,
        max_num_seqs=16,
        num_kv_blocks=120,
        block_size=16,
        max_num_batched_tokens=1024,
        preemption_mode=mode,
        num_swap_blocks=200 if mode == "swap" else 0,
    )
    m = _run_checked(eng, _pressure_trace())
    assert rec.calls, "the trace must make the engine pick victims"
    assert any(ch != max(off, key=lambda c: c[2])[0] for off, ch in rec.calls), (
        "on this trace the least progress is not always the most recent admission: some pick must differ"
    )
    for offered, chosen in rec.calls:
        want = min(offered, key=lambda c: (c[1], -c[2]))[0]
        assert chosen == want, (
            f"offered (id, positions of KV, admit_seq) {offered}: the least progress is {want}, "
            f"your policy gave up {chosen}"
        )
    assert all(x.finish_reason == "length" for x in m.values()), "every request must still finish"


# --- Exercise 3: PriorityPreemption ----------------------------------------------------------------------


def _schedule(eng):
    return {
        rid: (r.metrics.first_scheduled_time, tuple(r.metrics.token_times), r.metrics.num_preemptions)
        for rid, r in eng.requests.items()
    }


def _same_as_priority(trace, what, **cfg):
    ref, yours = _engine(Priority(preempt=True), **cfg), _engine(ex().PriorityPreemption(), **cfg)
    _run_checked(ref, trace)
    _run_checked(yours, trace)
    want, got = _schedule(ref), _schedule(yours)
    for rid in want:
        assert got[rid] == want[rid], (
            f"{what}, request {rid}: the engine's Priority policy started it at "
            f"{want[rid][0]:.3f} s and preempted it {want[rid][2]} times; with yours "
            f"{got[rid][0]} s and {got[rid][2]} times"
        )
    assert [(p.request_id, p.reason) for r in ref.step_records for p in r.preempted] == [
        (p.request_id, p.reason) for r in yours.step_records for p in r.preempted
    ]
    return yours


def test_priority_order_by_hand():
    eng = _engine()
    submit_trace(
        eng,
        [
            TraceRequest("a", 0.0, 8, 4, priority=2),
            TraceRequest("b", 0.1, 8, 4, priority=0),
            TraceRequest("c", 0.2, 8, 4, priority=2),
            TraceRequest("d", 0.3, 8, 4, priority=1),
        ],
        vocab_size=eng.vocab_size,
    )
    r = eng.requests
    got = [q.request_id for q in ex().PriorityPreemption().order_waiting([r["d"], r["c"], r["b"], r["a"]], 1.0)]
    assert got == ["b", "d", "a", "c"], f"by class, then arrival: expected ['b', 'd', 'a', 'c'], got {got}"
    for q, seq in zip("abcd", (1, 2, 3, 4)):
        r[q].admit_seq = seq
    got = ex().PriorityPreemption().preempt_for(r["b"], [r["a"], r["c"], r["d"]], 1.0)
    assert got is r["c"], f"for b (class 0): the lowest class is 2 (a, c), c most recent: got {got and got.request_id}"
    got = ex().PriorityPreemption().preempt_for(r["d"], [r["b"]], 1.0)
    assert got is None, "d (class 1) may not push out b (class 0)"


@pytest.mark.parametrize("policy", ["LeastProgressVictim", "PriorityPreemption"])
def test_your_policy_is_your_own(policy):
    """A run under memory pressure with the engine's Priority policy switched off."""
    pol = ex().LeastProgressVictim() if policy == "LeastProgressVictim" else ex().PriorityPreemption()
    trace = synthetic_trace(
        40, rate=40, prompt_len=Uniform(32, 300), output_len=Uniform(10, 200), priority_mix={0: 0.3, 1: 0.7}, seed=9
    )
    eng = _engine(pol, max_num_seqs=8, num_kv_blocks=70, block_size=16, max_num_batched_tokens=512)
    with _engine_policies_switched_off():
        m = _run_checked(eng, trace)
    assert all(x.finish_reason == "length" for x in m.values()), f"{policy}: every request must finish"
    assert sum(x.num_preemptions for x in m.values()) > 0, "(the trace must cause preemptions)"


def test_priority_preempts_for_a_slot_like_the_engine():
    trace = [TraceRequest(f"low{i}", 0.0, 16, 300, priority=1) for i in range(4)]
    trace += [TraceRequest(f"high{i}", 0.5, 16, 20, priority=0) for i in range(2)]
    yours = _same_as_priority(trace, "no free slot", max_num_seqs=4)
    assert all(yours.requests[f"high{i}"].metrics.queue_wait <= STEP for i in range(2))


def test_priority_preempts_under_memory_pressure_like_the_engine():
    trace = [TraceRequest(f"low{i}", 0.0, 200, 200, priority=1) for i in range(2)]
    trace += [TraceRequest("high", 1.8, 100, 20, priority=0)]
    _same_as_priority(trace, "no free KV memory", max_num_seqs=16, num_kv_blocks=50, block_size=16)
    mixed = synthetic_trace(
        50,
        rate=40,
        prompt_len=Uniform(32, 300),
        output_len=Uniform(10, 200),
        priority_mix={0: 0.2, 1: 0.3, 2: 0.5},
        seed=9,
    )
    _same_as_priority(
        mixed,
        "three classes under pressure",
        max_num_seqs=8,
        num_kv_blocks=90,
        block_size=16,
        max_num_batched_tokens=512,
    )


# --- Exercise 4: headroom_blocks ---------------------------------------------------------------------


def test_headroom_blocks_by_hand():
    for (ctx, bs, k), want in (
        (([5, 16, 17], 16, 1), 1),  # only 16 -> 17 crosses into a new block
        (([5, 16, 17], 16, 16), 3),  # 21, 32, 33 positions: +1, +1, +1
        (([5, 16, 17], 16, 27), 4),  # 32, 43, 44 positions: +1, +2, +1
        (([0, 1], 4, 4), 1 + 1),  # 0 -> 4 (one block), 1 -> 5 (1 -> 2 blocks)
        (([8] * 5, 4, 1), 5),
        (([4] * 5, 4, 1), 5),
        (([7] * 5, 4, 1), 0),
        (([100, 3, 64], 8, 9), 4),
        (([], 16, 10), 0),
        (([40], 16, 0), 0),
    ):
        got = ex().headroom_blocks(list(ctx), bs, k)
        assert got == want, (
            f"requests holding {ctx} positions in blocks of {bs}, {k} more decode steps: "
            f"expected {want} fresh blocks, got {got}"
        )


def _decode_steps_preempting(prompts, block_size, num_steps, num_kv_blocks):
    """All of ``prompts`` admitted and prefilled in one step on ``num_kv_blocks`` blocks, then
    ``num_steps`` decode steps: how many preemptions happened in them."""
    eng = _engine(num_kv_blocks=num_kv_blocks, block_size=block_size, max_num_seqs=64)
    submit_trace(
        eng, [TraceRequest(f"r{i}", 0.0, p, num_steps + 2) for i, p in enumerate(prompts)], vocab_size=eng.vocab_size
    )
    first = eng.step()
    assert len(first.batch) == len(prompts) and all(e.phase == "prefill" for e in first.batch), "(one prefill step)"
    return sum(len(eng.step().preempted) for _ in range(num_steps))


@pytest.mark.parametrize(
    "prompts, block_size, num_steps",
    [
        ([5, 16, 17, 31, 40], 16, 1),
        ([5, 16, 17, 31, 40], 16, 20),
        ([100, 3, 64], 8, 9),
        ([7] * 6, 4, 3),
        ([33, 2, 90, 47], 16, 40),
    ],
)
def test_headroom_blocks_is_exactly_enough_in_the_engine(prompts, block_size, num_steps):
    """The engine's KV manager: with your headroom free after the prefill, the batch decodes
    num_steps steps without a preemption; with one block less, it must preempt."""
    got = ex().headroom_blocks(list(prompts), block_size, num_steps)
    held = sum(-(-p // block_size) for p in prompts)
    if got >= 1:
        short = _decode_steps_preempting(prompts, block_size, num_steps, held + got - 1)
        assert short > 0, (
            f"prompts {prompts}, blocks of {block_size}, {num_steps} steps: your headroom of {got} "
            f"blocks is more than needed (with {got - 1} free, the engine decoded without preempting)"
        )
    enough = _decode_steps_preempting(prompts, block_size, num_steps, held + got)
    assert enough == 0, (
        f"prompts {prompts}, blocks of {block_size}, {num_steps} steps: with your headroom of {got} "
        f"free blocks the engine still preempted {enough} times"
    )


# --- Exercise 5 (judgement): the swap/recompute crossover on a given link ----------------------------------


def _crossover_by_the_engines_rule(cm, bandwidth, block_size, max_tokens=16384):
    """The grader's own scan: the engine's rule at every whole number of blocks."""
    for n in range(block_size, max_tokens + 1, block_size):
        if swap_or_recompute(n * cm.kv_bytes_per_token, n, bandwidth, n / cm.step_time([n], [n])) == "recompute":
            return n
    return None


def test_crossover_by_hand():
    """10 ms to prefill whatever the length, 1 MB of KV per position, a 1 GB/s link: copying n positions takes
    n ms, so swap wins below 10 positions and recompute from 10 on (a tie recomputes)."""
    flat = ConstantStepTime(0.010, kv_bytes_per_token=10**6)
    for block_size, want in ((4, 12), (5, 10), (3, 12), (1, 10), (16, 16)):
        got = ex().swap_recompute_crossover(flat, 1e9, block_size=block_size)
        assert got == want, (
            f"1 MB per position over 1 GB/s (n ms to copy) against 10 ms to prefill, blocks of "
            f"{block_size}: the first whole-block victim that recomputes holds {want} positions, "
            f"got {got}"
        )
    got = ex().swap_recompute_crossover(flat, 1e12, block_size=16, max_tokens=4096)
    assert got is None, (
        f"over 1 TB/s 4096 positions copy in 4 ms, faster than the 10 ms prefill: expected None, got {got}"
    )


@pytest.mark.parametrize("model", ["llama-2-7b", "llama-3-8b"])
def test_crossover_on_the_modeled_h100(model):
    cm = RooflineCostModel("H100-SXM", model)
    for bandwidth, block_size in ((16e9, 16), (8e9, 16), (16e9, 32), (4e9, 8), (64e9, 16)):
        want = _crossover_by_the_engines_rule(cm, bandwidth, block_size)
        got = ex().swap_recompute_crossover(cm, bandwidth, block_size=block_size)
        assert got == want, (
            f"{model} on the modeled H100, a {bandwidth / 1e9:g} GB/s link, blocks of {block_size}: "
            f"the engine's rule recomputes from {want} positions on, your answer is {got}"
        )


def test_crossover_uses_your_rule():
    cm = RooflineCostModel("H100-SXM", "llama-2-7b")
    want = _crossover_by_the_engines_rule(cm, 16e9, 16)
    with _engine_rule_switched_off():
        got = ex().swap_recompute_crossover(cm, 16e9)
    assert got == want, f"Llama-2-7B, 16 GB/s, blocks of 16: expected {want}, got {got}"
