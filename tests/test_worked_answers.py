"""Worked answers (``minillm/worked_answers.py``): every exercise has one, a notebook cell offers it only
after a grade failed that exercise on an attempt, and never before.

The grading report that writes the record is exercised end to end in tests/test_grade_report.py (a wrong
answer opens the exercise's worked answer, an untouched stub and a reference answer open none); here the
record is written by hand."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from minillm import impl, worked_answers
from minillm.worked_answers import GRADES_FILE, exercises_named, offer, worked_answer

ROOT = Path(__file__).resolve().parent.parent
MODULES = sorted(p.stem for p in (ROOT / "solutions").glob("ex*.py"))


def sections(module: str) -> list[int]:
    return sorted(worked_answers._sections(worked_answers.solution_module(module)))


@pytest.mark.parametrize("module", MODULES)
def test_every_exercise_has_a_worked_answer_from_the_reference_code(module):
    numbers = sections(module)
    assert numbers, f"solutions/{module}.py has no '# Exercise N: ...' section"
    source = (ROOT / "solutions" / f"{module}.py").read_text()
    for n in numbers:
        a = worked_answer(module, n)
        assert len(a.why.split()) >= 15, f"{module} exercise {n}: the explanation is too short to explain"
        assert "### BEGIN SOLUTION" not in a.code and '"""' not in a.code, a.code
        body = [ln for ln in a.code.splitlines() if ln.strip() and not ln.lstrip().startswith(("def ", "class "))]
        assert body and all(ln in source for ln in body), f"{module} exercise {n}: code not from the solution"


def test_no_explanation_is_left_without_its_exercise():
    text = (ROOT / "solutions" / "worked_answers.md").read_text()
    heads = re.findall(r"^## (\S+) (\d+)$", text, re.M)
    assert len(heads) == len(set(heads)), "an exercise explained twice"
    want = {(m, n) for m in MODULES for n in sections(m)}
    assert {(m, int(n)) for m, n in heads} == want


def test_the_students_copy_holds_neither_answers_nor_explanations():
    assert not (ROOT / "exercises" / "worked_answers.md").exists()
    stub = (ROOT / "exercises" / "ex01_batching.py").read_text()
    assert "2 * model.num_layers * model.head_dim" not in stub


def test_every_notebook_cell_label_names_an_exercise():
    labels = {
        m for p in (ROOT / "notebooks").glob("0*.py") for m in re.findall(r'impl\.attempt\("([^"]+)"\)', p.read_text())
    }
    assert labels
    for label in labels:
        module, numbers = exercises_named(label)
        assert numbers, f"impl.attempt({label!r}) names no exercise of {module}"


def test_labels_name_exercises_by_the_functions_and_classes_they_call():
    assert exercises_named("ex02.blocks_needed / partial_block_waste") == ("ex02_paging", [1, 2])
    # paged_engine is given wiring, not an exercise: only the two names that are count
    assert exercises_named("ex02.paged_engine (your blocks_needed and BlockAllocator)") == ("ex02_paging", [1, 3])
    assert exercises_named("ex05.swap_or_recompute") == ("ex05_preemption", [1])


def grades(tmp_path: Path, record: dict) -> Path:
    (tmp_path / GRADES_FILE).write_text(json.dumps(record))
    return tmp_path


def test_offered_only_after_a_failed_grade(tmp_path, capsys):
    assert offer("ex05.swap_or_recompute", tmp_path) == [], "never graded: nothing"
    d = grades(tmp_path, {"ex05_preemption": {"1": "not attempted", "2": "passed", "3": "failed"}})
    assert offer("ex05.swap_or_recompute", d) == [], "an untouched stub is no attempt"
    assert offer("ex05.LeastProgressVictim", d) == [], "passed"
    capsys.readouterr()
    got = offer("ex05.PriorityPreemption", d)
    assert [(a.module, a.number) for a in got] == [("ex05_preemption", 3)]
    out = capsys.readouterr().out
    assert "Your last grade failed exercise 3" in out and "class PriorityPreemption" in out
    assert "lower = [r for r in running if r.priority > request.priority]" in out


def test_a_cell_offers_it_under_its_output_and_show_asks_for_a_grade_first(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(impl.ENV, str(tmp_path))
    with impl.attempt("ex01.kv_cache_bytes"):
        print("the cell's own output")
    assert capsys.readouterr().out == "the cell's own output\n"
    assert impl.show_worked_answer("ex01", 1) == []
    assert "no failed grade yet (make grade EX=01" in capsys.readouterr().out
    grades(tmp_path, {"ex01_batching": {"1": "failed"}})
    with impl.attempt("ex01.kv_cache_bytes"):
        raise NotImplementedError("a stub")
    out = capsys.readouterr().out
    assert out.index("not implemented yet") < out.index("Worked answer, ex01_batching exercise 1")
    assert [a.number for a in impl.show_worked_answer("ex01.kv_cache_bytes")] == [1]


def test_in_a_notebook_it_is_folded():
    a = worked_answer("ex02_paging", 1)
    html = a.html("Your last grade failed exercise 1 (how many blocks a request needs)")
    assert html.startswith("<details><summary>") and "</summary>" in html and html.endswith("</details>")
    assert html.index("</summary>") < html.index("-(-int(num_tokens) // int(block_size))")


def test_the_grade_report_maps_every_grader_to_its_exercises():
    from conftest import grader_exercises

    for path in sorted((ROOT / "tests" / "graders").glob("ex*.py")):
        found = grader_exercises(path)
        assert found, f"{path.name}: no '# --- Exercise N' sections"
        numbers = {n for _, ns in found for n in ns}
        want = set(sections(path.stem))
        assert numbers == want, f"{path.name}: graders of exercises {numbers}, solutions has {want}"
