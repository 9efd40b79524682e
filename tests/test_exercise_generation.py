"""The exercise machinery: solutions/ is the single source of truth, exercises/ is generated
from it, and no grader can pass on an untouched stub.

* ``exercises/`` is exactly what ``scripts/make_exercises.py`` generates from ``solutions/``
  (a file a student has edited is left alone locally; with ``CI`` set it must match too);
* every ``solutions/exNN_*.py`` has graders (``tests/graders/exNN_*.py``) and a registered
  ``exNN`` marker;
* run against freshly generated stubs, every grader fails, and fails with the
  ``NotImplementedError`` of its own notebook's exercise;
* the worked examples in the docstrings (``>>>`` lines) hold for the reference answers, so the
  example a student reads in a stub is right;
* in the notebooks, every exercise's description is followed by optional hints (collapsed
  ``<details>`` cells): the docstrings state contracts, the step-by-step help lives there.
"""

from __future__ import annotations

import doctest
import importlib.util
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from minillm import impl

pytestmark = pytest.mark.slow  # generates the stubs and grades them in subprocesses

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = ROOT / "solutions"
EXERCISES = ROOT / "exercises"
GRADERS = ROOT / "tests" / "graders"


def _script():
    spec = importlib.util.spec_from_file_location("make_exercises", ROOT / "scripts" / "make_exercises.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MK = _script()
MODULES = [p for p in MK.source_files(SOLUTIONS)]


@pytest.mark.parametrize("src", MODULES, ids=[p.name for p in MODULES])
def test_exercises_folder_is_what_the_script_generates(src):
    dst = EXERCISES / src.name
    assert dst.exists(), f"exercises/{src.name} is missing: run `make exercises`"
    have = dst.read_text(encoding="utf-8")
    want = MK.generate(src)
    if have != want and MK.is_edited(have) and not os.environ.get("CI"):
        pytest.skip(f"exercises/{src.name} has been edited (your work): not compared with the generated stubs")
    assert have == want, (
        f"exercises/{src.name} is not what scripts/make_exercises.py generates from "
        f"solutions/{src.name}: run `make exercises` (after editing solutions/, never exercises/)"
    )


@pytest.mark.parametrize("src", [p for p in MODULES if p.name != "__init__.py"], ids=lambda p: p.name)
def test_docstring_examples_hold_for_the_reference(src):
    mod = impl.load(src.stem, "solutions")
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    examples = 0
    for test in finder.find(mod, src.stem):
        test.globs = dict(vars(mod))
        runner.run(test)
        examples += len(test.examples)
    if not examples:
        pytest.skip(f"solutions/{src.name}: its worked examples are in prose, no >>> lines")
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"solutions/{src.name}: {result.failed} of {examples} docstring examples fail (above)"


NOTEBOOKS = sorted((ROOT / "notebooks").glob("0[1-9]*_*.ipynb"))  # 01 .. 07, 03b


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_every_exercise_description_is_followed_by_hints(path):
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    text = ["".join(c["source"]) if isinstance(c["source"], list) else c["source"] for c in cells]
    described = [
        i
        for i, (c, t) in enumerate(zip(cells, text))
        if c["cell_type"] == "markdown" and re.search(r"^\*\*Exercise\b|^\*\*`\w+`", t, re.M)
    ]
    assert described, f"{path.name}: no exercise description (a markdown cell with **Exercise ...**)"
    for i in described:
        nxt = text[i + 1] if i + 1 < len(cells) and cells[i + 1]["cell_type"] == "markdown" else ""
        assert "<details><summary>Hint 1</summary>" in nxt, (
            f"{path.name}, cell {i} ({text[i][:60]!r}...): the next cell should hold its hints, "
            "<details><summary>Hint 1</summary>...</details> (in the notebook's .py source)"
        )
        assert nxt.count("<details>") == nxt.count("</details>"), f"{path.name}, cell {i + 1}: unbalanced <details>"


def test_every_exercise_module_has_graders_and_a_marker(pytestconfig):
    markers = {m.split(":")[0].strip() for m in pytestconfig.getini("markers")}
    graders = {p.name for p in GRADERS.glob("ex*.py")}
    for src in MODULES:
        if src.name == "__init__.py":
            continue
        ex = src.name.split("_")[0]  # ex03, ex03b
        assert src.name in graders, f"solutions/{src.name} has no graders: add tests/graders/{src.name}"
        assert ex in markers, f"marker {ex!r} is not registered in pyproject.toml [tool.pytest.ini_options]"
    for g in graders:
        assert (SOLUTIONS / g).exists(), f"tests/graders/{g} grades a module that solutions/ does not have"


def test_stubs_name_their_exercise():
    text = MK.strip_solutions(
        "def f(x):\n    '''doc'''\n    ### BEGIN SOLUTION\n    return x\n    ### END SOLUTION\n\n"
        "class A:\n    def g(self):\n        if True:\n            ### BEGIN SOLUTION\n            pass\n"
        "            ### END SOLUTION\n        return 1\n",
        "ex07_demo.py",
    )
    assert "return x" not in text and "pass\n" not in text
    assert "    raise NotImplementedError('ex07.f: " in text
    assert "            raise NotImplementedError('ex07.A.g: " in text
    ns: dict = {}
    exec(compile(text, "ex07_demo.py", "exec"), ns)
    with pytest.raises(NotImplementedError, match=r"^ex07\.f: .*make grade EX=07"):
        ns["f"](1)


@pytest.mark.parametrize(
    "bad, why",
    [
        ("def f():\n    ### BEGIN SOLUTION\n    return 1\n", "never closed"),
        ("def f():\n    pass\n    ### END SOLUTION\n", "without"),
        ("def f():\n    ### BEGIN SOLUTION\n    ### BEGIN SOLUTION\n    pass\n    ### END SOLUTION\n", "inside"),
        ("### BEGIN SOLUTION\nx = 1\n### END SOLUTION\n", "inside a function"),
        ("def f():\n    ### BEGIN SOLUTION: hint\n    return 1\n    ### END SOLUTION\n", "malformed"),
    ],
)
def test_bad_markers_are_refused(bad, why):
    with pytest.raises(MK.MarkerError, match=why):
        MK.strip_solutions(bad, "ex07_demo.py")


def test_edits_are_detected_and_kept(tmp_path):
    src = SOLUTIONS / "ex01_batching.py"
    text = MK.generate(src)
    assert not MK.is_edited(text)
    assert MK.is_edited(text.replace("raise NotImplementedError(", "return 0  # (", 1))
    # The script keeps an edited file and regenerates an untouched one.
    out = tmp_path / "ex"
    assert MK.main(["--out", str(out)]) == 0
    assert (out / "ex01_batching.py").read_text() == text


def test_impl_loader_respects_minillm_impl(monkeypatch):
    monkeypatch.setenv(impl.ENV, "solutions")
    assert Path(impl.load("ex01_batching").__file__).parent == SOLUTIONS
    assert Path(impl.load("ex01_batching", "exercises").__file__).parent == EXERCISES
    first = impl.load("ex01_batching", "solutions")
    assert impl.load("ex01_batching", "solutions") is first, "a module is loaded once per process"
    old = first.plan_step
    assert impl.load("ex01_batching", "solutions", reload=True).plan_step is not old, "reload=True reads the file again"
    monkeypatch.delenv(impl.ENV)
    assert impl.which() == "exercises", "without MINILLM_IMPL a notebook must use the student's code"
    with pytest.raises(FileNotFoundError, match="MINILLM_IMPL"):
        impl.load("ex01_batching", "no-such-implementation")
    with pytest.raises(ModuleNotFoundError, match="ex99_nothing"):
        impl.load("ex99_nothing", "solutions")


def test_attempt_turns_a_stub_into_one_line(capsys):
    with impl.attempt("demo"):
        raise NotImplementedError("ex01.demo: not written yet")
    assert "demo: not implemented yet (ex01.demo: not written yet)" in capsys.readouterr().out


def test_every_grader_fails_on_the_untouched_stubs(tmp_path):
    """Graders run against fresh stubs (never against your edited exercises/): each must fail,
    with the NotImplementedError of its own exercise, so none can pass by accident."""
    stubs = tmp_path / "stubs"
    assert MK.main(["--out", str(stubs)]) == 0
    report = tmp_path / "report.xml"
    env = dict(os.environ, MINILLM_IMPL=str(stubs), HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "tests/test_exercises.py",
            "-q",
            "-p",
            "no:cacheprovider",
            "--tb=no",
            f"--junitxml={report}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert report.exists(), f"pytest did not run:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    cases = ET.parse(report).getroot().iter("testcase")
    seen, problems = 0, []
    for case in cases:
        seen += 1
        name = case.get("name")
        failure = case.find("failure")
        ex = name[len("test_") :].split("_")[0] if name.startswith("test_ex") else "?"
        if failure is None:
            state = "passed" if case.find("skipped") is None and case.find("error") is None else "skipped/errored"
            problems.append(f"{name}: {state} on the untouched stubs")
            continue
        msg = (failure.get("message") or "") + (failure.text or "")
        if "NotImplementedError" not in msg:
            problems.append(f"{name}: failed, but not with NotImplementedError: {msg[:300]}")
        elif f"{ex}." not in msg:
            problems.append(f"{name}: the NotImplementedError does not name an {ex} exercise: {msg[:300]}")
    assert seen > 0, f"no grader ran:\n{proc.stdout[-3000:]}"
    assert not problems, "\n".join(problems)
