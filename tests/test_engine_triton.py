"""End to end: the engine on the Triton kernels (Triton's interpreter on CPU) gives the
same greedy tokens as on the torch reference backend."""

import pytest

from minillm import LLM, SamplingParams
from minillm.core.invariants import check_all_free, check_invariants

from helpers import random_prompts

pytestmark = pytest.mark.slow  # the engine through Triton's interpreter


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_triton_backend_matches_torch(prefix_caching):
    prompts = random_prompts(4, 512, seed=3, lo=3, hi=14)
    prompts.append(prompts[0][:4] + [9, 9, 9])  # shares a prefix block with prompt 0
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            "random",
            attention_backend=backend,
            block_size=4,
            max_num_batched_tokens=7,
            num_kv_blocks=24,
            max_model_len=32,
            enable_prefix_caching=prefix_caching,
        )
        e = llm.engine
        ids = [e.add_request(p, sp) for p in prompts]
        while e.has_unfinished_requests():
            check_invariants(e, e.step())
        check_all_free(e)
        outs[backend] = [e.get_output(i).token_ids for i in ids]
        assert e.executor.backend == backend
    assert outs["triton"] == outs["torch"]
