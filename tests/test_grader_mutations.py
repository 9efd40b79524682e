"""The graders catch plausible wrong answers (mutation testing of tests/graders/).

For every exercise module, ``tests/mutants/exNN_*.py`` lists *mutants*: the reference answer
(``solutions/exNN_*.py``) with one realistic mistake, written as a source patch (``old`` text ->
``new`` text, each ``old`` found exactly once). Each mutant is written into a fresh directory
beside copies of the other solutions, ``MINILLM_IMPL`` points at that directory, and the module's
graders run against it in this process, in file order, until one fails. A mutant that passes every
grader is a wrong answer a student could hand in: the test fails and names it.

Two controls keep the harness honest: the unmodified reference, loaded the same way, passes every
grader (so a "caught" mutant is caught by its mistake, not by the set-up), and every mutant file
holds at least ``MIN_MUTANTS`` variants touching every graded function (the marked parts of the
module). The untouched stubs failing every grader is checked in test_exercise_generation.py.
"""

from __future__ import annotations

import ast
import itertools
import re
import runpy
import shutil
import signal
from pathlib import Path

import pytest
import torch

import test_exercises as collector
from minillm import impl

pytestmark = pytest.mark.slow  # every grader against the reference and against each wrong answer

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = ROOT / "solutions"
MUTANTS = Path(__file__).resolve().parent / "mutants"
MIN_MUTANTS = 8
HANG_S = 300  # a mutant that makes a grader loop forever is reported, not waited for


MK = runpy.run_path(str(ROOT / "scripts" / "make_exercises.py"))  # its functions, by name


def _modules() -> list[str]:
    return [p.stem for p in sorted(SOLUTIONS.glob("ex*.py"))]


def _mutants(module: str) -> list:
    path = MUTANTS / f"{module}.py"
    return list(runpy.run_path(str(path))["MUTANTS"]) if path.exists() else []


def _cases():
    for module in _modules():
        for m in _mutants(module):
            yield pytest.param(module, m, id=f"{module.split('_')[0]}-{m[0]}")


def _patches(mutant) -> list[tuple[str, str]]:
    _, *pairs = mutant
    if len(pairs) == 2 and isinstance(pairs[0], str):
        return [(pairs[0], pairs[1])]
    return [tuple(p) for p in pairs[0]]


def apply(text: str, mutant) -> str:
    """``text`` with the mutant's patches applied; each ``old`` must occur exactly once."""
    for old, new in _patches(mutant):
        n = text.count(old)
        if n != 1:
            raise AssertionError(
                f"mutant {mutant[0]!r}: {old!r} occurs {n} times in the solution (must be once): "
                "update tests/mutants/ after editing solutions/"
            )
        text = text.replace(old, new)
    return text


def _grader_calls(module: str):
    """(test name, zero-argument callable) for every grader of ``module``, parametrizations expanded."""
    path = next(p for ex, p in collector.grader_modules() if p.stem == module)
    mod = collector._load(path)
    for name, fn in vars(mod).items():
        if not (name.startswith("test_") and callable(fn)):
            continue
        grids = []
        for mark in reversed(getattr(fn, "pytestmark", [])):
            if mark.name != "parametrize":
                continue
            names = mark.args[0]
            names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
            rows = []
            for v in mark.args[1]:
                v = v.values if hasattr(v, "values") and hasattr(v, "marks") else v
                v = v if len(names) > 1 else (v[0] if isinstance(v, tuple) and len(v) == 1 else v,)
                rows.append(dict(zip(names, v)))
            grids.append(rows)
        for combo in itertools.product(*grids):
            kwargs = {k: v for row in combo for k, v in row.items()}
            label = name + (f"[{'-'.join(str(v) for v in kwargs.values())}]" if kwargs else "")
            yield label, (lambda fn=fn, kw=kwargs: fn(**kw))


class _Hung(BaseException):
    pass


def _on_alarm(signum, frame):
    raise _Hung()


_GENERIC = {"policy", "allocator", "step", "time", "self", "the"}


def _words(name: str) -> set[str]:
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()
    return {w for w in re.split(r"[^a-z0-9]+", snake) if len(w) >= 3 and w not in _GENERIC}


def _about(label: str, qualnames: set[str]) -> bool:
    """Is the grader ``label`` (a test name) likely about one of ``qualnames``? Only an ordering
    hint: graders that look related run first, so a mutant usually fails within a test or two."""
    want = set().union(*(_words(q) for q in qualnames)) if qualnames else set()
    have = _words(label.split("[")[0].removeprefix("test_"))
    return any(a.startswith(b) or b.startswith(a) for a in want for b in have)


def run_graders(
    module: str, impl_dir: Path, monkeypatch, about: frozenset = frozenset()
) -> list[tuple[str, BaseException]]:
    """Run ``module``'s graders against the modules in ``impl_dir``, those ``about`` the given
    functions first; stop at the first failure. Returns [(test, exception)] (empty: all passed)."""
    monkeypatch.setenv(impl.ENV, str(impl_dir))
    timer = hasattr(signal, "SIGALRM")
    if timer:
        old = signal.signal(signal.SIGALRM, _on_alarm)
        signal.alarm(HANG_S)
    try:
        calls = sorted(_grader_calls(module), key=lambda lc: not _about(lc[0], about))
        for label, call in calls:
            torch.manual_seed(0)
            try:
                call()
            except _Hung:
                raise
            except (Exception, pytest.fail.Exception) as e:  # AssertionError, pytest.raises' Failed, ...
                return [(label, e)]
        return []
    except _Hung:
        return [("(every grader)", TimeoutError(f"still running after {HANG_S} s"))]
    finally:
        if timer:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)


def _write_impl(tmp: Path, module: str, text: str) -> Path:
    d = tmp / "impl"
    d.mkdir()
    for p in SOLUTIONS.glob("*.py"):
        shutil.copy(p, d / p.name)
    (d / f"{module}.py").write_text(text, encoding="utf-8")
    return d


HARNESS_ERRORS = (NotImplementedError, SyntaxError, ImportError, NameError, TimeoutError)


def _touched(text: str, mutant) -> set[str]:
    """The functions (``Class.method`` or ``function``) a mutant's patches fall in."""
    spans = MK["_enclosing_names"](ast.parse(text))
    return {MK["_qualname_at"](spans, text.count("\n", 0, text.index(old)) + 1) for old, _ in _patches(mutant)}


@pytest.mark.parametrize("module", _modules())
def test_every_module_keeps_enough_mutants_covering_each_graded_function(module):
    mutants = _mutants(module)
    assert len(mutants) >= MIN_MUTANTS, (
        f"tests/mutants/{module}.py holds {len(mutants)} mutants; keep at least "
        f"{MIN_MUTANTS} plausible wrong answers per exercise module"
    )
    names = [m[0] for m in mutants]
    assert len(set(names)) == len(names), f"tests/mutants/{module}.py: two mutants share a name"
    text = (SOLUTIONS / f"{module}.py").read_text(encoding="utf-8")
    stub = MK["strip_solutions"](text, f"{module}.py")
    graded = set(re.findall(r"NotImplementedError\('ex\d\d[a-z]?\.([\w.]+):", stub))
    for m in mutants:
        apply(text, m)  # every patch applies exactly once
    touched = set().union(*(_touched(text, m) for m in mutants))
    missing = sorted(graded - touched)
    assert not missing, f"tests/mutants/{module}.py: no mutant touches {missing}"


@pytest.mark.parametrize("module", _modules())
def test_the_reference_passes_the_graders_when_loaded_like_a_mutant(module, tmp_path, monkeypatch):
    d = _write_impl(tmp_path, module, (SOLUTIONS / f"{module}.py").read_text(encoding="utf-8"))
    failed = run_graders(module, d, monkeypatch)
    assert not failed, f"the unmodified reference fails {failed[0][0]}: {failed[0][1]!r}"


@pytest.mark.parametrize("module, mutant", list(_cases()))
def test_every_mutant_fails_its_graders(module, mutant, tmp_path, monkeypatch):
    reference = (SOLUTIONS / f"{module}.py").read_text(encoding="utf-8")
    text = apply(reference, mutant)
    compile(text, f"{module}.py", "exec")
    d = _write_impl(tmp_path, module, text)
    failed = run_graders(module, d, monkeypatch, frozenset(_touched(reference, mutant)))
    assert failed, (
        f"the graders of {module} pass a wrong answer: {mutant[0]}\n(patch: {_patches(mutant)})\n"
        f"Add a grader case that fails it."
    )
    label, err = failed[0]
    assert not isinstance(err, HARNESS_ERRORS), (
        f"mutant {mutant[0]!r} failed {label} with {err!r}: a set-up error, not the mistake; fix the mutant"
    )
