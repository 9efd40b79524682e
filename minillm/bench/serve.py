"""``serve``: a load generator for any OpenAI-compatible server, and what its clients measure.

    python -m minillm.bench serve --trace FILE.jsonl --rate R --url http://127.0.0.1:8000
    python -m minillm.bench serve --write-trace FILE.jsonl [--trace-kind chat] [--size small]
    python -m minillm.bench serve --size tiny          # no --url: a server in this process

Replays a trace (JSONL: one request a line, ``prompt`` text or ``prompt_token_ids``, and
``output_len``, the format vLLM's benchmark tooling reads; ``minillm.analysis.workloads.save_jsonl`` writes
it) with the official ``openai`` client (``AsyncOpenAI``), streaming, as a Poisson process at
``--rate`` requests/s (or at the trace's own ``arrival_time``s without it). Reports, as the client
sees them, TTFT, TPOT, ITL and end-to-end latency percentiles and goodput under an SLO
(``--slo-ttft``, ``--slo-tpot``), computed by ``minillm.analysis.metrics.summarize``.

Without ``--url`` the server runs here (the shipped model), so each request's client-side times can
be put beside the engine's own ``RequestMetrics``: the difference is what lies outside the engine
(HTTP, the event loop, queueing before the step loop takes the request). Against a minillm server
at ``--url`` the engine's mean TTFT and TPOT come from its ``/metrics``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from ..analysis.metrics import percentile, summarize
from ..core.request import RequestMetrics
from .common import finish, pct, pick, progress, set_threads, table

NAME = "serve"
TRACE_KINDS = ("chat", "shared-prefix", "multi-turn", "flood")


# --------------------------------------------------------------------------------------
# Options (parsed after the common ones: python -m minillm.bench serve --url ... )
# --------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url", default=None, help="the server's base URL (http://host:port); none: start one in this process"
    )
    p.add_argument("--trace", default=None, help="JSONL trace to replay (default: a built --trace-kind)")
    p.add_argument(
        "--trace-kind",
        choices=TRACE_KINDS,
        default="chat",
        help="which of the series' traces to build when --trace is not given",
    )
    p.add_argument("--num-requests", type=int, default=None, help="replay only the first N (default: size's)")
    p.add_argument(
        "--rate",
        type=float,
        default=None,
        help="requests/s, Poisson arrivals ('inf': all at once); default: the trace's arrival times",
    )
    p.add_argument(
        "--write-trace", default=None, metavar="FILE.jsonl", help="write the built trace to this file and exit"
    )
    p.add_argument("--served-model", default=None, help="'model' sent with each request (default: the server's)")
    p.add_argument("--api-key", default=None, help="the server's API key")
    p.add_argument("--slo-ttft", type=float, default=1.0, help="goodput SLO on TTFT, seconds")
    p.add_argument("--slo-tpot", type=float, default=0.1, help="goodput SLO on TPOT, seconds")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="do not send vLLM's ignore_eos (requests may end before output_len)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def options(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with this benchmark's defaults filled in (``bench all`` does not parse them)."""
    p = argparse.ArgumentParser(add_help=False)
    add_arguments(p)
    defaults = vars(p.parse_args([]))
    for k, v in defaults.items():
        if not hasattr(args, k):
            setattr(args, k, v)
    return args


# --------------------------------------------------------------------------------------
# Traces
# --------------------------------------------------------------------------------------


@dataclass
class ReplayRequest:
    """What the client needs of a trace line."""

    request_id: str
    arrival_time: float
    prompt: Union[str, list[int]]
    output_len: int


def series_trace(kind: str, n: int, rate: Optional[float], vocab_size: int, seed: int = 0) -> list:
    """One of the series' workloads as ``TraceRequest``s with token-id prompts (``minillm.analysis.workloads``)."""
    from ..analysis.workloads import LogNormal, flood_trace, multi_turn_trace, shared_prefix_trace, synthetic_trace

    out_len = LogNormal(24, 0.8, lo=4, hi=128)
    if kind == "chat":
        return synthetic_trace(
            n,
            rate=rate,
            prompt_len=LogNormal(48, 0.8, lo=4, hi=384),
            output_len=out_len,
            vocab_size=vocab_size,
            seed=seed,
        )
    if kind == "shared-prefix":
        return shared_prefix_trace(
            n,
            prefix_len=64,
            suffix_len=LogNormal(16, 0.8, lo=1, hi=128),
            output_len=out_len,
            vocab_size=vocab_size,
            rate=rate,
            seed=seed,
        )
    if kind == "multi-turn":
        turns = 3
        return multi_turn_trace(
            max(1, n // turns),
            turns,
            system_len=32,
            user_len=LogNormal(16, 0.6, lo=2, hi=64),
            answer_len=out_len,
            vocab_size=vocab_size,
            seed=seed,
            rate=rate,
        )
    if kind == "flood":
        return flood_trace(
            num_flood=max(1, n * 3 // 4),
            num_polite=max(1, n // 8),
            prompt_len=32,
            output_len=out_len,
            vocab_size=vocab_size,
            seed=seed,
        )
    raise ValueError(f"trace kind {kind!r}: choose one of {TRACE_KINDS}")


def read_trace(path: Union[str, Path]) -> list[ReplayRequest]:
    """A JSONL trace (``minillm.analysis.workloads.load_jsonl``): ``prompt`` text or ``prompt_token_ids``, and
    ``output_len`` (vLLM's custom datasets call it ``output_tokens``)."""
    from ..analysis.workloads import load_jsonl

    return as_replay(load_jsonl(path))


def as_replay(trace: Sequence[Any]) -> list[ReplayRequest]:
    return [
        ReplayRequest(
            r.request_id,
            r.arrival_time,
            list(r.prompt_token_ids) if r.prompt_token_ids is not None else r.prompt,
            r.output_len,
        )
        for r in trace
    ]


def schedule(requests: Sequence[ReplayRequest], rate: Optional[float], seed: int = 0) -> list[float]:
    """Send times (seconds from the start): Poisson at ``rate``, all at 0 for ``inf``, else the trace's."""
    from ..analysis.workloads import make_arrivals

    if rate is None:
        t0 = min((r.arrival_time for r in requests), default=0.0)
        return [r.arrival_time - t0 for r in requests]
    return [float(t) for t in make_arrivals(len(requests), rate, "poisson", seed=seed)]


# --------------------------------------------------------------------------------------
# The client
# --------------------------------------------------------------------------------------


@dataclass
class ClientMetrics(RequestMetrics):
    """One request as the client saw it (seconds from the start of the run). ``token_times`` holds
    one time per streamed chunk; TPOT divides by the tokens the server counted (``usage``)."""

    response_id: Optional[str] = None
    error: Optional[str] = None
    status: Optional[int] = None

    @property
    def tpot(self) -> Optional[float]:
        if self.first_token_time is None or not self.token_times or self.num_output_tokens < 2:
            return None
        return (self.token_times[-1] - self.first_token_time) / (self.num_output_tokens - 1)


async def _one(client, model: str, r: ReplayRequest, t_start: float, ignore_eos: bool) -> ClientMetrics:
    import openai

    send = time.perf_counter()
    m = ClientMetrics(arrival_time=send - t_start)
    extra = {"ignore_eos": True} if ignore_eos else None
    try:
        stream = await client.completions.create(
            model=model,
            prompt=r.prompt,
            max_tokens=r.output_len,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
        async for chunk in stream:
            now = time.perf_counter() - t_start
            m.response_id = chunk.id
            if chunk.choices:
                if m.first_token_time is None:
                    m.first_token_time = now
                m.token_times.append(now)
                if chunk.choices[0].finish_reason is not None:
                    m.finish_reason = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                m.num_prompt_tokens = chunk.usage.prompt_tokens
                m.num_output_tokens = chunk.usage.completion_tokens
        m.finish_time = time.perf_counter() - t_start
        if m.num_output_tokens == 0:  # a server that sends no usage: one token per chunk
            m.num_output_tokens = len(m.token_times)
        if m.finish_reason is None:
            m.finish_reason = "stop"
    except openai.APIStatusError as e:
        m.status, m.error = e.status_code, str(e.message)
        m.finish_reason = "rejected" if e.status_code in (429, 503) else "abort"
    except Exception as e:  # a dropped connection, a timeout: counted, never hidden
        m.error, m.finish_reason = f"{type(e).__name__}: {e}", "abort"
    return m


async def replay(
    url: str,
    requests: Sequence[ReplayRequest],
    send_times: Sequence[float],
    *,
    model: Optional[str] = None,
    api_key: Optional[str] = None,
    max_concurrency: Optional[int] = None,
    ignore_eos: bool = True,
    show_progress: bool = True,
) -> list[ClientMetrics]:
    """Send each request at its time, streaming; one ``ClientMetrics`` per request, in trace order."""
    import httpx
    import openai

    limits = httpx.Limits(max_connections=max(1000, max_concurrency or 0), max_keepalive_connections=100)
    client = openai.AsyncOpenAI(
        base_url=url.rstrip("/") + "/v1",
        api_key=api_key or "none",
        max_retries=0,
        timeout=600.0,
        http_client=httpx.AsyncClient(limits=limits, timeout=600.0),
    )
    try:
        if model is None:
            model = (await client.models.list()).data[0].id
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = progress(len(requests), desc="serve", unit="req") if show_progress else None
        t_start = time.perf_counter()

        async def at(r: ReplayRequest, t: float) -> ClientMetrics:
            delay = t_start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                m = await _one(client, model, r, t_start, ignore_eos)
            else:
                async with sem:
                    m = await _one(client, model, r, t_start, ignore_eos)
            if bar is not None:
                bar.update(1)
            return m

        out = await asyncio.gather(*(at(r, t) for r, t in zip(requests, send_times)))
        if bar is not None:
            bar.close()
        return list(out)
    finally:
        await client.close()


def replay_in_background(
    url: str, requests: Sequence[ReplayRequest], send_times: Sequence[float], **kw
) -> concurrent.futures.Future:
    """:func:`replay` on its own event loop in a thread: returns at once with a Future of its
    ``ClientMetrics``, so the caller (a notebook, whose own event loop is busy running the cell)
    can watch the server meanwhile. ``kw``: :func:`replay`'s options."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="minillm-replay")
    future = pool.submit(asyncio.run, replay(url, requests, send_times, **kw))
    pool.shutdown(wait=False)  # the thread ends with the replay
    return future


# --------------------------------------------------------------------------------------
# Client vs engine
# --------------------------------------------------------------------------------------


def engine_request_id(response_id: Optional[str]) -> Optional[str]:
    """minillm's response ids are ``cmpl-<engine request id>``."""
    if not response_id:
        return None
    return response_id.split("-", 1)[1] if "-" in response_id else response_id


def engine_metrics(server, client: Sequence[ClientMetrics]) -> dict:
    """The engine's own ``RequestMetrics`` of the requests ``client`` sent, by engine request id,
    read on the engine thread of ``server`` (a ``minillm.serve.BackgroundServer``)."""
    ids = {engine_request_id(c.response_id) for c in client}
    return server.engine_call(lambda e: {i: e.requests[i].metrics for i in ids if i in e.requests})


def compare(client: Sequence[ClientMetrics], engine: dict) -> dict:
    """Per request: client TTFT - engine TTFT (the overhead: >= 0, since the client's interval
    contains the engine's) and the same for end-to-end latency; percentiles of both sides."""
    pairs = [
        (c, engine[engine_request_id(c.response_id)])
        for c in client
        if c.error is None and engine_request_id(c.response_id) in engine
    ]
    pairs = [(c, e) for c, e in pairs if c.ttft is not None and e.ttft is not None]
    d_ttft = [c.ttft - e.ttft for c, e in pairs]
    d_e2e = [c.e2e_latency - e.e2e_latency for c, e in pairs if c.e2e_latency is not None and e.e2e_latency is not None]
    out: dict[str, Any] = {"num_paired": len(pairs)}
    for name, get in (("ttft", lambda m: m.ttft), ("tpot", lambda m: m.tpot), ("e2e", lambda m: m.e2e_latency)):
        for side, idx in (("client", 0), ("engine", 1)):
            vals = [get(p[idx]) for p in pairs if get(p[idx]) is not None]
            for q in (50, 90, 99):
                out[f"{name}_p{q}_{side}"] = percentile(vals, q)
    for name, d in (("ttft", d_ttft), ("e2e", d_e2e)):
        out[f"overhead_{name}_min"] = min(d) if d else None
        for q in (50, 90, 99):
            out[f"overhead_{name}_p{q}"] = percentile(d, q)
        out[f"overhead_{name}_max"] = max(d) if d else None
    return out


def scrape_engine_means(url: str, api_key: Optional[str] = None) -> Optional[dict]:
    """A minillm server's ``/metrics``: (sum, count) of its TTFT and TPOT histograms; None elsewhere."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(url.rstrip("/") + "/metrics", timeout=10.0).text
        sums: dict = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                for key in ("time_to_first_token_seconds", "time_per_output_token_seconds"):
                    if s.name in (f"minillm:{key}_sum", f"minillm:{key}_count"):
                        sums[s.name] = sums.get(s.name, 0.0) + s.value
        return sums or None
    except Exception:
        return None


def _mean_between(before: Optional[dict], after: Optional[dict], key: str) -> Optional[float]:
    if not before or not after:
        return None
    s = after.get(f"minillm:{key}_sum", 0) - before.get(f"minillm:{key}_sum", 0)
    n = after.get(f"minillm:{key}_count", 0) - before.get(f"minillm:{key}_count", 0)
    return s / n if n else None


# --------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------

SIZE = dict(tiny=dict(n=8, rate=8.0), small=dict(n=64, rate=8.0), full=dict(n=256, rate=8.0))


def _vocab_size() -> int:
    from .common import SHIPPED_SHAPE, shipped_model_available

    if shipped_model_available():
        from ..model.loader import DEFAULT_MODEL_DIR

        return int(json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())["vocab_size"])
    return SHIPPED_SHAPE["vocab_size"]


def run(size: str, args) -> dict:
    args = options(args)
    P = pick(size, SIZE["tiny"], SIZE["small"], SIZE["full"])
    n = args.num_requests or P["n"]
    rate = args.rate if args.rate is not None else (P["rate"] if args.trace is None else None)
    if args.trace is not None:
        requests = read_trace(args.trace)[:n]
        source = str(args.trace)
    else:
        requests = as_replay(series_trace(args.trace_kind, n, None, _vocab_size(), args.seed))[:n]
        source = f"{args.trace_kind} trace ({n} requests, seed {args.seed})"
    times = schedule(requests, rate, args.seed)
    server, url, engine_side = None, args.url, None
    if url is None:
        server = _local_server(args)
        url = server.url
    try:
        before = scrape_engine_means(url)
        t0 = time.perf_counter()
        client = asyncio.run(
            replay(
                url,
                requests,
                times,
                model=args.served_model,
                api_key=args.api_key,
                max_concurrency=args.max_concurrency,
                ignore_eos=not args.no_ignore_eos,
                show_progress=not args.no_progress,
            )
        )
        wall = time.perf_counter() - t0
        after = scrape_engine_means(url)
        if server is not None:
            engine_side = engine_metrics(server, client)
    finally:
        if server is not None:
            server.stop()
    s = summarize(client, slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot)
    res: dict[str, Any] = {"client": s, "wall_s": wall, "errors": sorted({c.error for c in client if c.error})[:5]}
    res["engine_mean_ttft"] = _mean_between(before, after, "time_to_first_token_seconds")
    res["engine_mean_tpot"] = _mean_between(before, after, "time_per_output_token_seconds")
    if engine_side is not None:
        res["comparison"] = compare(client, engine_side)
    return {
        "config": {
            "url": args.url or "in-process (shipped model)",
            "trace": source,
            "num_requests": len(requests),
            "rate": rate,
            "slo_ttft": args.slo_ttft,
            "slo_tpot": args.slo_tpot,
            "max_concurrency": args.max_concurrency,
        },
        "results": res,
    }


def _local_server(args):
    from ..async_llm import AsyncLLM
    from ..serve import BackgroundServer
    from .common import make_llm

    set_threads(args)
    llm, label = make_llm(block_size=16, max_model_len=512, max_num_seqs=64, device=args.device)
    print(f"[serve] in-process server: {label}")
    return BackgroundServer(llm=AsyncLLM(llm.engine), api_key=args.api_key).start()


def tables(result: dict) -> list[str]:
    s, res = result["results"]["client"], result["results"]
    ms = lambda v: None if v is None else 1000 * v  # noqa: E731
    rows = [
        [name.upper()] + [ms(s.get(f"{name}_{k}")) for k in ("mean", "p50", "p90", "p99", "max")]
        for name in ("ttft", "tpot", "itl", "e2e")
    ]
    out = [table(["client-side (ms)", "mean", "p50", "p90", "p99", "max"], rows, title="latency as the client sees it")]
    out.append(
        table(
            ["requests", "finished", "rejected", "errors", "output tok/s", "req/s", "goodput req/s", "SLO attainment"],
            [
                [
                    s["num_requests"],
                    s["num_finished"],
                    s["num_rejected"],
                    s["num_aborted"],
                    s["output_throughput"],
                    s["request_throughput"],
                    s["goodput_requests_per_s"],
                    pct(s["slo_attainment"]),
                ]
            ],
            title=f"throughput and goodput (SLO: TTFT <= {s['slo_ttft']}s, TPOT <= {s['slo_tpot']}s)",
        )
    )
    c = res.get("comparison")
    if c:
        rows = [
            [f"{name.upper()} p{q}", ms(c[f"{name}_p{q}_engine"]), ms(c[f"{name}_p{q}_client"])]
            for name in ("ttft", "tpot", "e2e")
            for q in (50, 90, 99)
        ]
        out.append(
            table(
                ["metric (ms)", "engine", "client"],
                rows,
                title=f"client vs engine, {c['num_paired']} requests paired by id",
            )
        )
        out.append(
            table(
                ["overhead (ms)", "min", "p50", "p90", "p99", "max"],
                [
                    [f"{k.upper()} client - engine"]
                    + [ms(c[f"overhead_{k}_{q}"]) for q in ("min", "p50", "p90", "p99", "max")]
                    for k in ("ttft", "e2e")
                ],
                title="what lies outside the engine",
            )
        )
    elif res.get("engine_mean_ttft") is not None:
        out.append(
            table(
                ["mean (ms)", "engine (/metrics)", "client"],
                [
                    ["TTFT", ms(res["engine_mean_ttft"]), ms(s["ttft_mean"])],
                    ["TPOT", ms(res["engine_mean_tpot"]), ms(s["tpot_mean"])],
                ],
                title="client vs the server's own /metrics",
            )
        )
    if res["errors"]:
        out.append("errors: " + "; ".join(res["errors"]))
    return out


def goals(result: dict) -> list[dict]:
    from .common import goal

    s, c = result["results"]["client"], result["results"].get("comparison")
    g = [
        goal(
            "every request finished", f"{s['num_requests']}", s["num_finished"], s["num_finished"] == s["num_requests"]
        )
    ]
    if c and c["num_paired"]:
        ok = c["overhead_ttft_min"] >= 0 and all(
            c[f"ttft_p{q}_engine"] <= c[f"ttft_p{q}_client"] <= c[f"ttft_p{q}_engine"] + c["overhead_ttft_max"]
            for q in (50, 90, 99)
        )
        g.append(
            goal(
                "client TTFT percentiles = engine's + overhead",
                "engine <= client <= engine + max overhead",
                f"p50 {1000 * c['ttft_p50_engine']:.1f} -> {1000 * c['ttft_p50_client']:.1f} ms",
                ok,
            )
        )
    return g


def main(args) -> dict:
    args = options(args)
    if args.write_trace:
        P = pick(args.size, SIZE["tiny"], SIZE["small"], SIZE["full"])
        n = args.num_requests or P["n"]
        from ..analysis.workloads import save_jsonl

        trace = series_trace(
            args.trace_kind, n, args.rate if args.rate is not None else P["rate"], _vocab_size(), args.seed
        )
        save_jsonl(trace, args.write_trace)
        print(f"wrote {len(trace)} requests ({args.trace_kind}) to {args.write_trace}")
        return {"trace": args.write_trace, "num_requests": len(trace)}
    t0 = time.perf_counter()
    result = run(args.size, args)
    result["goals"] = goals(result)
    result["command"] = command(args)
    return finish(NAME, args, result, tables(result), t0)


def command(args) -> str:
    cmd = f"python -m minillm.bench serve --size {args.size}"
    for flag, v in (
        ("--url", args.url),
        ("--trace", args.trace),
        ("--rate", args.rate),
        ("--num-requests", args.num_requests),
    ):
        if v is not None:
            cmd += f" {flag} {v}"
    if args.trace is None and args.trace_kind != "chat":
        cmd += f" --trace-kind {args.trace_kind}"
    return cmd
