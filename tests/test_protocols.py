"""The written contracts: every component is checked against its ``typing.Protocol`` when the engine is
built, and a component that lacks a method fails there, with the method named.

The protocols: ``KVCacheManager`` and its capabilities (``minillm/core/kv_manager.py``), ``Executor``
(``minillm/executor.py``), ``Policy`` and ``LengthPredictor`` (``minillm/core/policies.py``), ``Proposer``
(``minillm/spec/speculative.py``). The built-in components and the exercises' reference answers keep them.
"""

import ast
import sys
from pathlib import Path

import pytest

from minillm import LLM
from minillm.checks import check_protocol, protocol_members
from minillm.core.kv_cache import PagedKVCacheManager
from minillm.core.kv_manager import CAPABILITIES, KVCacheManager, OnDemandBlocks, PrefixCaching, Swapping
from minillm.core.policies import FCFS, SJF, LengthPredictor, OraclePredictor, Policy
from minillm.core.reserved_kv_cache import ReservedKVCacheManager
from minillm.executor import EXECUTORS, ExecutionResult, Executor
from minillm.spec.speculative import NgramProposer, Proposer

sys.path.insert(0, str(Path(__file__).parent))
from test_architecture import ROOT, import_graph, package_modules

SIM = dict(model="random", executor="simulated", num_kv_blocks=32, block_size=4, max_model_len=64)


def without(cls: type, name: str) -> type:
    """A class with every attribute of ``cls`` (and of its bases) but ``name``: a student's manager that
    forgot one method."""
    attrs = {}
    for base in reversed(cls.__mro__[:-1]):
        attrs.update({k: v for k, v in vars(base).items() if k not in ("__dict__", "__weakref__")})
    del attrs[name]
    return type(f"{cls.__name__}Without_{name}", (), attrs)


# --- what each protocol promises ------------------------------------------------------------------------


def test_the_protocols_name_their_members():
    """Read off the protocols (a method or an attribute dropped from one fails here)."""
    assert protocol_members(KVCacheManager) == [
        "num_blocks",
        "block_size",
        "attn_block_size",
        "watermark_blocks",
        "supports_prefix_caching",
        "supports_swapping",
        "supports_forking",
        "allocates_on_demand",
        "can_allocate",
        "allocate",
        "free",
        "truncate",
        "block_table",
        "begin_step",
        "end_step",
        "rollback",
        "explain_wait",
        "snapshot",
        "totals",
        "stats",
    ]
    assert protocol_members(Swapping) == ["can_swap_out", "swap_out", "can_swap_in", "swap_in"]
    assert protocol_members(PrefixCaching) == [
        "enable_prefix_caching",
        "find_cached_prefix",
        "record_lookup",
        "cache_full_blocks",
        "forward_done",
    ]
    assert protocol_members(Executor) == ["execute", "checkpoint", "rollback", "forget", "close"]
    assert protocol_members(Policy) == ["name", "order_waiting", "pick_victim", "preempt_for", "on_step"]
    assert protocol_members(LengthPredictor) == ["name", "predict", "observe"]
    assert protocol_members(Proposer) == ["name", "needs_kv", "forwards", "propose", "draft_probs", "forget"]


def test_the_built_in_components_keep_their_protocols():
    paged, reserved = PagedKVCacheManager(8, 4), ReservedKVCacheManager(8, 4, 32)
    for kv in (paged, reserved):
        check_protocol(kv, KVCacheManager, "kv")
    for flag, protocol in CAPABILITIES.items():
        assert getattr(paged, flag) is True and getattr(reserved, flag) is False
        check_protocol(paged, protocol, flag)
    engine = LLM(**SIM).engine
    assert isinstance(engine.executor, Executor) and isinstance(engine.policy, Policy)
    assert isinstance(OraclePredictor(), LengthPredictor) and isinstance(NgramProposer(), Proposer)
    assert isinstance(FCFS(), Policy) and not isinstance(object(), Policy)


def test_the_reserved_manager_keeps_no_stand_ins():
    """It declares what it cannot do; it does not answer with a method that does nothing."""
    for protocol in (PrefixCaching, Swapping, OnDemandBlocks):
        for name in protocol_members(protocol):
            if name not in ("enable_prefix_caching", "num_free_blocks"):
                assert not hasattr(ReservedKVCacheManager, name), name
    for name in ("fork", "take_copies"):
        assert not hasattr(ReservedKVCacheManager, name)


# --- a component missing a method fails when the engine is built, naming it ------------------------------


@pytest.mark.parametrize("method", ["block_table", "explain_wait", "rollback", "truncate"])
def test_a_kv_manager_without_a_method_fails_at_build_naming_it(method):
    Mine = without(ReservedKVCacheManager, method)
    with pytest.raises(TypeError, match=rf"KVCacheManager protocol .* lacks {method}\(\)"):
        LLM(kv_allocation="reserved", kv_manager=lambda cfg, n: Mine(n, cfg.block_size, cfg.max_model_len), **SIM)


def test_a_declared_capability_needs_its_methods():
    class SaysItSwaps(ReservedKVCacheManager):
        supports_swapping = True

    with pytest.raises(
        TypeError,
        match=r"declares supports_swapping.*Swapping protocol .* lacks can_swap_out\(\), "
        r"swap_out\(\), can_swap_in\(\), swap_in\(\)",
    ):
        LLM(
            kv_allocation="reserved", kv_manager=lambda cfg, n: SaysItSwaps(n, cfg.block_size, cfg.max_model_len), **SIM
        )

    class Unsure(PagedKVCacheManager):
        supports_forking = "maybe"

    with pytest.raises(TypeError, match=r"Unsure.supports_forking='maybe': must be True or False"):
        LLM(kv_manager=lambda cfg, n: Unsure(n, cfg.block_size), **SIM)


def test_a_paged_manager_without_a_capability_method_fails_naming_it():
    Mine = without(PagedKVCacheManager, "swap_in")
    with pytest.raises(TypeError, match=r"Swapping protocol .* lacks swap_in\(\)$"):
        LLM(kv_manager=lambda cfg, n: Mine(n, cfg.block_size), **SIM)


def test_a_policy_without_a_hook_fails_at_build_naming_it():
    class Half:
        name = "half"

        def order_waiting(self, waiting, now):
            return waiting

        def pick_victim(self, candidates, now):
            return candidates[-1]

    with pytest.raises(TypeError, match=r"Policy protocol .* lacks preempt_for\(\), on_step\(\)"):
        LLM(policy=Half(), **SIM)


def test_a_predictor_without_predict_fails_naming_it():
    class Watcher:
        name = "watcher"

        def observe(self, request):
            pass

    with pytest.raises(TypeError, match=r"LengthPredictor protocol .* lacks predict\(\)"):
        SJF(predictor=Watcher())
    with pytest.raises(TypeError, match=r"LengthPredictor protocol .* lacks predict\(\)"):
        LLM(policy=SJF(predictor=Watcher()), **SIM)


def test_a_proposer_without_draft_probs_fails_naming_it():
    class Guesser:
        name, needs_kv, forwards = "guesser", False, []

        def propose(self, requests, k):
            return {}

        def forget(self, request_id):
            pass

    with pytest.raises(TypeError, match=r"Proposer protocol .* lacks draft_probs\(\)"):
        check_protocol(Guesser(), Proposer, "proposer")


def test_an_executor_without_forget_fails_naming_it():
    class Runs:
        def execute(self, out):
            return ExecutionResult()

        def checkpoint(self):
            pass

        def rollback(self, checkpoint):
            pass

        def close(self):
            pass

    with pytest.raises(TypeError, match=r"Executor protocol .* lacks forget\(\)"):
        check_protocol(Runs(), Executor, "the executor")


# --- the exercises plug in through the same contracts ------------------------------------------------------


def test_the_exercise_answers_keep_the_protocols():
    from solutions import ex02_paging, ex03_policies, ex04_prefix_cache, ex04b_parallel_sampling, ex05_preemption

    for llm in (
        ex02_paging.paged_engine(executor="simulated", num_kv_blocks=32),
        ex02_paging.reserved_engine(executor="simulated", num_kv_blocks=32),
        LLM(kv_manager=ex04b_parallel_sampling.cow_kv_manager, **SIM),
    ):
        assert isinstance(llm.engine.kv, KVCacheManager)
    assert ex04_prefix_cache.YourPrefixCachingKVCacheManager.supports_prefix_caching
    for cls in (ex05_preemption.LeastProgressVictim, ex05_preemption.PriorityPreemption):
        assert isinstance(LLM(policy=cls(), **SIM).engine.policy, cls)
    policies = [
        v
        for v in vars(ex03_policies).values()
        if isinstance(v, type) and Policy in v.__mro__ and v.__module__ == ex03_policies.__name__
    ]
    assert policies
    for cls in policies:
        LLM(policy=cls(), **SIM)


# --- the executor's contract and its kinds --------------------------------------------------------------


def test_the_executor_kinds_are_declared_in_one_place():
    """``EngineConfig.executor`` is read through ``EXECUTORS`` (``config.runs_model``): no other module
    compares the kind's name."""
    assert {k: v.runs_model for k, v in EXECUTORS.items()} == {"model": True, "simulated": False}
    named = []
    for path in sorted((ROOT / "minillm").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare) and any(
                isinstance(c, ast.Constant) and c.value in EXECUTORS for c in [node.left, *node.comparators]
            ):
                text = ast.unparse(node)
                if "executor" in text:
                    named.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text}")
    assert not named, named


def test_the_simulator_s_executor_imports_no_torch():
    """``ExecutionResult`` lives beside the ``Executor`` protocol, not in the torch runner: the simulated
    executor and the contract reach no module that imports torch (every import counted, also those
    inside functions). (The package's ``__init__`` loads the kernels, so ``import minillm`` itself does.)"""
    graph, known = import_graph(), package_modules()

    def imports_torch(path):
        return any(
            isinstance(n, ast.Import)
            and any(a.name.split(".")[0] == "torch" for a in n.names)
            or isinstance(n, ast.ImportFrom)
            and not n.level
            and (n.module or "").split(".")[0] == "torch"
            for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        )

    for start in ("minillm.sim.sim_executor", "minillm.executor"):
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo += graph[m]
        assert not [m for m in seen if imports_torch(known[m])], start
    worker = sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        if m.startswith("minillm.sim.")
        for d in deps
        if d.startswith("minillm.worker")
    )
    assert not worker, worker
