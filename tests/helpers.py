"""Small shared builders for the tests: tiny Hugging Face checkpoints written to disk."""

from __future__ import annotations

import torch


def tiny_hf_checkpoint(path, arch: str = "llama", seed: int = 0, vocab: int = 128):
    """A seeded random tiny checkpoint saved with transformers' save_pretrained."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "llama":
        cfg = tf.LlamaConfig(**common, rope_theta=500000.0)
        model = tf.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**common)
        model = tf.Qwen2ForCausalLM(cfg)
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**dict(common, head_dim=16, tie_word_embeddings=True))
        model = tf.Qwen3ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    with torch.no_grad():  # make biases and norms non-trivial so they are really tested
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    model.save_pretrained(path)
    return model


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    model.generation_config.eos_token_id = None  # like ignore_eos: always n tokens
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt) :].tolist()


def random_prompts(n: int, vocab: int, seed: int = 0, lo: int = 1, hi: int = 20) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (L,), generator=g).tolist() for L in lens]


def run_to_end(engine, max_steps: int = 5000, on_step=None) -> list:
    """Step ``engine`` until every request has finished, checking the invariants after every step
    (``check_invariants``) and that every block is free at the end (``check_all_free``). ``on_step(rec)``,
    if given, sees each step's record after the check. Returns the records, in order."""
    from minillm.core.invariants import check_all_free, check_invariants

    records = []
    while engine.has_unfinished_requests():
        assert len(records) < max_steps, f"the run does not end within {max_steps} steps"
        rec = engine.step()
        check_invariants(engine, rec)
        records.append(rec)
        if on_step is not None:
            on_step(rec)
    check_all_free(engine)
    return records


def drive_through_faults(eng, fault: type = Exception, max_steps: int = 3000) -> int:
    """Step ``eng`` to the end; each ``fault`` a step raises is caught, the invariants must hold after it,
    and the next step carries on. Every block is free at the end. Returns the number of faults."""
    from minillm.core.invariants import check_all_free, check_invariants

    faults = steps = 0
    while eng.has_unfinished_requests():
        assert steps < max_steps, "the run does not end"
        steps += 1
        try:
            rec = eng.step()
        except fault:
            faults += 1
            check_invariants(eng)
            continue
        check_invariants(eng, rec)
    check_all_free(eng)
    return faults
