"""Which implementation of the exercises runs: yours (``exercises/``) or the reference (``solutions/``).

Every notebook ends with exercises. Your code lives in ``exercises/exNN_*.py`` (generated
from ``solutions/`` by ``scripts/make_exercises.py``, with each answer replaced by a stub);
the reference answers live in ``solutions/exNN_*.py``. Notebooks and graders never import
either folder directly; they ask this module::

    from minillm import impl
    ex = impl.load("ex01_batching")     # exercises/ex01_batching.py, or solutions/... (see below)

``load`` reads the file on every call and executes it again when it changed, so re-running a
notebook's load cell after an edit picks the edit up (no kernel restart).

Which one is chosen by the environment variable ``MINILLM_IMPL``:

* unset or ``exercises``: your code, in ``exercises/`` (the default: a notebook runs what you wrote);
* ``solutions``: the reference answers (the tests and CI set this);
* a path to a directory: modules from there (the generation test points it at freshly
  generated stubs).

``impl.attempt()`` lets a notebook cell call an exercise that is still a stub without
stopping the notebook: the ``NotImplementedError`` is reported in one line instead. After a
grade that failed the exercise, the cell also offers its worked answer, folded
(``minillm/worked_answers.py``); ``impl.grade("01")`` grades from a cell, and
``impl.show_worked_answer("ex01.kv_cache_bytes")`` opens a worked answer after a failed grade.

A finished exercise plugs into the engine like a built-in, through ``EngineConfig``:
``LLM(policy=ex.MyPolicy())``, ``LLM(kv_manager=...)`` (a factory of KV managers),
``LLM(acceptance_rule=ex.verify)``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import linecache
import os
import subprocess
import sys
import zlib
from pathlib import Path
from types import ModuleType
from typing import Optional

from . import worked_answers

__all__ = ["ENV", "CHOICES", "REPO_ROOT", "which", "impl_dir", "load", "attempt", "grade", "show_worked_answer"]

ENV = "MINILLM_IMPL"
CHOICES = ("exercises", "solutions")
REPO_ROOT = Path(__file__).resolve().parent.parent  # the checkout: minillm/, exercises/, solutions/


def which(impl: Optional[str] = None) -> str:
    """The implementation in force: ``impl`` if given, else ``$MINILLM_IMPL``, else "exercises"."""
    return (impl if impl is not None else os.environ.get(ENV, "")).strip() or "exercises"


def impl_dir(impl: Optional[str] = None) -> Path:
    """The folder the modules are loaded from."""
    name = which(impl)
    if name in CHOICES:
        d = REPO_ROOT / name
    else:
        d = Path(name).expanduser().resolve()
    if not d.is_dir():
        hint = (
            f"choose one of {CHOICES} or a directory"
            if name not in CHOICES
            else "run `make exercises` to generate it"
            if name == "exercises"
            else "is the checkout complete?"
        )
        raise FileNotFoundError(f"{ENV}={name!r}: no directory {d} ({hint})")
    return d


def load(module: str, impl: Optional[str] = None, *, reload: bool = False) -> ModuleType:
    """The exercise module ``module`` (e.g. "ex01_batching") of the implementation in force.

    The file is read on every call: while it is unchanged the module already loaded is returned (the
    same object, so its classes stay the same), and once it changes (you edited it) it is executed
    again. Re-running a notebook's ``impl.load`` cell therefore picks up your edit, in every notebook,
    without restarting the kernel. ``reload=True`` executes the file again even when it is unchanged.

    ``exercises`` and ``solutions`` are loaded as modules of their packages (``exercises.ex01_batching``);
    a directory given by path is loaded under the name ``minillm_impl_<dir checksum>_<module>``.
    """
    name = which(impl)
    d = impl_dir(name)
    path = d / f"{module}.py"
    if not path.is_file():
        available = sorted(p.stem for p in d.glob("ex*.py"))
        raise ModuleNotFoundError(f"{ENV}={name!r}: no {module}.py in {d} (there: {available})")
    if name in CHOICES:
        root = str(REPO_ROOT)
        if root not in sys.path:
            sys.path.insert(0, root)
        package = importlib.import_module(name)
        qual = f"{name}.{module}"
    else:
        package = None
        qual = f"minillm_impl_{zlib.crc32(str(d).encode()):08x}_{module}"
    source = path.read_bytes()
    digest = hashlib.sha256(source).hexdigest()
    loaded = sys.modules.get(qual)
    if loaded is not None and not reload and _loaded_from.get(qual) == (str(path), digest):
        return loaded
    # Executed from the source just read, never from a cached .pyc: an edit within the same second
    # as the previous one (same mtime in the .pyc header) must count too.
    spec = importlib.util.spec_from_file_location(qual, path)
    mod = importlib.util.module_from_spec(spec)
    code = compile(source, str(path), "exec", dont_inherit=True)
    sys.modules[qual] = mod  # dataclasses and pickling look a module up while it executes
    try:
        exec(code, mod.__dict__)
    except BaseException:
        if loaded is not None:
            sys.modules[qual] = loaded
        else:
            sys.modules.pop(qual, None)
        raise
    _loaded_from[qual] = (str(path), digest)
    if package is not None:
        setattr(package, module, mod)
    linecache.checkcache(str(path))  # tracebacks show the lines of the file as it is now
    return mod


_loaded_from: dict[str, tuple[str, str]] = {}  # module name -> (file, sha256 of the source it ran)


@contextlib.contextmanager
def attempt(what: str = ""):
    """Run a notebook cell's exercise call; a stub's NotImplementedError becomes one line.

        with impl.attempt("ex01.completion_times"):
            print(ex.completion_times([100] * 8 + [1000] * 2, max_num_seqs=10))

    ``what`` names the exercise by the functions or classes the cell calls; once a grade has failed
    that exercise, its worked answer is offered under the output, folded (``worked_answers.offer``).
    """
    try:
        yield
    except NotImplementedError as e:
        label = f"{what}: " if what else ""
        print(
            f"{label}not implemented yet ({e}). Fill it in under exercises/, then re-run the "
            f"impl.load cell and this one ({ENV}={which()!r})."
        )
    if what:
        worked_answers.offer(what, impl_dir())


def grade(exercise: str, k: Optional[str] = None) -> list:
    """Grade an exercise from a notebook cell: the report ``make grade EX=NN`` prints (``exercise``: "05"
    or "ex05"; ``k``: only the graders whose names contain it), then the worked answers of the exercises
    it failed, folded. Returns those (``worked_answers.WorkedAnswer``)."""
    mark = exercise if exercise.startswith("ex") else f"ex{exercise}"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        mark,
        "tests/test_exercises.py",
        "--grade",
        "-qq",
        "--no-header",
        "-rN",
        "--tb=no",
        "--disable-warnings",
        "-p",
        "no:cacheprovider",
        "-o",
        "console_output_style=classic",
    ]
    if k:
        cmd += ["-k", k]
    env = {key: v for key, v in os.environ.items() if not key.startswith("PYTEST_")}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, env={**env, ENV: str(impl_dir())})
    print(proc.stdout.rstrip() or proc.stderr.rstrip())
    return worked_answers.offer_failed(mark, impl_dir())


def show_worked_answer(exercise: str, number: Optional[int] = None) -> list:
    """The worked answer of an exercise your last grade failed: ``show_worked_answer("ex05", 1)``, or by
    the label of its cell, ``show_worked_answer("ex05.swap_or_recompute")``. Before a failed grade it
    says how to grade instead."""
    return worked_answers.show(exercise, number, impl_dir())
