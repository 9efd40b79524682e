"""What a vLLM program passes, accepted with vLLM's meaning: the LLM's settings, SamplingParams' fields,
prompt dicts, ``llm.chat``; and the ``minillm`` command. Expected values are worked out by hand (a
block's bytes from the model's shape, min-p by its definition) or against another path of the engine."""

from __future__ import annotations

import io
import logging
import math

import pytest
import torch

import minillm.config as config_module
from minillm import LLM, EngineConfig, SamplingParams
from minillm.worker.sampler import Sampler, filter_probs

SMALL = dict(block_size=16, max_num_seqs=4, max_model_len=64)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def shipped():
    return LLM(max_model_len=96, max_num_seqs=8)


def greedy_tokens(llm, prompt=(5, 6, 7, 8)):
    return llm.generate([list(prompt)], GREEDY)[0].token_ids


# --- the LLM's settings -----------------------------------------------------------------------------------


def test_gpu_memory_utilization_sizes_the_kv_cache():
    llm = LLM("random", gpu_memory_utilization=0.99, **SMALL)
    assert llm.engine.num_kv_blocks == 4 * (64 // 16) + 1  # all it could use: max_num_seqs at max_model_len
    with pytest.raises(ValueError, match=r"EngineConfig.gpu_memory_utilization=1e-09: leaves"):
        LLM("random", gpu_memory_utilization=1e-9, **SMALL)


def test_gpu_memory_utilization_is_the_simulators_memory_share():
    sim = dict(model="llama-2-7b", executor="simulated", cost_model="H100-SXM", max_num_seqs=4096, max_model_len=4096)
    default = LLM(**sim).engine.num_kv_blocks
    assert LLM(**sim, gpu_memory_utilization=0.9).engine.num_kv_blocks == default  # vLLM's default share
    half = LLM(**sim, gpu_memory_utilization=0.5).engine.num_kv_blocks
    # H100: 80 GB; llama-2-7b: ~6.7e9 fp16 parameters, 32 layers x 4096 x 2 (K, V) x 2 bytes per position
    per_block = 32 * 4096 * 2 * 2 * 16
    assert half < default
    assert (default - half) * per_block == pytest.approx(0.4 * 80e9, rel=0.01)


@pytest.mark.parametrize(
    "fields,field",
    [
        (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization=0.0"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization=1.5"),
        (dict(gpu_memory_utilization="0.9"), "gpu_memory_utilization='0.9'"),
        (dict(gpu_memory_utilization=0.5, num_kv_blocks=8), "gpu_memory_utilization=0.5: and num_kv_blocks=8"),
        (dict(gpu_memory_utilization=0.5, kv_cache_memory_gb=0.25), "gpu_memory_utilization=0.5: and kv_cache"),
        (dict(swap_space=-1), "swap_space=-1"),
        (dict(swap_space=1, num_swap_blocks=4), "swap_space=1.0: and num_swap_blocks=4"),
        (dict(enforce_eager=1), "enforce_eager=1"),
        (dict(trust_remote_code="yes"), "trust_remote_code='yes'"),
        (dict(dtype="fp64"), "dtype='fp64'"),
        (dict(dtype="half16"), "dtype='half16'"),
    ],
)
def test_bad_vllm_settings_name_the_field_before_anything_loads(fields, field):
    with pytest.raises((TypeError, ValueError), match="EngineConfig." + field.replace("(", r"\(")):
        LLM("no/such/dir", **fields)  # the model is never looked at: the config fails first


def test_swap_space_is_the_swap_pool_in_gib():
    llm = LLM("random", swap_space=0.001, preemption_mode="swap", **SMALL)
    per_block = 2 * 2 * 16 * 2 * 4 * 16  # layers x KV heads x head size x (K, V) x float32 x block_size
    assert llm.config.num_swap_blocks == int(0.001 * 2**30) // per_block == 131
    assert llm.engine.kv.num_swap_blocks == 131 and llm.config.swap_space is None


@pytest.mark.parametrize(
    "alias,name",
    [("half", "float16"), ("float", "float32"), (torch.bfloat16, "bfloat16"), ("float16", "float16"), ("auto", "auto")],
)
def test_dtype_aliases(alias, name):
    assert EngineConfig(dtype=alias).dtype == name


def test_half_runs_the_model_in_float16():
    half = LLM("random", dtype="half", **SMALL)
    assert half.engine.dtype == torch.float16
    assert greedy_tokens(half) == greedy_tokens(LLM("random", dtype="float16", **SMALL))


def test_settings_without_effect_are_logged_once_and_change_nothing(monkeypatch, caplog):
    monkeypatch.setattr(config_module, "_logged", set())
    with caplog.at_level(logging.WARNING, logger="minillm"):
        a = LLM("random", enforce_eager=True, trust_remote_code=True, **SMALL)
        b = LLM("random", enforce_eager=True, trust_remote_code=True, **SMALL)
    said = [r.getMessage() for r in caplog.records if r.name == "minillm"]
    assert len(said) == 2 and "enforce_eager=True" in said[0] and "trust_remote_code=True" in said[1]
    assert greedy_tokens(a) == greedy_tokens(b) == greedy_tokens(LLM("random", **SMALL))


# --- SamplingParams ---------------------------------------------------------------------------------------


def test_min_p_by_its_definition():
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]])
    one = torch.ones(1)
    out = filter_probs(logits, one, torch.zeros(1, dtype=torch.long), one, min_p=torch.tensor([0.5]))
    # kept: p >= 0.5 * 0.5 = 0.25, i.e. 0.5 and 0.3, renormalized
    assert torch.allclose(out, torch.tensor([[0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]]))
    # at temperature 2 the probabilities flatten first (vLLM: temperature, then min-p)
    t2 = torch.softmax(logits / 2, -1)[0]
    keep = t2 >= 0.5 * t2.max()
    ref = torch.where(keep, t2, torch.zeros(())) / t2[keep].sum()
    got = filter_probs(logits, 2 * one, torch.zeros(1, dtype=torch.long), one, min_p=torch.tensor([0.5]))
    assert torch.allclose(got[0], ref) and int(keep.sum()) == 3


def test_min_p_one_is_greedy_and_min_p_zero_changes_nothing():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    s = Sampler(0)
    toks, failed = s.sample(
        logits, [SamplingParams(temperature=1.0, min_p=1.0, seed=i) for i in range(3)], ["a", "b", "c"]
    )
    assert not failed and toks == logits.argmax(-1).tolist()
    plain = Sampler(0).probs(logits, [SamplingParams(temperature=0.7, top_k=-1)] * 3)
    zero = Sampler(0).probs(logits, [SamplingParams(temperature=0.7, min_p=0.0, top_k=0)] * 3)
    assert torch.equal(plain, zero) and torch.allclose(plain, torch.softmax(logits / 0.7, -1))


def test_min_p_in_the_engine(shipped):
    p = "ROMEO:"
    greedy = shipped.generate(p, SamplingParams(temperature=0, max_tokens=10))[0].token_ids
    drawn = shipped.generate(
        [p] * 3, [SamplingParams(temperature=1.0, min_p=1.0, seed=s, max_tokens=10) for s in range(3)]
    )
    assert all(o.token_ids == greedy for o in drawn)


@pytest.mark.parametrize(
    "fields,match",
    [
        (dict(top_k=-2), r"SamplingParams.top_k=-2: must be an integer >= 1, or 0 or -1"),
        (dict(min_p=1.5), r"SamplingParams.min_p=1.5"),
        (dict(min_p=-0.1), r"SamplingParams.min_p=-0.1"),
        (dict(min_p="0.1"), r"SamplingParams.min_p='0.1'"),
        (dict(max_tokens=0), r"SamplingParams.max_tokens=0"),
        (dict(detokenize="no"), r"SamplingParams.detokenize='no'"),
        (dict(skip_special_tokens=None), r"SamplingParams.skip_special_tokens=None"),
        (dict(detokenize=False, stop=["\n"]), r"SamplingParams.stop=\['\\n'\]: stop strings are matched on the text"),
    ],
)
def test_bad_new_sampling_fields_name_the_field(fields, match):
    with pytest.raises((TypeError, ValueError), match=match):
        SamplingParams(**fields)


def test_top_k_minus_one_is_every_token():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(1))
    s = Sampler(0)
    assert torch.equal(s.probs(logits, [SamplingParams(top_k=-1)] * 2), s.probs(logits, [SamplingParams()] * 2))


def test_max_tokens_none_runs_to_the_end_of_the_context():
    llm = LLM("random", **SMALL)
    sp = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True, min_tokens=3)
    out = llm.generate([[5, 6, 7], [9] * 20], sp)
    assert [len(o.token_ids) for o in out] == [64 - 3, 64 - 20]
    assert all(o.finish_reason == "length" for o in out) and sp.max_tokens is None  # the caller's object kept


def test_skip_special_tokens_and_detokenize_in_the_text(shipped):
    from types import SimpleNamespace

    from minillm.detokenizer import IncrementalDetokenizer
    from minillm.outputs import final_text

    tok = shipped.get_tokenizer()
    ids = tok.encode("ROMEO:", add_special_tokens=False) + [tok.eos_token_id]
    for skip, want in ((True, "ROMEO:"), (False, "ROMEO:" + tok.eos_token)):
        d = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        d.update(ids)
        d.rewind(ids[:-1])
        d.update(ids)
        r = SimpleNamespace(
            sampling_params=SamplingParams(skip_special_tokens=skip), stop_text=None, output_token_ids=ids
        )
        assert d.text == final_text(r, tok) == want
    r = SimpleNamespace(sampling_params=SamplingParams(detokenize=False), stop_text=None, output_token_ids=ids)
    assert final_text(r, tok) == ""
    out = shipped.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=4, detokenize=False, logprobs=2))[0]
    assert out.text == "" and all(lp.decoded_token is None for pos in out.outputs[0].logprobs for lp in pos.values())


# --- prompts and chat ---------------------------------------------------------------------------------------


def test_tokenizer_as_a_directory(shipped, tmp_path):
    from minillm.model.loader import DEFAULT_MODEL_DIR

    llm = LLM("random", tokenizer=DEFAULT_MODEL_DIR, random_model=dict(vocab_size=1024), **SMALL)
    assert llm.get_tokenizer().encode("ROMEO:") == shipped.get_tokenizer().encode("ROMEO:")
    with pytest.raises(ValueError, match=r"tokenizer='.*': no tokenizer"):
        LLM("random", tokenizer=str(tmp_path), **SMALL)


def test_prompt_dicts_match_plain_prompts():
    llm = LLM("random", **SMALL)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}, [5, 6, 7, 8]], GREEDY)
    assert out[0].token_ids == out[1].token_ids == greedy_tokens(llm)


@pytest.mark.parametrize(
    "prompt,error,match",
    [
        ({"prompt_ids": [1, 2]}, TypeError, r"prompts\[1\]: unknown key\(s\) \['prompt_ids'\]"),
        ({"prompt": [1, 2]}, TypeError, r"prompts\[1\]\['prompt'\]=\[1, 2\]: must be a str"),
        (
            {"prompt_token_ids": [1], "multi_modal_data": {"image": 0}},
            ValueError,
            r"prompts\[1\]\['multi_modal_data'\]: not supported",
        ),
        ({}, TypeError, r"prompts\[1\]: a prompt dict needs 'prompt'"),
        ({"prompt_token_ids": [1, 99999]}, ValueError, r"prompts\[1\]: prompt\[1\]=99999"),
    ],
)
def test_bad_prompt_dicts_name_the_prompt_and_queue_nothing(prompt, error, match):
    llm = LLM("random", **SMALL)
    with pytest.raises(error, match=match):
        llm.generate([[5, 6], prompt], GREEDY)
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()


def test_priority_per_prompt_as_vllm():
    llm = LLM("random", policy="priority", block_size=16, max_num_seqs=1, max_model_len=64)
    out = llm.generate([[5, 6], [7, 8], [9, 10]], GREEDY, priority=[2, 0, 1])
    order = sorted(range(3), key=lambda i: out[i].metrics.first_token_time)
    assert order == [1, 2, 0]  # one at a time, lower priority value first
    with pytest.raises(ValueError, match=r"priority=\[1, 0\]: read only by policy='priority'"):
        LLM("random", **SMALL).generate([[5], [6]], GREEDY, priority=[1, 0])
    with pytest.raises(ValueError, match=r"priority: 1 given for 2 prompts"):
        llm.generate([[5], [6]], GREEDY, priority=[1])
    with pytest.raises(ValueError, match=r"lora_request='adapter'"):
        llm.generate([[5]], GREEDY, lora_request="adapter")


def test_neutral_vllm_prompt_keys_are_accepted():
    llm = LLM("random", **SMALL)
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 8], "multi_modal_data": None, "cache_salt": None}, GREEDY)
    assert out[0].token_ids == greedy_tokens(llm)


def test_chat_uses_the_servers_template_and_refuses_what_it_cannot_do(shipped):
    from minillm.serve.chat import PLAIN_STOP, render

    msgs = [{"role": "user", "content": "What light?", "name": "romeo"}]
    out = shipped.chat(msgs, SamplingParams(temperature=0, max_tokens=12))[0]
    prompt, stop = render(shipped.get_tokenizer(), msgs)
    assert out.prompt == prompt == "ROMEO:\nWhat light?\n\nASSISTANT:\n" and stop == PLAIN_STOP
    own_stop = shipped.chat(msgs, SamplingParams(temperature=0, max_tokens=12, stop=["o"]))[0]
    assert own_stop.outputs[0].stop_reason == "o"  # the caller's stop strings replace the template's
    for kw, match in (
        (dict(chat_template="{{ x }}"), "chat_template"),
        (dict(continue_final_message=True), "continue_final_message"),
        (dict(tools=[{"type": "function"}]), "tools"),
    ):
        with pytest.raises(ValueError, match=match):
            shipped.chat(msgs, **kw)
    with pytest.raises(TypeError, match=r"messages\[0\]='hi': must be a list of messages"):
        shipped.chat(["hi"])
    with pytest.raises(ValueError, match="messages: at least one message"):
        shipped.chat([])


# --- the minillm command ------------------------------------------------------------------------------------


def test_console_script_is_declared():
    import importlib
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    module, func = project["scripts"]["minillm"].split(":")
    from minillm import cli

    assert getattr(importlib.import_module(module), func) is cli.main


def test_serve_takes_the_model_as_its_first_argument():
    from minillm.cli import serve_argv

    assert serve_argv(["ckpt", "--port", "9"], True) == ["--model", "ckpt", "--port", "9"]
    assert serve_argv(["--port", "9"], True) == ["--port", "9"]
    assert serve_argv(["ckpt", "--port", "9"], False) == ["ckpt", "--port", "9"]  # the server's own positional
    with pytest.raises(SystemExit, match="given twice"):
        serve_argv(["ckpt", "--model", "other"], True)


def test_vllm_serve_flags_are_server_options():
    from minillm.serve.__main__ import engine_config_fields, make_parser

    args = make_parser().parse_args(
        [
            "--dtype",
            "half",
            "--gpu-memory-utilization",
            "0.5",
            "--swap-space",
            "2",
            "--enforce-eager",
            "--trust-remote-code",
        ]
    )
    fields = engine_config_fields(args)
    assert fields == dict(
        dtype="half", gpu_memory_utilization=0.5, swap_space=2.0, enforce_eager=True, trust_remote_code=True
    )
    assert EngineConfig(**fields).dtype == "float16"


def test_minillm_serve_model_reaches_the_engine(tmp_path):
    from minillm.cli import main
    import re

    with pytest.raises(SystemExit, match=re.escape(f"model='{tmp_path}/none': not a local checkpoint directory")):
        main(["serve", str(tmp_path / "none"), "--port", "0"])


@pytest.mark.parametrize(
    "command,shown",
    [
        ("serve", "--model"),
        ("serve", "--gpu-memory-utilization"),
        ("serve", "--enforce-eager"),
        ("serve", "--swap-space"),
        ("bench", "throughput"),
        ("chat", "--system-prompt"),
    ],
)
def test_each_command_has_its_own_help(command, shown, capsys):
    from minillm.cli import main

    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0 and shown in capsys.readouterr().out


def test_python_dash_m_minillm_is_the_command():
    import subprocess
    import sys
    from pathlib import Path

    from minillm import __version__

    out = subprocess.run(
        [sys.executable, "-m", "minillm", "--version"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[1],
        timeout=300,
    )
    assert out.returncode == 0 and out.stdout.strip() == f"minillm {__version__}", out.stderr


def test_version_and_no_command(capsys):
    from minillm import __version__
    from minillm.cli import main

    main(["--version"])
    assert capsys.readouterr().out.strip() == f"minillm {__version__}"
    with pytest.raises(SystemExit):
        main([])


def fake_openai_client(asked: list):
    """An OpenAI client's shape that records what it was asked: the chat loop's own logic under test.
    Its n-th reply streams as "reply ", (an empty delta), "n"."""
    from types import SimpleNamespace as NS

    def create(model, messages, stream, **extra):
        asked.append((model, [dict(m) for m in messages], extra))
        return iter([NS(choices=[NS(delta=NS(content=c))]) for c in ("reply ", None, str(len(asked)))])

    return NS(models=NS(list=lambda: NS(data=[NS(id="m1")])), chat=NS(completions=NS(create=create)))


def test_chat_keeps_the_conversation():
    from minillm.cli import chat

    asked, out = [], io.StringIO()
    client = fake_openai_client(asked)
    lines = iter(["hello", "again", ""])
    msgs = chat(
        ["--system-prompt", "be brief", "--max-tokens", "5"], client=client, read=lambda _: next(lines), out=out
    )
    assert out.getvalue() == "reply 1\nreply 2\n"
    assert [m["content"] for m in msgs] == ["be brief", "hello", "reply 1", "again", "reply 2"]
    assert asked[1][0] == "m1" and asked[1][2] == {"max_tokens": 5}
    assert [m["role"] for m in asked[1][1]] == ["system", "user", "assistant", "user"]


def test_chat_quick_against_a_running_server():
    from minillm.cli import chat
    from minillm.serve import BackgroundServer

    with BackgroundServer(block_size=16, num_kv_blocks=64, max_model_len=128) as server:
        out = io.StringIO()
        msgs = chat(["--url", server.url + "/v1", "-q", "What light?", "--max-tokens", "6"], out=out)
    assert len(msgs) == 2 and msgs[1]["role"] == "assistant"
    assert out.getvalue() == msgs[1]["content"] + "\n"
