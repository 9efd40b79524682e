"""LLM: the front door, shaped like vLLM's so what you learn here transfers.

    from minillm import LLM, SamplingParams
    llm = LLM()                                  # the shipped Shakespeare model, offline
    outs = llm.generate(["ROMEO:"], SamplingParams(max_tokens=60))
    print(outs[0].text)

Every ``EngineConfig`` field is a keyword: ``LLM(block_size=1, num_kv_blocks=24)``.
"""

from __future__ import annotations

import numbers
from typing import Optional, Sequence, Union

from .config import EngineConfig
from .engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams

Prompt = Union[str, list[int]]


def _is_token_ids(p) -> bool:
    """One prompt given as token ids (a list or tuple of integers, a 1-D array or tensor)?"""
    if getattr(p, "ndim", None) == 1:
        return True
    return isinstance(p, (list, tuple)) and len(p) > 0 and isinstance(p[0], numbers.Integral) \
        and not isinstance(p[0], bool)


class LLM:
    def __init__(self, model: Optional[str] = None, tokenizer=None, **config_fields):
        self.config = EngineConfig.from_fields("LLM", **config_fields)
        self.engine = LLMEngine(model, self.config, tokenizer=tokenizer)

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

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs in prompt order.

        All or nothing: every prompt and its params are checked first, and only then queued, so
        one bad prompt raises (naming its index) with nothing queued."""
        if isinstance(prompts, (str, bytes, bytearray)) or _is_token_ids(prompts):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        engine = self.engine
        checked = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            try:
                checked.append(engine.validate_request(p, sp, None, None, 0, None, None))
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
