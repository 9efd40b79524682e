"""The engine's shape, checked: imports go one way, components are configured (never patched from
outside), and every module says what it is for.

The import graph is read from the source (``ast``), every ``import`` counted, also those inside
functions: an import deferred into a function body still ties the two modules together.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"minillm": "minillm", "minillm_kernels": "kernels"}   # import name -> folder (pyproject.toml)


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
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            targets += [module] + [f"{module}.{a.name}" for a in node.names]
    found = set()
    for t in targets:
        while t and t not in known:          # "minillm.core.scheduler.Scheduler" -> "minillm.core.scheduler"
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
    assert "minillm.model.llama" in graph["minillm.model.loader"]          # relative: from .llama import ...
    assert "minillm.model.loader" in graph["minillm.engine"]              # from .model.loader import ...
    assert "minillm_kernels.ops" in graph["minillm.worker.model_runner"]          # inside a function
    assert "minillm_kernels._triton_setup" in graph["minillm_kernels.attention"]  # relative, in kernels/


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "modules that import each other in a circle (imports inside functions count too): " + \
        "; ".join(" <-> ".join(c) for c in found)


def test_the_kernels_do_not_import_the_engine():
    graph = import_graph()
    upward = sorted((m, d) for m, deps in graph.items() if m.startswith("minillm_kernels.") for d in deps
                    if d.startswith("minillm."))
    assert not upward, f"kernels/ imports minillm: {upward}"


FRONT_DOOR = ("minillm.llm", "minillm.async_llm", "minillm.serve")
BELOW_THE_FRONT_DOOR = ("minillm.core", "minillm.worker", "minillm.spec", "minillm.sim", "minillm.analysis",
                        "minillm.model", "minillm.engine")


def test_nothing_below_the_front_door_imports_it():
    """The engine and everything it is built from (and the simulator, which drives the engine) never
    import the front door (``LLM``, ``AsyncLLM``, the server): requests come in from above."""
    graph = import_graph()
    upward = sorted((m, d) for m, deps in graph.items() if m.startswith(BELOW_THE_FRONT_DOOR) for d in deps
                    if d.startswith(FRONT_DOOR))
    assert not upward, f"imports of the front door from below it: {upward}"


# --- components are configured, never patched from outside -------------------------------------------

COMPONENTS = {"engine", "executor", "scheduler", "kv", "runner", "speculator", "sampler", "policy", "proposer",
              "clock"}
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
            for target in (t.elts if isinstance(t, ast.Tuple) else [t]):
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
    p.write_text("llm.engine.executor.verify = f\ne.kv = m\nself.kv = m\nfig.layout.title = 't'\n"
                 "def g(engine):\n    engine.scheduler.watermark_blocks += 1\n")
    assert attribute_assignments(p) == [(1, "llm.engine.executor.verify"), (2, "e.kv"),
                                        (6, "engine.scheduler.watermark_blocks")]


OUTSIDE = [p for d in ("exercises", "solutions", "notebooks", "minillm/bench", "minillm/viz")
           for p in sorted((ROOT / d).rglob("*.py"))]


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
    if not tree.body:                       # an empty package marker
        return
    doc = ast.get_docstring(tree)
    assert doc and len(doc.split()) >= 5, f"{name} ({path.relative_to(ROOT)}) has no opening docstring"


def module_table() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    start = text.index("| module | what it teaches |")
    return text[start:text.index("\n\n", start)]


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
        row = next((r for r in rows if package + path.name in r or (package in r.split("|")[1] and
                                                                   f"`{path.name}`" in r.split("|")[1])), None)
        if row is None:
            missing.append(str(path.relative_to(ROOT)))
    if "`kernels/`" not in named:
        missing.append("kernels/")
    assert not missing, f"modules without a row in docs/architecture.md's module map: {missing}"


# --- the reading path of one step ----------------------------------------------------------------------

READING_PATH = ["minillm/core/request.py", "minillm/core/block_pool.py", "minillm/core/kv_cache.py",
                "minillm/core/scheduler.py", "minillm/worker/model_runner.py", "minillm/model/llama.py",
                "minillm/engine.py"]


def function_lengths(path: Path) -> dict[str, int]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {f.name: f.end_lineno - f.lineno + 1 for f in ast.walk(tree)
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}


@pytest.mark.parametrize("name", READING_PATH)
def test_no_function_on_the_reading_path_is_longer_than_60_lines(name):
    """A reader follows one step from the request through the block pool, the KV cache, the scheduler,
    the runner and the model to the engine: every function on that path fits on a screen."""
    long = {f: n for f, n in function_lengths(ROOT / name).items() if n > 60}
    assert not long, f"{name}: functions longer than 60 lines: {long}"


def test_the_reading_path_fits_in_two_thousand_lines():
    """One step's reading path, request to engine, is at most 2,000 lines (nano-vllm, the whole engine:
    about 1,400): each concept the step does not need to show lives in its own module beside it."""
    lines = {name: len((ROOT / name).read_text(encoding="utf-8").splitlines()) for name in READING_PATH}
    assert sum(lines.values()) <= 2000, f"the reading path is {sum(lines.values())} lines: {lines}"


def test_engine_step_reads_as_the_loop():
    """``LLMEngine.step`` is schedule -> execute -> update -> record, short enough to read at a glance."""
    tree = ast.parse((ROOT / "minillm/engine.py").read_text(encoding="utf-8"))
    engine = next(c for c in tree.body if isinstance(c, ast.ClassDef) and c.name == "LLMEngine")
    step = next(f for f in engine.body if isinstance(f, ast.FunctionDef) and f.name == "step")
    assert step.end_lineno - step.lineno + 1 <= 30
