"""LLM: the front door, shaped like vLLM's so what you learn here transfers.

    from minillm import LLM, SamplingParams
    llm = LLM()                                  # the shipped Shakespeare model, offline
    outs = llm.generate(["ROMEO:"], SamplingParams(max_tokens=60))
    print(outs[0].text)

Every ``EngineConfig`` field is a keyword: ``LLM(block_size=1, num_kv_blocks=24)``.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

from .config import EngineConfig
from .engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams

Prompt = Union[str, list[int]]


class LLM:
    def __init__(self, model: Optional[str] = None, tokenizer=None, **config_fields):
        unknown = set(config_fields) - EngineConfig.field_names()
        if unknown:
            raise TypeError(f"LLM: unknown config field(s) {sorted(unknown)}; "
                            f"EngineConfig has {sorted(EngineConfig.field_names())}")
        self.config = EngineConfig(**config_fields)
        self.engine = LLMEngine(model, self.config, tokenizer=tokenizer)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs in prompt order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        engine = self.engine
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        pending = set(ids)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="generate", unit="req")
        while pending and engine.has_unfinished_requests():
            rec = engine.step()
            done = [rid for rid in rec.finished + [w.request_id for w in rec.rejected] if rid in pending]
            pending.difference_update(done)
            if bar is not None and done:
                bar.update(len(done))
                bar.set_postfix(step=rec.step, batch=len(rec.batch))
        if bar is not None:
            bar.close()
        return [engine.get_output(rid) for rid in ids]
