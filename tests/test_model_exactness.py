"""The engine's greedy tokens equal transformers' generate(), token for token, in float32.

Batched, paged, chunked and preempted runs must all give what each prompt gives
alone in Hugging Face: batching and scheduling change *when* work happens, never
*what* is computed.
"""

import pytest

from minillm_kernels import cpu_attention
from minillm import LLM, SamplingParams
from minillm.core.invariants import check_all_free, check_invariants

from helpers import hf_greedy, random_prompts, tiny_hf_checkpoint

pytestmark = pytest.mark.slow  # transformers' generate beside the engine on several checkpoints

N_NEW = 8
CONFIGS = {
    "block16": dict(block_size=16),
    "block3-chunked7": dict(block_size=3, max_num_batched_tokens=7),
    "block1": dict(block_size=1),
    "pressure-preempt": dict(block_size=4, num_kv_blocks=12, max_num_batched_tokens=16),
}


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = tiny_hf_checkpoint(path, request.param)
    prompts = random_prompts(8, 128, seed=1)
    ref = [hf_greedy(model, p, N_NEW) for p in prompts]
    return str(path), prompts, ref


# "cpu": the C kernel that reads the paged cache in place (kernels/cpu_attention.py), needs a C compiler.
BACKENDS = [
    "torch",
    pytest.param("cpu", marks=pytest.mark.skipif(cpu_attention.compiler() is None, reason="no C compiler")),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_transformers(checkpoint, name, backend):
    path, prompts, ref = checkpoint
    llm = LLM(path, max_model_len=64, dtype="float32", attention_backend=backend, **CONFIGS[name])
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)) for p in prompts]
    saw_preemption = False
    while engine.has_unfinished_requests():
        rec = engine.step()
        check_invariants(engine, rec)
        saw_preemption |= bool(rec.preempted)
    check_all_free(engine)
    for rid, want in zip(ids, ref):
        assert engine.get_output(rid).token_ids == want, f"request {rid} differs from transformers"
    if name == "pressure-preempt":
        assert saw_preemption, "the small KV cache was meant to force preemption"
    if name == "block3-chunked7":
        assert max(r.num_batched_tokens for r in engine.step_records) <= 7
