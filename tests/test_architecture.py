"""The engine's shape, checked: imports go one way, components are configured (never patched from
outside), every module says what it is for, and structural rules hold: no import cycles, no module
assigns into another module's objects, no private (``_x``) attribute is used outside its module, and
each rule of the engine has one home.

The import graph is read from the source (``ast``), every ``import`` counted, also those inside
functions: an import deferred into a function body still ties the two modules together.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"minillm": "minillm", "minillm_kernels": "kernels"}  # import name -> folder (pyproject.toml)


def module_name(path: Path) -> str:
    for package, folder in PACKAGES.items():
        if path.is_relative_to(ROOT / folder):
            parts = [package, *path.relative_to(ROOT / folder).with_suffix("").parts]
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    raise ValueError(f"{path} is in none of {sorted(PACKAGES.values())}")


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for folder in PACKAGES.values() for p in sorted((ROOT / folder).rglob("*.py"))}


def imported_modules(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that ``name`` (the file ``path``) imports, anywhere in the file. An import
    of a package's own parent packages is left out (importing ``minillm.model.llama`` runs
    ``minillm/__init__`` and ``minillm/model/__init__`` first by definition, which is not a dependency)."""
    is_package = path.name == "__init__.py"
    targets = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            targets += [module] + [f"{module}.{a.name}" for a in node.names]
    found = set()
    for t in targets:
        while t and t not in known:  # "minillm.core.scheduler.Scheduler" -> "minillm.core.scheduler"
            t = t.rpartition(".")[0]
        if t and t != name and not name.startswith(t + "."):
            found.add(t)
    return found


def import_graph() -> dict[str, set[str]]:
    known = package_modules()
    return {name: imported_modules(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_is_read_from_the_source():
    graph = import_graph()
    assert "minillm.core.scheduler" in graph["minillm.engine"]
    assert "minillm.model.llama" in graph["minillm.model.loader"]  # relative: from .llama import ...
    assert "minillm.model.loader" in graph["minillm.engine"]  # from .model.loader import ...
    assert "minillm_kernels.ops" in graph["minillm.worker.model_runner"]  # inside a function
    assert "minillm_kernels._triton_setup" in graph["minillm_kernels.attention"]  # relative, in kernels/


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "modules that import each other in a circle (imports inside functions count too): " + "; ".join(
        " <-> ".join(c) for c in found
    )


def test_the_kernels_do_not_import_the_engine():
    graph = import_graph()
    upward = sorted(
        (m, d)
        for m, deps in graph.items()
        if m.startswith("minillm_kernels.")
        for d in deps
        if d.startswith("minillm.")
    )
    assert not upward, f"kernels/ imports minillm: {upward}"


FRONT_DOOR = ("minillm.llm", "minillm.async_llm", "minillm.serve")
BELOW_THE_FRONT_DOOR = (
    "minillm.core",
    "minillm.worker",
    "minillm.spec",
    "minillm.sim",
    "minillm.analysis",
    "minillm.model",
    "minillm.engine",
)


def test_nothing_below_the_front_door_imports_it():
    """The engine and everything it is built from (and the simulator, which drives the engine) never
    import the front door (``LLM``, ``AsyncLLM``, the server): requests come in from above."""
    graph = import_graph()
    upward = sorted(
        (m, d)
        for m, deps in graph.items()
        if m.startswith(BELOW_THE_FRONT_DOOR)
        for d in deps
        if d.startswith(FRONT_DOOR)
    )
    assert not upward, f"imports of the front door from below it: {upward}"


# --- components are configured, never patched from outside -------------------------------------------

COMPONENTS = {"engine", "executor", "scheduler", "kv", "runner", "speculator", "sampler", "policy", "proposer", "clock"}
ENGINE_NAMES = {"e", "eng", "engine", "llm", "runner", "executor", "scheduler", "kv"}


def attribute_assignments(path: Path) -> list[tuple[int, str]]:
    """``x.engine.attr = ...``-shaped assignments in ``path``: an attribute set on an engine component
    (through a name like ``engine`` / ``llm`` / ``runner``, or through a component attribute on the way),
    anywhere but on ``self``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        for t in targets:
            for target in t.elts if isinstance(t, ast.Tuple) else [t]:
                chain, n = [], target
                while isinstance(n, ast.Attribute):
                    chain.append(n.attr)
                    n = n.value
                if not (chain and isinstance(n, ast.Name)) or n.id == "self":
                    continue
                chain = [n.id] + chain[::-1]
                if chain[0] in ENGINE_NAMES or set(chain[1:-1]) & COMPONENTS:
                    out.append((node.lineno, ".".join(chain)))
    return out


def test_the_assignment_finder_finds_patching(tmp_path):
    p = tmp_path / "x.py"
    p.write_text(
        "llm.engine.executor.verify = f\ne.kv = m\nself.kv = m\nfig.layout.title = 't'\n"
        "def g(engine):\n    engine.scheduler.watermark_blocks += 1\n"
    )
    assert attribute_assignments(p) == [
        (1, "llm.engine.executor.verify"),
        (2, "e.kv"),
        (6, "engine.scheduler.watermark_blocks"),
    ]


OUTSIDE = [
    p
    for d in ("exercises", "solutions", "notebooks", "minillm/bench", "minillm/viz")
    for p in sorted((ROOT / d).rglob("*.py"))
]


@pytest.mark.parametrize("path", OUTSIDE, ids=[str(p.relative_to(ROOT)) for p in OUTSIDE])
def test_nothing_outside_the_engine_assigns_into_its_components(path):
    """Exercises, notebooks, benchmarks and widgets configure the engine (``LLM(policy=...)``,
    ``LLM(kv_manager=...)``, ``LLM(acceptance_rule=...)``, ``LLM(record=...)``); they never set an
    attribute on one of its components."""
    found = attribute_assignments(path)
    assert not found, f"{path.relative_to(ROOT)} assigns into engine components: {found}"


@pytest.mark.parametrize("name,path", sorted(package_modules().items()))
def test_every_module_says_what_it_is_for(name, path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    if not tree.body:  # an empty package marker
        return
    doc = ast.get_docstring(tree)
    assert doc and len(doc.split()) >= 5, f"{name} ({path.relative_to(ROOT)}) has no opening docstring"


def module_table() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    start = text.index("| module | what it teaches |")
    return text[start : text.index("\n\n", start)]


def test_the_module_map_names_every_module():
    """Each module of ``minillm/`` and of its sub-packages (the command-line ones, ``serve/`` and ``bench/``,
    and the model's, by their folder) and ``kernels/`` has a row in the module map of ``docs/architecture.md``,
    so a reader finds where each concept lives."""
    table = module_table()
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    named = " ".join(line.split("|")[1] for line in rows)
    missing = []
    for path in sorted((ROOT / "minillm").rglob("*.py")):
        rel = path.relative_to(ROOT / "minillm")
        if path.name.startswith("_") or rel.parts[0] == "checkpoints":
            continue
        if rel.parts[0] in ("serve", "bench", "model"):
            if f"minillm/{rel.parts[0]}/" not in named:
                missing.append(f"minillm/{rel.parts[0]}/")
            continue
        package = "minillm/" + "".join(f"{d}/" for d in rel.parts[:-1])
        row = next(
            (
                r
                for r in rows
                if package + path.name in r or (package in r.split("|")[1] and f"`{path.name}`" in r.split("|")[1])
            ),
            None,
        )
        if row is None:
            missing.append(str(path.relative_to(ROOT)))
    if "`kernels/`" not in named:
        missing.append("kernels/")
    assert not missing, f"modules without a row in docs/architecture.md's module map: {missing}"


# --- the reading path of one step ----------------------------------------------------------------------

READING_PATH = [
    "minillm/core/request.py",
    "minillm/core/block_pool.py",
    "minillm/core/kv_cache.py",
    "minillm/core/scheduler.py",
    "minillm/worker/model_runner.py",
    "minillm/model/llama.py",
    "minillm/engine.py",
]


def function_lengths(path: Path) -> dict[str, int]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {
        f.name: f.end_lineno - f.lineno + 1
        for f in ast.walk(tree)
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


@pytest.mark.parametrize("name", READING_PATH)
def test_no_function_on_the_reading_path_is_longer_than_60_lines(name):
    """A reader follows one step from the request through the block pool, the KV cache, the scheduler,
    the runner and the model to the engine: every function on that path fits on a screen."""
    long = {f: n for f, n in function_lengths(ROOT / name).items() if n > 60}
    assert not long, f"{name}: functions longer than 60 lines: {long}"


def test_engine_step_reads_as_the_loop():
    """``LLMEngine.step`` is schedule -> execute -> update -> record, short enough to read at a glance."""
    tree = ast.parse((ROOT / "minillm/engine.py").read_text(encoding="utf-8"))
    engine = next(c for c in tree.body if isinstance(c, ast.ClassDef) and c.name == "LLMEngine")
    step = next(f for f in engine.body if isinstance(f, ast.FunctionDef) and f.name == "step")
    assert step.end_lineno - step.lineno + 1 <= 30


# --- components keep written contracts: nothing probes what an object happens to have ----------------

PROBED = sorted((ROOT / "minillm/core").glob("*.py")) + [ROOT / "minillm/engine.py"]
# (file, the call as written): why it is not a probe of a component. Everything else is: a component's
# contract is a typing.Protocol (minillm/executor.py, core/kv_manager.py, core/policies.py,
# spec/speculative.py) and what it can do beyond that, a declared capability (``supports_swapping``).
ALLOWED_PROBES = {
    (
        "minillm/engine.py",
        'getattr(self.hf_config, "eos_token_id", None)',
    ): "a model's config.json need not name an EOS token (data, not a component)",
    (
        "minillm/core/policies.py",
        "getattr(r, attr)",
    ): "HistoryPredictor(key='tenant' | 'priority') reads the request field it was told to, by name",
    (
        "minillm/core/kv_manager.py",
        "getattr(kv, flag)",
    ): "check_kv_manager reads each capability CAPABILITIES declares, by its name, to check it",
    (
        "minillm/core/preemption.py",
        'getattr(cm, "kv_bytes_per_token", 0)',
    ): "EngineConfig.cost_model may be any object with step_time: one that knows no KV size makes the "
    "preemption cost rule fall back to recompute",
    (
        "minillm/core/request.py",
        "getattr(self, f)",
    ): "Request.snapshot saves every field __slots__ names, by name: the undo log cannot miss one",
    ("minillm/core/request.py", "getattr(m, f)"): "(the same, for the request's metrics)",
    (
        "minillm/core/scheduler.py",
        'getattr(type(self.policy), "order_waiting", None)',
    ): "the FCFS pass walks the queue itself when the policy's class keeps Policy's order (a wrapper that "
    "forwards attributes to a policy has no order_waiting on its class)",
}


def probes(path: Path) -> list[tuple[int, str]]:
    """Every ``hasattr(...)`` / ``getattr(...)`` call in ``path``: (line, the call as written)."""
    text = path.read_text(encoding="utf-8")
    return [
        (node.lineno, ast.get_source_segment(text, node))
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr")
    ]


def test_the_probe_finder_finds_probes(tmp_path):
    p = tmp_path / "x.py"
    p.write_text("if hasattr(kv, 'fork'):\n    f = getattr(e.executor, 'close', None)\nx.getattr(1)\n")
    assert probes(p) == [(1, "hasattr(kv, 'fork')"), (2, "getattr(e.executor, 'close', None)")]


@pytest.mark.parametrize("path", PROBED, ids=[str(p.relative_to(ROOT)) for p in PROBED])
def test_core_and_engine_never_probe_a_component(path):
    """The scheduler, the KV managers and the engine decide by a component's declared capabilities
    (``kv.supports_prefix_caching``, ``config.runs_model``), never by whether an object has a method."""
    rel = str(path.relative_to(ROOT))
    found = [(line, call) for line, call in probes(path) if (rel, call) not in ALLOWED_PROBES]
    assert not found, f"{rel} probes components with hasattr/getattr: {found}"


# --- structural rules: who may change what ----------------------------------------------------------------

ENGINE = [p for p in sorted((ROOT / "minillm/core").glob("*.py"))] + [ROOT / "minillm/engine.py"]


def declared_attributes(tree: ast.AST) -> set[str]:
    """The attribute names a module's own classes declare: methods, class-level fields (dataclass fields,
    ``__slots__`` entries) and every ``self.x = ...``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for b in node.body:
                if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(b.name)
                elif isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name):
                    names.add(b.target.id)
                elif isinstance(b, ast.Assign):
                    for t in b.targets:
                        if isinstance(t, ast.Name):
                            names.add(t.id)
                    slots = any(isinstance(t, ast.Name) and t.id == "__slots__" for t in b.targets)
                    if slots and isinstance(b.value, (ast.Tuple, ast.List)):
                        names |= {e.value for e in b.value.elts if isinstance(e, ast.Constant)}
        for target in assigned_attributes(node):
            if isinstance(target.value, ast.Name) and target.value.id in ("self", "cls"):
                names.add(target.attr)
    return names


def assigned_attributes(node: ast.AST) -> list[ast.Attribute]:
    """The ``x.attr`` targets a statement assigns (``=``, ``+=``, annotated, tuple unpacking)."""
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    else:
        return []
    flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
    return [t for t in flat if isinstance(t, ast.Attribute)]


def package_trees() -> dict[Path, ast.AST]:
    return {
        p: ast.parse(p.read_text(encoding="utf-8"))
        for folder in PACKAGES.values()
        for p in sorted((ROOT / folder).rglob("*.py"))
    }


def owners(trees: dict[Path, ast.AST]) -> dict[str, set[Path]]:
    """Attribute name -> the modules whose classes declare it."""
    out: dict[str, set[Path]] = {}
    for path, tree in trees.items():
        for name in declared_attributes(tree):
            out.setdefault(name, set()).add(path)
    return out


def foreign_assignments(paths: list[Path], trees: dict[Path, ast.AST]) -> list[str]:
    """``x.attr = ...`` in ``paths`` (``x`` not ``self``) where ``attr`` is an attribute that only other
    modules of the package declare: the module changes another module's object behind its back.
    (Attributes the package never declares belong to libraries: a figure's layout, a torch module.)"""
    who = owners(trees)
    found = []
    for path in paths:
        tree = trees[path]
        own = declared_attributes(tree)
        for node in ast.walk(tree):
            for t in assigned_attributes(node):
                if isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"):
                    continue
                if t.attr not in own and t.attr in who:
                    found.append(f"{path.relative_to(ROOT)}: {ast.unparse(t)}")
    return sorted(found)


def private_accesses(trees: dict[Path, ast.AST]) -> list[str]:
    """``x._attr`` (``x`` not ``self``) where ``_attr`` is declared by other modules only, and
    ``from m import _name`` of the package's own modules: a private name used outside its module."""
    who = owners(trees)
    found = []
    for path, tree in trees.items():
        own = declared_attributes(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue
                if node.attr not in own and node.attr in who:
                    found.append(f"{path.relative_to(ROOT)}: {ast.unparse(node)}")
            elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(tuple(PACKAGES))):
                found += [
                    f"{path.relative_to(ROOT)}: import {a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    return sorted(found)


def test_the_rule_finders_find_what_they_look_for(tmp_path):
    a = tmp_path / "a.py"
    b = tmp_path / "b.py"
    a.write_text(
        "class Req:\n    __slots__ = ('status', '_seen')\n    def go(self):\n        self.status = 1\n"
        "        self._seen = 0\n    def _hide(self):\n        pass\n"
    )
    b.write_text(
        "from .a import _hide\ndef f(req, fig):\n    req.status = 2\n    fig.layout = 3\n    req._seen += 1\n"
        "    return req._hide, req.status\n"
    )
    trees = {p: ast.parse(p.read_text()) for p in (a, b)}
    global ROOT
    root, ROOT = ROOT, tmp_path
    try:
        assert foreign_assignments([a, b], trees) == ["b.py: req._seen", "b.py: req.status"]
        assert private_accesses(trees) == ["b.py: import _hide", "b.py: req._hide", "b.py: req._seen"]
    finally:
        ROOT = root


def test_no_engine_module_assigns_into_another_modules_objects():
    """In the engine (``minillm/core``, ``engine.py``) an object's fields change only through code of the
    module that defines it: a request's state through ``Request``'s transition methods, a scheduler
    output through its own methods, a record through its constructor."""
    found = foreign_assignments(ENGINE, package_trees())
    assert not found, f"assignments into another module's objects: {found}"


def test_no_private_attribute_is_used_outside_its_module():
    """A name that starts with ``_`` is its module's own business: no other module of ``minillm`` or
    ``kernels`` reads, calls or imports it (a name another module needs is public and documented)."""
    found = private_accesses(package_trees())
    assert not found, f"private names used outside their module: {found}"


# The simulator's fast path (``minillm/sim/fast_forward.py``) steps the engine as ``engine.step()`` does: around a
# step it advances the counters ``engine.step()`` advances (the engine's step count, the scheduler's pass count
# and clock), and nothing else of another module's objects.
SIM_STEP_COUNTERS = ["minillm/sim/fast_forward.py: e.step_count"]


def test_the_simulator_changes_requests_only_through_their_transitions():
    """The simulator (``minillm/sim``) drives the engine from outside: a request changes only through its own
    and the scheduler's transition methods (``Request.append_tokens``, ``Scheduler.admit`` / ``finish``), a
    block table only through the KV manager (``kv.allocate``), and results and metrics are built through
    their constructors; the only fields it sets on another module's objects are the step counters."""
    found = foreign_assignments(sorted((ROOT / "minillm/sim").glob("*.py")), package_trees())
    assert found == sorted(SIM_STEP_COUNTERS), (
        f"minillm/sim assigns into another module's objects: {sorted(set(found) - set(SIM_STEP_COUNTERS))}"
    )


# --- one home per rule ---------------------------------------------------------------------------------------


def calls_in(path: Path) -> list[tuple[str, str]]:
    """(enclosing function, called expression) for every call in ``path``."""
    out = []
    for f in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(f):
                if isinstance(node, ast.Call):
                    out.append((f.name, ast.unparse(node.func)))
    return out


TRANSITIONS = {
    "admit",
    "preempt",
    "swap_in",
    "reject",
    "finish",
    "finish_request",
    "fork",
    "update_from_output",
    "_settle_guesses",
}


def test_only_the_scheduler_transitions_write_the_undo_log():
    """A request's life has one owner: the scheduler's transition methods are the only code that saves a
    request in the step's undo log (``journal.save`` / ``save_progress``), each before it changes the
    request, so a rollback cannot miss a change."""
    writers = {
        (path.relative_to(ROOT).as_posix(), fn)
        for path in sorted((ROOT / "minillm").rglob("*.py"))
        for fn, call in calls_in(path)
        if call.endswith(("journal.save", "journal.save_progress"))
    }
    assert writers and {fn for _, fn in writers} <= TRANSITIONS, sorted(writers)
    assert {p for p, _ in writers} == {"minillm/core/scheduler.py"}, sorted(writers)


def test_the_prefill_decode_rule_has_one_home():
    """``Request.is_decoding`` is the one prefill/decode rule; nothing else compares a request's computed
    positions with its newest token's position, and every "decode" label is read off that rule."""
    homes = set()
    for path in sorted((ROOT / "minillm").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            text = ast.unparse(node) if isinstance(node, (ast.Compare, ast.IfExp)) else ""
            if isinstance(node, ast.Compare) and "num_computed" in text and "num_tokens - 1" in text:
                homes.add(path.relative_to(ROOT).as_posix())
            test = ast.unparse(node.test) if isinstance(node, ast.IfExp) else ""
            if "'decode'" in text and any(f in test for f in ("num_computed", "num_output", "output_token_ids")):
                homes.add(f"{path.relative_to(ROOT).as_posix()}: {text}")  # a label worked out again
    assert homes == {"minillm/core/request.py"}, sorted(homes)


def test_a_preemption_mode_is_one_registry_entry():
    """The preemption modes are ``PREEMPTION_MODES``; the config's choices and the scheduler's counters are
    read from it, so a new mode is one class in ``core/preemption.py`` (here one that sends the victim to
    the back of the queue instead of the front), and nothing else changes."""
    from minillm import LLM, SamplingParams
    from minillm.core import preemption
    from minillm.core.request import RequestStatus

    class ToTheBack(preemption.Recompute):
        name = "back"

        def evict(self, sched, victim, out):
            sched.kv.free(victim)
            sched.counters["recomputed_tokens"] += victim.num_computed_tokens
            sched.writable_waiting().append(victim)
            return RequestStatus.PREEMPTED, False

    preemption.PREEMPTION_MODES["back"] = ToTheBack()
    try:
        llm = LLM(
            "random",
            executor="simulated",
            clock="modeled",
            cost_model=0.01,
            block_size=4,
            num_kv_blocks=12,
            max_num_seqs=4,
            preemption_mode="back",
        )
        for i in range(4):
            llm.engine.add_request(
                list(range(10, 18)), SamplingParams(max_tokens=12, ignore_eos=True), request_id=str(i)
            )
        records = llm.engine.run()
    finally:
        del preemption.PREEMPTION_MODES["back"]
    modes = {e.mode for r in records for e in r.preempted}
    assert modes == {"back"} and llm.engine.stats()["preemptions_back"] > 0
    assert all(r.is_finished and r.num_output_tokens == 12 for r in llm.engine.requests.values())
