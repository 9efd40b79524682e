"""The OpenAI-compatible server, driven by the official ``openai`` client over real HTTP.

One server (in a thread of this process, on a free localhost port) with the shipped model and a
small KV cache serves every test; a second one checks the API key and the full-queue answer.
"""

import asyncio
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from minillm import LLM, SamplingParams
from minillm.serve import BackgroundServer
from minillm.serve.chat import PLAIN_STOP, plain_template

CONFIG = dict(block_size=16, num_kv_blocks=96, max_model_len=256, max_num_seqs=64)
PROMPTS = ["ROMEO:", "First Citizen:\nBefore we proceed", "To be, or not"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # slow: starts the HTTP server


@pytest.fixture(scope="module", params=["thread", "process"])
def server(request):
    """The server, its engine stepped on a thread of this process or in a process of its own."""
    with BackgroundServer(engine_process=request.param == "process", **CONFIG) as s:
        yield s


def _fail_next_step(engine):
    """Run on the engine (thread or process): its next step raises, the one after runs as usual."""
    real_step = engine.step

    def failing_step():
        engine.step = real_step  # fail once
        raise RuntimeError("injected failure")

    engine.step = failing_step


@pytest.fixture(scope="module")
def reference():
    """LLM.generate on the same model and configuration, one prompt at a time."""
    return LLM(**CONFIG)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    return predicate()


def _assert_openai_error(resp: httpx.Response, status: int, param=None):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert {"message", "type", "param", "code"} <= set(body["error"])
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    return body["error"]


def test_greedy_completions_equal_llm_generate(client, reference, server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["shakespeare"]
    for prompt in PROMPTS:
        sp = SamplingParams(temperature=0, max_tokens=24)
        want = reference.generate([prompt], sp)[0]
        got = client.completions.create(
            model="shakespeare", prompt=prompt, max_tokens=24, temperature=0, extra_body={"return_token_ids": True}
        )
        choice = got.choices[0]
        assert choice.token_ids == want.token_ids
        assert choice.text == want.text
        assert choice.finish_reason == want.finish_reason
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.usage.completion_tokens == len(want.token_ids)
        assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    # token ids as the prompt, as vLLM's benchmark sends them
    ids = reference.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    got = client.completions.create(model="shakespeare", prompt=ids, max_tokens=8, temperature=0)
    assert got.choices[0].text == reference.generate([ids], SamplingParams(temperature=0, max_tokens=8))[0].text


def test_n_completions_logprobs_and_penalties(client, reference):
    """OpenAI's n (parallel sampling: the samples share the prompt's KV blocks), logprobs and
    penalties pass through to the engine: the same completions as LLM.generate gives."""
    from minillm.core.parallel_sampling import completion_seed

    kw = dict(temperature=1.0, max_tokens=12, seed=21, presence_penalty=0.5, frequency_penalty=0.3)
    want = reference.generate(
        ["ROMEO:"], SamplingParams(**kw, n=3, logprobs=2, repetition_penalty=1.2, ignore_eos=True)
    )[0]
    got = client.completions.create(
        model="shakespeare",
        prompt="ROMEO:",
        n=3,
        logprobs=2,
        **kw,
        extra_body={"return_token_ids": True, "ignore_eos": True, "repetition_penalty": 1.2},
    )
    assert [c.index for c in got.choices] == [0, 1, 2]
    for c, w in zip(got.choices, want.outputs):
        assert c.token_ids == w.token_ids and c.text == w.text
        # the engine process runs its own torch (its thread count, its batch order): the same
        # tokens, logprobs equal to float32 rounding
        want_logprobs = [lp[t].logprob for lp, t in zip(w.logprobs, w.token_ids)]
        assert c.logprobs.token_logprobs == pytest.approx(want_logprobs, rel=1e-5, abs=1e-5)
        assert all(len(top) >= 2 for top in c.logprobs.top_logprobs)
    assert got.usage.completion_tokens == sum(len(c.token_ids) for c in got.choices)
    # The same, streamed: the chunks of the three completions interleave, each with its index.
    stream = client.completions.create(
        model="shakespeare",
        prompt="ROMEO:",
        n=3,
        stream=True,
        **kw,
        extra_body={"return_token_ids": True, "ignore_eos": True, "repetition_penalty": 1.2},
    )
    ids = {0: [], 1: [], 2: []}
    for chunk in stream:
        for c in chunk.choices:
            ids[c.index] += c.token_ids
    assert [ids[i] for i in range(3)] == [w.token_ids for w in want.outputs]
    # Chat: logprobs of each token and the top alternatives.
    chat = client.chat.completions.create(
        model="shakespeare",
        messages=[{"role": "user", "content": "Speak."}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        n=2,
    )
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content
    content = chat.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in content)
    assert completion_seed(21, 0) == 21


def test_streaming_yields_the_same_tokens_in_order(client, reference):
    prompt = PROMPTS[1]
    want = reference.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    stream = client.completions.create(
        model="shakespeare",
        prompt=prompt,
        max_tokens=30,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    chunks = list(stream)
    token_chunks = [c for c in chunks if c.choices]
    assert len(token_chunks) > 1  # streamed, not one block at the end
    ids = [t for c in token_chunks for t in c.choices[0].token_ids]
    assert ids == want.token_ids
    assert "".join(c.choices[0].text for c in token_chunks) == want.text
    assert [c.choices[0].finish_reason for c in token_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in token_chunks[:-1])
    assert chunks[-1].usage.completion_tokens == 30 and not chunks[-1].choices
    assert len({c.id for c in chunks}) == 1


def test_sse_wire_format(server):
    body = {"model": "shakespeare", "prompt": "ROMEO:", "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for e in events[:-2]:
        assert e.startswith("data: ")
        assert json.loads(e[len("data: ") :])["object"] == "text_completion"


def test_chat_uses_the_plain_template(client, reference):
    messages = [
        {"role": "system", "content": "A scene in Verona."},
        {"role": "user", "name": "Romeo", "content": "What light through yonder window breaks?"},
    ]
    prompt = plain_template(messages)
    assert prompt.endswith("ROMEO:\nWhat light through yonder window breaks?\n\nASSISTANT:\n")
    assert reference.tokenizer.chat_template is None  # the shipped model has none
    got = client.chat.completions.create(model="shakespeare", messages=messages, max_tokens=40, temperature=0)
    full = reference.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0].text
    cut = min([full.find(s) for s in PLAIN_STOP if s in full] or [len(full)])
    assert got.choices[0].message.content == full[:cut]
    assert got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(reference.tokenizer.encode(prompt, add_special_tokens=False))
    stream = client.chat.completions.create(
        model="shakespeare", messages=messages, max_tokens=40, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == got.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == got.choices[0].finish_reason


def test_stop_strings_end_the_text_where_a_string_search_says_as_llm_generate_does(client, reference, server):
    """Stop strings are the engine's (SamplingParams.stop) on the server too: the text, whole or
    streamed, ends where a plain search of the unstopped text finds the stop (after it with
    vLLM's include_stop_str_in_output), the same text and tokens as LLM.generate with that stop,
    and the engine finishes the request itself ("stop", the string as its stop_reason, which the
    choice carries as vLLM's does)."""
    full = reference.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=40))[0].text
    body = full.strip()
    for stop in (body[:3], body[4:6], body[8:16]):  # stops of 3, 2 and 8 characters
        at = full.find(stop)
        for include in (False, True):
            want_text = full[: at + len(stop)] if include else full[:at]
            want = reference.generate(
                [PROMPTS[0]],
                SamplingParams(temperature=0, max_tokens=40, stop=[stop], include_stop_str_in_output=include),
            )[0]
            assert want.text == want_text
            kw = dict(
                model="shakespeare",
                prompt=PROMPTS[0],
                max_tokens=40,
                temperature=0,
                stop=[stop],
                extra_body={"include_stop_str_in_output": include, "return_token_ids": True},
            )
            got = client.completions.create(**kw)
            assert got.choices[0].text == want_text
            assert got.choices[0].token_ids == want.token_ids
            assert (got.choices[0].finish_reason, got.choices[0].stop_reason) == ("stop", stop)
            rid = got.id.split("-", 1)[1]
            assert server.engine_call(lambda e: (e.requests[rid].finish_reason, e.requests[rid].stop_reason)) == (
                "stop",
                stop,
            )
            chunks = list(client.completions.create(**kw, stream=True))
            assert "".join(c.choices[0].text for c in chunks) == want_text
            assert [t for c in chunks for t in c.choices[0].token_ids] == want.token_ids
            assert (chunks[-1].choices[0].finish_reason, chunks[-1].choices[0].stop_reason) == ("stop", stop)


def test_64_concurrent_streaming_clients_all_finish(server):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        async def one(i):
            stream = await aclient.completions.create(
                model="shakespeare",
                prompt=f"{PROMPTS[i % 3]} {i}",
                max_tokens=8,
                temperature=0.8,
                seed=i,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            finish, usage = None, None
            async for c in stream:
                if c.choices and c.choices[0].finish_reason:
                    finish = c.choices[0].finish_reason
                if c.usage:
                    usage = c.usage
            return finish, usage.completion_tokens

        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await aclient.close()

    results = asyncio.run(main())
    assert results == [("length", 8)] * 64
    load = server.call(server.llm.load())
    assert load["running"] == load["waiting"] == 0
    assert load["kv_blocks_free"] == load["kv_blocks_total"]


def test_a_client_that_disconnects_frees_its_kv(client, server):
    total = server.engine_call(lambda e: e.num_kv_blocks)
    stream = client.completions.create(
        model="shakespeare",
        prompt=PROMPTS[0],
        max_tokens=240,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    it = iter(stream)
    first = next(it)
    next(it), next(it)
    rid = first.id.split("-", 1)[1]
    held = server.engine_call(lambda e: e.kv.num_held_blocks(rid))
    assert held >= 1
    stream.close()  # the client goes away mid-stream
    state = _wait_for(
        lambda: (
            server.engine_call(
                lambda e: (e.requests[rid].finish_reason, e.kv.num_held_blocks(rid), e.kv.num_free_blocks)
            )
            if server.engine_call(lambda e: e.requests[rid].finish_reason)
            else None
        )
    )
    assert state == ("abort", 0, total)
    n_out = server.engine_call(lambda e: e.requests[rid].num_output_tokens)
    assert n_out < 240  # stopped early, not run to the end
    assert server.engine_call(lambda e: e.stats())["steps"] > 0
    # A client that gives up on a whole (non-streamed) answer is aborted too.
    before = server.engine_call(lambda e: set(e.requests))
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            server.url + "/v1/completions",
            timeout=0.5,
            json={"prompt": PROMPTS[0], "max_tokens": 240, "temperature": 0, "ignore_eos": True},
        )
    (rid,) = server.engine_call(lambda e: set(e.requests)) - before
    assert _wait_for(lambda: server.engine_call(lambda e: e.requests[rid].finish_reason)) == "abort"
    assert _wait_for(lambda: server.engine_call(lambda e: e.kv.num_free_blocks) == total)


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(client, server):
    url = server.url + "/v1/completions"
    good = {"model": "shakespeare", "prompt": "ROMEO:", "max_tokens": 3, "temperature": 0}
    cases = [
        (dict(content=b'{"model": "shakespeare", "prompt": '), 400, None),  # malformed JSON
        (dict(json={**good, "model": "gpt-9"}), 404, "model"),  # unknown model
        (dict(json={**good, "max_tokens": -5}), 400, "max_tokens"),  # engine's check
        (dict(json={**good, "prompt": "x" * 400}), 400, "prompt"),  # longer than context
        (dict(json={**good, "temperature": -1}), 400, "temperature"),
        (dict(json={**good, "max_tokens": "many"}), 400, "max_tokens"),  # wrong type
        (dict(json={**good, "max_tokens": True}), 400, "max_tokens"),  # a bool is no count
        (dict(json={**good, "prompt": [5, True]}), 400, "prompt"),  # nor a token id
        (dict(json={**good, "best_of": 0}), 400, "best_of"),
        (dict(json={**good, "n": 0}), 400, "n"),
        (dict(json={**good, "presence_penalty": 5}), 400, "presence_penalty"),
        (dict(json={k: v for k, v in good.items() if k != "prompt"}), 400, "prompt"),  # missing field
        (dict(json=[1, 2]), 400, None),  # not an object
        (dict(json={**good, "prompt": [5, 10**9]}), 400, "prompt"),  # id outside vocab
    ]
    for kwargs, status, param in cases:
        headers = {"content-type": "application/json"}
        err = _assert_openai_error(httpx.post(url, headers=headers, timeout=30, **kwargs), status, param)
        assert err["type"] in ("invalid_request_error", "not_found_error")
        # ...and the server still answers a good request
        assert httpx.post(url, json=good, timeout=30).status_code == 200
    # the same errors through the official client, streaming too
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="shakespeare", prompt="x", max_tokens=-1, stream=True)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.chat.completions.create(model="shakespeare", messages=[{"role": "user", "content": "x" * 400}])
    _assert_openai_error(httpx.get(server.url + "/v1/nothing-here"), 404)
    _assert_openai_error(httpx.get(url), 405)
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_a_failed_step_ends_the_requests_in_flight_and_serving_goes_on(client, server):
    server.engine_call(_fail_next_step)
    with pytest.raises(openai.InternalServerError, match="injected failure"):
        client.completions.create(model="shakespeare", prompt="ROMEO:", max_tokens=4)
    assert client.completions.create(model="shakespeare", prompt="ROMEO:", max_tokens=4).usage.completion_tokens == 4
    # Mid-stream: the stream ends with an error event (the 200 was sent), the request is aborted.
    stream = iter(
        client.completions.create(
            model="shakespeare", prompt="ROMEO:", max_tokens=200, stream=True, extra_body={"ignore_eos": True}
        )
    )
    rid = next(stream).id.split("-", 1)[1]
    server.engine_call(_fail_next_step)
    with pytest.raises(openai.APIError, match="injected failure"):
        list(stream)
    assert server.engine_call(lambda e: e.requests[rid].finish_reason) == "abort"
    assert client.completions.create(model="shakespeare", prompt="ROMEO:", max_tokens=4).usage.completion_tokens == 4
    assert server.engine_call(lambda e: e.has_unfinished_requests()) is False


def test_metrics_parse_as_prometheus_text(client, server):
    client.completions.create(model="shakespeare", prompt="ROMEO:", max_tokens=4, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "minillm:num_requests_running",
        "minillm:num_requests_waiting",
        "minillm:kv_cache_usage_perc",
        "minillm:num_preemptions",
        "minillm:time_to_first_token_seconds",
        "minillm:time_per_output_token_seconds",
        "minillm:request_finished",
    ):
        assert name in families, name
    samples = {s.name: s.value for f in families.values() for s in f.samples if not s.labels.get("le")}
    assert samples["minillm:time_to_first_token_seconds_count"] >= 1
    assert samples["minillm:time_to_first_token_seconds_sum"] > 0
    assert 0.0 <= samples["minillm:kv_cache_usage_perc"] <= 1.0
    assert samples["minillm:num_requests_running"] == 0

    def requests_done(e):  # one per request, however many completions (n) it had
        reasons = {}
        for rid, r in e.requests.items():
            reasons.setdefault(e.parent_id(rid), []).append(r.finish_reason)
        return sum(all(f in ("stop", "length") for f in fs) for fs in reasons.values())

    finished = server.engine_call(requests_done)
    assert samples["minillm:time_to_first_token_seconds_count"] == finished


def test_api_key_and_a_full_queue():
    with BackgroundServer(
        api_key="sesame", block_size=16, num_kv_blocks=64, max_model_len=256, max_num_seqs=1, max_queue_len=0
    ) as s:
        base = s.url + "/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
        err = _assert_openai_error(httpx.get(base + "/models"), 401)
        assert err["code"] == "invalid_api_key"
        assert httpx.get(s.url + "/health").status_code == 200  # health and metrics stay open
        assert httpx.get(s.url + "/metrics").status_code == 200
        client = openai.OpenAI(base_url=base, api_key="sesame", max_retries=0, timeout=60)
        assert client.models.list().data[0].id == "shakespeare"
        # One request runs (max_num_seqs=1); a second one waits beyond max_queue_len=0: rejected.
        long = client.completions.create(
            model="shakespeare",
            prompt="ROMEO:",
            max_tokens=200,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        it = iter(long)
        next(it)
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="shakespeare", prompt="JULIET:", max_tokens=4)
        assert e.value.status_code in (429, 503)
        assert "queue full" in e.value.body["message"]
        assert sum(1 for _ in it) > 0  # the running one goes on
        assert client.completions.create(model="shakespeare", prompt="JULIET:", max_tokens=4).usage


def test_load_generator_percentiles_match_the_engine_within_the_overhead(server, tmp_path):
    from minillm.bench import serve as bench
    from minillm.analysis.metrics import percentile, summarize
    from minillm.analysis.workloads import save_jsonl

    trace = bench.series_trace("chat", 8, None, vocab_size=1024, seed=1)
    path = tmp_path / "trace.jsonl"
    save_jsonl(trace, path)
    with open(path, "a", encoding="utf-8") as f:  # a vLLM-style line: text prompt and output_len only
        f.write(json.dumps({"prompt": "ROMEO:", "output_len": 6}) + "\n")
    requests = bench.read_trace(path)
    assert len(requests) == 9 and requests[-1].prompt == "ROMEO:"
    times = bench.schedule(requests, rate=10.0, seed=0)
    client_side = asyncio.run(bench.replay(server.url, requests, times, show_progress=False))
    assert [c.error for c in client_side] == [None] * 9
    assert [c.num_output_tokens for c in client_side] == [r.output_len for r in requests]
    ids = [bench.engine_request_id(c.response_id) for c in client_side]
    engine = server.engine_call(lambda e: {i: e.requests[i].metrics for i in ids})
    # Per request: the client's interval contains the engine's, so the overhead is >= 0 ...
    d_ttft = [c.ttft - engine[i].ttft for c, i in zip(client_side, ids)]
    d_e2e = [c.e2e_latency - engine[i].e2e_latency for c, i in zip(client_side, ids)]
    assert min(d_ttft) >= 0 and min(d_e2e) >= 0
    # ... and each percentile of the client's lies between the engine's and the engine's + the overhead.
    cmp = bench.compare(client_side, engine)
    assert cmp["num_paired"] == 9
    for name, d in (("ttft", max(d_ttft)), ("e2e", max(d_e2e))):
        for q in (50, 90, 99):
            e, c = cmp[f"{name}_p{q}_engine"], cmp[f"{name}_p{q}_client"]
            assert e <= c <= e + d + 1e-9, (name, q, e, c, d)
    # TPOT: the first and last tokens are each late by at most the overhead.
    for c, i in zip(client_side, ids):
        n = c.num_output_tokens
        if n > 1:
            assert abs(c.tpot - engine[i].tpot) <= max(d_ttft + d_e2e) / (n - 1) + 1e-9
    s = summarize(client_side, slo_ttft=60.0, slo_tpot=60.0)
    assert s["num_finished"] == 9 and s["slo_attainment"] == 1.0
    assert s["ttft_p50"] == percentile([c.ttft for c in client_side], 50)


def test_a_monitor_follows_the_served_engine_while_a_background_replay_runs(server):
    """notebook 00's section 5: the load generator in a thread of its own, an EngineMonitor drawing
    the engine the server steps; the monitor ends up with every step the engine took, in order,
    the replay's requests are the engine's, and the monitor refuses to step an engine it does not own."""
    from minillm.bench import serve as bench
    from minillm.viz import EngineMonitor

    if server.llm.engine.__class__.__name__ != "LLMEngine":
        pytest.skip("the monitor draws an engine of this process; the engine process's stays there")
    monitor = EngineMonitor(server.llm.engine, read=server.engine_call)
    before = len(monitor.records)
    requests = [bench.ReplayRequest(f"m{i}", 0.0, PROMPTS[i % 3], 8) for i in range(6)]
    future = bench.replay_in_background(server.url, requests, [0.01 * i for i in range(6)], show_progress=False)
    taken = monitor.follow(until=future.done, interval=0.05, timeout=120)
    client_side = future.result()
    assert [c.error for c in client_side] == [None] * 6
    engine = bench.engine_metrics(server, client_side)
    assert sorted(engine) == sorted(bench.engine_request_id(c.response_id) for c in client_side)
    steps = [r.step for r in monitor.records]
    assert taken == len(steps) - before > 0 and steps == sorted(set(steps))
    assert steps[-1] == server.engine_call(lambda e: e.step_records[-1].step)
    served = {e.request_id for r in monitor.records[before:] for e in r.batch}
    assert set(engine) <= served
    assert monitor.shown is monitor.records[-1]
    with pytest.raises(TypeError, match="poll"):
        monitor.step()


def test_a_background_server_says_whether_it_runs():
    s = BackgroundServer("random", block_size=16, num_kv_blocks=16, max_model_len=64)
    assert not s.running
    with s:
        assert s.running
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200
    assert not s.running


def test_command_line_serves(tmp_path):
    """``python -m minillm.serve`` with engine options, as ``make serve`` runs it."""
    import os
    import socket
    import subprocess
    import sys
    from minillm.serve.__main__ import engine_config_fields, make_parser

    args = make_parser().parse_args(
        [
            "--num-kv-blocks",
            "32",
            "--max-queue-len",
            "none",
            "--policy",
            "sjf",
            "--no-enable-chunked-prefill",
            "--watermark",
            "0.1",
        ]
    )
    assert engine_config_fields(args) == dict(
        num_kv_blocks=32, policy="sjf", enable_chunked_prefill=False, watermark=0.1
    )
    assert args.host == "127.0.0.1" and args.api_key is None
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "minillm.serve",
            "--port",
            str(port),
            "--num-kv-blocks",
            "32",
            "--max-model-len",
            "128",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "MINILLM_API_KEY": "k"},
    )
    try:

        def up():
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return proc.poll() is not None  # exited: stop waiting

        assert _wait_for(up, timeout=120) and proc.poll() is None
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        out = client.completions.create(model="shakespeare", prompt="ROMEO:", max_tokens=3, temperature=0)
        assert out.usage.completion_tokens == 3
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 401  # $MINILLM_API_KEY
    finally:
        proc.terminate()
        printed = proc.communicate(timeout=30)[0]
    assert "serving 'shakespeare'" in printed and "32 KV blocks" in printed


@pytest.mark.parametrize("record", ["none", "totals"])
def test_async_llm_refuses_a_record_mode_without_batch_entries(record):
    """AsyncLLM streams the tokens each step's batch entries name; a record mode that keeps none
    would stream nothing until a request ends, so it is refused up front, naming the field."""
    from minillm.async_llm import AsyncLLM

    with pytest.raises(ValueError, match=f"EngineConfig.record='{record}'"):
        AsyncLLM.from_config("random", record=record, num_kv_blocks=32)
    assert AsyncLLM.from_config("random", record="summary", num_kv_blocks=32).engine.record_mode == "summary"


def test_an_unusable_repetition_penalty_gets_400_and_the_streams_beside_it_finish(server, reference):
    """One request with repetition_penalty=1e-300 (float32 logits would overflow) among 4 streaming
    ones: it is answered 400 naming the field, and the 4 streams finish in full with the text they
    get without it."""

    def body(i, **kw):
        return dict(model="shakespeare", prompt=PROMPTS[i % 3], max_tokens=12, temperature=0, ignore_eos=True, **kw)

    want = [
        reference.generate([PROMPTS[i % 3]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].text
        for i in range(4)
    ]

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:

            async def stream(i):
                text, finish = "", None
                async with c.stream("POST", "/v1/completions", json=body(i, stream=True)) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[len("data: ") :])
                        assert "error" not in chunk, chunk
                        text += chunk["choices"][0]["text"]
                        finish = chunk["choices"][0]["finish_reason"] or finish
                return text, finish

            async def bad():
                await asyncio.sleep(0.05)  # while the streams run
                bad = {**body(0), "temperature": 0.8, "seed": 1, "repetition_penalty": 1e-300}
                return await c.post("/v1/completions", json=bad)

            return await asyncio.wait_for(asyncio.gather(*(stream(i) for i in range(4)), bad()), timeout=120)

    *streams, resp = asyncio.run(main())
    err = _assert_openai_error(resp, 400, "repetition_penalty")
    assert "repetition_penalty=1e-300" in err["message"]
    assert streams == [(w, "length") for w in want]
