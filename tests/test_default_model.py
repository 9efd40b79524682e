"""The shipped default models: they load offline, minillm decodes them exactly as transformers
does, and the model card's held-out numbers are reproduced.

``minillm/checkpoints/shakespeare`` is what ``LLM()`` loads with no arguments;
``minillm/checkpoints/shakespeare-draft`` is its speculative-decoding draft. Both are trained by
``scripts/train_shakespeare.py``. The outside reference here is Hugging Face ``transformers``
in float32: it reloads each directory on its own and recomputes the loss the card quotes.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may be downloaded: the models ship in the repo
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from minillm import LLM, SamplingParams

CKPT = Path(__file__).resolve().parents[1] / "minillm" / "checkpoints"
MAIN = CKPT / "shakespeare"
DRAFT = CKPT / "shakespeare-draft"
FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "README.md",
    "eval.json",
)
N_NEW = 24


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MAIN)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MAIN, dtype=torch.float32).eval()


@pytest.mark.parametrize("path", [MAIN, DRAFT], ids=["main", "draft"])
def test_checkpoint_is_complete_and_small(path):
    for name in FILES:
        assert (path / name).is_file(), f"{path.name}/{name} is missing"
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"], "meant to exercise GQA"
    assert cfg["head_dim"] == 64
    assert (path / "model.safetensors").stat().st_size < 10_500_000


def test_tokenizer_round_trip(tokenizer):
    text = (Path(MAIN) / "heldout_slice.txt").read_text()[:4000] + "\nROMEO:\n  Ay me! 'Tis 1597.\n"
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == 0
    assert len(text) / len(ids) > 2.0, "the BPE should merge: more than 2 characters per token"
    assert tokenizer("ROMEO:").input_ids[0] != tokenizer.eos_token_id, "no BOS is added"


def test_draft_shares_the_tokenizer():
    from transformers import AutoConfig, AutoTokenizer

    assert (MAIN / "tokenizer.json").read_bytes() == (DRAFT / "tokenizer.json").read_bytes()
    main, draft = AutoConfig.from_pretrained(MAIN), AutoConfig.from_pretrained(DRAFT)
    assert main.vocab_size == draft.vocab_size == len(AutoTokenizer.from_pretrained(DRAFT))
    assert draft.num_hidden_layers < main.num_hidden_layers
    assert draft.eos_token_id == main.eos_token_id


def test_draft_loads_offline():
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(DRAFT, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.isfinite(m(input_ids=torch.tensor([[1, 2, 3]])).logits).all()


def heldout_loss(model, ids: list[int], context: int) -> float:
    """Summed next-token loss (nats): windows of context+1 tokens every `context` tokens, so
    every token but the first is predicted once (the rule of scripts/train_shakespeare.py)."""
    total = 0.0
    t = torch.tensor(ids)
    with torch.no_grad():
        for i in range(0, len(t) - 1, context):
            w = t[i : i + context + 1][None]
            logits = model(input_ids=w[:, :-1]).logits
            total += F.cross_entropy(logits[0], w[0, 1:], reduction="sum").item()
    return total


def test_card_perplexity_reproduced_on_heldout_slice(hf_model, tokenizer):
    card = json.loads((MAIN / "eval.json").read_text())["heldout_slice"]
    text = (MAIN / "heldout_slice.txt").read_text()
    ids = tokenizer(text).input_ids
    assert len(text) == card["chars"] and len(ids) == card["tokens"]
    nats = heldout_loss(hf_model, ids, card["context"])
    ppl = math.exp(nats / (len(ids) - 1))
    assert ppl == pytest.approx(card["perplexity"], rel=0.05)
    assert nats / len(text) == pytest.approx(card["nats_per_char"], rel=0.05)
    # the card's number is also quoted in the human-readable card
    assert f"{card['perplexity']:.2f}" in (MAIN / "README.md").read_text()


def test_quality_goal():
    ev = json.loads((MAIN / "eval.json").read_text())
    assert ev["heldout"]["nats_per_char"] <= 1.7


def hf_greedy_ignore_eos(model, prompt: list[int], n: int) -> list[int]:
    # eos_token_id=None disables the stop at <|endoftext|> without masking it, which is what
    # ignore_eos=True means (min_new_tokens would instead forbid token 0 and change the argmax).
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


PROMPTS = ["ROMEO:", "To be, or not to be", "\n\nACT III. Scene I.\n"]


def test_llm_greedy_matches_transformers(hf_model, tokenizer):
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    want = [hf_greedy_ignore_eos(hf_model, ids, N_NEW) for ids in prompts]
    assert all(len(w) == N_NEW for w in want)
    llm = LLM(model=str(MAIN), dtype="float32")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True))
    for prompt, out, w in zip(PROMPTS, outs, want):
        assert out.token_ids == w, f"prompt {prompt!r}: minillm and transformers differ"


def test_llm_default_is_the_shakespeare_model(hf_model, tokenizer):
    ids = tokenizer("ROMEO:").input_ids
    want = hf_greedy_ignore_eos(hf_model, ids, 8)
    out = LLM(dtype="float32").generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert out.token_ids == want
