"""The engine: one ``step()`` = schedule, execute, apply, record.

One direction per step: the scheduler decides (a ``SchedulerOutput``), the
executor (the real model, or the simulator) runs it, and the engine applies
the results (append tokens, finish requests, free their KV) and emits a
``StepRecord``. Nothing reaches back up.
"""

from __future__ import annotations

import itertools
import math
import os
import time
import warnings
from pathlib import Path
from typing import Optional, Union

import torch

from .clock import make_clock
from .config import EngineConfig
from .kv_cache import make_kv_manager
from .outputs import RequestOutput
from .policies import make_policy
from .request import Request, RequestStatus
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .step_record import BatchEntry, StepRecord

DEFAULT_MODEL_DIR = Path(__file__).parent / "checkpoints" / "shakespeare"
DEFAULT_DRAFT_DIR = Path(__file__).parent / "checkpoints" / "shakespeare-draft"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> str:
    if name == "auto":
        return "bfloat16" if device.type == "cuda" else "float32"
    return name


class LLMEngine:
    def __init__(self, model: Optional[str], config: EngineConfig, tokenizer=None):
        self.config = config
        self.device = resolve_device(config.device)
        dtype_name = resolve_dtype(config.dtype, self.device)
        self.model_path = self._resolve_model_path(model)
        self.tokenizer = tokenizer

        # --- the model (or, for the simulator, only its shape) -------------------------
        self.model = None
        if config.executor == "simulated":
            self.hf_config, self.model_spec = self._simulated_shape(self.model_path, config)
        else:
            from .model.loader import load_model
            from .costmodel import ModelSpec
            self.model, self.hf_config = load_model(self.model_path, dtype_name, str(self.device),
                                                    config.seed, config.random_model)
            self.model_spec = ModelSpec.from_hf_config(self.hf_config)
        if self.tokenizer is None and self.model_path != "random":
            self.tokenizer = self._load_tokenizer(self.model_path)
        self.vocab_size = self.hf_config.vocab_size
        eos = getattr(self.hf_config, "eos_token_id", None)
        self.eos_token_id = eos[0] if isinstance(eos, (list, tuple)) else eos
        self.dtype = {"float32": torch.float32, "float16": torch.float16,
                      "bfloat16": torch.bfloat16}[dtype_name]

        # --- time: the clock and (for modeled time) the cost model ---------------------
        self.cost_model = self._make_cost_model()
        self.clock = make_clock(config.clock)

        # --- KV memory ---------------------------------------------------------------------
        num_blocks = config.num_kv_blocks or self._size_kv_from_memory()
        self.num_kv_blocks = num_blocks
        self.kv = make_kv_manager(config, num_blocks)
        self._check_config()

        # --- scheduler and executor -----------------------------------------------------------
        self.policy = make_policy(config.policy)
        self.scheduler = Scheduler(config, self.kv, self.policy, self.cost_model)
        if config.executor == "simulated":
            from .simulated import SimulatedExecutor
            self.executor = SimulatedExecutor(config, self.kv, self._bytes_per_block())
        else:
            from .model_runner import ModelRunner
            self.executor = ModelRunner(config, self.model, self.hf_config, self.kv, num_blocks,
                                        self.device, self.dtype)
        self.speculator = None                      # speculative decoding: proposes before each step
        if config.speculative_model is not None:
            from .speculative import make_speculator
            self.speculator = make_speculator(self)

        self._simulated = config.executor == "simulated"
        self.requests: dict[str, Request] = {}      # every request ever added
        self._active: dict[str, Request] = {}       # not yet finished
        self._ids = itertools.count()
        self.step_count = 0
        self.swapped_bytes = 0                      # KV bytes copied to/from host memory
        self.step_records: list[StepRecord] = []
        self.keep_records = True                    # set False for very long simulated runs
        self.record_block_map = num_blocks <= 1024  # per-block map in StepRecord.kv (widgets draw it)

    # --- set-up helpers --------------------------------------------------------------------
    @staticmethod
    def _resolve_model_path(model: Optional[str]) -> str:
        if model is None:
            if (DEFAULT_MODEL_DIR / "config.json").exists():
                return str(DEFAULT_MODEL_DIR)
            warnings.warn("the shipped default model is missing; using a small random Llama")
            return "random"
        if model == "default-draft":
            return str(DEFAULT_DRAFT_DIR)
        if model == "random":
            return "random"
        return os.fspath(model)

    @staticmethod
    def _simulated_shape(path: str, cfg: EngineConfig):
        """The simulator needs only the model's shape: a preset of ``costmodel.MODELS``
        (``model="llama-2-70b"``), the tiny random Llama, or a checkpoint's config.json."""
        from types import SimpleNamespace
        from .costmodel import MODELS, ModelSpec
        if path in MODELS and not os.path.isdir(path):
            m = MODELS[path]
            shape = SimpleNamespace(num_hidden_layers=m.num_layers, hidden_size=m.hidden_size,
                                    num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
                                    head_dim=m.head_dim, intermediate_size=m.intermediate_size,
                                    vocab_size=m.vocab_size, eos_token_id=None)
            return shape, m
        if path == "random":              # a plain namespace: no need to import transformers
            from .model.loader import RANDOM_DEFAULTS
            shape = SimpleNamespace(**{**RANDOM_DEFAULTS, **cfg.random_model})
        else:
            from transformers import AutoConfig
            shape = AutoConfig.from_pretrained(path)
        return shape, ModelSpec.from_hf_config(shape)

    @staticmethod
    def _load_tokenizer(path: str):
        if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model",
                                                                   "vocab.json")):
            return None
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path)

    def _make_cost_model(self):
        cfg = self.config
        if cfg.cost_model is None and cfg.clock != "modeled" and cfg.preemption_mode != "auto":
            return None
        from .costmodel import get_cost_model
        spec = cfg.cost_model if cfg.cost_model is not None else "H100-SXM"
        return get_cost_model(spec, self.model_spec, kv_cache_dtype=cfg.kv_cache_dtype)

    def _bytes_per_block(self) -> int:
        cm = self.cost_model
        if self.config.executor == "simulated" and getattr(cm, "kv_bytes_per_token", 0):
            return cm.kv_bytes_per_token * self.config.block_size   # the cost model's shape (70B)
        c = self.hf_config
        kvh = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        elt = 4 if self.config.executor == "model" and self.dtype == torch.float32 else 2
        from .costmodel import kv_block_bytes   # values (1 byte for int8/fp8) and their per-block scales
        return kv_block_bytes(c.num_hidden_layers, self.config.block_size, kvh, hd, elt, self.config.kv_cache_dtype)

    def _size_kv_from_memory(self) -> int:
        cfg = self.config
        cm = self.cost_model
        if cfg.executor == "simulated" and cm is not None and hasattr(cm, "kv_capacity_tokens"):
            blocks = cm.kv_capacity_tokens() // cfg.block_size
            if blocks < 1:
                raise ValueError(f"cost_model={cm.name}: the weights leave no memory for a KV cache; "
                                 "model more GPUs, e.g. RooflineCostModel(minillm.simulated."
                                 "tensor_parallel('H100-SXM', 4), ...), or set num_kv_blocks")
            return blocks
        from .speculative import draft_kv_bytes_per_block   # a draft's KV shares each block
        per_block = self._bytes_per_block() + (draft_kv_bytes_per_block(cfg, self.dtype)
                                               if cfg.executor == "model" else 0)
        by_memory = int(cfg.kv_cache_memory_gb * 2**30) // per_block
        enough = cfg.max_num_seqs * math.ceil(cfg.max_model_len / cfg.block_size) + 1
        return max(1, min(by_memory, enough))

    def _check_config(self) -> None:
        cfg = self.config
        if not cfg.enable_chunked_prefill and cfg.max_num_batched_tokens < cfg.max_model_len:
            raise ValueError(
                f"EngineConfig.max_num_batched_tokens={cfg.max_num_batched_tokens} is below "
                f"max_model_len={cfg.max_model_len} with enable_chunked_prefill=False: a long prompt "
                "could never be scheduled (raise the budget or enable chunked prefill)")
        if cfg.max_num_batched_tokens < 1 + cfg.num_speculative_tokens:
            raise ValueError(f"EngineConfig.max_num_batched_tokens={cfg.max_num_batched_tokens} cannot hold "
                             f"one decode with {cfg.num_speculative_tokens} speculative tokens")
        max_pos = getattr(self.hf_config, "max_position_embeddings", None)
        if max_pos is not None and cfg.max_model_len > max_pos and self.model_path != "random":
            warnings.warn(f"max_model_len={cfg.max_model_len} exceeds the model's "
                          f"max_position_embeddings={max_pos}")

    # --- requests -----------------------------------------------------------------------------
    def add_request(self, prompt: Union[str, list[int]], sampling_params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None, arrival_time: Optional[float] = None,
                    priority: int = 0, tenant: Optional[str] = None,
                    expected_output_len: Optional[int] = None) -> str:
        """Queue one request; returns its id. Bad input raises ValueError naming the field."""
        sp = sampling_params if sampling_params is not None else SamplingParams()
        if request_id is None:
            request_id = str(next(self._ids))
            while request_id in self.requests:
                request_id = str(next(self._ids))
        request_id = str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id={request_id!r}: already used")
        text = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt={prompt[:30]!r}: a string prompt needs a tokenizer and this "
                                 "model has none; pass a list of token ids")
            text = prompt
            prompt = self.tokenizer.encode(prompt, add_special_tokens=False)
        ids = list(prompt)
        if not ids:
            raise ValueError(f"prompt (request {request_id!r}): empty; it needs at least one token")
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt[{i}]={t!r} (request {request_id!r}): token id outside the "
                                 f"vocabulary [0, {self.vocab_size})")
        cfg = self.config
        if len(ids) >= cfg.max_model_len:
            raise ValueError(f"prompt (request {request_id!r}) has {len(ids)} tokens: max_model_len="
                             f"{cfg.max_model_len} leaves no room for one output token")
        need = min(len(ids) + sp.max_tokens, cfg.max_model_len)
        if cfg.kv_allocation == "reserved":
            # Admission keeps the watermark's headroom free, so a region must fit beside it.
            cap = (self.num_kv_blocks - self.scheduler.watermark_blocks) * cfg.block_size
            if need > cap:
                raise ValueError(f"request {request_id!r}: its reservation of {need} positions (prompt "
                                 f"{len(ids)} + max_tokens {sp.max_tokens}) exceeds the whole KV capacity "
                                 f"of {cap} positions; it could never run")
        else:
            usable = self.num_kv_blocks - self.scheduler.watermark_blocks
            blocks = math.ceil(need / cfg.block_size)
            if blocks > usable:
                raise ValueError(f"request {request_id!r}: at its maximum length ({need} positions = "
                                 f"{blocks} blocks) it would not fit the KV cache even alone "
                                 f"({usable} usable blocks); lower max_tokens or add blocks")
        if arrival_time is None:
            arrival_time = self.clock.now()
        req = Request(request_id, ids, sp, arrival_time, priority, tenant, self.eos_token_id,
                      expected_output_len, prompt=text)
        req.metrics.clock = self.clock.name
        self.requests[request_id] = req
        self._active[request_id] = req
        self.scheduler.add(req)
        return request_id

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(str(request_id))
        if req is None:
            raise KeyError(f"abort_request: unknown request_id={request_id!r}")
        if req.is_finished:
            return
        self.scheduler.remove(req)
        self._finalize(req, "abort", self.clock.now())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def get_output(self, request_id: str) -> RequestOutput:
        r = self.requests[request_id]
        text = None
        if self.tokenizer is not None and self.model is not None:
            text = self.tokenizer.decode(r.output_token_ids, skip_special_tokens=True)
        return RequestOutput(request_id=r.request_id, prompt=r.prompt, prompt_token_ids=r.prompt_token_ids,
                             token_ids=list(r.output_token_ids), text=text, finish_reason=r.finish_reason,
                             metrics=r.metrics, num_cached_tokens=r.metrics.num_cached_tokens,
                             finish_detail=r.finish_detail)

    def _finalize(self, req: Request, reason: str, t: float) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.metrics.finish_reason = reason
        req.metrics.finish_time = t
        req.metrics.num_output_tokens = req.num_output_tokens
        self._active.pop(req.request_id, None)
        forget = getattr(self.executor, "forget", None) or getattr(getattr(self.executor, "sampler", None),
                                                                    "forget", None)
        if forget:
            forget(req.request_id)
        if self.speculator is not None:
            self.speculator.forget(req.request_id)

    def _stop_reason(self, req: Request, tok: int) -> Optional[str]:
        sp = req.sampling_params
        if not sp.ignore_eos and req.eos_token_id is not None and tok == req.eos_token_id:
            return "stop"
        if tok in sp.stop_token_ids:
            return "stop"
        n_out = len(req.output_token_ids)     # (plain len: this runs once per token, keep it cheap)
        if n_out >= sp.max_tokens or len(req.prompt_token_ids) + n_out >= self.config.max_model_len:
            return "length"
        if self._simulated and req.expected_output_len is not None and n_out >= req.expected_output_len:
            return "stop"       # the simulator's stand-in for the model emitting EOS at the trace length
        return None

    # --- one step ---------------------------------------------------------------------------------
    def _idle_wait(self) -> None:
        """Nothing can run now: let the clock reach the next arrival."""
        s = self.scheduler
        if s.running or s.swapped or s.held or s.waiting:
            return
        t = s.next_arrival()
        if t is not None and t > self.clock.now():
            self.clock.wait_until(t)

    def _step_cost(self, out: SchedulerOutput, swap_bytes: int) -> tuple[float, float, float]:
        cm = self.cost_model
        step = cm.step_time([s.num_new_tokens for s in out.scheduled],
                            [s.num_computed_before + s.num_new_tokens for s in out.scheduled]) \
            if out.scheduled else 0.0
        sched = cm.schedule_time(len(self.scheduler.running), len(self.scheduler.waiting)) \
            if out.reformed else 0.0
        swap = cm.swap_time(swap_bytes) if swap_bytes else 0.0
        return step + sched + swap, sched, swap

    def step(self) -> StepRecord:
        """One scheduler iteration: schedule -> execute -> apply -> StepRecord."""
        self._idle_wait()
        now = self.clock.now()
        t0 = time.perf_counter()
        # Speculative decoding: the proposer guesses for each decoding request first; the
        # scheduler then decides how many guesses fit this step's budget.
        draft_time = self.speculator.propose(self.scheduler.running) if self.speculator else 0.0
        t1 = time.perf_counter()
        out = self.scheduler.schedule(now)
        t_sched = time.perf_counter() - t1
        result = self.executor.execute(out)
        wall = time.perf_counter() - t0
        if self.clock.name == "modeled":
            duration, sched_time, swap_time = self._step_cost(out, result.swap_bytes)
            duration += draft_time                  # the draft's forwards, then the target's
            self.clock.advance(duration)
        else:
            duration, sched_time, swap_time = wall, t_sched, 0.0
        t = self.clock.now()
        self.swapped_bytes += result.swap_bytes

        finished: list[str] = []
        reasons: dict[str, str] = {}
        for req in out.released:                 # held back until now (static batch / every-N)
            self._finalize(req, req.pending_finish_reason, now)
            finished.append(req.request_id)
            reasons[req.request_id] = req.finish_reason
        for w in out.rejected:
            req = self.requests[w.request_id]
            self._finalize(req, "rejected", now)
            req.finish_detail = w.reason

        batch = []
        spec_proposed = spec_accepted = 0
        for s in out.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            accepted = result.spec_accepted.get(req.request_id)
            if s.spec_token_ids:
                # Speculative decoding: KV of rejected draft positions is rolled back.
                rejected = len(s.spec_token_ids) - (accepted or 0)
                req.num_computed_tokens -= rejected
                self.kv.truncate(req, req.num_computed_tokens)
                spec_proposed += len(s.spec_token_ids)
                spec_accepted += accepted or 0
                req.metrics.num_spec_proposed += len(s.spec_token_ids)
                req.metrics.num_spec_accepted += accepted or 0
            elif self.speculator is not None:
                # Blocks reserved for guesses the scheduler did not keep go back to the pool.
                self.kv.truncate(req, req.num_computed_tokens)
            req.spec_token_ids = []
            new = result.sampled.get(req.request_id, [])
            reason = None
            appended = 0
            for tok in new:
                appended += 1
                req.output_token_ids.append(tok)
                req.metrics.token_times.append(t)
                if req.metrics.first_token_time is None:
                    req.metrics.first_token_time = t
                reason = self._stop_reason(req, tok)
                if reason:
                    break
            if len(new) > 1 and reason:
                # Tokens accepted past a stop are dropped: keep KV consistent with the output.
                req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
            self.kv.cache_full_blocks(req)
            batch.append(BatchEntry(req.request_id, s.phase, s.num_new_tokens, s.num_computed_before,
                                    req.num_computed_tokens, len(s.spec_token_ids), accepted or 0,
                                    appended))
            if reason:
                if self.scheduler.finish(req):
                    self._finalize(req, reason, t)
                    finished.append(req.request_id)
                    reasons[req.request_id] = reason
                else:
                    req.pending_finish_reason = reason
        if self.config.batching == "static" and not self.scheduler.running and self.scheduler.held:
            for req in self.scheduler.held:      # the whole static batch is done: return it now
                self._finalize(req, req.pending_finish_reason, t)
                finished.append(req.request_id)
                reasons[req.request_id] = req.finish_reason
            self.scheduler.held = []
        self.policy.on_step(out.scheduled, t)

        record = StepRecord(
            step=self.step_count, time=t, duration=duration, batch=batch,
            num_batched_tokens=out.num_batched_tokens, token_budget=out.token_budget,
            admitted=out.admitted, finished=finished, preempted=out.preempted, waiting=out.waiting,
            kv=self.kv.snapshot(self._active, detail=self.record_block_map),
            running=[r.request_id for r in self.scheduler.running],
            swapped=[r.request_id for r in self.scheduler.swapped], swapped_in=out.swapped_in,
            rejected=out.rejected, finish_reasons=reasons, scheduled=out.reformed,
            clock=self.clock.name, schedule_time=sched_time, swap_time=swap_time,
            spec_proposed=spec_proposed, spec_accepted=spec_accepted,
            draft_time=draft_time)
        self.step_count += 1
        if self.keep_records:
            self.step_records.append(record)
        return record

    # --- conveniences -------------------------------------------------------------------------------
    def run(self, max_steps: Optional[int] = None, progress=None) -> list[StepRecord]:
        """Step until every request is done (or max_steps)."""
        records = []
        while self.has_unfinished_requests() and (max_steps is None or len(records) < max_steps):
            records.append(self.step())
            if progress is not None:
                progress(records[-1])
        return records

    def stats(self) -> dict:
        d = dict(self.scheduler.counters)
        d["swapped_bytes"] = self.swapped_bytes
        d["prefix_cache"] = self.kv.stats()
        d["steps"] = self.step_count
        return d

    def request_metrics(self) -> list:
        return [r.metrics for r in self.requests.values()]
