"""AsyncLLM on its own (no HTTP): aborts end their streams, cancelled streams leave nothing behind,
and bad sampling params are refused before anything is registered. Every wait has a timeout, so a
stream that never ends fails the test instead of hanging it."""

import asyncio

import pytest

from minillm import SamplingParams
from minillm.async_llm import AsyncLLM
from minillm.core.parallel_sampling import completion_id

CONFIG = dict(block_size=4, num_kv_blocks=256, max_model_len=128, max_num_seqs=16)
LONG = dict(max_tokens=100, ignore_eos=True, temperature=0.0)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]  # slow: the engine on a worker thread


def serve(main):
    """Run ``main(llm)`` against a started AsyncLLM on the tiny random model."""

    async def go():
        async with AsyncLLM.from_config("random", **CONFIG) as llm:
            return await asyncio.wait_for(main(llm), timeout=60)

    return asyncio.run(go())


async def settle(llm):
    """Wait until the engine has nothing left to run; return what load() says then."""
    for _ in range(600):
        if not await llm.engine_call(lambda e: e.has_unfinished_requests()):
            return await llm.load()
        await asyncio.sleep(0.01)
    raise AssertionError("the engine never settled")


def test_abort_delivers_a_final_output_to_the_stream():
    async def main(llm):
        gen = llm.generate([5, 6, 7], SamplingParams(**LONG), request_id="r")
        first = await gen.__anext__()
        await llm.abort("r")
        outs = [first] + [o async for o in gen]
        return outs, await settle(llm)

    outs, load = serve(main)
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert sum(len(o.token_ids) for o in outs) == outs[-1].num_output_tokens < 100
    assert load["running"] == load["waiting"] == 0 and load["kv_blocks_free"] == load["kv_blocks_total"]


def test_aborting_one_sample_ends_its_stream_and_the_others_finish():
    async def main(llm):
        gen = llm.generate([5, 6, 7], SamplingParams(n=2, max_tokens=30, ignore_eos=True), request_id="g")
        outs = []
        async for out in gen:
            outs.append(out)
            if len(outs) == 3:
                await llm.abort(completion_id("g", 1))
        return outs

    outs = serve(main)
    last = {o.index: o for o in outs if o.finished}
    assert last[1].finish_reason == "abort" and last[1].num_output_tokens < 30
    assert last[0].finish_reason == "length" and last[0].num_output_tokens == 30


def test_an_aborted_group_ends_every_sample_stream():
    async def main(llm):
        gen = llm.generate([5, 6, 7], SamplingParams(n=3, **LONG), request_id="g")
        first = await gen.__anext__()
        await llm.abort("g")
        return [first] + [o async for o in gen]

    outs = serve(main)
    assert sorted(o.index for o in outs if o.finished) == [0, 1, 2]
    assert {o.finish_reason for o in outs if o.finished} == {"abort"}


def test_aborting_sample_0_before_the_fork_ends_every_sample_stream():
    """Before its fork a group is one sequence, sample 0: aborting that sample ends the group, so
    every sample's stream gets its final output (found by the async fuzzer: the others waited forever)."""

    async def main(llm):
        blockers = [
            asyncio.ensure_future(_collect(llm.generate([3, 4], SamplingParams(**LONG), request_id=b)))
            for b in ("b1", "b2")
        ]
        task = asyncio.ensure_future(_collect(llm.generate([5, 6, 7], SamplingParams(n=2, **LONG), request_id="g")))
        while not await llm.engine_call(lambda e: "g" in e.parents):
            await asyncio.sleep(0.005)
        assert not await llm.engine_call(lambda e: e.parents["g"].forked)  # waiting: both slots are taken
        await llm.abort(completion_id("g", 0))
        return await asyncio.wait_for(task, 30), [await b for b in blockers]

    async def go():
        async with AsyncLLM.from_config("random", **{**CONFIG, "max_num_seqs": 2}) as llm:
            return await asyncio.wait_for(main(llm), timeout=60)

    outs, blocked = asyncio.run(go())
    assert sorted(o.index for o in outs if o.finished) == [0, 1]
    assert {o.finish_reason for o in outs if o.finished} == {"abort"}
    assert [b[-1].finish_reason for b in blocked] == ["length", "length"]


async def _collect(gen):
    return [o async for o in gen]


def test_streams_cancelled_before_their_fork_leave_no_phantoms():
    """60 streams of n=3 cancelled at once, some before their prompt ran (so before the fork):
    load() and the table of outputs handed out count none of them afterwards."""

    async def main(llm):
        async def consume(i):
            async for _ in llm.generate([1 + i % 7, 2, 3], SamplingParams(n=3, **LONG)):
                pass

        tasks = [asyncio.ensure_future(consume(i)) for i in range(60)]
        await asyncio.sleep(0.2)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        load = await settle(llm)
        return load, await llm.engine_call(lambda e: len(llm._sent)), llm.num_in_flight()

    load, sent, in_flight = serve(main)
    assert (load["running"], load["waiting"], load["swapped"]) == (0, 0, 0)
    assert sent == 0 and in_flight == 0
    assert load["kv_blocks_free"] == load["kv_blocks_total"]


@pytest.mark.parametrize(
    "make, err, match",
    [
        (lambda: {"max_tokens": 3}, TypeError, r"sampling_params=\{'max_tokens': 3\}.*must be a SamplingParams"),
        (lambda: _edited(n="2"), TypeError, r"SamplingParams\.n='2'"),
        (lambda: _edited(max_tokens=0), ValueError, r"SamplingParams\.max_tokens=0"),
    ],
)
def test_bad_params_are_refused_before_anything_is_registered(make, err, match):
    async def main(llm):
        with pytest.raises(err, match=match):
            async for _ in llm.generate([1, 2, 3], make(), request_id="r"):
                pass
        state = (llm.num_in_flight(), await llm.engine_call(lambda e: (len(llm._sent), len(e.requests))))
        outs = [o async for o in llm.generate([1, 2, 3], SamplingParams(max_tokens=3), request_id="r")]
        return state, outs[-1]

    state, last = serve(main)
    assert state == (0, (0, 0))
    assert last.finish_reason == "length" and last.num_output_tokens == 3


def _edited(**fields):
    sp = SamplingParams(max_tokens=3)
    for k, v in fields.items():
        setattr(sp, k, v)
    return sp
