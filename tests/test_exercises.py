"""The graders of the notebooks' exercises, one marker per notebook.

    make grade EX=01                                        # your code in exercises/
    MINILLM_IMPL=exercises pytest -m ex01 tests/test_exercises.py   # the same, by hand
    MINILLM_IMPL=solutions pytest tests/test_exercises.py           # the reference answers (CI)

Which implementation is graded is ``minillm.impl``'s choice: ``$MINILLM_IMPL`` when it is set
(``exercises``, ``solutions`` or a directory), else ``solutions`` under pytest (tests/conftest.py).

The graders of notebook NN live in ``tests/graders/exNN_<topic>.py``, next to the module they
grade (``solutions/exNN_<topic>.py``). This file collects every such module: each of its
``test_*`` functions appears here as ``test_exNN_<name>``, marked ``exNN``. A notebook with a second
exercise module names it ``exNNb_<topic>`` (marked ``exNNb``, graded with ``make grade EX=NNb``). A new
notebook's exercises plug in by adding those two files; nothing here changes.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest
from _pytest.assertion.rewrite import rewrite_asserts  # pytest's own assert rewriting, for the graders

pytestmark = pytest.mark.slow  # every exercise's graders inside the engine (make grade EX=NN runs one exercise's)

GRADERS = Path(__file__).resolve().parent / "graders"
GRADER_RE = re.compile(r"^(ex\d\d[a-z]?)_\w+\.py$")


def grader_modules() -> list[tuple[str, Path]]:
    """(exNN, path) of every grader module, in order."""
    return [(m.group(1), p) for p in sorted(GRADERS.glob("ex*.py")) if (m := GRADER_RE.match(p.name))]


def _load(path: Path):
    """A grader module, its ``assert`` statements rewritten as pytest rewrites a test file's, so that a
    failing ``assert got == want`` reports both values (the student sees what was wrong)."""
    name = f"minillm_graders_{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    source = path.read_bytes()
    tree = ast.parse(source, filename=str(path))
    rewrite_asserts(tree, source, str(path))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    exec(compile(tree, str(path), "exec", dont_inherit=True), mod.__dict__)
    return mod


def _collect() -> None:
    here = globals()
    for exercise, path in grader_modules():
        mod = _load(path)
        mark = getattr(pytest.mark, exercise)
        for name, obj in vars(mod).items():
            if name.startswith("test_") and callable(obj):
                alias = f"test_{exercise}_{name[len('test_') :]}"
                if alias in here:
                    raise RuntimeError(f"{path.name}: two graders collected as {alias}")
                here[alias] = mark(obj)


_collect()
