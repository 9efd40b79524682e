"""vLLM programs, run unchanged on minillm: only ``from vllm`` becomes ``from minillm``.

Each program below is written as vLLM's documentation writes its offline examples
(examples/offline_inference: basic, chat, prompt dicts and ``TokensPrompt``, sampling parameters,
parallel sampling), with vLLM's keyword arguments (``gpu_memory_utilization``, ``enforce_eager``,
``swap_space``, ``dtype="half"``, ``min_p``, ``top_k=-1``, ``max_tokens=None``). The test swaps the
import and runs the source with ``MODEL`` set to the shipped checkpoint (a hub name would mean a
download), then checks what the program printed against what minillm's own API gives.
"""

from __future__ import annotations

import pytest

from minillm.model.loader import DEFAULT_MODEL_DIR

MODEL = str(DEFAULT_MODEL_DIR)


def run_vllm_program(source: str, capsys) -> tuple[dict, str]:
    """Run ``source`` with vLLM's imports pointed at minillm; (its globals, what it printed)."""
    assert "from vllm" in source and "minillm" not in source
    scope = {"MODEL": MODEL, "__name__": "__main__"}
    exec(compile(source.replace("from vllm", "from minillm"), "<vllm program>", "exec"), scope)
    return scope, capsys.readouterr().out


BASIC = """
from vllm import LLM, SamplingParams

prompts = [
    "ROMEO:",
    "JULIET:",
    "First Citizen:",
    "KING HENRY:",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)


def main():
    llm = LLM(model=MODEL, max_model_len=128, gpu_memory_utilization=0.9, enforce_eager=True,
              trust_remote_code=True, swap_space=0.01)
    outputs = llm.generate(prompts, sampling_params)
    print("\\nGenerated Outputs:\\n" + "-" * 60)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt:    {prompt!r}")
        print(f"Output:    {generated_text!r}")
        print("-" * 60)
    return llm, outputs


if __name__ == "__main__":
    llm, outputs = main()
"""


def test_basic_offline_inference(capsys):
    scope, printed = run_vllm_program(BASIC, capsys)
    outputs = scope["outputs"]
    assert [o.prompt for o in outputs] == scope["prompts"]
    for o in outputs:
        assert f"Prompt:    {o.prompt!r}" in printed and f"Output:    {o.outputs[0].text!r}" in printed
        assert 1 <= len(o.outputs[0].token_ids) <= 16  # vLLM's default max_tokens is 16
    llm = scope["llm"]
    assert llm.engine.num_kv_blocks == 64 * 8 + 1  # 0.9 of this machine holds every request
    assert llm.config.num_swap_blocks > 0  # swap_space=0.01 GiB, in blocks


CHAT = """
from vllm import LLM, SamplingParams

llm = LLM(model=MODEL, max_model_len=256, dtype="float")
sampling_params = SamplingParams(temperature=0, max_tokens=24)


def print_outputs(outputs):
    print("\\nGenerated Outputs:\\n" + "-" * 80)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}\\n")
        print(f"Generated text: {generated_text!r}")
        print("-" * 80)


conversation = [
    {"role": "system", "content": "You are a courtier of Verona."},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Good morrow, my lord."},
    {"role": "user", "content": "What news from Mantua?"},
]
outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
print_outputs(outputs)

# A batch of conversations in one call.
conversations = [conversation for _ in range(3)]
batch = llm.chat(conversations, sampling_params, use_tqdm=True)
print_outputs(batch)

tokenizer = llm.get_tokenizer()
"""


def test_chat(capsys):
    from minillm.serve.chat import PLAIN_STOP, plain_template

    scope, printed = run_vllm_program(CHAT, capsys)
    out, batch, llm = scope["outputs"], scope["batch"], scope["llm"]
    # the server's template (the shipped model has none of its own), its stop at the end of a speech
    assert out[0].prompt == plain_template(scope["conversation"])
    assert out[0].prompt.endswith("USER:\nWhat news from Mantua?\n\nASSISTANT:\n")
    assert "\n\n" not in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "length" or out[0].outputs[0].stop_reason == PLAIN_STOP[0]
    assert len(batch) == 3 and all(b.outputs[0].token_ids == out[0].outputs[0].token_ids for b in batch)
    assert f"Generated text: {out[0].outputs[0].text!r}" in printed
    # the same as a plain generate of the rendered prompt with the template's stop
    from minillm import SamplingParams

    direct = llm.generate(out[0].prompt, SamplingParams(temperature=0, max_tokens=24, stop=PLAIN_STOP))[0]
    assert direct.outputs[0].token_ids == out[0].outputs[0].token_ids
    assert scope["tokenizer"] is llm.engine.tokenizer


PROMPT_DICTS = """
from vllm import LLM, SamplingParams
from vllm.inputs import TextPrompt, TokensPrompt

llm = LLM(model=MODEL, max_model_len=128, dtype="float32")
tokenizer = llm.get_tokenizer()
token_ids = tokenizer.encode("ROMEO:", add_special_tokens=False)

prompts = [
    "ROMEO:",
    {"prompt": "ROMEO:"},
    TextPrompt(prompt="ROMEO:"),
    {"prompt_token_ids": token_ids},
    TokensPrompt(prompt_token_ids=token_ids),
]
outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10))
for output in outputs:
    print(output.prompt_token_ids, output.outputs[0].text)
single = llm.generate({"prompt": "JULIET:"}, SamplingParams(temperature=0.0, max_tokens=4))
"""


def test_prompt_dicts(capsys):
    scope, _ = run_vllm_program(PROMPT_DICTS, capsys)
    outs = scope["outputs"]
    assert len(outs) == 5
    assert all(o.prompt_token_ids == scope["token_ids"] for o in outs)
    assert all(o.outputs[0].token_ids == outs[0].outputs[0].token_ids for o in outs)
    assert len(scope["single"]) == 1 and scope["single"][0].prompt == "JULIET:"


SAMPLING = """
from vllm import LLM, SamplingParams

llm = LLM(model=MODEL, max_model_len=48, gpu_memory_utilization=0.9)
prompts = ["ROMEO:", "JULIET:"]

# min_p with top_k=-1 (every token), to the end of the context (max_tokens=None)
params = SamplingParams(temperature=0.9, top_k=-1, min_p=0.1, max_tokens=None, seed=7, ignore_eos=True)
long = llm.generate(prompts, params)

# parallel sampling: n completions of each prompt
params_n = SamplingParams(n=3, temperature=1.0, top_p=0.9, max_tokens=8, seed=0)
parallel = llm.generate(prompts, params_n)
for output in parallel:
    for completion in output.outputs:
        print(output.prompt, completion.index, repr(completion.text))

# tokens only, special tokens in the text
raw = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=6, detokenize=False))
kept = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=6, skip_special_tokens=False))
"""


def test_sampling_params(capsys):
    scope, printed = run_vllm_program(SAMPLING, capsys)
    for o in scope["long"]:  # max_tokens=None: until max_model_len
        assert len(o.prompt_token_ids) + len(o.outputs[0].token_ids) == 48
        assert o.outputs[0].finish_reason == "length"
    for o in scope["parallel"]:
        assert [c.index for c in o.outputs] == [0, 1, 2]
        assert all(len(c.token_ids) == 8 for c in o.outputs)
        assert all(f"{o.prompt} {c.index} {c.text!r}" in printed for c in o.outputs)
    raw, kept = scope["raw"][0], scope["kept"][0]
    assert raw.outputs[0].text == "" and raw.outputs[0].token_ids == kept.outputs[0].token_ids
    tok = scope["llm"].get_tokenizer()
    assert kept.outputs[0].text == tok.decode(kept.outputs[0].token_ids, skip_special_tokens=False)


@pytest.mark.parametrize("program", [BASIC, CHAT, PROMPT_DICTS, SAMPLING])
def test_programs_name_only_vllm(program):
    """The programs are vLLM's: they import from vllm and never name minillm."""
    assert "from vllm import LLM" in program and "minillm" not in program
