"""minillm.sim.replay: the notebooks' trace replay gives what the engine, set up and run by hand, gives."""

from minillm import LLM
from minillm.analysis import metrics, workloads
from minillm.sim.costmodel import ConstantStepTime
from minillm.sim.replay import replay


def by_hand(trace, model, cost_model, **config):
    """The replay written out: an LLM on the simulated executor and modeled clock, the trace submitted, run."""
    llm = LLM(model=model, executor="simulated", clock="modeled", cost_model=cost_model, record="summary", **config)
    workloads.submit_trace(llm.engine, trace, vocab_size=llm.engine.vocab_size)
    records = llm.engine.run()
    m = {rid: r.metrics for rid, r in llm.engine.requests.items()}
    stats = llm.engine.kv.stats() if llm.config.enable_prefix_caching else None
    return records, metrics.summarize(m, records, max_num_seqs=llm.config.max_num_seqs, prefix_cache_stats=stats)


def test_replay_is_the_engine_run_by_hand_with_its_defaults():
    trace = workloads.synthetic_trace(
        40,
        rate=8.0,
        prompt_len=workloads.LogNormal(200, 0.8, hi=1500),
        output_len=workloads.LogNormal(100, 1.0, hi=600),
        vocab_size=500,
        seed=0,
    )
    cases = [
        dict(
            model="llama-2-7b", cost_model="H100-SXM", num_kv_blocks=256, max_model_len=4096, enable_prefix_caching=True
        ),
        dict(model="random", cost_model=ConstantStepTime(0.010), policy="sjf", max_num_seqs=4, max_model_len=2048),
    ]
    for case in cases:
        records, want = by_hand(trace, **case)
        eng, m, got = replay(trace, **case)
        assert len(eng.step_records) == len(records)
        assert sorted(m) == sorted(eng.requests) and len(m) == len(trace)
        assert {k: got[k] for k in want} == want, case
