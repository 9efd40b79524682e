"""The server as a drop-in for vLLM's users: what the official ``openai`` client and vLLM-style
programs send is accepted with the same meaning (a list of prompts, echo, logit_bias, top_k=-1,
the OpenAI fields clients send by default, /tokenize, /detokenize, /version, /v1/models/{id}), or
refused with a 400 that says why; oversized bodies and prompts are refused before tokenizing while
the server keeps answering; /metrics counts requests, not sequences; the OpenAPI schema says what
the server does (400, never 422; /metrics as text).

References are outside the code under test: ``LLM.generate`` on the same model (the offline
engine), the tokenizer itself, and hand-derived cases (a +100 logit bias forces its token).
"""

import asyncio
import json
import logging
import re
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from minillm import LLM, LLMEngine, EngineConfig, SamplingParams
from minillm.async_llm import AsyncLLM
from minillm.serve import BackgroundServer
from minillm.serve.chat import plain_template

CONFIG = dict(block_size=16, num_kv_blocks=96, max_model_len=256, max_num_seqs=64)
PROMPTS = ["ROMEO:", "First Citizen:\nBefore we proceed", "To be, or not"]

pytestmark = pytest.mark.timeout(300)


class ThreadRecordingTokenizer:
    """The model's tokenizer, noting the thread of every ``encode`` (injected into the engine)."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.encode_threads: list[str] = []
        self.encoded_chars: list[int] = []

    def encode(self, text, *args, **kwargs):
        self.encode_threads.append(threading.current_thread().name)
        self.encoded_chars.append(len(text))
        return self._tok.encode(text, *args, **kwargs)

    def __len__(self):
        return len(self._tok)

    def __getattr__(self, name):
        return getattr(self._tok, name)


@pytest.fixture(scope="module")
def reference():
    return LLM(**CONFIG)


@pytest.fixture(scope="module")
def server(reference):
    tok = ThreadRecordingTokenizer(reference.tokenizer)
    llm = AsyncLLM(LLMEngine(None, EngineConfig(**CONFIG), tokenizer=tok))
    with BackgroundServer(llm=llm) as s:
        s.recording_tokenizer = tok
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _error(resp: httpx.Response, status: int, param=None, match=None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    if param is not None:
        assert err["param"] == param, err
    if match is not None:
        assert re.search(match, err["message"]), err["message"]
    return err


def _wait_for_value(read, timeout=30.0):
    """``read()`` once it stops changing (polled), or its last value after ``timeout``."""
    deadline, last = time.monotonic() + timeout, read()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = read()
        if now == last and None not in now:
            return now
        last = now
    return last


def _post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


def _greedy(reference, prompt, **kw):
    return reference.generate([prompt], SamplingParams(temperature=0, **kw))[0]


# --- big bodies -------------------------------------------------------------------------------------


def test_a_3mb_prompt_and_a_3mb_chat_message_get_4xx_while_health_answers_and_a_stream_runs_on(server, reference):
    """The 3 MB texts are refused before tokenizing (no token is long enough for them to fit the
    context); /health answers throughout and a stream beside them gets its exact tokens."""
    big = "O Romeo, Romeo! wherefore art thou Romeo? " * (3_000_000 // 42)
    want = _greedy(reference, PROMPTS[1], max_tokens=60, ignore_eos=True)
    before = len(server.recording_tokenizer.encoded_chars)

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:

            async def stream():
                ids = []
                body = dict(
                    prompt=PROMPTS[1], max_tokens=60, temperature=0, ignore_eos=True, stream=True, return_token_ids=True
                )
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            ids += json.loads(line[6:])["choices"][0]["token_ids"]
                return ids

            async def health_while(task):
                waits = []
                while not task.done():
                    t0 = time.monotonic()
                    assert (await c.get("/health")).status_code == 200
                    waits.append(time.monotonic() - t0)
                    await asyncio.sleep(0.02)
                return waits

            async def bigs():
                await asyncio.sleep(0.05)
                return await asyncio.gather(
                    c.post("/v1/completions", json={"prompt": big, "max_tokens": 4}),
                    c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": big}]}),
                    c.post("/tokenize", json={"prompt": big}),
                )

            s = asyncio.ensure_future(stream())
            b = asyncio.ensure_future(bigs())
            waits = await health_while(asyncio.gather(s, b))
            return s.result(), b.result(), waits

    ids, refused, waits = asyncio.run(main())
    assert ids == want.token_ids
    for resp, param in zip(refused, ("prompt", "messages", "prompt")):
        err = _error(resp, 400, param, match="cannot fit this model's maximum context length of 256 tokens")
        assert err["code"] == "context_length_exceeded"
    assert waits and max(waits) < 5.0  # a generous bound: it answered throughout
    assert all(n < 10_000 for n in server.recording_tokenizer.encoded_chars[before:])  # never tokenized


def test_text_is_tokenized_on_its_own_thread_and_the_char_limit_is_exact(server):
    """The prompt limit: 2 x the longest token's characters x (max_model_len - 1). One character
    over it is refused untokenized; at it, the text is tokenized (on the tokenizer's thread, not
    the event loop's nor the engine's) and then refused for its token count."""
    longest = max(len(server.llm.tokenizer.decode([i])) for i in range(len(server.llm.tokenizer)))
    limit = 2 * longest * (256 - 1)
    tok = server.recording_tokenizer
    before = len(tok.encoded_chars)
    _error(
        _post(server, "/v1/completions", {"prompt": "a" * (limit + 1)}),
        400,
        "prompt",
        match=f"at most {limit} characters",
    )
    assert tok.encoded_chars[before:] == []
    _error(
        _post(server, "/v1/completions", {"prompt": "a" * limit}),
        400,
        "prompt",
        match=r"maximum context length is 256 tokens .*your prompt has \d+ tokens",
    )
    assert tok.encoded_chars[before:] == [limit]
    _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert set(tok.encode_threads[before:]) == {"minillm-tokenize_0"}


def test_a_body_over_the_limit_gets_413_by_its_length_or_as_it_streams_in():
    with BackgroundServer("random", block_size=16, num_kv_blocks=16, max_model_len=64, max_request_bytes=10_000) as s:
        url = s.url + "/v1/completions"
        err = _error(httpx.post(url, json={"prompt": [1] * 5000}, timeout=30), 413, match="limit of 10000 bytes")
        assert err["code"] == "request_too_large"

        def chunks():  # no Content-Length: chunked transfer
            yield b'{"prompt": ['
            for _ in range(100):
                yield b"1, " * 100
            yield b"1]}"

        _error(httpx.post(url, content=chunks(), headers={"content-type": "application/json"}, timeout=30), 413)
        assert httpx.post(url, json={"prompt": [1, 2], "max_tokens": 2}, timeout=30).status_code == 200
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200


# --- OpenAI's fields --------------------------------------------------------------------------------


def test_openai_fields_clients_send_are_honoured_at_neutral_values_and_refused_otherwise(client, server, caplog):
    msgs = [{"role": "user", "content": "Speak."}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    plain = client.chat.completions.create(model="shakespeare", messages=msgs, max_tokens=6, temperature=0)
    neutral = client.chat.completions.create(
        model="shakespeare",
        messages=msgs,
        max_tokens=6,
        temperature=0,
        tools=[tool],
        tool_choice="none",
        parallel_tool_calls=False,
        response_format={"type": "text"},
        metadata={"run": "1"},
        store=False,
        modalities=["text"],
        service_tier="auto",
        user="u1",
    )
    assert neutral.choices[0].message.content == plain.choices[0].message.content
    for extra, param, match in [
        (dict(tools=[tool]), "tools", "does not call tools"),
        (dict(tools=[tool], tool_choice="required"), "tool_choice", "does not call tools"),
        (dict(response_format={"type": "json_object"}), "response_format", "structured output"),
        (dict(store=True), "store", "stores no completions"),
        (dict(modalities=["text", "audio"]), "modalities", "text only"),
        (dict(reasoning_effort="high"), "reasoning_effort", "not supported"),
    ]:
        with pytest.raises(openai.BadRequestError, match=match) as e:
            client.chat.completions.create(model="shakespeare", messages=msgs, max_tokens=2, **extra)
        assert e.value.body["param"] == param
    # A field neither OpenAI nor vLLM has: accepted, and named in the log.
    with caplog.at_level(logging.WARNING, logger="minillm.serve.api_server"):
        got = _post(server, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 2, "frobnicate": 1})
    assert got.status_code == 200
    assert "frobnicate" in caplog.text and "ignored" in caplog.text


def test_chat_names_and_roles_are_restricted_as_openai_does(server, client, reference):
    url = "/v1/chat/completions"
    for name in ("A\n\nASSISTANT", "x" * 65, "Romeo Montague", ""):
        _error(_post(server, url, {"messages": [{"role": "user", "name": name, "content": "Hi"}]}), 400, "messages")
    _error(_post(server, url, {"messages": [{"role": "wizard", "content": "Hi"}]}), 400, "messages")
    _error(_post(server, url, {"messages": []}), 400, "messages")
    messages = [{"role": "user", "name": "Romeo_1-x" + "y" * 55, "content": "Hi"}]
    got = client.chat.completions.create(model="shakespeare", messages=messages, max_tokens=5, temperature=0)
    assert got.usage.prompt_tokens == len(
        reference.tokenizer.encode(plain_template(messages), add_special_tokens=False)
    )


def test_bounds_openai_and_vllm_set(server):
    good = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True}
    assert _post(server, "/v1/chat/completions", {**good, "top_logprobs": 20}).status_code == 200
    _error(_post(server, "/v1/chat/completions", {**good, "top_logprobs": 21}), 400, "top_logprobs")
    _error(_post(server, "/v1/completions", {"prompt": "x", "logprobs": 21}), 400, "logprobs")
    # max_tokens past the context: OpenAI's and vLLM's 400, not a silent clamp
    n_prompt = len(server.llm.tokenizer.encode("ROMEO:", add_special_tokens=False))
    err = _error(
        _post(server, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 257 - n_prompt}),
        400,
        "max_tokens",
        match="maximum context length is 256 tokens",
    )
    assert f"you requested 257 tokens ({n_prompt} in the prompt, {257 - n_prompt} in the completion)" in err["message"]
    ok = _post(server, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 256 - n_prompt, "temperature": 0})
    assert ok.status_code == 200
    _error(
        _post(server, "/v1/chat/completions", {**good, "max_tokens": 1000}),
        400,
        "max_tokens",
        match="maximum context length is 256 tokens.*in the messages",
    )


def test_request_ids_are_random(client):
    ids = [client.completions.create(model="shakespeare", prompt="ROMEO:", max_tokens=1).id for _ in range(3)]
    assert all(re.fullmatch(r"cmpl-[0-9a-f]{32}", i) for i in ids) and len(set(ids)) == 3


# --- what vLLM's completions endpoint takes ---------------------------------------------------------


def test_a_list_of_prompts_gives_choices_indexed_across_prompts(client, reference):
    """Choice j of prompt i is index i * n + j (OpenAI's and vLLM's order; LangChain's batch reads it)."""
    got = client.completions.create(
        model="shakespeare", prompt=PROMPTS, max_tokens=10, temperature=0, n=2, extra_body={"return_token_ids": True}
    )
    assert [c.index for c in got.choices] == list(range(6))
    want = [_greedy(reference, p, max_tokens=10) for p in PROMPTS]
    for c in got.choices:
        assert c.text == want[c.index // 2].text and c.token_ids == want[c.index // 2].token_ids
    assert got.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    assert got.usage.completion_tokens == 2 * sum(len(w.token_ids) for w in want)
    # token-id prompts, streamed: each choice's chunks in order, under its index
    ids = [w.prompt_token_ids for w in want]
    stream = client.completions.create(
        model="shakespeare",
        prompt=ids,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts = {}
    usage = None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
        usage = chunk.usage or usage
    assert texts == {i: w.text for i, w in enumerate(want)}
    assert usage.completion_tokens == sum(len(w.token_ids) for w in want)


def test_echo_logit_bias_and_top_k_minus_one(client, reference, server):
    want = _greedy(reference, "ROMEO:", max_tokens=8)
    got = client.completions.create(model="shakespeare", prompt="ROMEO:", max_tokens=8, temperature=0, echo=True)
    assert got.choices[0].text == "ROMEO:" + want.text
    chunks = list(
        client.completions.create(
            model="shakespeare", prompt=want.prompt_token_ids, max_tokens=8, temperature=0, echo=True, stream=True
        )
    )
    assert chunks[0].choices[0].text == "ROMEO:" and "".join(c.choices[0].text for c in chunks) == got.choices[0].text
    _error(_post(server, "/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}), 400, "echo")
    # logit_bias: +100 forces its token (hand-derived); -100 bans the greedy choice (LLM.generate's answer)
    forced = client.completions.create(
        model="shakespeare",
        prompt="ROMEO:",
        max_tokens=5,
        temperature=0,
        logit_bias={"7": 100},
        extra_body={"return_token_ids": True},
    )
    assert forced.choices[0].token_ids == [7] * 5
    first = want.token_ids[0]
    banned = client.completions.create(
        model="shakespeare",
        prompt="ROMEO:",
        max_tokens=8,
        temperature=0,
        logit_bias={str(first): -100},
        extra_body={"return_token_ids": True},
    )
    ref = reference.generate(["ROMEO:"], SamplingParams(temperature=0, max_tokens=8, logit_bias={first: -100}))[0]
    assert banned.choices[0].token_ids == ref.token_ids and first not in ref.token_ids
    _error(_post(server, "/v1/completions", {"prompt": "x", "logit_bias": {"100000": 1}}), 400, "logit_bias")
    _error(_post(server, "/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}), 400, "logit_bias")
    # top_k=-1 is vLLM's "all tokens": the same seeded draw as top_k=0
    kw = dict(model="shakespeare", prompt="ROMEO:", max_tokens=12, temperature=1.0, seed=5)
    a = client.completions.create(**kw, extra_body={"top_k": -1}).choices[0].text
    assert a == client.completions.create(**kw, extra_body={"top_k": 0}).choices[0].text
    assert a == reference.generate(["ROMEO:"], SamplingParams(temperature=1.0, max_tokens=12, seed=5))[0].text
    # so is any k past the vocabulary, however large (found by schemathesis: 2**97 overflowed a step)
    assert a == client.completions.create(**kw, extra_body={"top_k": 2**97}).choices[0].text


def test_models_retrieve_tokenize_detokenize_and_version(client, server, reference):
    assert client.models.retrieve("shakespeare").id == "shakespeare"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    tok = reference.tokenizer
    text = "O Romeo, Romeo!"
    got = _post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert got["tokens"] == tok.encode(text, add_special_tokens=False)
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] == 256
    assert got["token_strs"] == tok.convert_ids_to_tokens(got["tokens"])
    messages = [{"role": "user", "content": text}]
    chat = _post(server, "/tokenize", {"messages": messages}).json()
    assert chat["tokens"] == tok.encode(plain_template(messages), add_special_tokens=False)
    assert _post(server, "/detokenize", {"tokens": got["tokens"]}).json() == {"prompt": tok.decode(got["tokens"])}
    _error(_post(server, "/detokenize", {"tokens": [5, 10**6]}), 400, "tokens")
    _error(_post(server, "/tokenize", {}), 400)
    import minillm

    assert httpx.get(server.url + "/version").json() == {"version": minillm.__version__}


# --- /metrics ---------------------------------------------------------------------------------------


def _metrics(server) -> dict:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return {
        (s.name, s.labels.get("finished_reason")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if not s.labels.get("le")
    }


def _finished(m: dict, reason=None) -> float:
    return sum(
        v for (name, r), v in m.items() if name == "minillm:request_finished_total" and (reason is None or r == reason)
    )


def test_metrics_count_an_n4_request_once_and_its_tokens_as_usage_does(client, server):
    before = _metrics(server)
    got = client.completions.create(model="shakespeare", prompt="ROMEO:", n=4, max_tokens=9, temperature=1.0, seed=3)
    after = _metrics(server)
    assert _finished(after) - _finished(before) == 1
    gen = ("minillm:generation_tokens_total", None)
    assert after[gen] - before[gen] == got.usage.completion_tokens
    prompt = ("minillm:prompt_tokens_total", None)
    assert after[prompt] - before[prompt] == got.usage.prompt_tokens
    ttft = ("minillm:time_to_first_token_seconds_count", None)
    assert after[ttft] - before[ttft] == 1


def test_an_abort_is_counted_when_it_happens_on_an_idle_server(client, server):
    before = _metrics(server)
    stream = client.completions.create(
        model="shakespeare", prompt="ROMEO:", max_tokens=200, n=2, stream=True, extra_body={"ignore_eos": True}
    )
    it = iter(stream)
    next(it), next(it)
    stream.close()
    deadline = time.monotonic() + 30
    while _finished(_metrics(server), "abort") == _finished(before, "abort") and time.monotonic() < deadline:
        time.sleep(0.05)
    after = _metrics(server)
    assert _finished(after, "abort") - _finished(before, "abort") == 1  # one request, two sequences
    assert _finished(after) - _finished(before) == 1
    assert server.engine_call(lambda e: e.has_unfinished_requests()) is False
    # several prompts in one stream: the client going away aborts them all and frees their KV
    total = server.engine_call(lambda e: e.num_kv_blocks)
    stream = client.completions.create(
        model="shakespeare", prompt=PROMPTS, max_tokens=200, stream=True, extra_body={"ignore_eos": True}
    )
    it = iter(stream)
    rid = next(it).id.split("-", 1)[1]
    next(it)
    stream.close()
    ids = [f"{rid}-{i}" for i in range(3)]
    assert _wait_for_value(
        lambda: server.engine_call(lambda e: [e.requests[i].finish_reason for i in ids] + [e.kv.num_free_blocks])
    ) == ["abort"] * 3 + [total]


# --- the OpenAPI schema and the behaviour, one ------------------------------------------------------


def test_the_openapi_schema_documents_what_the_server_does(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            assert "422" not in op["responses"], (path, method)
            if method == "post":
                assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
                    "/ErrorResponse"
                ), path
    assert list(schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert "text/event-stream" in schema["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    comps = schema["components"]["schemas"]
    assert comps["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1
    assert "HTTPValidationError" not in comps
    # the bodies the schema now refuses, refused
    for body, param in [
        ({"prompt": "x", "best_of": 0}, "best_of"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": [1, False]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x", "stop": ["a"] * 5}, "stop"),
        ({"prompt": "x", "n": 1.5}, "n"),
    ]:
        _error(_post(server, "/v1/completions", body), 400, param)
    assert httpx.get(server.url + "/metrics").headers["content-type"].startswith("text/plain")


# --- the official client, async ---------------------------------------------------------------------


def test_the_async_openai_client(server, reference):
    want = [_greedy(reference, p, max_tokens=6) for p in PROMPTS]

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as c:
            batch = await c.completions.create(model="shakespeare", prompt=PROMPTS, max_tokens=6, temperature=0)
            model = await c.models.retrieve("shakespeare")
            chat = await c.chat.completions.create(
                model="shakespeare",
                temperature=0,
                max_tokens=6,
                tools=[],
                tool_choice="none",
                messages=[{"role": "user", "content": "Speak."}],
            )
            stream = await c.chat.completions.create(
                model="shakespeare",
                temperature=0,
                max_tokens=6,
                stream=True,
                messages=[{"role": "user", "content": "Speak."}],
            )
            streamed = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
            return batch, model, chat, streamed

    batch, model, chat, streamed = asyncio.run(main())
    assert [c.text for c in batch.choices] == [w.text for w in want]
    assert model.id == "shakespeare"
    assert streamed == chat.choices[0].message.content


def test_langchain_batch_chat_tools_none_and_structured_output_refused_clearly(server, reference):
    """LangChain's OpenAI().batch() sends one request with a list of prompts; ChatOpenAI with
    tools bound at tool_choice="none" is served; with_structured_output's JSON mode and function
    calling are refused with a 400 that says why."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel

    base = server.url + "/v1"
    llm = langchain_openai.OpenAI(base_url=base, api_key="x", model="shakespeare", max_tokens=8, temperature=0)
    assert llm.batch(PROMPTS) == [_greedy(reference, p, max_tokens=8).text for p in PROMPTS]
    chat = langchain_openai.ChatOpenAI(base_url=base, api_key="x", model="shakespeare", max_tokens=8, temperature=0)
    text = chat.invoke("Speak.").content
    assert "".join(c.content for c in chat.stream("Speak.")) == text
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    assert chat.bind_tools([tool], tool_choice="none").invoke("Speak.").content == text

    class Answer(BaseModel):
        text: str

    for method, match in (("json_mode", "structured output"), ("function_calling", "does not call tools")):
        with pytest.raises(openai.BadRequestError, match=match):
            chat.with_structured_output(Answer, method=method).invoke("Speak.")


# --- vLLM's sampling fields, a server's life, the chat command --------------------------------------


def test_min_p_and_skip_special_tokens_reach_the_sampler(server, reference):
    """vLLM's ``min_p`` is honoured, not ignored: at 1 only the most likely token is left, so a sampled
    reply is the greedy one; outside [0, 1] it is a 400 naming the field."""
    prompt = [5, 6, 7]
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 11}
    greedy = _greedy(reference, prompt, max_tokens=6).token_ids
    got = _post(server, "/v1/completions", {**body, "min_p": 1.0, "return_token_ids": True}).json()
    assert got["choices"][0]["token_ids"] == greedy
    _error(_post(server, "/v1/completions", {**body, "min_p": 5}), 400, match="min_p")
    assert _post(server, "/v1/completions", {**body, "skip_special_tokens": False}).status_code == 200


def test_a_stopped_background_server_refuses_to_start_again():
    s = BackgroundServer("random", block_size=16, num_kv_blocks=16, max_model_len=64).start()
    with pytest.raises(RuntimeError, match="already serving"):
        s.start()
    s.stop()
    with pytest.raises(RuntimeError, match="build a new BackgroundServer"):
        s.start()
    s.stop()  # a second stop does nothing


def test_minillm_chat_says_in_one_line_that_no_server_answers():
    proc = subprocess.run(
        [sys.executable, "-m", "minillm", "chat", "--url", "http://127.0.0.1:9/v1", "-q", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == ["minillm chat: APIConnectionError: Connection error."], proc.stderr
