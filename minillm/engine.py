"""The engine: one ``step()`` = schedule, execute, apply, record.

One direction per step: the scheduler decides (a ``SchedulerOutput``), the
executor (the real model, or the simulator) runs it, and the engine applies
the results (append tokens, finish requests, free their KV) and emits a
``StepRecord``. Nothing reaches back up.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import time
import warnings
from typing import Optional, Union

import torch

from .sim.clock import PhaseTimes, make_clock
from .checks import as_int, as_real
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .core.kv_cache import make_kv_manager
from .model.loader import DEFAULT_DRAFT_DIR, DEFAULT_MODEL_DIR
from .outputs import CompletionOutput, RequestOutput
from .core.parallel_sampling import ParentRequest, completion_id
from .core.policies import make_policy
from .core.request import Request
from .sampling_params import SamplingParams
from .core.scheduler import Scheduler, SchedulerOutput
from .step_record import StepRecord



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
        self.model, self.hf_config, self.model_spec = self._load_model(dtype_name)
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
        self._check_kv_fits(num_blocks)
        self.num_kv_blocks = num_blocks
        self.kv = self._make_kv_manager(num_blocks)
        self._check_config()

        # --- scheduler and executor -----------------------------------------------------------
        self.policy = make_policy(config.policy)
        self.scheduler = Scheduler(config, self.kv, self.policy, self.cost_model, tokenizer=self.tokenizer)
        self.executor = self._make_executor(num_blocks)
        self.speculator = None                      # speculative decoding: proposes before each step
        if config.speculative_model is not None:
            from .spec.speculative import make_speculator
            self.speculator = make_speculator(self)
            self.executor.set_proposer(self.speculator.proposer)

        self._simulated = config.executor == "simulated"
        self.requests: dict[str, Request] = {}      # every request ever added
        self.parents: dict[str, ParentRequest] = {}  # parallel sampling (n > 1): request id -> its group
        self._active: dict[str, Request] = {}       # not yet finished (what the KV snapshot looks up)
        self._ids = itertools.count()
        self.step_count = 0
        self.swapped_bytes = 0                      # KV bytes copied to/from host memory
        self.record_mode = config.record if config.record != "auto" else \
            ("full" if num_blocks <= 256 else "summary")      # the per-block map costs O(blocks) a step
        self.step_records: list[StepRecord] = []    # the latest records (EngineConfig.record_history)
        self.step_summaries: list = []              # simulate(records="summary"): a StepSummary per step
        self._aborted: list[str] = []               # aborted since the last record
        self._forked: list[Request] = []            # sequences forked by the step in progress

    # --- set-up helpers --------------------------------------------------------------------
    def _load_model(self, dtype_name: str):
        """(model, hf_config, model_spec): the weights on this process, or only the shape (the simulator;
        tensor parallelism, whose weights live in the ranks' processes)."""
        from .sim.costmodel import ModelSpec
        config = self.config
        if config.executor == "simulated":
            return (None, *self._simulated_shape(self.model_path, config))
        if config.tensor_parallel_size > 1:
            from .worker.tp_executor import model_config
            hf_config = model_config(self.model_path, config)
            return None, hf_config, ModelSpec.from_hf_config(hf_config)
        from .model.loader import load_model
        model, hf_config = load_model(self.model_path, dtype_name, str(self.device), config.seed,
                                      config.random_model)
        return model, hf_config, ModelSpec.from_hf_config(hf_config)

    def _make_kv_manager(self, num_blocks: int):
        """The built-in KV manager for the config, or the one ``EngineConfig.kv_manager`` builds."""
        config = self.config
        kv = (config.kv_manager or make_kv_manager)(config, num_blocks)
        if kv.num_blocks != num_blocks or kv.block_size != config.block_size:
            raise ValueError(f"EngineConfig.kv_manager={config.kv_manager!r}: built a manager of "
                             f"{kv.num_blocks} blocks of {kv.block_size} tokens; the engine has "
                             f"{num_blocks} blocks of {config.block_size}")
        if getattr(kv, "watermark_blocks", None) != int(config.watermark * num_blocks):   # the manager keeps it
            raise ValueError(f"EngineConfig.kv_manager={config.kv_manager!r}: built a manager without the "
                             f"watermark={config.watermark} (pass the config's watermark to it)")
        return kv

    def _make_executor(self, num_blocks: int):
        """Who runs a step: the model on this process, N rank processes, or the simulator."""
        config = self.config
        if config.executor == "simulated":
            from .sim.sim_executor import SimulatedExecutor
            return SimulatedExecutor(config, self.kv, self._bytes_per_block())
        if config.tensor_parallel_size > 1:
            from .worker.tp_executor import TPExecutor   # N rank processes, each with a shard of the model
            return TPExecutor(config, self.model_path, self.hf_config, self.kv, num_blocks, self.device,
                              self.dtype)
        from .worker.model_runner import ModelRunner
        return ModelRunner(config, self.model, self.hf_config, self.kv, num_blocks, self.device, self.dtype)

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
        from .sim.costmodel import MODELS, ModelSpec
        if path in MODELS and not os.path.isdir(path):
            m = MODELS[path]
            shape = SimpleNamespace(num_hidden_layers=m.num_layers, hidden_size=m.hidden_size,
                                    num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
                                    head_dim=m.head_dim, intermediate_size=m.intermediate_size,
                                    vocab_size=m.vocab_size, eos_token_id=None)
            return shape, m
        from .model.loader import RANDOM_DEFAULTS, check_model_config, load_config
        if path == "random":              # a plain namespace: no need to import transformers
            shape = SimpleNamespace(**{**RANDOM_DEFAULTS, **cfg.random_model})
            check_model_config(shape, "EngineConfig.random_model")
        else:                             # a local checkpoint directory; never a model hub
            shape = load_config(path, presets=sorted(MODELS))
        return shape, ModelSpec.from_hf_config(shape)

    @staticmethod
    def _load_tokenizer(path: str):
        if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model",
                                                                   "vocab.json")):
            return None
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path, local_files_only=True)

    def _make_cost_model(self):
        cfg = self.config
        if cfg.cost_model is None and cfg.clock != "modeled" and cfg.preemption_mode != "auto":
            return None
        from .sim.costmodel import get_cost_model
        spec = cfg.cost_model if cfg.cost_model is not None else "H100-SXM"
        return get_cost_model(spec, self.model_spec, kv_cache_dtype=cfg.kv_cache_dtype)

    def _bytes_per_block(self) -> int:
        cm = self.cost_model
        if self.config.executor == "simulated" and getattr(cm, "kv_bytes_per_token", 0):
            return cm.kv_bytes_per_token * self.config.block_size   # the cost model's shape (70B)
        elt = 4 if self.config.executor == "model" and self.dtype == torch.float32 else 2
        # values (1 byte for int8/fp8) and their per-block scales
        return self.model_spec.kv_block_bytes(self.config.block_size, elt, self.config.kv_cache_dtype)

    def _size_kv_from_memory(self) -> int:
        cfg = self.config
        cm = self.cost_model
        if cfg.executor == "simulated" and cm is not None and hasattr(cm, "kv_capacity_tokens"):
            blocks = cm.kv_capacity_tokens() // cfg.block_size
            if blocks < 1:
                raise ValueError(f"cost_model={cm.name}: the weights leave no memory for a KV cache; "
                                 "model more GPUs, e.g. RooflineCostModel(minillm.sim.simulated."
                                 "tensor_parallel('H100-SXM', 4), ...), or set num_kv_blocks")
            return blocks
        from .spec.speculative import draft_kv_bytes_per_block   # a draft's KV shares each block
        per_block = self._bytes_per_block() + (draft_kv_bytes_per_block(cfg, self.dtype)
                                               if cfg.executor == "model" else 0)
        by_memory = int(cfg.kv_cache_memory_gb * 2**30) // per_block
        enough = cfg.max_num_seqs * math.ceil(cfg.max_model_len / cfg.block_size) + 1
        return max(1, min(by_memory, enough))

    # Host memory the block tables take per block (Block objects, free lists), a generous bound.
    BOOKKEEPING_BYTES_PER_BLOCK = 512

    def _check_kv_fits(self, num_blocks: int) -> None:
        """Before anything is allocated: the KV cache (and the swap space) must fit in memory,
        else a ValueError naming the field, the bytes needed and the bytes there are."""
        from .model.loader import host_memory_bytes
        cfg = self.config
        field = (f"EngineConfig.num_kv_blocks={cfg.num_kv_blocks}" if cfg.num_kv_blocks is not None
                 else f"EngineConfig.kv_cache_memory_gb={cfg.kv_cache_memory_gb}")
        host = (num_blocks + cfg.num_swap_blocks) * self.BOOKKEEPING_BYTES_PER_BLOCK
        device = 0
        if cfg.executor == "model":
            from .spec.speculative import draft_kv_bytes_per_block
            per_block = self._bytes_per_block() + draft_kv_bytes_per_block(cfg, self.dtype)
            device = num_blocks * per_block
            host += cfg.num_swap_blocks * self._bytes_per_block()
        checks = []
        if device and self.device.type == "cuda":
            try:
                free = torch.cuda.mem_get_info(self.device)[0]
            except (RuntimeError, AssertionError):
                free = None
            if free is not None:
                checks.append((device, free, f"{self.device} (free)"))
        else:
            host += device
        checks.append((host, host_memory_bytes(), "host memory"))
        for need, have, where in checks:
            if need > have:
                raise ValueError(
                    f"{field}: {num_blocks} KV blocks"
                    f"{f' + {cfg.num_swap_blocks} swap blocks' if cfg.num_swap_blocks else ''} need "
                    f"{need:,} bytes ({need / 2**30:.1f} GiB), more than the {have:,} bytes "
                    f"({have / 2**30:.1f} GiB) of {where}; lower num_kv_blocks (or num_swap_blocks)")

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
        """Queue one request; returns its id. A bad value raises ValueError/TypeError naming the
        field and the value before anything changes; the engine keeps its own copy of
        ``sampling_params``, so changing the caller's object later changes nothing."""
        return self._register(self._check_request(prompt, sampling_params, request_id, arrival_time,
                                                  priority, tenant, expected_output_len))

    def _check_request(self, prompt, sampling_params, request_id, arrival_time, priority, tenant,
                       expected_output_len) -> dict:
        """Every check of ``add_request``, changing nothing: the request's fields, normalised
        (token ids and numbers as plain ints and floats, a validated copy of the params)."""
        who = f" (request {str(request_id)!r})" if request_id is not None else ""
        if sampling_params is None:
            sp = SamplingParams()
        elif isinstance(sampling_params, SamplingParams):
            sp = dataclasses.replace(sampling_params)     # a copy, checked again (it may have been edited)
        else:
            raise TypeError(f"sampling_params={sampling_params!r}{who}: must be a SamplingParams or None")
        if request_id is not None:
            request_id = str(request_id)
            taken = [request_id] + [completion_id(request_id, i) for i in range(sp.n)] * (sp.n > 1)
            if any(t in self.requests or t in self.parents for t in taken):
                raise ValueError(f"request_id={request_id!r}: already used"
                                 + (" (or one of its samples' ids, '<id>#<index>')" if sp.n > 1 else ""))
        if arrival_time is not None:
            arrival_time = as_real("", "arrival_time", arrival_time, where=who)
        priority = as_int("", "priority", priority, where=who)
        try:
            hash(tenant)
        except TypeError:
            raise TypeError(f"tenant={tenant!r}{who}: must be hashable (a name such as 'alice', or None)") from None
        expected_output_len = as_int("", "expected_output_len", expected_output_len, 0, optional=True, where=who)
        for i, t in enumerate(sp.stop_token_ids):
            if t >= self.vocab_size:
                raise ValueError(f"SamplingParams.stop_token_ids[{i}]={t}{who}: token id outside the "
                                 f"vocabulary [0, {self.vocab_size})")
        self._check_sampling_support(sp, who)
        ids, text = self._check_prompt(prompt, who)
        self._check_fits(ids, sp, who)
        return dict(request_id=request_id, prompt_token_ids=ids, sampling_params=sp, arrival_time=arrival_time,
                    priority=priority, tenant=tenant, expected_output_len=expected_output_len, prompt=text)

    def _check_prompt(self, prompt, who: str) -> tuple[list[int], Optional[str]]:
        """The prompt as token ids in the vocabulary (a str is encoded with the tokenizer), and its text."""
        text = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt={prompt[:30]!r}: a string prompt needs a tokenizer and this "
                                 "model has none; pass a list of token ids")
            text = prompt
            prompt = self.tokenizer.encode(prompt, add_special_tokens=False)
        elif isinstance(prompt, (bytes, bytearray, memoryview)):
            raise TypeError(f"prompt={bytes(prompt)[:30]!r}{who}: bytes are not a prompt; decode them to a "
                            "str (text) or pass a list of token ids")
        elif hasattr(prompt, "tolist") and not isinstance(prompt, list):   # a numpy array, a tensor
            prompt = prompt.tolist()
        try:
            ids = list(prompt)
        except TypeError:
            raise TypeError(f"prompt={prompt!r}{who}: must be a str or a list of token ids") from None
        if not ids:
            raise ValueError(f"prompt{who}: empty; it needs at least one token")
        # Checked in bulk first (a trace submits millions of token ids); the loop below, which
        # names the offending position, runs only when something is wrong or needs converting.
        bulk_ok = set(map(type, ids)) == {int} and 0 <= min(ids) and max(ids) < self.vocab_size
        for i, t in enumerate(() if bulk_ok else ids):
            if type(t) is not int:        # numpy / torch integers become ints; floats, bools do not
                try:
                    t = ids[i] = as_int("", f"prompt[{i}]", t)
                except TypeError:
                    raise TypeError(f"prompt[{i}]={t!r}{who}: a token id must be an integer") from None
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt[{i}]={t!r}{who}: token id outside the "
                                 f"vocabulary [0, {self.vocab_size})")
        return ids, text

    def _check_fits(self, ids: list[int], sp: SamplingParams, who: str) -> None:
        """A request that could never run is refused: longer than max_model_len, or larger than the KV
        cache even alone (beside the watermark's headroom; a parallel-sampling group with a block per sample)."""
        cfg = self.config
        if len(ids) >= cfg.max_model_len:
            raise ValueError(f"prompt{who} has {len(ids)} tokens: max_model_len="
                             f"{cfg.max_model_len} leaves no room for one output token")
        need = min(len(ids) + sp.max_tokens, cfg.max_model_len)
        if cfg.kv_allocation == "reserved":
            # Admission keeps the watermark's headroom free, so a region must fit beside it.
            cap = (self.num_kv_blocks - self.kv.watermark_blocks) * cfg.block_size
            if need > cap:
                raise ValueError(f"request{who}: its reservation of {need} positions (prompt "
                                 f"{len(ids)} + max_tokens {sp.max_tokens}) exceeds the whole KV capacity "
                                 f"of {cap} positions; it could never run")
        else:
            usable = self.num_kv_blocks - self.kv.watermark_blocks
            blocks = math.ceil(need / cfg.block_size)
            if blocks > usable:
                raise ValueError(f"request{who}: at its maximum length ({need} positions = "
                                 f"{blocks} blocks) it would not fit the KV cache even alone "
                                 f"({usable} usable blocks); lower max_tokens or add blocks")
            group = math.ceil(len(ids) / cfg.block_size) + sp.n - 1
            if sp.n > 1 and group > usable:
                raise ValueError(f"SamplingParams.n={sp.n}{who}: the prompt's blocks plus one per other "
                                 f"sample ({group} blocks) exceed the {usable} usable blocks")

    def _check_sampling_support(self, sp: SamplingParams, who: str) -> None:
        """The sampling features this engine's configuration can serve (SamplingParams itself
        checked each value's type and range)."""
        cfg = self.config
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(sp, name)
            if k is not None and k > self.vocab_size:
                raise ValueError(f"SamplingParams.{name}={k}{who}: more than the vocabulary's "
                                 f"{self.vocab_size} tokens")
            if k is not None and cfg.executor == "simulated":
                raise ValueError(f"SamplingParams.{name}={k}{who}: the simulated executor has no logits")
        if sp.stop and self.tokenizer is None:
            raise ValueError(f"SamplingParams.stop={sp.stop!r}{who}: stop strings are matched on text "
                             "and this model has no tokenizer; use stop_token_ids")
        if self.speculator is not None:
            for name, off in (("logprobs", None), ("prompt_logprobs", None), ("n", 1), ("min_tokens", 0),
                              ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
                if getattr(sp, name) != off:
                    raise ValueError(f"SamplingParams.{name}={getattr(sp, name)!r}{who}: not supported with "
                                     "speculative decoding (EngineConfig.speculative_model)")
        if sp.n > 1:
            if cfg.kv_allocation != "paged":
                raise ValueError(f"SamplingParams.n={sp.n}{who}: parallel sampling shares KV blocks, "
                                 "which needs kv_allocation='paged'")
            if sp.n > cfg.max_num_seqs:
                raise ValueError(f"SamplingParams.n={sp.n}{who}: its {sp.n} sequences could never run "
                                 f"together under max_num_seqs={cfg.max_num_seqs}")

    def _register(self, checked: dict) -> str:
        """Queue a request ``_check_request`` accepted: nothing here can fail on its input."""
        request_id = checked["request_id"]
        if request_id is None:
            request_id = str(next(self._ids))
            while request_id in self.requests or request_id in self.parents:
                request_id = str(next(self._ids))
        arrival_time = checked["arrival_time"]
        if arrival_time is None:
            arrival_time = self.clock.now()
        sp = checked["sampling_params"]
        parent = ParentRequest(request_id, sp) if sp.n > 1 else None
        req = Request(completion_id(request_id, 0) if parent else request_id, checked["prompt_token_ids"],
                      parent.params[0] if parent else sp, arrival_time, checked["priority"],
                      checked["tenant"], self.eos_token_id, checked["expected_output_len"],
                      prompt=checked["prompt"])
        req.metrics.clock = self.clock.name
        if parent is not None:
            # Parallel sampling: the group enters as its first sequence; it forks the others
            # once the prompt is computed (see minillm/core/parallel_sampling.py).
            req.parent = parent
            parent.members.append(req)
            self.parents[request_id] = parent
        self.requests[req.request_id] = req
        self._active[req.request_id] = req
        self.scheduler.add(req)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Stop a request wherever it is and free its KV; the next StepRecord lists it in
        ``aborted``. Aborting a finished request does nothing."""
        parent = self.parents.get(str(request_id))
        if parent is not None:              # every sample of a parallel-sampling request
            for m in list(parent.members):
                self.abort_request(m.request_id)
            return
        req = self.requests.get(str(request_id))
        if req is None:
            raise KeyError(f"abort_request: unknown request_id={request_id!r}")
        if req.is_finished:
            return
        self.scheduler.remove(req)
        self.scheduler.finish_request(req, "abort", self.clock.now())
        self._aborted.append(req.request_id)
        self._forget([req])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def is_finished(self, request_id: str) -> bool:
        """Has the request (every one of its samples, for n > 1) finished?"""
        parent = self.parents.get(request_id)
        return parent.finished if parent is not None else self.requests[request_id].is_finished

    def parent_id(self, sequence_id: str) -> str:
        """The request a sequence belongs to (itself, unless it is one of n parallel samples)."""
        r = self.requests.get(sequence_id)
        return r.parent.request_id if r is not None and r.parent is not None else sequence_id

    def _final_text(self, r: Request) -> str:
        """A sequence's whole output text: cut where a stop string matched, else its tokens decoded."""
        return r.stop_text if r.stop_text is not None else \
            self.tokenizer.decode(r.output_token_ids, skip_special_tokens=True)

    def output_text(self, sequence_id: str) -> str:
        """One sequence's output text so far, for front ends that stream it (``AsyncLLM``): while
        it runs, what its incremental detokenizer (minillm/detokenizer.py) has decoded; once
        finished, exactly the text ``get_output`` gives (cut at the stop string that ended it).
        "" without a tokenizer."""
        r = self.requests[sequence_id]
        if self.tokenizer is None:
            return ""
        if r.is_finished:
            return self._final_text(r)
        if r.detokenizer is None:
            r.detokenizer = IncrementalDetokenizer(self.tokenizer)
        r.detokenizer.update(r.output_token_ids)
        return r.detokenizer.text

    def _completion(self, r: Request, index: int) -> CompletionOutput:
        text = None
        if self.tokenizer is not None and self.config.executor == "model":
            text = self._final_text(r)
        logprobs = self._with_text(r.output_logprobs)
        return CompletionOutput(index=index, text=text, token_ids=list(r.output_token_ids),
                                cumulative_logprob=None if logprobs is None else
                                sum(lp[t].logprob for lp, t in zip(logprobs, r.output_token_ids)),
                                logprobs=logprobs, finish_reason=r.finish_reason, stop_reason=r.stop_reason,
                                finish_detail=r.finish_detail)

    def _with_text(self, positions):
        """Logprob dicts with each token's text filled in (when there is a tokenizer)."""
        if positions is None or self.tokenizer is None:
            return None if positions is None else list(positions)
        for lp in positions:
            for tok, l in (lp or {}).items():
                if l.decoded_token is None:
                    l.decoded_token = self.tokenizer.decode([tok])
        return list(positions)

    def get_output(self, request_id: str) -> RequestOutput:
        """The request's output: all n completions in ``outputs`` (by index), and the first
        completion's tokens, text and finish reason at the top level."""
        parent = self.parents.get(request_id)
        members = parent.members if parent is not None else [self.requests[request_id]]
        outputs = [self._completion(m, i) for i, m in enumerate(members)]
        r, first = members[0], outputs[0]
        return RequestOutput(request_id=request_id, prompt=r.prompt, prompt_token_ids=r.prompt_token_ids,
                             token_ids=first.token_ids, text=first.text, finish_reason=first.finish_reason,
                             metrics=r.metrics, num_cached_tokens=r.metrics.num_cached_tokens,
                             finish_detail=first.finish_detail, outputs=outputs,
                             prompt_logprobs=self._with_text(r.prompt_logprobs))

    def _forget(self, finished: list[Request]) -> None:
        """Finished requests leave the engine: the executor and the proposer drop their state."""
        forget = getattr(self.executor, "forget", None) or getattr(getattr(self.executor, "sampler", None),
                                                                    "forget", None)
        for req in finished:
            self._active.pop(req.request_id, None)
            if forget:
                forget(req.request_id)
            if self.speculator is not None:
                self.speculator.forget(req.request_id)

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
        """One scheduler iteration: schedule -> execute -> update -> StepRecord.

        All or nothing: if anything raises inside (a policy hook, the forward, Ctrl-C), the
        queues, requests, KV tables, random streams and clock are put back as they were, the
        exception propagates, and the next ``step()`` carries on from there."""
        checkpoint = (self.scheduler.checkpoint(), self.executor.checkpoint(), self.clock.now())
        self._forked = []
        try:
            record, update = self._step()
        except BaseException:
            for seq in self._forked:                 # sequences forked by the failed step
                self.requests.pop(seq.request_id, None)
                self._active.pop(seq.request_id, None)
            sched, execu, t = checkpoint
            self.scheduler.rollback(sched)
            self.executor.rollback(execu)
            self.clock.reset(t)
            raise
        self.scheduler.commit()
        self._forget(update.finished)
        self._aborted = []
        self.step_count += 1
        self.swapped_bytes += record.swap_bytes
        self._keep(record)
        return record

    def _step(self):
        self._idle_wait()
        now = self.clock.now()
        t0 = time.perf_counter()
        # Speculative decoding: the proposer guesses for each decoding request first; the
        # scheduler then decides how many guesses fit this step's budget.
        draft_time = self.speculator.propose(self.scheduler.running) if self.speculator else 0.0
        phases = PhaseTimes(self.config.phase_clock)     # host time per phase, when asked for
        t1 = time.perf_counter()
        p = phases.mark()
        out = self.scheduler.schedule(now)
        phases.add("schedule", p)
        t_sched = time.perf_counter() - t1
        p = phases.mark()
        result = self.executor.execute(out)
        self.kv.forward_done()
        phases.add("execute", p)
        phases.times.update(result.phase_times)
        wall = time.perf_counter() - t0
        if self.clock.name == "modeled":
            duration, sched_time, swap_time = self._step_cost(out, result.swap_bytes)
            duration += draft_time                  # the draft's forwards, then the target's
            self.clock.advance(duration)
        else:
            duration, sched_time, swap_time = wall, t_sched, 0.0
        t = self.clock.now()
        p = phases.mark()
        update = self.scheduler.update_from_output(out, result, t)
        phases.add("update", p)
        self._forked = update.forked
        for seq in update.forked:                    # parallel sampling: the group's other sequences
            self.requests[seq.request_id] = seq
            self._active[seq.request_id] = seq
        p = phases.mark()
        record = self._record(out, update, t, duration, sched_time, swap_time, draft_time, result.swap_bytes)
        phases.add("record", p)
        record.phase_times = phases.times
        return record, update

    def _record(self, out, update, t, duration, sched_time, swap_time, draft_time, swap_bytes) -> StepRecord:
        mode = self.record_mode
        kv = None if mode == "none" else self.kv.snapshot(self._active, detail=mode == "full")
        return StepRecord(
            step=self.step_count, time=t, duration=duration, batch=update.batch,
            num_batched_tokens=out.num_batched_tokens, token_budget=out.token_budget,
            admitted=out.admitted, finished=[r.request_id for r in update.finished],
            preempted=out.preempted, waiting=out.waiting, kv=kv,
            running=[r.request_id for r in self.scheduler.running],
            swapped=[r.request_id for r in self.scheduler.swapped], swapped_in=out.swapped_in,
            rejected=out.rejected, aborted=list(self._aborted),
            finish_reasons={r.request_id: r.finish_reason for r in update.finished},
            scheduled=out.reformed, clock=self.clock.name, schedule_time=sched_time, swap_time=swap_time,
            spec_proposed=update.spec_proposed, spec_accepted=update.spec_accepted,
            draft_time=draft_time, swap_bytes=swap_bytes, forks=update.forks, copies=out.copies)

    def _keep(self, record: StepRecord) -> None:
        """The bounded history ``engine.step_records`` (``EngineConfig.record_history``)."""
        limit = self.config.record_history
        if self.record_mode == "none" or limit == 0:
            return
        self.step_records.append(record)
        if limit is not None and len(self.step_records) > 2 * limit:
            del self.step_records[:len(self.step_records) - limit]     # amortised O(1) per step

    # --- conveniences -------------------------------------------------------------------------------
    def run(self, max_steps: Optional[int] = None, progress=None) -> list[StepRecord]:
        """Step until every request is done (or max_steps)."""
        records = []
        while self.has_unfinished_requests() and (max_steps is None or len(records) < max_steps):
            records.append(self.step())
            if progress is not None:
                progress(records[-1])
        return records

    def close(self) -> None:
        """Release the executor's processes (tensor parallelism's ranks); idempotent."""
        close = getattr(self.executor, "close", None)
        if close is not None:
            close()

    def stats(self) -> dict:
        d = dict(self.scheduler.counters)
        d["swapped_bytes"] = self.swapped_bytes
        d["prefix_cache"] = self.kv.stats()
        d["steps"] = self.step_count
        return d

    def request_metrics(self) -> list:
        return [r.metrics for r in self.requests.values()]
