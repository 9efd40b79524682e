"""Tensor parallelism for real: one step on ``N`` ranks, each a process with a shard of the model.

``LLM(..., tensor_parallel_size=N)`` makes the engine use ``TPExecutor`` in place of the
single-device ``ModelRunner``. Who holds what:

- **The driver** (the engine's own process) keeps everything that decides: the scheduler,
  the block pool and block tables, the sampler and its random streams. It holds no weights
  and no KV values. Each step its ``ModelRunner`` prepares the flat batch exactly as on one
  device (the same object, whose model is the ``RankGroup``: the two never drift) and sends it to every rank: **one
  broadcast of the scheduler's decision** (input ids, positions, attention metadata, the
  logits rows, the step's swaps and copy-on-write copies).
- **Rank r** (a worker process, started with ``torch.multiprocessing`` "spawn") holds its
  shard of every layer (``minillm.model.parallel``: heads ``r*H/N ... (r+1)*H/N``, a slice of
  the MLP and of the vocabulary) and **its heads' slice of every KV block**: block ``b`` is
  the same block number on every rank, each rank storing its own ``num_kv_heads / N`` heads
  in it. It runs **one forward** per step; the all-reduces inside (two per layer, plus the
  embedding's) go between the ranks over ``torch.distributed`` (gloo on CPU, NCCL on CUDA),
  never through the driver. Rank 0 gathers the LM head's vocabulary slices and sends the
  logits back; the driver samples, as on one device.

The driver is not itself a rank (nano-vllm runs rank 0 inside the engine's process). Keeping
it outside the process group costs one more process, and buys a driver that is never blocked
inside a collective: it waits for the ranks' replies with a timeout while watching every
process, so a rank that dies or raises surfaces here as a ``TensorParallelError`` naming the
rank, within ``step_timeout`` seconds at worst, and every rank is then shut down. The
notebook kernel never joins a process group, so several engines can live side by side.

One process per rank on CPU: the threads of the machine are divided between the ranks.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import traceback
import weakref
from datetime import timedelta
from multiprocessing.connection import wait
from types import SimpleNamespace
from typing import Callable, Optional

import numpy as np
import torch

from .model_runner import LocalModel, ModelRunner, resolve_backend
from ..core.scheduler_output import SchedulerOutput

START_TIMEOUT = 300.0  # seconds for every rank to load its shard and report ready
STEP_TIMEOUT = 300.0  # seconds for every rank to answer one step (the first may compile kernels)
GRACE = 2.0  # seconds, after a rank fails, to hear from the others before reporting


class TensorParallelError(RuntimeError):
    """A rank died, raised or stopped answering; every rank has been shut down."""


def _process_context():
    """How rank processes start: "forkserver" where there is one (a clean process like "spawn",
    forked from a server that imported torch and minillm once, so the ranks of every later
    engine start in a fraction of a second), else "spawn". Never a plain fork of the driver,
    whose threads (and CUDA state) a child cannot safely inherit."""
    import multiprocessing

    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = torch.multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(
            ["minillm.worker.tp_executor", "minillm.model.parallel", "transformers.models.llama.modeling_llama"]
        )
        return ctx
    return torch.multiprocessing.get_context("spawn")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# =====================================================================================
# A rank (runs in its own process)
# =====================================================================================


class Worker:
    """One rank: its shard of the model as a ``LocalModel``, which owns this rank's slice of the KV
    cache (and of the swap space) and does the swaps; batch preparation and sampling stay in the driver."""

    def __init__(self, rank: int, spec: SimpleNamespace):
        import torch.distributed as dist
        from ..model.parallel import load_shard_model

        self.rank, self.world = rank, spec.world
        if spec.device == "cuda":
            self.device = torch.device("cuda", rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            torch.set_num_threads(spec.threads)
        dist.init_process_group(
            "nccl" if spec.device == "cuda" else "gloo",
            init_method=spec.init_method,
            rank=rank,
            world_size=spec.world,
            timeout=timedelta(seconds=spec.timeout),
        )
        self.model = load_shard_model(
            spec.model, spec.hf_config, rank, spec.world, spec.dtype, str(self.device), spec.seed, spec.random_overrides
        )
        self.local = LocalModel(
            spec.runner_config, self.model, spec.num_blocks, self.device, spec.dtype, spec.attn_block_size
        )

    def step(self, swap_out, copies, swap_in, batch: Optional[dict]):
        """This step's block moves on this rank's slice of the cache, in ``LocalModel.swap``'s
        order (swap-outs, copy-on-write ``copies``, swap-ins), then (if anything is scheduled)
        one forward over this rank's shard. Rank 0 returns the logits (numpy); the others None."""
        from ..model.llama import AttentionMetadata

        if swap_out or copies or swap_in:
            self.local.swap(SimpleNamespace(swap_out=swap_out, copies=copies, swap_in=swap_in))
        if batch is None:
            return None
        t = {k: torch.from_numpy(v).to(self.device) for k, v in batch.items() if isinstance(v, np.ndarray)}
        meta = AttentionMetadata(
            slot_mapping=t["slot_mapping"],
            block_tables=t["block_tables"],
            cu_seqlens_q=t["cu_seqlens_q"],
            context_lens=t["context_lens"],
            max_q_len=batch["max_q_len"],
            backend=batch["backend"],
        )
        logits = self.local.forward(t["input_ids"], t["positions"], meta, t["rows"])
        return logits.cpu().numpy() if self.rank == 0 else None

    def comm(self) -> dict:
        """This rank's collectives so far: calls and bytes of all-reduce and gather."""
        from ..model.parallel import COMM

        return dict(COMM)

    def describe(self) -> dict:
        """What this rank holds: its parameters' shapes and its KV cache slice."""
        k = self.local.kv_caches[0][0]
        return dict(
            rank=self.rank,
            device=str(self.device),
            params={n: tuple(p.shape) for n, p in self.model.named_parameters()},
            num_heads=self.model.num_heads,
            num_kv_heads=self.model.num_kv_heads,
            kv_cache_shape=tuple(k.shape),
            kv_bytes_per_block=self.local.bytes_per_block,
        )


def _rank_main(rank: int, spec: SimpleNamespace, conn) -> None:
    """A rank's whole life: build its shard, report ready, then serve the driver's messages
    until "close". An exception is sent to the driver (naming this rank) and ends the process;
    so does the driver's end of the pipe closing (the driver is gone). Ctrl-C is the driver's
    to handle: a rank ignores it, and finishes the step it is in with the others."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        worker = Worker(rank, spec)
        conn.send(("ok", worker.local.bytes_per_block))
        while True:
            msg = conn.recv()
            if msg[0] == "close":
                break
            if msg[0] == "step":
                reply = worker.step(*msg[1:])
            else:  # ("call", fn, args): collective_rpc
                reply = msg[1](worker, *msg[2])
            conn.send(("ok", reply))
    except EOFError:
        os._exit(1)  # the driver is gone
    except BaseException as e:  # reported, then exit
        try:
            conn.send(("error", time.time(), f"{type(e).__name__}: {e}", traceback.format_exc()))
        finally:
            os._exit(1)  # peers may be stuck in a collective with us
    import torch.distributed as dist

    dist.destroy_process_group()


class _DeferredInterrupts:
    """Ctrl-C while the ranks run a step: counted, not raised, until every rank has answered.
    Raising at once would leave some ranks in the step and others not (their next collectives
    would pair with the wrong step), or cut a message in the pipe in half. Only the main
    thread receives Ctrl-C; elsewhere this does nothing."""

    def __init__(self):
        self.count = 0
        self._old = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._note)
        return self

    def _note(self, signum, frame):
        self.count += 1

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
        if self.count and exc[0] is None:
            if callable(self._old):
                self._old(signal.SIGINT, None)  # KeyboardInterrupt, now that the step is whole
            elif self._old == signal.SIG_DFL:
                raise KeyboardInterrupt
        return False


def _shut_down(procs: list, conns: list, grace: float) -> None:
    """Stop every rank: "close" to each, then terminate, then kill whatever is left."""
    for c in conns:
        try:
            c.send(("close",))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)
    for c in conns:
        c.close()


# =====================================================================================
# The driver's side
# =====================================================================================


class RankGroup:
    """The model split over ``config.tensor_parallel_size`` rank processes, seen from the driver: the
    two verbs of a ``LocalModel`` (``swap``, ``forward``) carried out by the ranks, plus ``close()``,
    ``describe()`` and ``collective_rpc``. A step's swaps and copy-on-write copies travel to the ranks
    with its batch (one message per step); ``flush()`` sends them alone in a step with no forward."""

    def __init__(
        self,
        config,
        model: str,
        hf_config,
        num_blocks: int,
        attn_block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        step_timeout: float = STEP_TIMEOUT,
        start_timeout: float = START_TIMEOUT,
    ):
        from ..model.parallel import check_heads, rank_config

        self.world = config.tensor_parallel_size
        check_heads(hf_config, self.world)
        self.config = config
        self.backend = resolve_backend(config.attention_backend, device, dtype, config.kv_cache_dtype)
        shard = rank_config(hf_config, 0, self.world)
        # What the driver's batch preparation reads of the model: heads per KV head, on each rank.
        self.num_heads, self.num_kv_heads = shard.num_attention_heads, shard.num_key_value_heads
        self.attn_block_size = attn_block_size
        self.step_timeout = step_timeout
        self._swaps = None  # this step's swaps and copies, sent with its batch
        self._closed: Optional[str] = None  # why the ranks are gone, once they are
        self._procs, self._conns = self._start(model, hf_config, num_blocks, device, dtype)
        self._finalizer = weakref.finalize(self, _shut_down, self._procs, self._conns, 5.0)
        per_rank = self._gather(start_timeout, "start")  # each rank's KV bytes per block
        self.bytes_per_block = sum(per_rank)

    def _start(self, model, hf_config, num_blocks, device, dtype):
        cuda = device.type == "cuda"
        if cuda:
            if device.index not in (None, 0):
                raise ValueError(
                    f"EngineConfig.device={str(device)!r}: with tensor_parallel_size="
                    f"{self.world}, rank r runs on cuda:r; use device='cuda'"
                )
            if torch.cuda.device_count() < self.world:
                raise ValueError(
                    f"tensor_parallel_size={self.world}: needs {self.world} CUDA devices, "
                    f"{torch.cuda.device_count()} visible"
                )
        c = self.config
        spec = SimpleNamespace(
            world=self.world,
            device="cuda" if cuda else "cpu",
            init_method=f"tcp://127.0.0.1:{_free_port()}",
            timeout=self.step_timeout,
            threads=max(1, torch.get_num_threads() // self.world),
            model=model,
            hf_config=hf_config,
            dtype=dtype,
            seed=c.seed,
            random_overrides=dict(c.random_model),
            num_blocks=num_blocks,
            attn_block_size=self.attn_block_size,
            runner_config=SimpleNamespace(
                attention_backend=c.attention_backend,
                kv_cache_dtype=c.kv_cache_dtype,
                block_size=c.block_size,
                num_swap_blocks=c.num_swap_blocks,
                max_num_seqs=c.max_num_seqs,
            ),
        )
        ctx = _process_context()
        procs, conns = [], []
        for rank in range(self.world):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(rank, spec, theirs), name=f"minillm-tp-rank{rank}", daemon=True)
            p.start()
            theirs.close()  # only the rank holds its end: EOF when it exits
            procs.append(p)
            conns.append(mine)
        return procs, conns

    # --- talking to the ranks ---------------------------------------------------------------
    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _fail(self, why: str):
        self.close(grace=0.0)  # a failed rank group: no orderly goodbye
        self._closed = why
        raise TensorParallelError(f"tensor parallelism ({self.world} ranks): {why}; every rank has been shut down")

    def _broadcast(self, msg, what: str) -> list:
        """Send ``msg`` to every rank; return their replies (rank order)."""
        if self._closed is not None:
            raise TensorParallelError(f"tensor parallelism: the ranks are shut down ({self._closed})")
        with _DeferredInterrupts() as interrupts:
            unreachable = set()
            for rank, c in enumerate(self._conns):
                try:
                    c.send(msg)
                except (OSError, ValueError):  # its end of the pipe is gone: it died
                    unreachable.add(rank)
                    break  # the others fail anyway (a collective misses it)
            return self._gather(self.step_timeout, what, unreachable, interrupts)

    def _gather(self, timeout: float, what: str, dead=frozenset(), interrupts=None) -> list:
        """One reply from every rank, watching each process while waiting. A rank that raises
        or dies fails the step: the others then fail too (their collectives lose a peer), so
        the driver waits up to ``GRACE`` seconds for the whole picture, and names the cause
        first: a rank that died without a word, else the earliest exception. A rank silent
        past ``timeout`` seconds fails the step as well. Every rank is then shut down. A first
        Ctrl-C waits for the step to end (then raises KeyboardInterrupt: the engine rolls the
        step back); a second one stops waiting and shuts the ranks down."""
        replies: list = [None] * self.world
        pending = set(range(self.world))
        errors: dict[int, tuple] = {}  # rank -> (time, message, traceback)
        died = set(dead)
        deadline = time.monotonic() + (GRACE if died else timeout)
        conn_rank = {id(c): r for r, c in enumerate(self._conns)}
        while pending - died - set(errors):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if interrupts is not None and interrupts.count >= 2:
                self._fail(f"interrupted (Ctrl-C twice) while waiting for rank(s) {sorted(pending)} to finish {what!r}")
            waiting = pending - died - set(errors)
            ready = wait(
                [self._conns[r] for r in waiting] + [self._procs[r].sentinel for r in waiting], min(left, 0.25)
            )
            for obj in sorted(ready, key=lambda o: isinstance(o, int)):  # messages before deaths
                rank = conn_rank.get(id(obj))
                if rank is None:  # a process ended
                    rank = next(r for r, p in enumerate(self._procs) if p.sentinel == obj)
                    if rank in errors or self._conns[rank].poll():
                        continue  # it left a message: read it (next round)
                    died.add(rank)
                    continue
                try:
                    kind, *payload = obj.recv()
                except (EOFError, OSError):
                    died.add(rank)
                    continue
                if kind == "error":
                    errors[rank] = tuple(payload)
                else:
                    replies[rank] = payload[0]
                    pending.discard(rank)
            if (died or errors) and deadline - time.monotonic() > GRACE:
                deadline = time.monotonic() + GRACE  # a failure: collect the rest of the picture
        if not (died or errors or pending):
            return replies
        for r in died:
            self._procs[r].join(1.0)
        causes = [
            f"rank {r} (pid {self._procs[r].pid}) died during {what!r} (exit code {self._procs[r].exitcode})"
            for r in sorted(died - set(errors))
        ]
        for r, (_, msg, tb) in sorted(errors.items(), key=lambda e: e[1][0]):
            if causes:  # a consequence: one line is enough
                causes.append(f"rank {r} raised {msg.splitlines()[0][:200]}")
            else:  # the cause: with the rank's own traceback
                causes.append(f"rank {r} raised during {what!r}: {msg}\n--- rank {r}'s traceback ---\n{tb}")
        if not causes:
            causes = [f"no answer from rank(s) {sorted(pending)} to {what!r} within {timeout:g} s"]
        self._fail("; then ".join(causes))

    def collective_rpc(self, fn: Callable, *args) -> list:
        """``fn(worker, *args)`` on every rank (``fn`` must be picklable: a module-level
        function); the results in rank order. E.g. ``collective_rpc(Worker.describe)``."""
        return self._broadcast(("call", fn, args), getattr(fn, "__name__", "call"))

    def describe(self) -> list[dict]:
        """What each rank holds (its parameters' shapes, its KV cache slice)."""
        return self.collective_rpc(Worker.describe)

    def close(self, grace: float = 5.0) -> None:
        """Shut every rank down: "close" to each, ``grace`` seconds to exit, then terminate
        (idempotent; also runs at exit and when the executor is garbage collected)."""
        if self._closed is None:
            self._closed = "closed"
        if self._finalizer.detach() is not None:
            _shut_down(self._procs, self._conns, grace)

    # --- one step -------------------------------------------------------------------------------
    def discard(self) -> None:
        """A new step (or a failed one): no swaps are pending."""
        self._swaps = None

    def swap(self, out: SchedulerOutput) -> int:
        """Not done here: the step's swaps and copy-on-write copies travel to the ranks with its
        batch, and each rank applies them to its own slice of every block."""
        self._swaps = (list(out.swap_out), list(out.copies), list(out.swap_in))
        return (len(out.swap_out) + len(out.swap_in)) * self.bytes_per_block

    def _step_message(self, batch: Optional[dict]):
        swap_out, copies, swap_in = self._swaps or ([], [], [])
        self._swaps = None
        return ("step", swap_out, copies, swap_in, batch)

    def forward(self, input_ids, positions, meta, logits_rows: torch.Tensor) -> torch.Tensor:
        """Send the batch (with the step's block moves), every rank's shard runs, rank 0's logits back."""
        batch = dict(
            input_ids=input_ids.numpy(),
            positions=positions.numpy(),
            slot_mapping=meta.slot_mapping.numpy(),
            block_tables=meta.block_tables.numpy(),
            cu_seqlens_q=meta.cu_seqlens_q.numpy(),
            context_lens=meta.context_lens.numpy(),
            max_q_len=meta.max_q_len,
            backend=meta.backend,
            rows=logits_rows.numpy(),
        )
        return torch.from_numpy(self._broadcast(self._step_message(batch), "step")[0])

    def flush(self) -> None:
        """Block moves of a step with no forward go to the ranks on their own."""
        if self._swaps is not None and any(self._swaps):
            self._broadcast(self._step_message(None), "swap")
        self._swaps = None


class TPExecutor:
    """The engine's executor over ``config.tensor_parallel_size`` ranks (``minillm.executor.Executor``):
    a ``ModelRunner`` on the driver (batch preparation, sampling, the verification of speculative
    tokens: the same code as on one device) whose model is a ``RankGroup`` (the swaps and the forward,
    in the ranks). Plus what a group of processes needs: ``close()``, ``describe()``, ``collective_rpc``."""

    def __init__(
        self,
        config,
        model: str,
        hf_config,
        kv_manager,
        num_blocks: int,
        device: torch.device,
        dtype: torch.dtype,
        step_timeout: float = STEP_TIMEOUT,
        start_timeout: float = START_TIMEOUT,
    ):
        self.ranks = RankGroup(
            config, model, hf_config, num_blocks, kv_manager.attn_block_size, device, dtype, step_timeout, start_timeout
        )
        # batches are prepared on the host and sent
        self.runner = ModelRunner(config, kv_manager, self.ranks, torch.device("cpu"))
        self.backend, self.sampler = self.runner.backend, self.runner.sampler  # (a draft model shares them)
        self.bytes_per_block = self.ranks.bytes_per_block

    def execute(self, out: SchedulerOutput):
        res = self.runner.execute(out)  # ranks.swap(), then ranks.forward() if anything is scheduled
        self.ranks.flush()  # block moves in a step with no forward
        return res

    def checkpoint(self) -> None:
        self.ranks.discard()
        self.runner.checkpoint()

    def rollback(self, checkpoint) -> None:
        self.ranks.discard()
        self.runner.rollback(checkpoint)

    def forget(self, request_id: str) -> None:
        self.runner.forget(request_id)

    def set_proposer(self, proposer) -> None:
        self.runner.set_proposer(proposer)

    # --- the ranks ------------------------------------------------------------------------------
    @property
    def pids(self) -> list[int]:
        return self.ranks.pids

    def describe(self) -> list[dict]:
        """What each rank holds (its parameters' shapes, its KV cache slice)."""
        return self.ranks.describe()

    def collective_rpc(self, fn: Callable, *args) -> list:
        """``fn(worker, *args)`` on every rank: ``RankGroup.collective_rpc``."""
        return self.ranks.collective_rpc(fn, *args)

    def close(self, grace: float = 5.0) -> None:
        self.ranks.close(grace)
