"""The notebooks' printed tables (``minillm/viz/printouts.py``) say what the records say, checked on a
step worked out by hand."""

from __future__ import annotations

from minillm import LLM, SamplingParams
from minillm.viz import printouts


def test_a_step_record_printed_field_by_field(capsys):
    # Budget 8, blocks of 4: a's 6-token prompt whole, then 2 of b's 5 (a chunk); c waits for the budget.
    # KV: a holds 6 positions in 2 blocks, b 2 in 1: 8 positions in 3 of 8 blocks, 2 + 2 empty in last blocks.
    llm = LLM(
        model="random",
        executor="simulated",
        clock="modeled",
        cost_model=0.010,
        block_size=4,
        num_kv_blocks=8,
        max_num_batched_tokens=8,
        max_model_len=32,
    )
    for rid, n in (("a", 6), ("b", 5), ("c", 3)):
        llm.engine.add_request(list(range(10, 10 + n)), SamplingParams(max_tokens=2, ignore_eos=True), request_id=rid)
    printouts.step_record(llm.engine.step())
    assert capsys.readouterr().out.splitlines() == [
        "step 0: 8 of 8 budget tokens, took 10.0 ms (modeled clock)",
        "  a: prefill + 6 tokens   KV  0 ->  6 positions   1 token(s) out",
        "  b: prefill + 2 tokens   KV  0 ->  2 positions   0 token(s) out",
        "  c waits: prefill of 3 tokens does not fit the 0 tokens left in the budget of 8",
        "  KV: 8 of 32 positions hold KV, in 3 of 8 blocks of 4 (4 positions empty in partly filled last blocks)",
    ]


def test_a_request_returning_after_preemption_is_found_in_the_records(capsys):
    llm = LLM(model="random", executor="simulated", clock="modeled", cost_model=0.010, max_model_len=32)
    llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True), request_id="C")
    records = llm.engine.run()
    printouts.return_after_preemption({"run": records}, "C", after_step=1)
    assert capsys.readouterr().out == (
        "run                            C returns at step 1 with a decode of 1 token(s) "
        "(3 positions already in the cache); the run takes 3 steps\n"
    )
