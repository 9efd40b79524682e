"""router: N data-parallel replicas behind three routers, on shared-prefix and multi-turn traces.

Every replica is a simulated engine (the engine's own scheduler and paged KV with prefix caching,
a modeled H100 clock for Llama-2-7B); ``minillm.sim.cluster.run_replicas`` advances them together
and asks the router at each arrival. Compared side by side on the same trace:

* ``round-robin``: blind to load and content;
* ``least-tokens``: the replica with the fewest outstanding tokens;
* ``prefix-aware``: consistent hashing on the prompt's first 4 KV blocks, bounded at 1.25x the
  mean load (Mirrokni et al., "consistent hashing with bounded loads").

Measured: prefix-cache hit rate (blocks found / blocks looked up, over all replicas), TTFT p50/p99
and goodput under a TTFT + TPOT SLO, on the modeled clock; and the simulator's wall time, which
is what bounds the trace size (``--size full`` is 100,000 requests per trace).
"""

from __future__ import annotations

import time

from .common import finish, goal, pick, set_threads, table

NAME = "router"
ROUTER_NAMES = ("round-robin", "least-tokens", "prefix-aware")
SLO = dict(slo_ttft=0.5, slo_tpot=0.05)


def _sizes(size: str) -> dict:
    return pick(
        size,
        tiny=dict(n=240, replicas=4, rate=60.0),
        small=dict(n=10_000, replicas=8, rate=160.0),
        full=dict(n=100_000, replicas=8, rate=160.0),
    )


def traces(n: int, rate: float, seed: int = 0) -> dict:
    """The two traces of about ``n`` requests each: 31 applications' system prompts (512 tokens)
    before a unique question; and conversations of 5 turns, each with its own system prompt.
    Request i of the first uses prompt i mod 31, and an odd number of conversations start in
    each round: counts that share no factor with the replicas', so round robin does not land
    each prefix on the same replica by arithmetic coincidence."""
    from ..analysis.workloads import LogNormal, multi_turn_trace, shared_prefix_trace

    shared = shared_prefix_trace(
        n,
        prefix_len=512,
        suffix_len=LogNormal(64, 0.6, 8, 512),
        output_len=LogNormal(96, 0.7, 4, 512),
        vocab_size=32000,
        rate=rate,
        num_prefixes=31,
        seed=seed,
    )
    turns = 5
    convs = multi_turn_trace(
        (n // turns) | 1,
        turns,
        system_len=256,
        user_len=LogNormal(48, 0.6, 8, 256),
        answer_len=LogNormal(96, 0.7, 4, 384),
        vocab_size=32000,
        think_time=4.0,
        seed=seed,
        rate=rate / turns,
        shared_system=False,
    )
    return {"shared-prefix": shared, "multi-turn": convs}


def run(args) -> dict:
    from ..sim.cluster import run_replicas

    P = _sizes(args.size)
    set_threads(args)
    res: dict = {}
    rows = []
    for tname, trace in traces(P["n"], P["rate"], args.seed).items():
        res[tname] = {}
        for r in ROUTER_NAMES:
            t0 = time.perf_counter()
            _, s = run_replicas(trace, r, P["replicas"], model="llama-2-7b", hardware="H100-SXM", **SLO)
            wall = time.perf_counter() - t0
            keep = {
                k: s[k]
                for k in (
                    "num_requests",
                    "num_finished",
                    "prefix_cache_hit_rate",
                    "ttft_p50",
                    "ttft_p99",
                    "tpot_p50",
                    "goodput_requests_per_s",
                    "slo_attainment",
                    "requests_per_instance",
                    "steps",
                    "duration",
                )
            }
            keep["wall_s"] = wall
            res[tname][r] = keep
            rows.append(
                [
                    tname,
                    r,
                    len(trace),
                    keep["prefix_cache_hit_rate"],
                    keep["ttft_p50"] * 1e3,
                    keep["ttft_p99"] * 1e3,
                    keep["goodput_requests_per_s"],
                    keep["slo_attainment"],
                    max(keep["requests_per_instance"]) / (len(trace) / P["replicas"]),
                    wall,
                ]
            )
    cfg = dict(
        model="llama-2-7b (shape only)",
        hardware="H100-SXM, 1 GPU per replica",
        replicas=P["replicas"],
        rate=P["rate"],
        requests_per_trace=P["n"],
        prefix_aware="first 4 blocks, load bound 1.25x mean",
        **SLO,
    )
    t = table(
        [
            "trace",
            "router",
            "requests",
            "prefix hit rate",
            "TTFT p50 (ms)",
            "TTFT p99 (ms)",
            "goodput (req/s)",
            "SLO attainment",
            "busiest / even share",
            "wall (s)",
        ],
        rows,
        title=f"{P['replicas']} replicas, {P['rate']:g} req/s, modeled clock; wall = simulator time",
    )
    goals = []
    for tname in res:
        rr, pa = res[tname]["round-robin"], res[tname]["prefix-aware"]
        goals.append(
            goal(
                f"{tname}: prefix-aware hit rate above round robin",
                "> round robin",
                f"{pa['prefix_cache_hit_rate']:.3f} vs {rr['prefix_cache_hit_rate']:.3f}",
                pa["prefix_cache_hit_rate"] > rr["prefix_cache_hit_rate"],
            )
        )
        goals.append(
            goal(
                f"{tname}: every request finishes",
                str(rr["num_requests"]),
                min(x["num_finished"] for x in res[tname].values()),
                all(x["num_finished"] == x["num_requests"] for x in res[tname].values()),
            )
        )
    return dict(config=cfg, results=res, goals=goals, _tables=[t])


def main(args) -> dict:
    t0 = time.perf_counter()
    r = run(args)
    return finish(NAME, args, r, r.pop("_tables"), t0)
