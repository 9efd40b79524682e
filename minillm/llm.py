"""LLM: the front door, shaped like vLLM's so what you learn here transfers.

    from minillm import LLM, SamplingParams
    llm = LLM()                                  # the shipped Shakespeare model, offline
    outs = llm.generate(["ROMEO:"], SamplingParams(max_tokens=60))
    print(outs[0].text)

Every ``EngineConfig`` field is a keyword: ``LLM(block_size=1, num_kv_blocks=24)``, vLLM's
among them (``gpu_memory_utilization``, ``swap_space``, ``dtype="half"``, ``enforce_eager``,
``trust_remote_code``: config.py says what each means here). A prompt is a string, token ids, or
vLLM's prompt dict (``{"prompt": ...}``, ``{"prompt_token_ids": [...]}``: minillm/inputs.py);
``llm.chat(messages)`` renders a conversation with the server's chat template (minillm/serve/chat.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import numbers
import os
from collections.abc import Mapping
from typing import Optional, Sequence, Union

from .config import EngineConfig
from .engine import LLMEngine
from .inputs import TextPrompt, TokensPrompt, parse_prompt
from .model.loader import load_tokenizer
from .outputs import RequestOutput
from .sampling_params import SamplingParams

Prompt = Union[str, list[int], TextPrompt, TokensPrompt]
Params = Union[SamplingParams, Sequence[SamplingParams], None]


def _is_token_ids(p) -> bool:
    """One prompt given as token ids (a list or tuple of integers, a 1-D array or tensor)?"""
    if getattr(p, "ndim", None) == 1:
        return True
    return (
        isinstance(p, (list, tuple))
        and len(p) > 0
        and isinstance(p[0], numbers.Integral)
        and not isinstance(p[0], bool)
    )


def _per_prompt(sampling_params: Params, n: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: the same for all, or a list with one for each."""
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or SamplingParams()] * n
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"sampling_params: {len(params)} given for {n} prompts")
    return params


@contextlib.contextmanager
def _collector_skips_the_old_heap():
    """What is alive when a run starts frozen for its length (``gc.freeze``): the collector's full passes,
    which otherwise walk every object of torch, transformers and the model (about 0.1 s each), walk only
    what the run creates, as vLLM's engine core freezes its startup heap (``freeze_gc_heap``). Unfrozen at
    the end, so nothing stays that would be collected otherwise. Left alone if the heap is frozen already."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class LLM:
    def __init__(self, model: Optional[str] = None, tokenizer=None, **config_fields):
        """``model``: a checkpoint directory, None (the shipped model) or "random"; ``tokenizer``: a
        tokenizer object or, as in vLLM, a directory holding one (default: the model's own)."""
        config = EngineConfig.from_fields("LLM", **config_fields)
        if isinstance(tokenizer, (str, os.PathLike)):  # vLLM's: a tokenizer directory
            tokenizer = load_tokenizer(os.fspath(tokenizer), must_exist=True)
        self.engine = LLMEngine(model, config, tokenizer=tokenizer)
        self.config = self.engine.config  # as the engine resolved it (swap_space -> num_swap_blocks)

    def close(self) -> None:
        """Shut down the engine's worker processes (``tensor_parallel_size > 1``); idempotent.
        ``with LLM(...) as llm:`` calls it on the way out."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The model's tokenizer (a Hugging Face tokenizer), as vLLM's ``LLM.get_tokenizer``; None for
        a model without one (``model="random"``)."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        sampling_params: Params = None,
        use_tqdm: bool = False,
        lora_request=None,
        priority: Optional[Sequence[int]] = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs in prompt order.
        ``priority`` (vLLM's): one per prompt, lower first, with ``policy="priority"``; ``lora_request``
        must be None (no adapters here).

        All or nothing: every prompt and its params are checked first, and only then queued, so
        one bad prompt raises (naming its index) with nothing queued."""
        if lora_request is not None:
            raise ValueError(f"lora_request={lora_request!r}: minillm has no LoRA adapters; pass None")
        if isinstance(prompts, (str, bytes, bytearray, Mapping)) or _is_token_ids(prompts):
            prompts = [prompts]
        prompts = list(prompts)
        params = _per_prompt(sampling_params, len(prompts))
        priorities = self._priorities(priority, len(prompts))
        engine = self.engine
        checked = []
        for i, (p, sp, prio) in enumerate(zip(prompts, params, priorities)):
            p = parse_prompt(p, f"prompts[{i}]")
            try:
                checked.append(engine.validate_request(p, sp, None, None, prio, None, None))
            except (TypeError, ValueError) as e:
                if type(e) not in (TypeError, ValueError):
                    raise
                raise type(e)(f"prompts[{i}]: {e}") from e
        ids = [engine.register_request(c) for c in checked]
        pending = set(ids)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        with _collector_skips_the_old_heap():
            while pending and engine.has_unfinished_requests():
                rec = engine.step()
                done = {engine.parent_id(rid) for rid in rec.finished + [w.request_id for w in rec.rejected]}
                done = [rid for rid in done if rid in pending and engine.is_finished(rid)]
                pending.difference_update(done)
                if bar is not None and done:
                    bar.update(len(done))
                    bar.set_postfix(step=rec.step, batch=rec.batch_size)
        if bar is not None:
            bar.close()
        return [engine.get_output(rid) for rid in ids]

    def _priorities(self, priority: Optional[Sequence[int]], n: int) -> list[int]:
        """``generate``'s ``priority`` list, checked as vLLM does: one per prompt, and only where the
        policy reads it (elsewhere a priority would change nothing, silently)."""
        if priority is None:
            return [0] * n
        priority = list(priority)
        if len(priority) != n:
            raise ValueError(f"priority: {len(priority)} given for {n} prompts")
        if any(priority) and getattr(self.engine.policy, "name", None) != "priority":
            raise ValueError(
                f"priority={priority!r}: read only by policy='priority' (this engine's policy is "
                f"{getattr(self.engine.policy, 'name', self.engine.policy)!r})"
            )
        return priority

    def chat(
        self,
        messages,
        sampling_params: Params = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
        chat_template: Optional[str] = None,
        continue_final_message: bool = False,
        tools: Optional[list] = None,
    ) -> list[RequestOutput]:
        """Reply to a conversation (a list of ``{"role": ..., "content": ...}`` messages), or to each of a
        list of conversations, as vLLM's ``LLM.chat``: each is rendered with the server's chat template
        (minillm/serve/chat.py: the tokenizer's own, else the plain play-script one) and generated.

        The plain template's reply ends at its first blank line (``chat.PLAIN_STOP``), as the server's
        does: those stop strings are added to params that have none of their own. A custom
        ``chat_template``, ``continue_final_message`` and ``tools`` are refused (not served here)."""
        from .serve.chat import render

        if chat_template is not None:
            raise ValueError(
                "chat_template: a custom template is not supported; minillm uses the "
                "tokenizer's own (or its plain template)"
            )
        if continue_final_message:
            raise ValueError("continue_final_message=True: not supported; the reply starts a new turn")
        if tools:
            raise ValueError(f"tools: {len(tools)} given; minillm has no tool calling")
        one = (
            isinstance(messages, Sequence)
            and not isinstance(messages, str)
            and (not messages or isinstance(messages[0], Mapping))
        )
        conversations = [messages] if one else list(messages)
        params = _per_prompt(sampling_params, len(conversations))
        prompts, chat_params = [], []
        for i, (conv, sp) in enumerate(zip(conversations, params)):
            where = "messages" if one else f"messages[{i}]"
            if isinstance(conv, (str, bytes)) or not isinstance(conv, Sequence):
                raise TypeError(f"{where}={conv!r}: must be a list of messages ({{'role': ..., 'content': ...}})")
            for j, m in enumerate(conv):
                if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                    raise TypeError(f"{where}[{j}]={m!r}: a message is a dict with a 'role' string and a 'content'")
            if not conv:
                raise ValueError(f"{where}: at least one message is needed")
            prompt, default_stop = render(self.engine.tokenizer, conv, add_generation_prompt)
            sp = sp or SamplingParams()
            if isinstance(sp, SamplingParams) and default_stop and not sp.stop and sp.detokenize:
                sp = dataclasses.replace(sp, stop=list(default_stop))
            prompts.append(prompt)
            chat_params.append(sp)
        return self.generate(prompts, chat_params, use_tqdm=use_tqdm)
