"""Every input checked at the door: a bad value raises a ValueError/TypeError naming the field
and the value before anything changes, and the other requests finish as they would have.

One test per way a bad input used to get in: a NaN arrival blocking every later arrival, a
request registered before its arrival time failed (a ghost), sampling parameters or request
fields that pass and then fail every later step for the whole batch, config fields that fail
late or not at all, a checkpoint's config.json used before it is checked, a KV cache too big
for the machine, SamplingParams kept by reference, ``generate`` queueing half a list, an
acceptance rule (``EngineConfig.acceptance_rule``, run as ``ModelRunner.verify``) trusted blindly,
a model name sent to a model hub, and a training state loaded with pickle's full powers.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import types

import numpy as np
import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.config import EngineConfig
from minillm.core.invariants import check_all_free

GREEDY = dict(temperature=0.0, ignore_eos=True)
SMALL = dict(block_size=4, num_kv_blocks=64, max_model_len=64, max_num_seqs=8)
BAD = (ValueError, TypeError)


def engine(**kw):
    return LLM("random", **{**SMALL, **kw}).engine


def finish(e, max_steps=500):
    steps = 0
    while e.has_unfinished_requests():
        e.step()
        steps += 1
        assert steps < max_steps, "the run does not end"
    check_all_free(e)


def alone(prompt, max_tokens=4, **kw):
    """The greedy tokens of ``prompt`` with the engine to itself."""
    e = engine(**kw)
    rid = e.add_request(prompt, SamplingParams(max_tokens=max_tokens, **GREEDY))
    finish(e)
    return e.get_output(rid).token_ids


def rejected_cleanly(e, call, field, good_id):
    """``call`` raises naming ``field``; nothing is registered; the good request finishes as alone."""
    before = (dict(e.requests), len(e.scheduler.waiting), len(e.scheduler.incoming))
    with pytest.raises(BAD, match=field):
        call()
    assert (dict(e.requests), len(e.scheduler.waiting), len(e.scheduler.incoming)) == before
    finish(e)
    assert e.get_output(good_id).token_ids == alone([3, 4, 5])


# --- 4. arrival_time --------------------------------------------------------------------------------


@pytest.mark.parametrize("arrival", [float("nan"), float("inf"), float("-inf"), "10:30", True, [1.0]])
def test_a_bad_arrival_time_is_rejected_before_the_request_exists(arrival):
    e = engine()
    good = e.add_request([3, 4, 5], SamplingParams(max_tokens=4, **GREEDY))
    rejected_cleanly(
        e,
        lambda: e.add_request([6, 7], SamplingParams(max_tokens=2), request_id="x", arrival_time=arrival),
        "arrival_time",
        good,
    )
    # no ghost: the id is free, and a later arrival is not blocked behind a NaN
    e.add_request([6, 7], SamplingParams(max_tokens=2, **GREEDY), request_id="x", arrival_time=e.clock.now() + 0.01)
    finish(e)
    assert len(e.get_output("x").token_ids) == 2


# --- 5. sampling parameters and request fields --------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", "0.5"),
        ("seed", 1.5),
        ("seed", "3"),
        ("seed", True),
        ("seed", 2**70),
        ("seed", -1),
        ("top_p", "x"),
        ("top_p", float("nan")),
        ("top_k", 1.5),
        ("top_k", True),
        ("max_tokens", True),
        ("max_tokens", 2.0),
        ("max_tokens", float("nan")),
        ("stop_token_ids", "12"),
        ("stop_token_ids", b"12"),
        ("stop_token_ids", 5),
        ("stop_token_ids", [1.5]),
        ("stop_token_ids", [True]),
        ("stop_token_ids", [-1]),
        ("ignore_eos", "no"),
        ("ignore_eos", 1),
        ("ignore_eos", None),
    ],
)
def test_bad_sampling_params_name_the_field(field, value):
    shown = "stop_token_ids" if field == "stop_token_ids" else f"{field}={value!r}"
    with pytest.raises(BAD, match=f"SamplingParams.{shown}".replace("[", r"\[").replace("(", r"\(")):
        SamplingParams(**{field: value})


def test_integer_like_sampling_params_become_plain_ints():
    sp = SamplingParams(
        seed=np.int64(3),
        top_k=torch.tensor(5),
        max_tokens=np.int32(4),
        stop_token_ids=np.array([7, 8]),
        temperature=np.float32(0.5),
    )
    assert (sp.seed, sp.top_k, sp.max_tokens, sp.stop_token_ids) == (3, 5, 4, [7, 8])
    assert all(type(v) is int for v in (sp.seed, sp.top_k, sp.max_tokens, *sp.stop_token_ids))
    assert SamplingParams(stop_token_ids=(1, 2)).stop_token_ids == [1, 2]
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1  # torch.Generator takes it as is


def test_a_sampling_params_edited_into_a_bad_value_is_caught_at_the_door():
    e = engine()
    good = e.add_request([3, 4, 5], SamplingParams(max_tokens=4, **GREEDY))
    sp = SamplingParams(max_tokens=2)
    sp.seed = "3"  # after construction: no __post_init__ ran
    rejected_cleanly(e, lambda: e.add_request([6, 7], sp), "seed", good)


@pytest.mark.parametrize(
    "policy,kw,field",
    [
        ("priority", dict(priority="high"), "priority"),
        ("priority", dict(priority=None), "priority"),
        ("priority", dict(priority=0.5), "priority"),
        ("fcfs", dict(priority=[1]), "priority"),
        ("fair", dict(tenant=["a"]), "tenant"),
        ("fair", dict(tenant={"a": 1}), "tenant"),
        ("sjf", dict(expected_output_len="long"), "expected_output_len"),
        ("sjf", dict(expected_output_len=-1), "expected_output_len"),
        ("fcfs", dict(expected_output_len=2.5), "expected_output_len"),
        ("fcfs", dict(sampling_params={"max_tokens": 2}), "sampling_params"),
        ("fcfs", dict(sampling_params=SamplingParams(stop_token_ids=[10**6])), "stop_token_ids"),
    ],
)
def test_bad_request_fields_are_rejected_for_every_policy(policy, kw, field):
    e = engine(policy=policy)
    good = e.add_request([3, 4, 5], SamplingParams(max_tokens=4, **GREEDY))
    kw = dict(kw)
    sp = kw.pop("sampling_params", SamplingParams(max_tokens=2))
    rejected_cleanly(e, lambda: e.add_request([6, 7], sp, **kw), field, good)


def test_numpy_and_torch_token_ids_are_accepted_as_ints():
    plain = alone([3, 4, 5])
    for prompt in (np.array([3, 4, 5]), torch.tensor([3, 4, 5]), [np.int64(3), np.uint16(4), torch.tensor(5)]):
        e = engine()
        rid = e.add_request(prompt, SamplingParams(max_tokens=4, **GREEDY))
        assert e.requests[rid].prompt_token_ids == [3, 4, 5]
        assert all(type(t) is int for t in e.requests[rid].prompt_token_ids)
        finish(e)
        assert e.get_output(rid).token_ids == plain


@pytest.mark.parametrize(
    "prompt,match",
    [
        (b"\x03\x04", "bytes"),
        (bytearray(b"\x03\x04"), "bytes"),
        ([3, 4.0], r"prompt\[1\]=4.0"),
        ([True, 4], r"prompt\[0\]=True"),
        (np.array([3.0, 4.0]), r"prompt\[0\]=3.0"),
        (7, "prompt=7"),
        (None, "prompt=None"),
    ],
)
def test_bytes_floats_and_non_lists_are_not_token_ids(prompt, match):
    e = engine()
    good = e.add_request([3, 4, 5], SamplingParams(max_tokens=4, **GREEDY))
    rejected_cleanly(e, lambda: e.add_request(prompt, SamplingParams(max_tokens=2)), match, good)


# --- 6. engine configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_queue_len", float("nan")),
        ("max_queue_len", 1.5),
        ("max_queue_len", True),
        ("kv_cache_memory_gb", float("nan")),
        ("kv_cache_memory_gb", float("inf")),
        ("kv_cache_memory_gb", True),
        ("num_kv_blocks", True),
        ("num_swap_blocks", False),
        ("num_speculative_tokens", True),
        ("block_size", 4.0),
        ("seed", 1.5),
        ("seed", "0"),
        ("seed", -1),
        ("seed", True),
        ("device", "cuda:abc"),
        ("device", "cuda:"),
        ("device", 0),
        ("cost_model", float("nan")),
        ("cost_model", float("inf")),
        ("cost_model", -1.0),
        ("cost_model", [0.01]),
        ("cost_model", "H999"),
        ("cost_model", True),
        ("enable_chunked_prefill", "no"),
        ("enable_prefix_caching", 1),
        ("enable_chunked_prefill", None),
        ("watermark", float("nan")),
        ("watermark", "0.1"),
        ("max_queue_delay", float("nan")),
        ("max_queue_delay", float("inf")),
        ("max_queue_delay", "1"),
        ("policy", "lifo"),
        ("policy", None),
        ("speculative_model", 3),
        ("random_model", "big"),
    ],
)
def test_bad_config_fields_fail_at_construction_naming_the_field(field, value):
    with pytest.raises(BAD, match=f"EngineConfig.{field}="):
        EngineConfig(**{field: value})


def test_integer_like_config_values_become_plain_ints():
    cfg = EngineConfig(num_kv_blocks=np.int64(8), block_size=torch.tensor(4), seed=np.uint32(7), device="cuda:1")
    assert (cfg.num_kv_blocks, cfg.block_size, cfg.seed) == (8, 4, 7)
    assert all(type(v) is int for v in (cfg.num_kv_blocks, cfg.block_size, cfg.seed))


GOOD_CONFIG = dict(
    model_type="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


@pytest.mark.parametrize("executor", ["simulated", "model"])
@pytest.mark.parametrize(
    "change,field",
    [
        (dict(num_hidden_layers=-1), "num_hidden_layers"),
        (dict(num_hidden_layers=0), "num_hidden_layers"),
        (dict(num_attention_heads=0), "num_attention_heads"),
        (dict(num_key_value_heads=3), "num_key_value_heads"),
        (dict(hidden_size=30), "hidden_size"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(hidden_size=10**9), "hidden_size"),
        (dict(vocab_size=10**12), "vocab_size"),
        (dict(intermediate_size=0), "intermediate_size"),
        (dict(eos_token_id=64), "eos_token_id"),
    ],
)
def test_a_checkpoint_config_is_checked_before_anything_is_sized_from_it(tmp_path, executor, change, field):
    (tmp_path / "config.json").write_text(json.dumps({**GOOD_CONFIG, **change}))
    with pytest.raises(ValueError, match=f"config.json.*{field}"):
        LLM(str(tmp_path), executor=executor, num_kv_blocks=16)


@pytest.mark.parametrize("executor", ["simulated", "model"])
def test_random_model_overrides_are_checked(executor):
    with pytest.raises(ValueError, match="random_model.*num_attention_heads"):
        LLM("random", executor=executor, random_model=dict(num_attention_heads=0, head_dim=None))


@pytest.mark.parametrize("executor", ["simulated", "model"])
def test_random_model_refuses_unknown_fields_naming_them(executor):
    with pytest.raises(TypeError, match=r"random_model: unknown LlamaConfig field\(s\) \['bogus', 'hiden_size'\]"):
        LLM("random", executor=executor, random_model={"bogus": 1, "hiden_size": 32, "vocab_size": 64})
    assert LLM("random", executor=executor, random_model={"vocab_size": 64}).engine.vocab_size == 64


def test_random_model_fields_are_llama_config_arguments():
    """Every field random_model takes is an argument of transformers' LlamaConfig (rope_theta: its older name)."""
    import inspect
    from transformers import LlamaConfig
    from minillm.model.loader import RANDOM_MODEL_FIELDS

    takes = set(inspect.signature(LlamaConfig.__init__).parameters) | {"rope_theta"}
    assert RANDOM_MODEL_FIELDS <= takes, sorted(RANDOM_MODEL_FIELDS - takes)


@pytest.mark.parametrize("executor,blocks", [("model", 10**9), ("simulated", 10**10)])
def test_a_kv_cache_too_big_for_the_machine_is_a_value_error_with_bytes(executor, blocks):
    with pytest.raises(ValueError, match=rf"num_kv_blocks={blocks}.* bytes .*more than"):
        LLM("random", executor=executor, num_kv_blocks=blocks)
    with pytest.raises(ValueError, match=r"num_kv_blocks=8.*swap blocks.* bytes"):
        LLM("random", executor=executor, num_kv_blocks=8, num_swap_blocks=blocks)


# --- 7. SamplingParams copied at the door ---------------------------------------------------------------------


def test_changing_the_callers_sampling_params_later_changes_nothing():
    e = engine(num_kv_blocks=4)  # 16 positions: max_tokens=1000 could never fit
    sp = SamplingParams(max_tokens=3, **GREEDY)
    rid = e.add_request([3, 4, 5], sp)
    sp.max_tokens = 1000
    sp.stop_token_ids.append(e.get_output(rid).prompt_token_ids[0])
    sp.temperature = 1.0
    assert e.requests[rid].sampling_params is not sp
    finish(e)
    assert e.get_output(rid).token_ids == alone([3, 4, 5], max_tokens=3)


# --- 8. LLM.generate: all or nothing --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad,match",
    [
        ([5, 10**6], r"prompts\[1\].*prompt\[1\]=1000000"),
        ([], r"prompts\[1\].*empty"),
        (b"\x05\x06", r"prompts\[1\].*bytes"),
        ([5, 6.5], r"prompts\[1\].*prompt\[1\]=6.5"),
    ],
)
def test_generate_queues_nothing_when_one_prompt_is_bad(bad, match):
    llm = LLM("random", **SMALL)
    sp = SamplingParams(max_tokens=3, **GREEDY)
    with pytest.raises(BAD, match=match):
        llm.generate([[3, 4], bad, [6, 7]], sp)
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()
    outs = llm.generate([[3, 4], [6, 7]], sp)
    assert [len(o.token_ids) for o in outs] == [3, 3]


def test_generate_queues_nothing_when_one_params_is_bad():
    llm = LLM("random", **SMALL)
    good = SamplingParams(max_tokens=3, **GREEDY)
    edited = SamplingParams(max_tokens=3)
    edited.temperature = float("nan")
    for params in ([good, good, "greedy"], [good, edited, good]):
        with pytest.raises(BAD, match=r"prompts\[\d\]"):
            llm.generate([[3, 4], [5, 6], [6, 7]], params)
        assert not llm.engine.requests


def test_generate_takes_one_prompt_of_numpy_ids():
    llm = LLM("random", **SMALL)
    outs = llm.generate(np.array([3, 4, 5]), SamplingParams(max_tokens=4, **GREEDY))
    assert len(outs) == 1 and outs[0].token_ids == alone([3, 4, 5])


# --- 9. the acceptance-rule hook ---------------------------------------------------------------------------

SPEC = dict(SMALL, speculative_model="ngram", num_speculative_tokens=2)
LOOP = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]


def spec_run(verify=None):
    e = LLM("random", **SPEC, acceptance_rule=verify).engine
    a = e.add_request(LOOP, SamplingParams(max_tokens=20, **GREEDY))
    b = e.add_request([3, 4, 5], SamplingParams(max_tokens=20, **GREEDY))
    return e, a, b


def _wrong_tokens(logits, draft, *args):
    return [10**6]


def _too_many(logits, draft, *args):
    return list(draft) + [1, 2]


def _nothing(logits, draft, *args):
    return []


def _not_the_draft(logits, draft, *args):
    return [(draft[0] + 1) % 512, 3]


def _floats(logits, draft, *args):
    return [float(draft[0])]


def _a_string(logits, draft, *args):
    return "12"


class FixableRule:
    """An acceptance rule configured like any (``LLM(acceptance_rule=...)``) that the test fixes mid-run:
    ``hook`` until ``fixed`` is set, then the built-in rule."""

    def __init__(self, hook):
        self.hook = hook
        self.fixed = False

    def __call__(self, *args):
        from minillm.spec import acceptance

        return (acceptance.verify if self.fixed else self.hook)(*args)

    def __repr__(self):
        return self.hook.__qualname__


@pytest.mark.parametrize("hook", [_wrong_tokens, _too_many, _nothing, _not_the_draft, _floats, _a_string])
def test_a_bad_acceptance_rule_is_named_and_the_run_recovers(hook):
    e, a, b = spec_run()
    finish(e)
    expected = (e.get_output(a).token_ids, e.get_output(b).token_ids)
    rule = FixableRule(hook)
    e, a, b = spec_run(rule)
    with pytest.raises(ValueError, match=rf"ModelRunner.verify \(the acceptance rule .*{hook.__name__}\)"):
        finish(e)
    rule.fixed = True  # fix the rule: the run carries on, nothing lost
    finish(e)
    assert (e.get_output(a).token_ids, e.get_output(b).token_ids) == expected


def test_a_hook_may_return_a_tensor_or_numpy_ints():
    from minillm.spec import acceptance

    e, a, b = spec_run()
    finish(e)
    expected = e.get_output(a).token_ids
    e, a, b = spec_run(lambda *args: torch.tensor(acceptance.verify(*args)))
    finish(e)
    assert e.get_output(a).token_ids == expected


# --- 15. no model hub, ever -----------------------------------------------------------------------------------


@pytest.fixture
def no_hub(monkeypatch):
    """AutoConfig / AutoTokenizer may only read local directories, with local_files_only."""
    import transformers

    for cls in (transformers.AutoConfig, transformers.AutoTokenizer):
        real = cls.from_pretrained.__func__

        def local_only(klass, path, *args, _real=real, **kw):
            assert os.path.isdir(path) and kw.get("local_files_only"), f"a model hub would be asked for {path!r}"
            return _real(klass, path, *args, **kw)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(local_only))


@pytest.mark.parametrize("executor", ["simulated", "model"])
def test_an_unknown_model_name_never_reaches_a_model_hub(no_hub, executor):
    match = "no-such/model-xyz.*llama-2-7b" if executor == "simulated" else "no-such/model-xyz"
    with pytest.raises(ValueError, match=match):
        LLM("no-such/model-xyz", executor=executor)


@pytest.mark.parametrize("executor", ["simulated", "model"])
def test_a_checkpoint_directory_is_read_locally_only(tmp_path, no_hub, executor):
    from helpers import tiny_hf_checkpoint

    tiny_hf_checkpoint(tmp_path)
    llm = LLM(str(tmp_path), executor=executor, num_kv_blocks=16, block_size=4, max_model_len=32)
    assert llm.engine.vocab_size == 128


# --- 16. resuming training loads no pickled code --------------------------------------------------------------


def test_training_resumes_with_weights_only(tmp_path, monkeypatch):
    import transformers as tf

    spec = importlib.util.spec_from_file_location(
        "train_shakespeare", os.path.join(os.path.dirname(__file__), "..", "scripts", "train_shakespeare.py")
    )
    ts = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "train_shakespeare", ts)  # its dataclasses look themselves up
    spec.loader.exec_module(ts)
    loads = []
    real_load = torch.load

    def load(*args, **kw):
        loads.append(kw.get("weights_only"))
        return real_load(*args, **kw)

    monkeypatch.setattr(ts.torch, "load", load)
    args = types.SimpleNamespace(
        resume=True,
        lr=1e-3,
        min_lr=1e-4,
        warmup_steps=1,
        weight_decay=0.1,
        batch_size=2,
        grad_clip=1.0,
        eval_every=100,
        eval_windows=2,
        save_minutes=1e9,
        seed=0,
    )
    cfg = tf.LlamaConfig(
        vocab_size=16,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=8,
    )
    stream = np.arange(200) % 16
    state = str(tmp_path / "state.pt")
    torch.manual_seed(0)
    run1 = ts.train("t", tf.LlamaForCausalLM(cfg), stream, stream, args, 2, 5.0, state, str(tmp_path / "hf"), "cpu")
    run2 = ts.train("t", tf.LlamaForCausalLM(cfg), stream, stream, args, 3, 5.0, state, str(tmp_path / "hf"), "cpu")
    assert loads == [True]  # the resume read tensors and plain values only
    assert run1["steps"] == 2 and run2["steps"] == 3 and len(run2["history"]) == 2
    assert math.isfinite(run2["history"][-1]["val_nats_per_token"])
