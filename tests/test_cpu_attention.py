"""The CPU attention kernel (kernels/cpu_attention.py: the paged KV read in place) against the torch
reference it must equal, and the engine with it against transformers.

The batches come from test_kernels.make_batch: unused cache slots hold NaN and unused block-table
entries are huge, so a kernel that read past a request's context, or a padding entry of its
table, would show it in the output.
"""

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.model import cpu_fused, cpu_linear
from minillm.worker.model_runner import resolve_backend
from minillm_kernels import attention, cpu_attention, ops

from helpers import hf_greedy, random_prompts, tiny_hf_checkpoint
from test_kernels import SCENARIOS, make_batch, naive_attention

pytestmark = pytest.mark.skipif(cpu_attention.compiler() is None, reason="no C compiler for the CPU kernel")


def cpu_args(*a, **kw):
    args, seqs = make_batch(*a, **kw)
    return [x.cpu() if torch.is_tensor(x) else x for x in args], seqs


def check(args, seqs=None):
    out = cpu_attention.paged_attention_cpu(*args)
    ref = attention.paged_attention_ref(*args)
    assert out.shape == ref.shape and out.dtype == torch.float32 and torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    if seqs is not None:  # and both against dense float64 attention from the contiguous sequences
        torch.testing.assert_close(out.double(), naive_attention(args, seqs), atol=1e-5, rtol=1e-5)
    return out


# Prefill, decode, mixed, chunked on earlier context (a prefix-cache hit has the same shape:
# q_len new tokens over ctx_len > q_len), several speculative tokens per request.
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("block_size", [1, 3, 16, 64])
def test_equals_reference(scenario, block_size):
    check(*cpu_args(*SCENARIOS[scenario], num_heads=8, num_kv_heads=2, block_size=block_size, seed=3))


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1), (6, 2), (16, 4)])
@pytest.mark.parametrize("head_dim", [32, 64, 80, 128])
def test_gqa_and_head_dims(num_heads, num_kv_heads, head_dim):
    check(*cpu_args(*SCENARIOS["mixed"], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, seed=4))


def test_long_prefill_spans_several_query_tiles():
    # 70 new tokens: the kernel's tiles of 16 queries, each with its own causal end.
    check(*cpu_args([70, 1, 33], [70, 300, 90], num_heads=8, num_kv_heads=4, seed=5))


@pytest.mark.parametrize("permute", [False, True])
def test_block_table_order(permute):
    check(*cpu_args(*SCENARIOS["chunked"], permute=permute, seed=6))


def test_noncontiguous_q_and_empty_batch():
    args, seqs = cpu_args(*SCENARIOS["mixed"], seed=7)
    q = args[0]
    wide = torch.zeros(q.shape[0], q.shape[1], 2 * q.shape[2])
    wide[..., ::2] = q
    heads_outer = q.transpose(0, 1).contiguous().transpose(0, 1)  # other strides, the last one 1
    ref = attention.paged_attention_ref(*args)
    for view in (heads_outer, wide[..., ::2]):  # ... and one with a last stride of 2
        assert not view.is_contiguous()
        torch.testing.assert_close(cpu_attention.paged_attention_cpu(view, *args[1:]), ref, atol=2e-5, rtol=2e-5)
    q, kc, vc, bt, cu, ctx, scale = args
    empty = torch.zeros(1, dtype=torch.int32)
    out = cpu_attention.paged_attention_cpu(q[:0], kc, vc, bt[:0], empty, empty[:0], scale)
    assert out.shape == (0, *q.shape[1:])


def test_dispatch_sends_other_dtypes_to_the_reference():
    args, _ = cpu_args(*SCENARIOS["mixed"], dtype=torch.bfloat16, seed=8)
    assert not cpu_attention.supports(args[0], args[1])
    assert torch.equal(ops.paged_attention(*args, backend="cpu"), ops.paged_attention(*args, backend="torch"))
    args, _ = cpu_args(*SCENARIOS["decode"], seed=8)
    torch.testing.assert_close(
        ops.paged_attention(*args, backend="cpu"), ops.paged_attention_ref(*args), atol=2e-5, rtol=2e-5
    )
    with pytest.raises(ValueError, match="float32"):
        cpu_attention.paged_attention_cpu(args[0].double(), *args[1:])


def test_resolve_backend():
    cpu = torch.device("cpu")
    assert resolve_backend("cpu", cpu) == "cpu"
    assert resolve_backend("cpu", cpu, torch.bfloat16) == "torch"  # the kernel is float32 only
    assert resolve_backend("cpu", cpu, torch.float32, "int8") == "torch"
    assert resolve_backend("auto", cpu) == "cpu"  # the kernel compiles here
    assert resolve_backend("auto", cpu, torch.bfloat16) == "torch"
    assert resolve_backend("auto", cpu, torch.float32, "int8") == "torch"


def test_auto_without_a_compiler_is_the_torch_reference(monkeypatch, capsys):
    """No C compiler: "auto" on the CPU falls back to the torch reference and says why in one line."""
    monkeypatch.setenv("CC", "/nonexistent/cc")
    cpu_attention._library.cache_clear()
    try:
        assert resolve_backend("auto", torch.device("cpu")) == "torch"
    finally:
        cpu_attention._library.cache_clear()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "torch reference" in err[0] and "C compiler" in err[0]


def test_missing_compiler_is_named(monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert cpu_attention.compiler() is None
    cpu_attention._library.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="C compiler.*attention_backend='torch'"):
            cpu_attention._library()
    finally:
        cpu_attention._library.cache_clear()


def test_engine_with_prefix_cache_hits_matches_transformers(tmp_path):
    """Prompts sharing a 20-token prefix with prefix caching: later requests start with
    num_computed_tokens > 0 (a hit), so their first step attends over blocks another request
    wrote; the greedy tokens equal transformers' and the torch backend's."""
    model = tiny_hf_checkpoint(tmp_path, "llama")
    shared = random_prompts(1, 128, seed=9, lo=20, hi=20)[0]
    prompts = [shared + tail for tail in random_prompts(6, 128, seed=10)]
    ref = [hf_greedy(model, p, 6) for p in prompts]
    outs = {}
    for backend in ("cpu", "torch"):
        llm = LLM(
            str(tmp_path),
            max_model_len=64,
            dtype="float32",
            attention_backend=backend,
            block_size=4,
            enable_prefix_caching=True,
            max_num_seqs=3,
        )
        got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        outs[backend] = [o.outputs[0].token_ids for o in got]
        assert sum(o.num_cached_tokens for o in got) > 0, "the shared prefix was meant to hit"
        assert llm.engine.executor.backend == backend
    assert outs["cpu"] == ref
    assert outs["torch"] == ref


# --- the CPU fast path's packed linear layers (minillm/model/cpu_linear.py) ---------------------


LAYOUTS = [
    pytest.param(
        layout, marks=pytest.mark.skipif(layout == "onednn" and not cpu_linear.can_use_onednn(), reason="no oneDNN")
    )
    for layout in cpu_linear.LAYOUTS
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 32, 100])
def test_packed_linear_equals_linear(rows, bias, layout):
    torch.manual_seed(rows)
    lin = torch.nn.Linear(96, 200, bias=bias)
    packed = cpu_linear.PackedLinear(lin, layout, batch_hint=32)
    x = torch.randn(rows, 96)
    with torch.no_grad():
        torch.testing.assert_close(packed(x), lin(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed(x.view(1, rows, 96)), lin(x).view(1, rows, 200), atol=1e-5, rtol=1e-5)
        # the residual rides on the same call
        r = torch.randn(rows, 200)
        got = cpu_linear.linear_add(r, x, packed.packed, None if lin.bias is None else lin.bias.detach())
        torch.testing.assert_close(got, r + lin(x), atol=1e-5, rtol=1e-5)


def test_choose_layout_names_one_and_packed_refuses_another():
    assert cpu_linear.choose_layout([(64, 32), (32, 64)], rows=4, rounds=1) in cpu_linear.LAYOUTS
    with pytest.raises(ValueError, match="layout='blocked'"):
        cpu_linear.packed(torch.zeros(4, 4), "blocked", 4)


def test_step_shapes_are_the_fused_forward_s_matrix_multiplies(tmp_path):
    """The shapes ``choose_layout`` times are those the fused model multiplies by, in order."""
    tiny_hf_checkpoint(tmp_path, "llama")
    plain = LLM(str(tmp_path), max_model_len=64, dtype="float32", attention_backend="torch").engine.model
    shapes = cpu_fused.step_shapes(plain)
    cfg = plain.model.layers[0].self_attn
    hidden, head = cfg.q_proj.in_features, cfg.head_dim
    per_layer = [
        ((cfg.num_heads + 2 * cfg.num_kv_heads) * head, hidden),
        (hidden, cfg.num_heads * head),
        (2 * plain.model.layers[0].mlp.gate_proj.out_features, hidden),
        (hidden, plain.model.layers[0].mlp.down_proj.in_features),
    ]
    assert shapes == per_layer * len(plain.model.layers) + [tuple(plain.lm_head.weight.shape)]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_engine_fuses_every_layer_and_keeps_the_parameters(tmp_path, family):
    """Every decoder layer fused, every other linear packed (the LM head), the state_dict unchanged,
    and the logits of a fused layer stack equal the plain model's (qwen2: q/k/v biases; qwen3: q/k norms)."""
    tiny_hf_checkpoint(tmp_path, family)
    llm = LLM(str(tmp_path), max_model_len=64, dtype="float32", attention_backend="cpu")
    plain = LLM(str(tmp_path), max_model_len=64, dtype="float32", attention_backend="torch")
    model = llm.engine.model
    assert all(type(layer) is cpu_fused.FusedDecoderLayer for layer in model.model.layers)
    assert type(model.lm_head) is cpu_linear.PackedLinear
    # The fused layers' own nn.Linear modules stay as they are (their weights are packed stacked).
    assert not any(type(m) is cpu_linear.PackedLinear for layer in model.model.layers for m in layer.modules())
    ours, theirs = model.state_dict(), plain.engine.model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    prompts = random_prompts(5, 128, seed=11)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3)
    got, want = llm.generate(prompts, params), plain.generate(prompts, params)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lg, lw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert lg.keys() == lw.keys()
            for t in lg:
                assert abs(lg[t].logprob - lw[t].logprob) < 1e-4


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fused_layer_equals_plain_layer(layout):
    """One FusedDecoderLayer against the DecoderLayer it was built from, on a mixed batch (a prefill
    chunk and two decodes) over a paged cache: the same output and the same K/V written."""
    from types import SimpleNamespace
    from minillm.model.llama import AttentionMetadata, DecoderLayer

    torch.manual_seed(12)
    cfg = SimpleNamespace(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        attention_bias=True,
        model_type="llama",
    )
    plain = DecoderLayer(cfg, 0)
    for p in plain.parameters():
        torch.nn.init.normal_(p, std=0.2)
    fused = cpu_fused.FusedDecoderLayer(plain, layout, batch_hint=8)
    T = 7
    x = torch.randn(T, 64)
    cos, sin = torch.randn(T, 1, 16), torch.randn(T, 1, 16)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([8, 9, 10, 11, 12, 4, 17]),
        block_tables=torch.tensor([[2, 3], [1, 0], [4, 0]], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 5, 6, 7], dtype=torch.int32),
        context_lens=torch.tensor([5, 1, 2], dtype=torch.int32),
        max_q_len=5,
    )
    caches = [(torch.zeros(5, 4, 2, 16), torch.zeros(5, 4, 2, 16)) for _ in range(2)]
    caches[0][0][4, 0] = caches[1][0][4, 0] = torch.randn(2, 16)  # request 2's earlier position
    caches[0][1][4, 0] = caches[1][1][4, 0] = torch.randn(2, 16)
    want = plain(x, cos, sin, caches[0], meta)
    meta.backend = "cpu"
    got = fused(x, cos, sin, caches[1], meta)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches[1][0], caches[0][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches[1][1], caches[0][1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 16), (8, 4, 64), (3, 1, 128)])
def test_rope_and_cache_equals_torch_bit_for_bit(num_heads, num_kv_heads, head_dim):
    """RoPE and the cache write in C against llama.py's torch operations (rotate_half, index_copy_):
    the rotated queries and the cache equal bit for bit; slots not written keep their NaN."""
    from minillm.model.llama import rotate_half

    torch.manual_seed(head_dim)
    T, H, Hkv, D = 9, num_heads, num_kv_heads, head_dim
    qkv = torch.randn(T, (H + 2 * Hkv) * D)
    angles = torch.randn(T, 1, D // 2) * 10
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    slots = torch.randperm(6 * 4)[:T]
    want_k, want_v = torch.full((6, 4, Hkv, D), float("nan")), torch.full((6, 4, Hkv, D), float("nan"))
    q, k, v = qkv.view(T, H + 2 * Hkv, D).split([H, Hkv, Hkv], dim=1)
    want_q = q * cos + rotate_half(q) * sin
    want_k.view(-1, Hkv, D).index_copy_(0, slots, k * cos + rotate_half(k) * sin)
    want_v.view(-1, Hkv, D).index_copy_(0, slots, v)
    got_k, got_v = torch.full_like(want_k, float("nan")), torch.full_like(want_v, float("nan"))
    cpu_attention.rope_and_cache(qkv, H, Hkv, cos, sin, got_k, got_v, slots)
    assert torch.equal(qkv[:, : H * D].view(T, H, D), want_q)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got_v, want_v, rtol=0, atol=0, equal_nan=True)


def test_rope_and_cache_rejects_what_it_cannot_take():
    qkv, cache = torch.randn(2, 4 * 16), torch.zeros(2, 4, 1, 16)
    cos = torch.ones(2, 1, 16)
    with pytest.raises(ValueError, match="rope_and_cache"):
        cpu_attention.rope_and_cache(qkv.double(), 2, 1, cos, cos, cache, cache, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="int64"):
        cpu_attention.rope_and_cache(qkv, 2, 1, cos, cos, cache, cache, torch.tensor([0, 1], dtype=torch.int32))


@pytest.mark.parametrize("rows,n,stride", [(1, 16, 16), (32, 256, 256), (5, 80, 200)])
def test_rms_norm_equals_torch(rows, n, stride):
    """The C RMSNorm against F.rms_norm and against float64 arithmetic (rows of any stride)."""
    torch.manual_seed(n)
    x = (torch.randn(rows, stride) * 3)[:, :n]
    w = torch.randn(n)
    got = cpu_attention.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(got, torch.nn.functional.rms_norm(x, (n,), w, 1e-5), atol=1e-6, rtol=1e-5)
    xd = x.double()
    want = xd / (xd.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * w.double()
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="rms_norm"):
        cpu_attention.rms_norm(x.double(), w, 1e-5)
    with pytest.raises(ValueError, match="rms_norm"):
        cpu_attention.rms_norm(x, w[:-1], 1e-5)


def step_inputs(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, seed):
    """One step's fused projection output, RoPE tables, paged caches and metadata (its new tokens' slots)."""
    from minillm.model.llama import AttentionMetadata

    (q, k_cache, v_cache, bt, cu, ctx, scale), _ = cpu_args(
        q_lens, ctx_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, seed=seed
    )
    T, bs = q.shape[0], k_cache.shape[1]
    qkv = torch.randn(T, (num_heads + 2 * num_kv_heads) * head_dim)
    angles = torch.randn(T, 1, head_dim // 2) * 10
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    slots = [
        int(bt[r, p // bs]) * bs + p % bs for r, (n, c) in enumerate(zip(q_lens, ctx_lens)) for p in range(c - n, c)
    ]
    meta = AttentionMetadata(torch.tensor(slots), bt, cu, ctx, max(q_lens), backend="cpu")
    return qkv, cos, sin, k_cache, v_cache, meta, scale


@pytest.mark.parametrize("scenario", ["decode", "mixed", "verify"])
def test_step_calls_equal_rope_and_cache_then_attention(scenario):
    """StepCalls (checked once a step) gives what the two functions give, bit for bit, layer after layer;
    a layer of another layout, or another forward's cos, is refused."""
    H, Hkv, D = 8, 2, 64
    qkv, cos, sin, k_cache, v_cache, meta, scale = step_inputs(*SCENARIOS[scenario], H, Hkv, D, seed=7)
    calls = None
    for layer in range(2):  # a second layer: its own qkv and caches, the step's shared inputs
        qkv_l, k_l, v_l = qkv + layer, k_cache.clone(), v_cache.clone()
        want_qkv, want_k, want_v = qkv_l.clone(), k_l.clone(), v_l.clone()
        cpu_attention.rope_and_cache(want_qkv, H, Hkv, cos, sin, want_k, want_v, meta.slot_mapping)
        want = cpu_attention.paged_attention_cpu(
            want_qkv[:, : H * D].view(-1, H, D), want_k, want_v, meta.block_tables, meta.cu_seqlens_q,
            meta.context_lens, scale,
        )  # fmt: skip
        if calls is None:
            calls = cpu_attention.StepCalls(qkv_l, H, Hkv, cos, sin, k_l, v_l, meta, scale)
        assert calls.fits(qkv_l, cos, k_l, v_l, scale)
        got = calls(qkv_l, cos, k_l, v_l, scale)
        assert torch.equal(got, want) and torch.equal(qkv_l, want_qkv)
        torch.testing.assert_close(k_l, want_k, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(v_l, want_v, rtol=0, atol=0, equal_nan=True)
    assert not calls.fits(qkv, cos.clone(), k_cache, v_cache, scale)  # another forward's RoPE tables
    assert not calls.fits(qkv, cos, k_cache, v_cache, scale * 2)
    with pytest.raises(ValueError, match="StepCalls"):
        calls(qkv[:, :-1], cos, k_cache, v_cache, scale)
