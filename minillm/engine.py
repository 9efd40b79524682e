"""The engine: one ``step()`` = schedule, execute, apply, record.

One direction per step: the scheduler decides (a ``SchedulerOutput``), the executor (the real
model, or the simulator) runs it, the scheduler applies the results where the requests live
(``update_from_output``), and the engine emits a ``StepRecord``. Nothing reaches back up. What it
loads, sizes, checks and returns lives beside it: ``model/loader``, ``kv_sizing``, ``checks``, ``outputs``.
"""

from __future__ import annotations

import dataclasses
import itertools
from operator import attrgetter
from typing import Optional, Union

from .sim.clock import PhaseTimes, make_clock
from .sim.costmodel import engine_cost_model, modeled_step_time
from .checks import check_config, check_protocol, check_request
from .executor import Executor
from .config import EngineConfig
from .core.kv_cache import make_kv_manager
from .core.kv_manager import check_kv_manager
from .kv_sizing import bytes_per_block, check_kv_fits, num_blocks_from_memory, num_swap_blocks_from_memory
from .model.loader import load_target, load_tokenizer, resolve_device, resolve_dtype, resolve_model_path, torch_dtype
from .outputs import RequestOutput, RequestTable, output_text, request_output
from .core.parallel_sampling import ParentRequest, first_sequence, id_clash
from .core.policies import make_policy
from .core.request import Request
from .sampling_params import SamplingParams, checked_copy
from .core.scheduler import Scheduler
from .step_record import StepRecord


class LLMEngine:
    def __init__(self, model: Optional[str], config: EngineConfig, tokenizer=None):
        self.config = config
        self.device = resolve_device(config.device) if config.runs_model else None  # (the simulator: no torch)
        dtype_name = resolve_dtype(config.dtype, self.device)
        self.model_path = resolve_model_path(model)
        self.tokenizer = tokenizer

        # --- the model (or, for the simulator, only its shape) -------------------------
        self.model, self.hf_config, self.model_spec = load_target(self.model_path, config, dtype_name, self.device)
        if self.tokenizer is None and self.model_path != "random":
            self.tokenizer = load_tokenizer(self.model_path)
        self.vocab_size = self.hf_config.vocab_size
        eos = getattr(self.hf_config, "eos_token_id", None)
        self.eos_token_id = eos[0] if isinstance(eos, (list, tuple)) else eos
        self.dtype = torch_dtype(dtype_name) if config.runs_model else None

        # --- time: the clock and (for modeled time) the cost model ---------------------
        self.cost_model = engine_cost_model(config, self.model_spec)
        self.clock = make_clock(config.clock)

        # --- KV memory ---------------------------------------------------------------------
        if config.swap_space is not None:  # vLLM's swap_space (GiB): this engine's config holds it in blocks
            config = self.config = dataclasses.replace(
                config,
                swap_space=None,
                num_swap_blocks=(num_swap_blocks_from_memory(config, self.model_spec, self.cost_model, self.dtype)),
            )
        num_blocks = config.num_kv_blocks or num_blocks_from_memory(
            config, self.model_spec, self.cost_model, self.dtype, self.device
        )
        check_kv_fits(config, num_blocks, self.model_spec, self.cost_model, self.dtype, self.device)
        self.num_kv_blocks = num_blocks
        # the built-in KV manager for the config, or the one EngineConfig.kv_manager builds
        self.kv = check_kv_manager((config.kv_manager or make_kv_manager)(config, num_blocks), config, num_blocks)
        check_config(config, self.hf_config, self.model_path)

        # --- scheduler and executor -----------------------------------------------------------
        self.policy = make_policy(config.policy)
        self.scheduler = Scheduler(config, self.kv, self.policy, self.cost_model, tokenizer=self.tokenizer)
        self.executor = check_protocol(self._make_executor(num_blocks), Executor, "the executor")
        self.speculator = self._make_speculator()  # speculative decoding: proposes before each step

        self.requests: dict[str, Request] = RequestTable()  # every request ever added
        self.parents: dict[str, ParentRequest] = {}  # parallel sampling (n > 1): request id -> its group
        self.active: dict[str, Request] = {}  # not yet finished (what the KV snapshot looks up)
        self._ids = itertools.count()
        self.step_count = 0
        self.swapped_bytes = 0  # KV bytes copied to/from host memory
        self.record_mode = (
            config.record if config.record != "auto" else ("full" if num_blocks <= 256 else "summary")
        )  # the per-block map costs O(blocks) a step
        self.step_records: list[StepRecord] = []  # the latest records (EngineConfig.record_history)
        self.step_summaries: list = []  # simulate(records="summary"): a StepSummary per step
        self._aborted: list[str] = []  # aborted since the last record
        self._forked: list[Request] = []  # sequences forked by the step in progress

    # --- set-up helpers --------------------------------------------------------------------
    def _make_speculator(self):
        """The draft model and its proposer (``EngineConfig.speculative_model``), or None."""
        config = self.config
        if config.speculative_model is None:
            return None
        assert self.device is not None and self.dtype is not None  # a draft model runs: both resolved
        from .spec.speculative import make_speculator

        speculator = make_speculator(
            config,
            self.kv,
            self.model_spec,
            self.cost_model,
            self.device,
            self.dtype,
            self.executor.backend,
            self.executor.sampler,
        )
        self.executor.set_proposer(speculator.proposer)
        return speculator

    def _make_executor(self, num_blocks: int):
        """Who runs a step: the model on this process, N rank processes, or the simulator."""
        config = self.config
        if not config.runs_model:
            from .sim.sim_executor import SimulatedExecutor

            return SimulatedExecutor(
                config, self.kv, bytes_per_block(config, self.model_spec, self.cost_model, self.dtype)
            )
        assert self.device is not None and self.dtype is not None  # a model runs: both resolved in __init__
        if config.tensor_parallel_size > 1:
            from .worker.tp_executor import TPExecutor  # N rank processes, each with a shard of the model

            return TPExecutor(config, self.model_path, self.hf_config, self.kv, num_blocks, self.device, self.dtype)
        from .worker.model_runner import LocalModel, ModelRunner  # the model and its KV cache on this process

        local = LocalModel(config, self.model, num_blocks, self.device, self.dtype, self.kv.attn_block_size)
        return ModelRunner(config, self.kv, local, self.device)

    # --- requests -----------------------------------------------------------------------------
    def add_request(
        self,
        prompt: Union[str, list[int]],
        sampling_params: Optional[SamplingParams] = None,
        request_id: Optional[str] = None,
        arrival_time: Optional[float] = None,
        priority: int = 0,
        tenant: Optional[str] = None,
        expected_output_len: Optional[int] = None,
    ) -> str:
        """Queue one request; returns its id. A bad value raises ValueError/TypeError naming the
        field and the value before anything changes; the engine keeps its own copy of
        ``sampling_params``, so changing the caller's object later changes nothing."""
        return self.register_request(
            self.validate_request(
                prompt, sampling_params, request_id, arrival_time, priority, tenant, expected_output_len
            )
        )

    def validate_request(
        self, prompt, sampling_params, request_id, arrival_time, priority, tenant, expected_output_len
    ) -> dict:
        """Every check of ``add_request`` (``minillm/checks.py``), changing nothing: the request's
        fields, normalised (token ids and numbers as plain ints and floats, a copy of the params)."""
        who = f" (request {str(request_id)!r})" if request_id is not None else ""
        sp = checked_copy(sampling_params, who)
        if request_id is not None:
            request_id = str(request_id)
            clash = id_clash(request_id, sp.n, self.requests, self.parents)
            if clash is not None:
                raise ValueError(f"request_id={request_id!r}: {clash}")
        return check_request(self, prompt, sp, who, request_id, arrival_time, priority, tenant, expected_output_len)

    def register_request(self, checked: dict) -> str:
        """Queue a request ``validate_request`` accepted: nothing here can fail on its input."""
        request_id = checked["request_id"]
        if request_id is None:
            n = checked["sampling_params"].n
            request_id = str(next(self._ids))
            while id_clash(request_id, n, self.requests, self.parents) is not None:
                request_id = str(next(self._ids))
        arrival_time = checked["arrival_time"]
        if arrival_time is None:
            arrival_time = self.clock.now()
        req = first_sequence(
            request_id,
            checked["sampling_params"],
            prompt_token_ids=checked["prompt_token_ids"],
            arrival_time=arrival_time,
            priority=checked["priority"],
            tenant=checked["tenant"],
            eos_token_id=self.eos_token_id,
            expected_output_len=checked["expected_output_len"],
            prompt=checked["prompt"],
            clock=self.clock.name,
        )
        if req.parent is not None:  # parallel sampling: the group enters as its first sequence
            self.parents[request_id] = req.parent
        self.requests[req.request_id] = req
        self.active[req.request_id] = req
        self.scheduler.add(req)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Stop a request wherever it is and free its KV; the next StepRecord lists it in
        ``aborted``. Aborting a finished request does nothing, nor one done and held back
        (static / every-N batching): it keeps its finish reason."""
        parent = self.parents.get(str(request_id))
        if parent is not None:  # every sample of a parallel-sampling request
            for m in list(parent.members):
                self.abort_request(m.request_id)
            return
        req = self.requests[str(request_id)]
        if req.is_finished or req.pending_finish_reason is not None:
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

    def output_text(self, sequence_id: str) -> str:
        """One sequence's output text so far, for front ends that stream it (``AsyncLLM``): while it
        runs, what its incremental detokenizer has decoded; once finished, exactly the text
        ``get_output`` gives (cut at the stop string that ended it). "" without a tokenizer."""
        return output_text(self.requests[sequence_id], self.tokenizer)

    def get_output(self, request_id: str) -> RequestOutput:
        """The request's output: all n completions in ``outputs`` (by index), and the first
        completion's tokens, text and finish reason at the top level (``minillm/outputs.py``)."""
        parent = self.parents.get(request_id)
        members = parent.members if parent is not None else [self.requests[request_id]]
        return request_output(request_id, members, self.tokenizer, with_text=self.config.runs_model)

    def _forget(self, finished: list[Request]) -> None:
        """Finished requests leave the engine: the executor and the proposer drop their state."""
        for req in finished:
            self.active.pop(req.request_id, None)
            self.executor.forget(req.request_id)
            if self.speculator is not None:
                self.speculator.forget(req.request_id)

    # --- one step ---------------------------------------------------------------------------------
    def _idle_wait(self) -> bool:
        """Nothing can run now (``scheduler.is_idle()``): let the clock reach the next arrival. True when
        the clock waited: the step that follows starts from an idle engine (``CostModel.after_idle_time``)."""
        if not self.scheduler.is_idle():
            return False
        t = self.scheduler.next_arrival()
        if t is None or t <= self.clock.now():
            return False
        self.clock.wait_until(t)
        return True

    def step(self) -> StepRecord:
        """One scheduler iteration: schedule -> execute -> apply the results -> StepRecord -> commit.

        All or nothing: if anything raises inside (a policy hook, the forward, Ctrl-C), the queues, requests,
        KV tables, random streams and clock are put back, the exception propagates, and the next step carries on."""
        checkpoint = (self.scheduler.checkpoint(), self.executor.checkpoint(), self.clock.now())
        phases = PhaseTimes(self.config.phase_clock)  # host time per phase, when asked for
        try:
            after_idle = self._idle_wait()
            start = self.clock.now()
            if self.speculator:  # speculative decoding: each decoding request's draft (or its slots)
                self.speculator.propose(self.scheduler.running)
            with phases.timing("schedule"):  # 1. who runs, and how many tokens each
                t = self.clock.now()
                out = self.scheduler.schedule(t)
            times = dict(schedule=self.clock.now() - t, draft=self.speculator.draft(out) if self.speculator else 0.0)
            with phases.timing("execute"):  # 2. the forward (or the simulator)
                result = self.executor.execute(out)
            phases.times.update(result.phase_times)  # the executor's own phases (prepare, forward, sample)
            self._advance_clock(out, result, start, times, after_idle)
            with phases.timing("update"):  # 3. the results applied where the requests live
                update = self._apply(out, result, times["end"])
            with phases.timing("record"):  # 4. what the step did, for the views
                record = self._record(out, update, times, result.swap_bytes, phases.times)
        except BaseException:
            self._rollback(checkpoint)
            raise
        self._commit(update, record)  # 5. the step stands: forget its undo log
        return record

    def _advance_clock(self, out, result, start: float, times: dict, after_idle: bool = False) -> None:
        """The step's duration: what the cost model prices it at (modeled time: the clock advances by it;
        ``after_idle``: the step follows a wait for an arrival), or the wall time it took. ``times`` gains
        ``duration``, ``schedule`` and ``swap`` (seconds) and ``end``, the clock when the step ends (the
        time of its tokens and of its record)."""
        if self.clock.name == "modeled":
            duration, times["schedule"], times["swap"] = modeled_step_time(
                self.cost_model,
                out,
                len(self.scheduler.running),
                len(self.scheduler.waiting),
                result.swap_bytes,
                after_idle=after_idle,
            )
            times["duration"] = duration + times["draft"]  # the draft's forwards, then the target's
            self.clock.advance(times["duration"])
        else:
            times["duration"], times["swap"] = self.clock.now() - start, 0.0
        times["end"] = self.clock.now()

    def _apply(self, out, result, t: float):
        """The scheduler applies the results; sequences a parallel-sampling group forked join the engine."""
        if self.kv.supports_prefix_caching:
            self.kv.forward_done()  # the blocks this step registered now hold their prefixes
        update = self.scheduler.update_from_output(out, result, t)
        self._forked = update.forked
        for seq in update.forked:
            self.requests[seq.request_id] = seq
            self.active[seq.request_id] = seq
        return update

    def _rollback(self, checkpoint: tuple) -> None:
        """The step raised: everything it changed goes back (sequences it forked never existed)."""
        for seq in self._forked:
            self.requests.pop(seq.request_id, None)
            self.active.pop(seq.request_id, None)
        self._forked = []
        sched, execu, t = checkpoint
        self.scheduler.rollback(sched)
        self.executor.rollback(execu)
        self.clock.reset(t)

    def _commit(self, update, record: StepRecord) -> None:
        self._forked = []
        self.scheduler.commit()
        self._forget(update.finished)
        self._aborted = []
        self.step_count += 1
        self.swapped_bytes += record.swap_bytes
        self._keep(record)

    def _record(self, out, update, times: dict, swap_bytes: int, phase_times: dict) -> StepRecord:
        mode = self.record_mode  # "totals": the counts only (simulate(records="summary"))
        kv = (
            None
            if mode == "none"
            else self.kv.totals(self.active)
            if mode == "totals"
            else self.kv.snapshot(self.active, detail=mode == "full")
        )
        some = mode != "none"  # "none": no prefill/decode split, no running/swapped ids
        num_batched, num_decode = out.num_batched_tokens, out.num_decode_tokens if some else 0
        return StepRecord(
            step=self.step_count,
            time=times["end"],
            duration=times["duration"],
            batch=update.batch,
            batch_size=len(out.scheduled),
            num_prefill_tokens=num_batched - num_decode if some else 0,
            num_decode_tokens=num_decode,
            num_batched_tokens=num_batched,
            token_budget=out.token_budget,
            admitted=out.admitted,
            finished=[r.request_id for r in update.finished],
            preempted=out.preempted,
            waiting=out.waiting,
            not_scheduled=out.not_scheduled,
            kv=kv,
            running=list(map(attrgetter("request_id"), self.scheduler.running)) if some else [],
            swapped=[r.request_id for r in self.scheduler.swapped] if some else [],
            swapped_in=out.swapped_in,
            rejected=out.rejected,
            aborted=list(self._aborted),
            finish_reasons={r.request_id: r.finish_reason for r in update.finished},
            reformed=out.reformed,
            clock=self.clock.name,
            schedule_time=times["schedule"],
            swap_time=times["swap"],
            spec_proposed=update.spec_proposed,
            spec_accepted=update.spec_accepted,
            draft_time=times["draft"],
            swap_bytes=swap_bytes,
            forks=update.forks,
            copies=out.copies,
            phase_times=phase_times,
        )

    def _keep(self, record: StepRecord) -> None:
        """The bounded history ``engine.step_records`` (``EngineConfig.record_history``)."""
        limit = self.config.record_history
        if self.record_mode == "none" or limit == 0:
            return
        self.step_records.append(record)
        if limit is not None and len(self.step_records) > 2 * limit:
            del self.step_records[: len(self.step_records) - limit]  # amortised O(1) per step

    # --- conveniences -------------------------------------------------------------------------------
    def run(self, max_steps: Optional[int] = None, progress=None) -> list[StepRecord]:
        """Step until every request is done (or max_steps)."""
        records: list[StepRecord] = []
        while self.has_unfinished_requests() and (max_steps is None or len(records) < max_steps):
            records.append(self.step())
            if progress is not None:
                progress(records[-1])
        return records

    def close(self) -> None:
        """Release the executor's processes (tensor parallelism's ranks); idempotent."""
        self.executor.close()

    def stats(self) -> dict:
        d = dict(self.scheduler.counters)
        d["swapped_bytes"] = self.swapped_bytes
        d["prefix_cache"] = self.kv.stats()
        d["steps"] = self.step_count
        return d

    def request_metrics(self) -> list:
        return [r.metrics for r in self.requests.values()]
