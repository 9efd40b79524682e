"""Tensor parallelism on 2 CPU ranks (gloo): the same greedy tokens as one device for Llama,
Qwen2 and Qwen3 shapes, and the same seeded parallel samples (copy-on-write on every rank);
head counts that do not split are refused; a rank that dies, raises or hangs surfaces in the
driver as an error naming it, with every rank shut down."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from helpers import random_prompts, tiny_hf_checkpoint
from minillm import LLM, SamplingParams
from minillm.config import EngineConfig
from minillm.worker.tp_executor import TensorParallelError, Worker

pytestmark = pytest.mark.slow  # starts rank processes

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
# Small blocks and a small token budget: prompts arrive in chunks, decodes batch with prefills.
SMALL = dict(block_size=4, num_kv_blocks=96, max_num_batched_tokens=24, max_model_len=128)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _assert_all_gone(llm):
    ex = llm.engine.executor
    for p in ex.ranks._procs:
        assert not p.is_alive(), f"rank process {p.pid} still running"
        assert _gone(p.pid), f"rank process {p.pid} left behind"


def _raise_within(seconds: float, fn):
    """Run ``fn`` in a thread; return the exception it raised, failing if it runs past ``seconds``
    (a liveness bound: the driver must not hang on a dead rank)."""
    box = {}

    def target():
        try:
            fn()
        except BaseException as e:  # reported to the test's thread
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"the driver did not raise within {seconds} s"
    assert "error" in box, "expected an error from the driver"
    return box["error"]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_two_ranks_give_the_same_greedy_tokens(tmp_path, arch):
    tiny_hf_checkpoint(tmp_path, arch)  # 4 heads, 2 KV heads: 1 KV head per rank
    prompts = random_prompts(5, 128, seed=3, lo=2, hi=30)
    want = [o.token_ids for o in LLM(str(tmp_path), **SMALL).generate(prompts, GREEDY)]
    with LLM(str(tmp_path), tensor_parallel_size=2, **SMALL) as llm:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        held = llm.engine.executor.describe()
        assert llm.engine.executor.bytes_per_block == sum(h["kv_bytes_per_block"] for h in held)
        comm = llm.engine.executor.collective_rpc(Worker.comm)
        records = llm.engine.step_records
    assert got == want
    # Per forward: 2 all-reduces per layer (o_proj, down_proj) + 1 (embedding) of [T, 64] fp32
    # activations, and 1 gather of the logits.
    forwards, tokens = len(records), sum(r.num_batched_tokens for r in records)
    assert comm[0] == comm[1]
    assert comm[0]["all_reduce"] == 5 * forwards and comm[0]["gather"] == forwards
    assert comm[0]["all_reduce_bytes"] == 5 * tokens * 64 * 4
    for h in held:  # each rank: half the heads, half of every KV block
        assert (h["num_heads"], h["num_kv_heads"]) == (2, 1)
        assert h["kv_cache_shape"] == (96, 4, 1, 16)
        assert h["params"]["model.layers.0.self_attn.o_proj.weight"] == (64, 32)  # row-parallel
        assert h["params"]["model.layers.0.mlp.gate_proj.weight"] == (48, 64)  # column-parallel
        assert h["params"]["model.embed_tokens.weight"] == (64, 64)  # half the vocabulary
    _assert_all_gone(llm)


def test_swaps_and_prefix_caching_match_one_device():
    """Preemption by swapping and prefix-cache hits move and share blocks; every rank's
    slice of a block must follow (the random model: 4 heads, 2 KV heads)."""
    kw = dict(
        block_size=4,
        num_kv_blocks=14,
        max_num_batched_tokens=32,
        preemption_mode="swap",
        num_swap_blocks=32,
        enable_prefix_caching=True,
        max_model_len=64,
    )
    shared = list(range(10, 22))
    prompts = [shared + p for p in random_prompts(4, 512, seed=5, lo=2, hi=10)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    one = LLM("random", **kw)
    want = [o.token_ids for o in one.generate(prompts, sp)]
    with LLM("random", tensor_parallel_size=2, **kw) as llm:
        got = [o.token_ids for o in llm.generate(prompts, sp)]
        assert llm.engine.swapped_bytes == one.engine.swapped_bytes > 0  # swaps happened
        assert llm.engine.stats()["prefix_cache"] == one.engine.stats()["prefix_cache"]
    assert got == want


@pytest.mark.parametrize("preempt", [False, True], ids=["fits", "swapped"])
def test_parallel_samples_with_copy_on_write_match_one_device(preempt):
    """n=3 seeded samples per prompt: the samples share the prompt's last, partly filled block
    until each writes into it, then get a copy; every rank must copy its slice of that block
    (fp32, CPU, gloo), or the samples read a wrong prefix and draw other tokens. "swapped": a
    KV cache too small for every group at once, so groups are swapped out and in, in one step
    together with copies (each rank applies them with ``ModelRunner.swap``, in its order)."""
    kw = dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=32, max_model_len=64)
    if preempt:
        kw.update(num_kv_blocks=16, preemption_mode="swap", num_swap_blocks=64)
    prompts = random_prompts(4 if preempt else 3, 512, seed=11, lo=5, hi=14)
    prompts = [p if len(p) % 4 else p + [7] for p in prompts]  # a partial last block to share
    sp = SamplingParams(n=3, max_tokens=12 if preempt else 8, temperature=0.9, seed=2024, ignore_eos=True)
    one = LLM("random", **kw)
    want = [[c.token_ids for c in o.outputs] for o in one.generate(prompts, sp)]
    with LLM("random", tensor_parallel_size=2, **kw) as llm:
        got = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, sp)]
        records = llm.engine.step_records
        assert llm.engine.swapped_bytes == one.engine.swapped_bytes
    copies = [c for r in records for c in r.copies]
    if preempt:
        assert any(r.copies and r.swap_bytes for r in records)  # a step that swaps and copies
    else:
        assert len(copies) == len(prompts) * 2  # each prompt: two samples copied the block
    assert all(len(samples) == 3 and len(set(map(tuple, samples))) == 3 for samples in want)
    assert got == want


def test_a_rank_that_cannot_load_its_shard_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    tiny_hf_checkpoint(tmp_path, "llama")
    f = tmp_path / "model.safetensors"
    state = load_file(f)
    del state["model.norm.weight"]
    save_file(state, f, metadata={"format": "pt"})
    with pytest.raises(TensorParallelError, match=r"rank \d raised during 'start'.*missing=\['model.norm.weight'\]"):
        LLM(str(tmp_path), tensor_parallel_size=2, max_model_len=128)


def test_head_counts_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4.*num_attention_heads=4.*num_key_value_heads=2"):
        LLM("random", tensor_parallel_size=4)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2.*num_attention_heads=6.*num_key_value_heads=3"):
        LLM(
            "random",
            tensor_parallel_size=2,
            random_model=dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3),
        )
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size=2.*executor='model'"):
        EngineConfig(tensor_parallel_size=2, executor="simulated")


def test_a_killed_rank_is_an_error_and_every_rank_is_shut_down():
    llm = LLM("random", tensor_parallel_size=2, num_kv_blocks=32)
    llm.generate([[5, 6, 7]], GREEDY)
    pids = llm.engine.executor.pids
    os.kill(pids[1], signal.SIGKILL)
    err = _raise_within(60, lambda: llm.generate([[8, 9, 10]], GREEDY))
    assert isinstance(err, TensorParallelError), err
    assert "rank 1" in str(err) and "died" in str(err)  # seen dying, not waited out
    _assert_all_gone(llm)
    with pytest.raises(TensorParallelError, match="shut down"):  # and it stays down, at once
        llm.engine.step()
    llm.close()  # idempotent


def _break_rank_1(worker: Worker) -> None:
    if worker.rank == 1:

        def broken(*args, **kwargs):
            raise RuntimeError("injected fault in the forward")

        worker.model.forward = broken


def test_a_rank_that_raises_is_named_in_the_error():
    llm = LLM("random", tensor_parallel_size=2, num_kv_blocks=32)
    llm.engine.executor.collective_rpc(_break_rank_1)
    err = _raise_within(60, lambda: llm.generate([[5, 6, 7]], GREEDY))
    assert isinstance(err, TensorParallelError), err
    msg = str(err)
    assert "rank 1 raised during 'step'" in msg
    assert msg.index("rank 1 raised") < msg.find("rank 0 raised") % (len(msg) + 1)  # named first, the cause
    assert "injected fault in the forward" in msg
    _assert_all_gone(llm)


def _stall_rank_1(worker: Worker, seconds: float) -> None:
    if worker.rank == 1:
        time.sleep(seconds)


def test_a_silent_rank_times_out():
    llm = LLM("random", tensor_parallel_size=2, num_kv_blocks=32)
    llm.engine.executor.ranks.step_timeout = 5.0  # rank 0 answers well within this even on a loaded machine
    err = _raise_within(60, lambda: llm.engine.executor.collective_rpc(_stall_rank_1, 120.0))
    assert isinstance(err, TensorParallelError), err
    assert "no answer from rank(s) [1]" in str(err)
    _assert_all_gone(llm)


def _slow_first_forward_on_rank_1(worker: Worker, seconds: float) -> None:
    if worker.rank == 1:
        forward = worker.model.forward
        calls = []

        def slow(*args, **kwargs):
            if not calls:
                calls.append(1)
                time.sleep(seconds)
            return forward(*args, **kwargs)

        worker.model.forward = slow


def _interrupt_after(seconds: float, times: int = 1):
    def fire():
        for _ in range(times):
            time.sleep(seconds)
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=fire, daemon=True).start()


def test_ctrl_c_during_a_step_keeps_the_ranks_in_step():
    """Ctrl-C while the ranks compute: they finish the step together, the driver then raises
    KeyboardInterrupt and the engine rolls the step back; the next steps give the same tokens."""
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    want = [o.token_ids for o in LLM("random", num_kv_blocks=32).generate(prompts, GREEDY)]
    with LLM("random", tensor_parallel_size=2, num_kv_blocks=32) as llm:
        llm.engine.executor.collective_rpc(_slow_first_forward_on_rank_1, 2.0)
        ids = [llm.engine.add_request(p, GREEDY) for p in prompts]
        _interrupt_after(0.3)
        with pytest.raises(KeyboardInterrupt):
            llm.engine.step()
        assert llm.engine.step_count == 0
        llm.engine.run()
        assert [llm.engine.get_output(i).token_ids for i in ids] == want


def test_ctrl_c_twice_stops_waiting():
    llm = LLM("random", tensor_parallel_size=2, num_kv_blocks=32)
    llm.engine.executor.ranks.step_timeout = 60.0  # the bound, should the second Ctrl-C be ignored
    _interrupt_after(0.3, times=2)  # Ctrl-C reaches the main thread: call from it
    with pytest.raises(TensorParallelError, match="Ctrl-C twice"):
        llm.engine.executor.collective_rpc(_stall_rank_1, 120.0)
    _assert_all_gone(llm)


def test_close_ends_every_rank():
    with LLM("random", tensor_parallel_size=2, num_kv_blocks=32) as llm:
        pids = llm.engine.executor.pids
        assert not any(_gone(p) for p in pids)
    _assert_all_gone(llm)
