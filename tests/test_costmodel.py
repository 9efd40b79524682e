"""The cost model against hand arithmetic and the notebooks' worked numbers.

Every expected number below is written out from datasheet figures and model shapes,
not taken from the code under test.
"""

from dataclasses import replace
from types import SimpleNamespace

import pytest

from minillm.sim.simulated import tensor_parallel
from minillm.sim.costmodel import (
    HARDWARE,
    MODELS,
    ConstantStepTime,
    CostModel,
    RooflineCostModel,
    bytes_per_generated_token,
    decode_step_time_vs_batch,
    get_cost_model,
    kv_cache_bytes,
    max_batch_size,
    swap_or_recompute,
    ModelSpec,
)

# Llama-2-7B, counted by hand from its config.json (hidden 4096, 32 layers, MLP 11008,
# vocab 32000, untied embeddings):
#   per layer: attention 4 * 4096^2 = 67,108,864; MLP 3 * 4096 * 11008 = 135,266,304; norms 8,192
#   32 layers: 32 * 202,383,360 = 6,476,267,520; embed + lm_head 2 * 32000 * 4096 = 262,144,000;
#   final norm 4,096  ->  6,738,415,616 parameters (Hugging Face reports the same).
LLAMA7_PARAMS = 32 * (4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096) + 2 * 32000 * 4096 + 4096
LLAMA7_WEIGHT_BYTES = 13_476_831_232  # 2 bytes each
LLAMA7_KV_PER_TOKEN = 2 * 32 * 32 * 128 * 2  # = 524,288 bytes (0.5 MiB)

# H100 SXM datasheet: 989 TFLOP/s dense bf16, 3.35 TB/s; default efficiencies 0.7 and 0.8;
# fixed step overhead 0.3 ms.
H100_FLOPS = 989e12 * 0.7
H100_BW = 3350e9 * 0.8
OVERHEAD = 3e-4


def test_parameter_counts_match_hand_counts():
    assert LLAMA7_PARAMS == 6_738_415_616
    assert MODELS["llama-2-7b"].num_params == 6_738_415_616
    assert MODELS["llama-2-7b"].weight_bytes == LLAMA7_WEIGHT_BYTES
    assert MODELS["llama-2-7b"].kv_bytes_per_token == LLAMA7_KV_PER_TOKEN == 524_288
    # Llama-2-70B: q, o 8192^2 each; k, v 8192 * (8 * 128) each; MLP 3 * 8192 * 28672; norms.
    per_layer_70b = 2 * 8192**2 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192
    assert MODELS["llama-2-70b"].num_params == 80 * per_layer_70b + 2 * 32000 * 8192 + 8192 == 68_976_648_192
    assert MODELS["llama-2-70b"].num_kv_heads == 8
    # Qwen3-0.6B: 16 heads x 128 = 2048 wide q; 8 kv heads x 128 = 1024; tied embeddings;
    # q_norm + k_norm (128 each) per layer. "0.44B non-embedding" on the model card.
    per_layer_q3 = 1024 * 2048 + 2 * 1024 * 1024 + 2048 * 1024 + 3 * 1024 * 3072 + 2 * 1024 + 2 * 128
    assert 28 * per_layer_q3 + 1024 == 440_467_456
    assert MODELS["qwen3-0.6b"].num_params == 28 * per_layer_q3 + 1024 + 151936 * 1024 == 596_049_920
    assert MODELS["qwen3-0.6b"].kv_bytes_per_token == 2 * 28 * 8 * 128 * 2


def test_hardware_presets_are_dense_datasheet_figures():
    assert HARDWARE["A100-80GB"].peak_flops == 312e12 and HARDWARE["A100-80GB"].hbm_bandwidth == 2039e9
    assert HARDWARE["H100-SXM"].peak_flops == 989e12 and HARDWARE["H100-SXM"].hbm_bandwidth == 3350e9
    assert HARDWARE["H200"].hbm_bandwidth == 4800e9 and HARDWARE["H200"].hbm_bytes == 141e9
    assert HARDWARE["L4"].peak_flops == 121e12 and HARDWARE["L4"].hbm_bandwidth == 300e9
    assert HARDWARE["A100-80GB"].pcie_bandwidth == 32e9 and HARDWARE["H100-SXM"].pcie_bandwidth == 64e9


# --- ConstantStepTime ------------------------------------------------------------------------


def test_constant_step_time_ignores_the_batch():
    cm = ConstantStepTime(0.010)
    assert cm.step_time([1], [5]) == 0.010
    assert cm.step_time([1] * 32, [900] * 32) == 0.010
    assert cm.step_time([2000], [2000]) == 0.010
    assert cm.schedule_time(100, 1000) == 0.0
    assert cm.swap_time(10**9) == 0.0
    assert ConstantStepTime(0.01, swap_bandwidth=32e9).swap_time(32e9) == pytest.approx(1.0)
    assert not hasattr(cm, "kv_capacity_tokens")  # no memory size: the engine sizes KV itself


def test_worked_example_scheduling_overhead_ratio():
    # Decode 15 ms per step, scheduling 0.5 ms: 3.3% per step, 0.67% when scheduling every 5 steps.
    cm = ConstantStepTime(0.015, schedule_overhead=0.0005)
    assert cm.schedule_time(10, 0) / cm.step_time([1], [1]) == pytest.approx(0.5 / 15)
    assert cm.schedule_time(10, 0) / (5 * cm.step_time([1], [1])) == pytest.approx(0.5 / 75)


def test_worked_example_static_vs_continuous_with_10ms_steps():
    # 8 requests of 100 tokens and 2 of 1000, all at once, 10 ms per decode step.
    cm = ConstantStepTime(0.010)
    clock, finish = 0.0, {}
    remaining = [100] * 8 + [1000] * 2
    while any(remaining):  # continuous batching: the finished leave at once
        active = [i for i, r in enumerate(remaining) if r]
        clock += cm.step_time([1] * len(active), [1] * len(active))
        for i in active:
            remaining[i] -= 1
            if remaining[i] == 0:
                finish[i] = clock
    assert sum(finish[i] for i in range(8)) / 8 == pytest.approx(1.0)  # 1000 ms
    assert finish[8] == pytest.approx(10.0)  # static would give all 10 s


def test_step_time_checks_its_arguments():
    cm = RooflineCostModel("H100-SXM", "llama-2-7b")
    with pytest.raises(ValueError, match="context_len"):
        cm.step_time([5], [3])  # context after the step must include the new tokens
    with pytest.raises(ValueError):
        cm.step_time([1, 1], [3])
    assert cm.step_time([], []) == 0.0  # nothing runs, no time passes
    with pytest.raises(ValueError, match="context_len=0"):
        cm.step_time([1, 1], [3, 0])  # a decode-only batch is checked too
    with pytest.raises(ValueError):
        cm.step_time([1, 1], [3])


@pytest.mark.parametrize(
    "q, c",
    [
        ([1] * 7, [5, 900, 1, 64, 3000, 17, 2]),
        ([1], [1]),
        ([1, 1, 3], [9, 9, 9]),
        ([2, 1], [2, 40]),
        ([0, 1], [5, 5]),
        ([1] * 40, list(range(1, 41))),
    ],
)
def test_step_time_is_the_breakdowns_time_for_decode_only_and_mixed_batches(q, c):
    """``step_time`` prices a decode-only batch (every q = 1: the attention pairs are the context
    lengths) and a mixed one with the same roofline as ``breakdown``, to the last bit."""
    for cm in (
        RooflineCostModel("H100-SXM", "llama-2-7b"),
        RooflineCostModel(tensor_parallel("H100-SXM", 4, link="NVLink"), "llama-2-70b"),
    ):
        assert cm.step_time(q, c) == cm.breakdown(q, c)["time"]
        assert cm.step_time(tuple(q), tuple(c)) == cm.step_time(q, c)


def test_a_decode_step_is_priced_from_its_batch_size_and_total_context():
    """``decode_step_time(n, total)`` is ``step_time`` of n decodes holding ``total`` positions in all,
    to the last bit, however the context is spread; ``modeled_step_time`` (what the engine's clock
    asks) takes it for a step of decodes and the lists otherwise, with the same result either way."""
    from minillm.core.scheduler_output import ScheduledRequest, SchedulerOutput
    from minillm.sim.costmodel import modeled_step_time

    cm = RooflineCostModel(tensor_parallel("H100-SXM", 4, link="NVLink"), "llama-2-70b")
    for c in ([5, 900, 1, 64, 3000, 17, 2], [1], list(range(1, 257)), [4096] * 256):
        assert (
            cm.decode_step_time(len(c), sum(c))
            == cm.step_time([1] * len(c), c)
            == cm.breakdown([1] * len(c), c)["time"]
        )
    assert cm.decode_step_time(3, 3 * 700) == cm.step_time([1, 1, 1], [1, 1000, 1099])  # only the total counts
    assert cm.decode_step_time(0, 0) == 0.0
    with pytest.raises(ValueError, match="total_context=2"):
        cm.decode_step_time(3, 2)  # each request holds at least its new token
    for q in ([1] * 5, [1, 1, 40, 1, 7]):  # decodes only; then two prefills among them
        grants = [ScheduledRequest(None, n, before, 0, "decode", True) for n, before in zip(q, [9, 300, 0, 77, 12])]
        out = SchedulerOutput(scheduled=grants, token_budget=8192, reformed=False)
        want = cm.step_time(q, [g.num_computed_before + g.num_new_tokens for g in grants])
        assert modeled_step_time(cm, out, 5, 0, 0) == (want, 0.0, 0.0)

    class Slower(RooflineCostModel):  # a subclass that prices steps its own way is asked itself
        def step_time(self, num_new_tokens, context_lens):
            return 2 * super().step_time(num_new_tokens, context_lens)

    slow = Slower("H100-SXM", "llama-2-7b")
    assert slow.decode_step_time(2, 100) is None
    out = SchedulerOutput(
        scheduled=[ScheduledRequest(None, 1, 49, 1, "decode", True)] * 2, token_budget=8, reformed=False
    )
    assert modeled_step_time(slow, out, 2, 0, 0)[0] == 2 * RooflineCostModel("H100-SXM", "llama-2-7b").step_time(
        [1, 1], [50, 50]
    )
    assert modeled_step_time(ConstantStepTime(0.01), out, 2, 0, 0)[0] == 0.01  # no decode_step_time: the lists


# --- Roofline ------------------------------------------------------------------------------------


def test_decode_batch1_is_memory_bound_and_costs_weights_over_bandwidth():
    cm = RooflineCostModel("H100-SXM", "llama-2-7b")
    b = cm.breakdown([1], [512])
    assert b["bound"] == "memory"
    hand_bytes = LLAMA7_WEIGHT_BYTES + LLAMA7_KV_PER_TOKEN * (512 + 1)  # weights + KV read + KV written
    assert b["bytes"] == hand_bytes == 13_745_790_976
    assert cm.step_time([1], [512]) == pytest.approx(hand_bytes / H100_BW + OVERHEAD, rel=1e-12)
    # ~ weights / bandwidth: 13.48 GB / 2.68 TB/s = 5.03 ms, the KV adds 2%.
    assert cm.step_time([1], [512]) == pytest.approx(LLAMA7_WEIGHT_BYTES / H100_BW + OVERHEAD, rel=0.03)
    # arithmetic intensity ~1 FLOP/byte, far below the ridge point (989e12 / 3.35e12 = 295)
    assert b["arithmetic_intensity"] < 2 < HARDWARE["H100-SXM"].ridge_point


def test_long_prefill_is_compute_bound_with_causal_attention_flops():
    cm = RooflineCostModel("H100-SXM", "llama-2-7b")
    n = 2048
    # linear: 2 * params per token; attention: 4 * 32 layers * 32 heads * 128 dims per
    # (query, key) pair, and a causal prompt of n tokens has n(n+1)/2 pairs.
    hand_flops = 2 * LLAMA7_PARAMS * n + 4 * 32 * 32 * 128 * (n * (n + 1) // 2)
    assert hand_flops == 28_700_598_861_824
    b = cm.breakdown([n], [n])
    assert b["flops"] == hand_flops and b["bound"] == "compute"
    assert cm.step_time([n], [n]) == pytest.approx(hand_flops / H100_FLOPS + OVERHEAD, rel=1e-12)
    # a chunk of 512 new tokens after 1536 cached ones: pairs = 512 * 1536 + 512 * 513 / 2
    assert cm.breakdown([512], [2048])["flops"] == 2 * LLAMA7_PARAMS * 512 + 4 * 32 * 32 * 128 * (
        512 * 1536 + 512 * 513 // 2
    )


def test_batching_1_to_32_throughput_vs_latency(capsys):
    """The rule of thumb: from batch 1 to 32, throughput grows about 20x while the step time
    grows only about 1.5x. On an H100 with Llama-2-7B at 512 positions of
    context, the roofline gives (by hand):
      b=1:  (13,476,831,232 + 1 * 513 * 524,288) B / 2.68e12 B/s + 0.3 ms = 5.429 ms
      b=32: (13,476,831,232 + 32 * 513 * 524,288) B / 2.68e12 B/s + 0.3 ms = 8.540 ms
      (compute at b=32: ~4.4e11 FLOP / 6.92e14 FLOP/s = 0.64 ms, still memory bound)
    latency x1.57, throughput 32 / 1.57 = x20.3. Longer contexts shrink the gain (the KV
    is not shared): at 2048 positions it is x10 for x3.2 latency.
    """
    cm = RooflineCostModel("H100-SXM", "llama-2-7b")
    lat, thr = decode_step_time_vs_batch(cm, [1, 8, 32, 64, 128], context_len=512)
    hand = [(LLAMA7_WEIGHT_BYTES + b * 513 * LLAMA7_KV_PER_TOKEN) / H100_BW + OVERHEAD for b in (1, 32)]
    assert lat[0] == pytest.approx(hand[0], rel=1e-12) and lat[2] == pytest.approx(hand[1], rel=1e-12)
    lat_ratio, thr_ratio = lat[2] / lat[0], thr[2] / thr[0]
    with capsys.disabled():
        print(
            f"\n[H100 + llama-2-7b, ctx 512] batch 1 -> 32: latency x{lat_ratio:.2f} "
            f"({lat[0] * 1e3:.2f} -> {lat[2] * 1e3:.2f} ms), throughput x{thr_ratio:.1f} "
            f"({thr[0]:.0f} -> {thr[2]:.0f} tok/s)"
        )
    assert 1.4 < lat_ratio < 1.8
    assert 17 < thr_ratio < 23
    assert list(thr) == sorted(thr)  # more batch, more throughput
    assert all(a < b for a, b in zip(lat, lat[1:]))  # ... and more latency per step
    lat2k, thr2k = decode_step_time_vs_batch(cm, [1, 32], context_len=2048)
    assert thr2k[1] / thr2k[0] < thr_ratio  # long contexts: KV reads are not shared


def test_bytes_per_generated_token_is_weights_over_batch():
    m = MODELS["llama-2-7b"]
    assert bytes_per_generated_token(m, 1) == LLAMA7_WEIGHT_BYTES
    assert bytes_per_generated_token(m, 32) == LLAMA7_WEIGHT_BYTES / 32
    assert bytes_per_generated_token("llama-2-7b", 8, context_len=100) == LLAMA7_WEIGHT_BYTES / 8 + 100 * 524_288


def test_kv_formula_llama2_70b_by_hand():
    # M_KV = 2 * n_layer * d_head * n_kv_head * n_max * b * sizeof(dtype).
    # Without GQA (64 KV heads), one 4096-token request: 2 * 80 * 128 * 64 * 4096 * 1 * 2
    # = 10,737,418,240 B = 10 GiB, the "about 10 GB" per request often quoted for Llama-2-70B.
    no_gqa = replace(MODELS["llama-2-70b"], num_kv_heads=64, name="llama-2-70b-mha")
    assert kv_cache_bytes(no_gqa, 4096, 1) == 2 * 80 * 128 * 64 * 4096 * 2 == 10 * 2**30
    # With the real GQA (8 KV heads) it is 8x smaller: 1.25 GiB; a batch of 32 is 40 GiB.
    assert kv_cache_bytes("llama-2-70b", 4096) == 1_342_177_280
    assert kv_cache_bytes("llama-2-70b", 4096, batch=32) == 32 * 1_342_177_280


def test_memory_limits_batch_size():
    # H100 80 GB, 90% usable: 72e9 - 13,476,831,232 = 58,523,168,768 B for KV
    # / 524,288 B per position = 111,624 positions; / 4096 per request = 27 requests.
    assert RooflineCostModel("H100-SXM", "llama-2-7b").kv_capacity_tokens(0.9) == 111_624
    assert max_batch_size("H100-SXM", "llama-2-7b", 4096) == 27
    # Llama-2-70B's 138 GB of bf16 weights do not fit one 80 GB A100 at all ...
    assert max_batch_size("A100-80GB", "llama-2-70b", 4096) == 0
    # ... on four: (4 * 80e9 * 0.9 - 137,953,296,384) / 327,680 = 457,906 positions -> 111 requests
    assert max_batch_size("A100-80GB", "llama-2-70b", 4096, num_gpus=4) == 111


def test_swap_time_and_schedule_time():
    cm = RooflineCostModel("A100-80GB", "llama-2-7b")
    assert cm.swap_time(32e9) == pytest.approx(1.0)  # PCIe 4.0 x16 ~ 32 GB/s
    assert cm.swap_time(1e9) == pytest.approx(1 / 32)  # 1 GB in ~31 ms
    s0, s10, s20 = cm.schedule_time(0, 0), cm.schedule_time(10, 0), cm.schedule_time(20, 0)
    assert s0 > 0 and s10 > s0
    assert s20 - s10 == pytest.approx(s10 - s0)  # linear in running requests
    assert cm.schedule_time(10, 100) > s10  # the queue costs something too


def test_swap_or_recompute_both_directions():
    # The notebook's example: 2000 input tokens, prefill ~500 ms -> S_prefill = 4000 tokens/s;
    # 1 GB of KV over 32 GB/s = 31 ms < 500 ms: swap.
    assert swap_or_recompute(1e9, 2000, 32e9, 4000) == "swap"
    # A short context with a fast prefill: 100 tokens at 10,000 tokens/s = 10 ms < 31 ms: recompute.
    assert swap_or_recompute(1e9, 100, 32e9, 10_000) == "recompute"
    assert swap_or_recompute(32e9 * 0.01, 100, 32e9, 10_000) == "recompute"  # a tie: recompute


def test_preemption_mode_uses_the_cost_model():
    # 10 ms per step prefills 1024 tokens in 10 ms -> 102,400 tokens/s, i.e. 9.8 us per token;
    # swapping one 0.5 MiB position at 32 GB/s takes 16.4 us: recompute wins.
    slow_bus = ConstantStepTime(0.010, swap_bandwidth=32e9, kv_bytes_per_token=524_288)
    assert slow_bus.prefill_tokens_per_s(1024) == pytest.approx(102_400)
    assert slow_bus.preemption_mode(1000) == "recompute"
    # At 128 GB/s a position swaps in 4.1 us: swap wins.
    assert ConstantStepTime(0.010, swap_bandwidth=128e9, kv_bytes_per_token=524_288).preemption_mode(1000) == "swap"
    # H100 + llama-2-7b: 2000 positions = 1.05 GB over 64 GB/s = 16 ms; prefill ~50k tokens/s -> 40 ms.
    cm = RooflineCostModel("H100-SXM", "llama-2-7b")
    hand_prefill = 1024 / ((2 * LLAMA7_PARAMS * 1024 + 4 * 32 * 32 * 128 * (1024 * 1025 // 2)) / H100_FLOPS + OVERHEAD)
    assert cm.prefill_tokens_per_s(1024) == pytest.approx(hand_prefill, rel=1e-12)
    assert cm.preemption_mode(2000) == swap_or_recompute(2000 * 524_288, 2000, 64e9, hand_prefill) == "swap"


def test_from_hf_config_dict_and_object():
    # Llama-2-7b-hf's config.json (the fields that matter, as published).
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "max_position_embeddings": 4096,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 32,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "vocab_size": 32000,
    }
    m = ModelSpec.from_hf_config(cfg, name="llama-2-7b-hf")
    assert (m.num_params, m.head_dim, m.dtype_bytes, m.kv_bytes_per_token) == (6_738_415_616, 128, 2, 524_288)
    # a transformers-style object (attributes), float32, GQA, no head_dim key
    obj = SimpleNamespace(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=100,
        tie_word_embeddings=True,
        torch_dtype="float32",
        model_type="llama",
        head_dim=None,
    )
    t = ModelSpec.from_hf_config(obj)
    # per layer: q 64*64 + k,v 2 * 64*32 + o 64*64 + MLP 3*64*128 + norms 128 = 36,992; 2 layers;
    # final norm 64; tied embedding 100*64.
    assert t.num_params == 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 128) + 64 + 100 * 64 == 80_448
    assert (t.head_dim, t.dtype_bytes, t.kv_bytes_per_token) == (16, 4, 2 * 2 * 2 * 16 * 4)


def test_get_cost_model():
    assert get_cost_model(None) is None
    cm = ConstantStepTime(0.01)
    assert get_cost_model(cm) is cm
    r = get_cost_model("H100-SXM")
    assert isinstance(r, RooflineCostModel) and r.model.name == "llama-2-7b" and r.hardware.name == "H100-SXM"
    assert get_cost_model("h200", "qwen3-0.6b").model.name == "qwen3-0.6b"
    assert isinstance(get_cost_model(0.02), ConstantStepTime) and get_cost_model(0.02).step_time([1], [1]) == 0.02
    assert isinstance(r, CostModel) and r.kv_bytes_per_token == 524_288
    with pytest.raises(ValueError, match=r"'B300'.*H100-SXM"):
        get_cost_model("B300")
    with pytest.raises(ValueError, match="unknown model preset 'gpt-5'"):
        RooflineCostModel("H100-SXM", "gpt-5")


@pytest.mark.slow
def test_from_hf_config_transformers_object():
    transformers = pytest.importorskip("transformers")  # slow to import: kept out of the quick run
    c = transformers.LlamaConfig(
        hidden_size=4096,
        intermediate_size=11008,
        num_attention_heads=32,
        num_hidden_layers=32,
        num_key_value_heads=32,
        vocab_size=32000,
        tie_word_embeddings=False,
    )
    m = ModelSpec.from_hf_config(c)
    assert (m.num_params, m.kv_bytes_per_token) == (6_738_415_616, 524_288)


# --- tensor parallelism's all-reduce ---------------------------------------------------------


def test_allreduce_ring_bytes_and_latency_by_hand():
    from minillm.sim.costmodel import LINKS, LinkSpec

    nv = LINKS["NVLink"]
    assert nv.bandwidth == 450e9 and LINKS["PCIe"].bandwidth == 64e9 and LINKS["InfiniBand"].bandwidth == 50e9
    # 1 MB over 4 GPUs: each sends 2 * 3/4 * 1e6 = 1.5e6 bytes; at 450 GB/s that is 3.333 us, + 10 us.
    assert nv.allreduce_time(1e6, 4) == pytest.approx(10e-6 + 1.5e6 / 450e9)
    assert nv.allreduce_time(1e6, 1) == 0.0
    # 2 GPUs: 2 * 1/2 = 1 x the bytes.
    link = LinkSpec("toy", bandwidth=1e9, latency=0.0)
    assert link.allreduce_time(1e9, 2) == pytest.approx(1.0)
    assert link.allreduce_time(1e9, 8) == pytest.approx(1.75)


def test_tp_step_adds_two_allreduces_per_layer_and_ideal_stays_available():
    from minillm.sim.simulated import tensor_parallel

    ideal = RooflineCostModel(tensor_parallel("H100-SXM", 4), "llama-2-7b")
    pcie = RooflineCostModel(tensor_parallel("H100-SXM", 4, link="PCIe"), "llama-2-7b")
    # 1024 new tokens of Llama-2-7B: activations 1024 * 4096 * 2 = 8,388,608 bytes per all-reduce;
    # ring over 4 GPUs moves 1.5x that; PCIe Gen5 64 GB/s -> 196.608 us, + 20 us latency;
    # 2 per layer x 32 layers = 64 all-reduces -> 13.862912 ms.
    per = 20e-6 + 1.5 * 1024 * 4096 * 2 / 64e9
    assert per == pytest.approx(216.608e-6)
    q, c = [1024], [1024]
    assert pcie.breakdown(q, c)["allreduce_time"] == pytest.approx(64 * per)
    assert pcie.step_time(q, c) == pytest.approx(ideal.step_time(q, c) + 64 * per)
    assert ideal.breakdown(q, c)["allreduce_time"] == 0.0  # link=None: ideal TP
    # One GPU has nothing to reduce, whatever the link.
    one = RooflineCostModel(tensor_parallel("H100-SXM", 1, link="PCIe"), "llama-2-7b")
    assert one.breakdown(q, c)["allreduce_time"] == 0.0
    # Decode at batch 1 over NVLink, 8 GPUs: 64 x (10 us + 2 * 7/8 * 8192 B / 450 GB/s).
    nv8 = RooflineCostModel(tensor_parallel("H100-SXM", 8, link="NVLink"), "llama-2-7b")
    assert nv8.breakdown([1], [512])["allreduce_time"] == pytest.approx(64 * (10e-6 + 1.75 * 8192 / 450e9))
    with pytest.raises(ValueError, match="link preset"):
        tensor_parallel("H100-SXM", 2, link="carrier-pigeon")
