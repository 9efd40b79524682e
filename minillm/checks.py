"""Checks at the door: every value a person passes in is checked where it enters.

``EngineConfig``, ``SamplingParams`` and ``LLMEngine.add_request`` use these helpers, so a
bad value raises at once, naming the field and the value, before any state changes: a
``TypeError`` for a value of the wrong kind (``seed="3"``), a ``ValueError`` for one of the
right kind but out of range (``temperature=nan``). Integer-like values (numpy or torch
integers) are converted to plain ``int``; ``True``/``False`` never count as numbers.

The checks of a request at the engine's door follow (``check_request``: its prompt, the sampling
features the engine can serve, whether it could ever fit the KV cache), and of the engine's config
against its model (``check_config``).
"""

from __future__ import annotations

import inspect
import math
import numbers
import operator
import warnings
from typing import Any, Optional

# torch.Generator.manual_seed takes 0 <= seed < 2**64 (a negative seed wraps around).
MAX_SEED = 2**64 - 1


def label(owner: str, name: str) -> str:
    return f"{owner}.{name}" if owner else name


def as_int(
    owner: str,
    name: str,
    value: Any,
    low: Optional[int] = None,
    high: Optional[int] = None,
    *,
    optional: bool = False,
    where: str = "",
    rng: Optional[str] = None,
) -> Optional[int]:
    """``value`` as a plain int in ``[low, high]`` (None allowed when ``optional``)."""
    if value is None and optional:
        return None

    def error(kind):  # the message, built only for a bad value
        words = rng if rng is not None else _range_words(low, high)
        return kind(f"{label(owner, name)}={value!r}{where}: must be an integer{words}{' or None' if optional else ''}")

    v = value
    if type(v) is not int:
        if isinstance(v, bool) or str(getattr(v, "dtype", "")) in ("torch.bool", "bool"):
            raise error(TypeError)
        try:
            v = int(operator.index(v))  # numpy and torch integers; not float, str, bool arrays
        except TypeError:
            raise error(TypeError) from None
    if (low is not None and v < low) or (high is not None and v > high):
        raise error(ValueError)
    return v


def as_real(
    owner: str,
    name: str,
    value: Any,
    low: Optional[float] = None,
    high: Optional[float] = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    optional: bool = False,
    where: str = "",
) -> Optional[float]:
    """``value`` as a finite float between ``low`` and ``high`` (open ends when asked)."""
    if value is None and optional:
        return None

    def error(kind):  # the message, built only for a bad value
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        rng = f" in {lo}{low if low is not None else '-inf'}, {high if high is not None else 'inf'}{hi}"
        if low is not None and high is None:
            rng = f" {'>' if low_open else '>='} {low}"
        want = (
            f"must be a finite number{rng if low is not None or high is not None else ''}"
            f"{' or None' if optional else ''}"
        )
        return kind(f"{label(owner, name)}={value!r}{where}: {want}")

    if (
        type(value) is not float
        and type(value) is not int
        and (isinstance(value, bool) or not isinstance(value, numbers.Real))
    ):
        raise error(TypeError)
    v = float(value)
    if (
        not math.isfinite(v)
        or (low is not None and (v <= low if low_open else v < low))
        or (high is not None and (v >= high if high_open else v > high))
    ):
        raise error(ValueError)
    return v


def as_bool(owner: str, name: str, value: Any, where: str = "") -> bool:
    """``True`` or ``False`` (a numpy bool too); not a string, a number or None."""
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
        return bool(value)
    raise TypeError(f"{label(owner, name)}={value!r}{where}: must be True or False")


def as_seed(owner: str, name: str, value: Any, *, optional: bool = False, where: str = "") -> Optional[int]:
    """A seed ``torch.Generator.manual_seed`` takes as it is: an integer in [0, 2**64)."""
    return as_int(owner, name, value, 0, MAX_SEED, optional=optional, where=where, rng=" in [0, 2**64)")


def _range_words(low: Optional[int], high: Optional[int]) -> str:
    if low is not None and high is not None:
        return f" in [{low}, {high}]"
    if low is not None:
        return f" >= {low}"
    if high is not None:
        return f" <= {high}"
    return ""


# --- a request at the engine's door (LLMEngine.add_request) --------------------------------------


def check_request(
    engine, prompt, sp, who: str, request_id, arrival_time, priority, tenant, expected_output_len
) -> dict:
    """A request at ``engine``'s door (``LLMEngine.add_request``), its params ``sp`` already a checked
    copy: every field checked and normalised (token ids and numbers as plain ints and floats), nothing
    changed. ``who`` names the request in the messages."""
    if arrival_time is not None:
        arrival_time = as_real("", "arrival_time", arrival_time, where=who)
    priority = as_int("", "priority", priority, where=who)
    try:
        hash(tenant)
    except TypeError:
        raise TypeError(f"tenant={tenant!r}{who}: must be hashable (a name such as 'alice', or None)") from None
    expected_output_len = as_int("", "expected_output_len", expected_output_len, 0, optional=True, where=who)
    for i, t in enumerate(sp.stop_token_ids):
        if t >= engine.vocab_size:
            raise ValueError(
                f"SamplingParams.stop_token_ids[{i}]={t}{who}: token id outside the vocabulary [0, {engine.vocab_size})"
            )
    for t in sp.logit_bias or ():
        if t >= engine.vocab_size:
            raise ValueError(
                f"SamplingParams.logit_bias[{t}]{who}: token id outside the vocabulary [0, {engine.vocab_size})"
            )
    check_sampling_support(engine, sp, who)
    ids, text = check_prompt(engine, prompt, who)
    if sp.max_tokens is None:  # vLLM's None: until the context ends (the engine's own copy of the params)
        sp.max_tokens = max(1, engine.config.max_model_len - len(ids))
    check_fits(engine, ids, sp, who)
    return dict(
        request_id=request_id,
        prompt_token_ids=ids,
        sampling_params=sp,
        arrival_time=arrival_time,
        priority=priority,
        tenant=tenant,
        expected_output_len=expected_output_len,
        prompt=text,
    )


def check_prompt(engine, prompt, who: str) -> tuple[list[int], Optional[str]]:
    """The prompt as token ids in the vocabulary (a str is encoded with the tokenizer), and its text."""
    text = None
    if isinstance(prompt, str):
        if engine.tokenizer is None:
            raise ValueError(
                f"prompt={prompt[:30]!r}: a string prompt needs a tokenizer and this "
                "model has none; pass a list of token ids"
            )
        text = prompt
        prompt = engine.tokenizer.encode(prompt, add_special_tokens=False)
    elif isinstance(prompt, (bytes, bytearray, memoryview)):
        raise TypeError(
            f"prompt={bytes(prompt)[:30]!r}{who}: bytes are not a prompt; decode them to a "
            "str (text) or pass a list of token ids"
        )
    elif hasattr(prompt, "tolist") and not isinstance(prompt, list):  # a numpy array, a tensor
        prompt = prompt.tolist()
    try:
        ids = list(prompt)
    except TypeError:
        raise TypeError(f"prompt={prompt!r}{who}: must be a str or a list of token ids") from None
    if not ids:
        raise ValueError(f"prompt{who}: empty; it needs at least one token")
    # Checked in bulk first (a trace submits millions of token ids); the loop below, which
    # names the offending position, runs only when something is wrong or needs converting.
    bulk_ok = set(map(type, ids)) == {int} and 0 <= min(ids) and max(ids) < engine.vocab_size
    for i, t in enumerate(() if bulk_ok else ids):
        if type(t) is not int:  # numpy / torch integers become ints; floats, bools do not
            try:
                t = ids[i] = as_int("", f"prompt[{i}]", t)
            except TypeError:
                raise TypeError(f"prompt[{i}]={t!r}{who}: a token id must be an integer") from None
        if not 0 <= t < engine.vocab_size:
            raise ValueError(f"prompt[{i}]={t!r}{who}: token id outside the vocabulary [0, {engine.vocab_size})")
    return ids, text


def check_fits(engine, ids: list[int], sp, who: str) -> None:
    """A request that could never run is refused: longer than max_model_len, or larger than the KV
    cache even alone (beside the watermark's headroom; a parallel-sampling group with a block per sample)."""
    cfg = engine.config
    if len(ids) >= cfg.max_model_len:
        raise ValueError(
            f"prompt{who} has {len(ids)} tokens: max_model_len={cfg.max_model_len} leaves no room for one output token"
        )
    need = min(len(ids) + sp.max_tokens, cfg.max_model_len)
    if cfg.kv_allocation == "reserved":
        # Admission keeps the watermark's headroom free, so a region must fit beside it.
        cap = (engine.num_kv_blocks - engine.kv.watermark_blocks) * cfg.block_size
        if need > cap:
            raise ValueError(
                f"request{who}: its reservation of {need} positions (prompt "
                f"{len(ids)} + max_tokens {sp.max_tokens}) exceeds the whole KV capacity "
                f"of {cap} positions; it could never run"
            )
    else:
        usable = engine.num_kv_blocks - engine.kv.watermark_blocks
        blocks = math.ceil(need / cfg.block_size)
        if blocks > usable:
            raise ValueError(
                f"request{who}: at its maximum length ({need} positions = "
                f"{blocks} blocks) it would not fit the KV cache even alone "
                f"({usable} usable blocks); lower max_tokens or add blocks"
            )
        group = math.ceil(len(ids) / cfg.block_size) + sp.n - 1
        if sp.n > 1 and group > usable:
            raise ValueError(
                f"SamplingParams.n={sp.n}{who}: the prompt's blocks plus one per other "
                f"sample ({group} blocks) exceed the {usable} usable blocks"
            )


def check_sampling_support(engine, sp, who: str) -> None:
    """The sampling features this engine's configuration can serve (SamplingParams itself
    checked each value's type and range)."""
    cfg = engine.config
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(sp, name)
        if k is not None and k > engine.vocab_size:
            raise ValueError(f"SamplingParams.{name}={k}{who}: more than the vocabulary's {engine.vocab_size} tokens")
        if k is not None and not cfg.runs_model:
            raise ValueError(f"SamplingParams.{name}={k}{who}: the simulated executor has no logits")
    if sp.stop and engine.tokenizer is None:
        raise ValueError(
            f"SamplingParams.stop={sp.stop!r}{who}: stop strings are matched on text "
            "and this model has no tokenizer; use stop_token_ids"
        )
    if engine.speculator is not None:
        for name, off in (
            ("logprobs", None),
            ("prompt_logprobs", None),
            ("n", 1),
            ("min_tokens", 0),
            ("presence_penalty", 0.0),
            ("frequency_penalty", 0.0),
            ("repetition_penalty", 1.0),
            ("logit_bias", None),
        ):
            if getattr(sp, name) != off:
                raise ValueError(
                    f"SamplingParams.{name}={getattr(sp, name)!r}{who}: not supported with "
                    "speculative decoding (EngineConfig.speculative_model)"
                )
    if sp.n > 1:
        if not engine.kv.supports_forking:
            raise ValueError(
                f"SamplingParams.n={sp.n}{who}: parallel sampling shares KV blocks, "
                "which needs a KV manager that supports forking (kv_allocation='paged')"
            )
        if sp.n > cfg.max_num_seqs:
            raise ValueError(
                f"SamplingParams.n={sp.n}{who}: its {sp.n} sequences could never run "
                f"together under max_num_seqs={cfg.max_num_seqs}"
            )


def check_config(cfg, hf_config, model_path: str) -> None:
    """The engine's config against its model: a budget that holds what one step must (a whole prompt
    without chunked prefill, a decode with its speculative tokens); a warning past the model's positions."""
    if not cfg.enable_chunked_prefill and cfg.max_num_batched_tokens < cfg.max_model_len:
        raise ValueError(
            f"EngineConfig.max_num_batched_tokens={cfg.max_num_batched_tokens} is below "
            f"max_model_len={cfg.max_model_len} with enable_chunked_prefill=False: a long prompt "
            "could never be scheduled (raise the budget or enable chunked prefill)"
        )
    if cfg.max_num_batched_tokens < 1 + cfg.num_speculative_tokens:
        raise ValueError(
            f"EngineConfig.max_num_batched_tokens={cfg.max_num_batched_tokens} cannot hold "
            f"one decode with {cfg.num_speculative_tokens} speculative tokens"
        )
    max_pos = getattr(hf_config, "max_position_embeddings", None)
    if max_pos is not None and cfg.max_model_len > max_pos and model_path != "random":
        warnings.warn(f"max_model_len={cfg.max_model_len} exceeds the model's max_position_embeddings={max_pos}")


def protocol_members(protocol: type) -> list[str]:
    """The names a ``typing.Protocol`` promises: its methods and its annotated attributes (its own, and
    those of the protocols it extends)."""
    names: list[str] = []
    for cls in reversed(protocol.__mro__):
        if cls is object or not getattr(cls, "_is_protocol", False) or cls.__name__ in ("Protocol", "Generic"):
            continue
        for name in [*vars(cls).get("__annotations__", {}), *vars(cls)]:
            if not name.startswith("_") and name not in names:
                names.append(name)
    return names


def check_protocol(obj: Any, protocol: type, who: str) -> Any:
    """``obj`` must keep ``protocol``: every method it names, callable, and every attribute. Returns ``obj``;
    raises a TypeError naming what is missing and where the protocol is written down. ``who``: the field
    that built ``obj`` (``EngineConfig.kv_manager=...``)."""
    missing = []
    for name in protocol_members(protocol):
        method = inspect.isfunction(inspect.getattr_static(protocol, name, None))
        if not hasattr(obj, name) or (method and not callable(getattr(obj, name))):
            missing.append(f"{name}()" if method else name)
    if missing:
        raise TypeError(
            f"{who}: {obj!r} does not keep the {protocol.__name__} protocol "
            f"({protocol.__module__}): it lacks {', '.join(missing)}"
        )
    return obj
