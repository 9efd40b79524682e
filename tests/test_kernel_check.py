"""``minillm.kernel_check``: the notebooks' one-line check of the Triton attention kernel against its torch
reference, on an engine's own KV cache."""

import pytest

from minillm import LLM, SamplingParams
from minillm.kernel_check import check_paged_attention


def _engine(**kw):
    llm = LLM(
        model="random", device="cpu", dtype="float32", attention_backend="torch", block_size=4, num_kv_blocks=32, **kw
    )
    eng = llm.engine
    for i, n in enumerate((5, 9)):
        eng.add_request(list(range(10, 10 + n)), SamplingParams(max_tokens=6, ignore_eos=True), request_id=f"r{i}")
    return eng


def test_check_compares_the_running_requests_at_their_kv_lengths():
    eng = _engine()
    eng.step()
    eng.step()
    check = check_paged_attention(eng)
    assert check.request_ids == ("r0", "r1")
    assert check.kv_lengths == (6, 10)  # prompt + one token sampled by the prefill, stored by the decode
    assert check.max_abs_diff < check.tolerance == 1e-4
    assert "max |triton - torch|" in str(check)


def test_check_refuses_an_engine_that_has_not_stepped():
    with pytest.raises(ValueError, match="not run a step"):
        check_paged_attention(_engine())


def test_check_raises_when_the_kernel_disagrees(monkeypatch):
    from minillm_kernels import ops

    eng = _engine()
    eng.step()
    real = ops.paged_attention

    def off_by_a_little(*args, backend, **kw):
        out = real(*args, backend=backend, **kw)
        return out + 1e-2 if backend == "triton" else out

    monkeypatch.setattr(ops, "paged_attention", off_by_a_little)
    with pytest.raises(AssertionError, match="disagrees"):
        check_paged_attention(eng)
