"""Re-running a notebook's load cell picks up an edit of the exercise file (``impl.load``).

A student edits ``exercises/exNN_*.py`` and re-runs the cell ``ex = impl.load("exNN_...")``;
the notebooks pass no flag, so ``impl.load`` itself must notice the change.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from minillm import impl

ROOT = Path(__file__).resolve().parent.parent

STUB = """
from dataclasses import dataclass


@dataclass
class Answer:
    value: int


def answer():
    raise NotImplementedError("ex01.answer")
"""


RAISE = 'raise NotImplementedError("ex01.answer")'


def _edit(path: Path, body: str) -> None:
    """Put ``body`` in place of the stub's ``raise``, keeping the file's size and mtime (the worst case
    for a cache keyed on them, as Python's .pyc files are)."""
    st = path.stat()
    path.write_text(STUB.replace(RAISE, body.ljust(len(RAISE))))
    assert path.stat().st_size == st.st_size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.fixture
def demo(tmp_path) -> Path:
    """An implementation directory (``MINILLM_IMPL=<dir>``) holding one stub, ``ex01_demo.py``."""
    d = tmp_path / "impl"
    d.mkdir()
    (d / "ex01_demo.py").write_text(STUB)
    return d / "ex01_demo.py"


def test_an_edit_is_picked_up_by_the_next_load(demo):
    path, d = demo, demo.parent
    first = impl.load("ex01_demo", str(d))
    with pytest.raises(NotImplementedError):
        first.answer()
    assert impl.load("ex01_demo", str(d)) is first, "an unchanged file is not executed again"

    _edit(path, "return Answer(1)")
    second = impl.load("ex01_demo", str(d))
    assert second is not first
    assert second.answer() == second.Answer(1)
    assert sys.modules[second.__name__] is second

    _edit(path, "return Answer(2)")
    assert impl.load("ex01_demo", str(d)).answer().value == 2


def test_a_broken_edit_raises_and_keeps_the_last_good_module(demo):
    path, d = demo, demo.parent
    good = impl.load("ex01_demo", str(d))
    path.write_text(STUB + "\ndef broken(:\n")
    with pytest.raises(SyntaxError):
        impl.load("ex01_demo", str(d))
    assert sys.modules[good.__name__] is good
    path.write_text(STUB.replace(RAISE, "return Answer(3)"))
    assert impl.load("ex01_demo", str(d)).answer().value == 3


def test_the_exercises_package_picks_up_an_edit(tmp_path, monkeypatch):
    """``MINILLM_IMPL=exercises`` loads ``exercises.exNN_*`` from the checkout: the same rule holds there."""
    checkout = tmp_path / "checkout"
    (checkout / "exercises").mkdir(parents=True)
    shutil.copy(ROOT / "exercises" / "__init__.py", checkout / "exercises" / "__init__.py")
    path = checkout / "exercises" / "ex01_demo.py"
    path.write_text(STUB)
    monkeypatch.setattr(impl, "REPO_ROOT", checkout)
    monkeypatch.setattr(sys, "path", [str(checkout)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT])
    saved = {m: sys.modules.pop(m) for m in list(sys.modules) if m == "exercises" or m.startswith("exercises.")}
    try:
        _edit_the_exercises_package(path)
    finally:
        for m in [m for m in sys.modules if m == "exercises" or m.startswith("exercises.")]:
            del sys.modules[m]
        sys.modules.update(saved)


def _edit_the_exercises_package(path: Path) -> None:
    first = impl.load("ex01_demo", "exercises")
    assert first.__name__ == "exercises.ex01_demo" and Path(first.__file__) == path
    _edit(path, "return Answer(4)")
    second = impl.load("ex01_demo", "exercises")
    assert second.answer().value == 4
    assert sys.modules["exercises"].ex01_demo is second


def test_reload_true_executes_an_unchanged_file_again(demo):
    first = impl.load("ex01_demo", str(demo.parent))
    assert impl.load("ex01_demo", str(demo.parent), reload=True) is not first


def test_every_notebook_loads_its_exercises_through_impl_load():
    """Each exercise module is loaded by a notebook's code cell through ``impl.load`` (which notices edits)."""
    import nbformat

    loaded = set()
    for nb_path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(nb_path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                loaded |= set(re.findall(r'impl\.load\("(ex\d\d[a-z]?_\w+)"', cell.source))
                assert "importlib" not in cell.source, f"{nb_path.name}: load exercises with impl.load only"
    modules = {p.stem for p in (ROOT / "solutions").glob("ex*.py")}
    assert modules <= loaded, f"no notebook code cell loads {sorted(modules - loaded)} with impl.load"
