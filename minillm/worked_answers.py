"""Worked answers: an exercise's reference answer and why it works, offered after a failed grade.

A student grades an exercise with ``make grade EX=NN`` in a terminal, or ``impl.grade("NN")`` in a
notebook cell (the same report). The report records, per exercise of the module it graded, how the last grade
went, in ``.grades.json`` inside the graded folder (``exercises/`` for a student): "failed" when a
grader failed on the student's attempt, "passed", or "not attempted" while the stubs still raise
``NotImplementedError`` (an untouched stub is no attempt, and opens nothing).

From a failed grade on, the notebook cell of that exercise (``with impl.attempt("ex05.swap_or_recompute")``)
offers the worked answer under its output, folded (an HTML ``<details>``): the reference code, read from
``solutions/exNN_*.py``, and a short account of why it works, from ``solutions/worked_answers.md``. A
later passing grade folds it away again. ``impl.show_worked_answer("ex05.swap_or_recompute")`` (or
``impl.show_worked_answer("ex05", 1)``) opens it on request, and also only after a failed grade.
(``minillm.impl`` holds the calls a notebook makes, with the implementation's folder; this module
knows the answers and the record, and is handed the folder.)

Exercises are the sections of a solution module that open with a comment line ``# Exercise N: title``;
a cell's label names the exercise by the functions and classes it calls ("ex02.blocks_needed /
partial_block_waste" names exercises 1 and 2 of ``ex02_paging``).
"""

from __future__ import annotations

import ast
import html
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

__all__ = [
    "WorkedAnswer",
    "GRADES_FILE",
    "worked_answer",
    "exercises_named",
    "record_grades",
    "last_grade",
    "offer",
    "show",
    "offer_failed",
]

SOLUTIONS = Path(__file__).resolve().parent.parent / "solutions"  # the reference answers, in the checkout

GRADES_FILE = ".grades.json"  # in the graded folder: {module: {exercise number: outcome}}
EXPLANATIONS = "worked_answers.md"  # in solutions/: "## <module> <number>" sections
SECTION_RE = re.compile(r"^# Exercise (\d+)[^:\n]*:\s*(.*)$")
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"


@dataclass
class WorkedAnswer:
    module: str  # "ex05_preemption"
    number: int  # the exercise's number in its notebook
    title: str  # "recompute or swap"
    code: str  # the reference answer: the section's definitions, docstrings left out
    why: str  # why it works, in a few sentences

    def text(self) -> str:
        return f"Worked answer, {self.module} exercise {self.number} ({self.title})\n\n{self.why}\n\n{self.code}"

    def html(self, summary: str) -> str:
        """Folded: the summary line shows, the answer opens on a click."""
        return (
            f"<details><summary><b>{html.escape(summary)}</b></summary>"
            f"<p style='max-width:60em'>{html.escape(self.why)}</p>"
            f"<pre style='font-size:12px'>{html.escape(self.code)}</pre></details>"
        )


# --- the reference answers ------------------------------------------------------------------------


def solution_module(prefix: str) -> Path:
    """``solutions/<prefix>_*.py`` for an exercise prefix such as "ex05" (or a module name such as
    "ex05_preemption")."""
    d = SOLUTIONS
    exact = d / f"{prefix}.py"
    if exact.is_file():
        return exact
    found = sorted(d.glob(f"{prefix}_*.py"))
    if len(found) != 1:
        raise ValueError(f"exercise {prefix!r}: expected one solutions/{prefix}_*.py, found {[p.name for p in found]}")
    return found[0]


def _sections(path: Path) -> dict[int, tuple[str, list[ast.stmt]]]:
    """number -> (title, the section's top-level definitions that hold a marked answer) of a solution
    module (given code, such as the wiring into the engine after the last exercise, is left out)."""
    source = path.read_text()
    lines = source.splitlines()
    starts = [
        (i + 1, int(m.group(1)), m.group(2).strip()) for i, line in enumerate(lines) if (m := SECTION_RE.match(line))
    ]
    tree = ast.parse(source)
    out: dict[int, tuple[str, list[ast.stmt]]] = {}
    for k, (line, number, title) in enumerate(starts):
        end = starts[k + 1][0] if k + 1 < len(starts) else float("inf")
        defs = [
            node
            for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef))
            and line < node.lineno < end
            and any(BEGIN in text for text in lines[node.lineno - 1 : node.end_lineno])
        ]
        out[number] = (title, defs)
    return out


def _answer_code(path: Path, defs: list[ast.stmt]) -> str:
    """The definitions of a section, without docstrings and markers."""
    lines = path.read_text().splitlines()
    drop: set[int] = set()
    parts = []
    for node in defs:
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        segment = lines[first - 1 : node.end_lineno]
        for sub in ast.walk(node):
            body = getattr(sub, "body", None)
            if (
                isinstance(sub, (ast.FunctionDef, ast.ClassDef))
                and body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                drop.update(range(body[0].lineno, body[0].end_lineno + 1))
        parts.append(
            "\n".join(
                line for n, line in enumerate(segment, first) if n not in drop and line.strip() not in (BEGIN, END)
            )
        )
    return "\n\n\n".join(parts)


def _explanations() -> dict[tuple[str, int], str]:
    text = (SOLUTIONS / EXPLANATIONS).read_text()
    out = {}
    for block in re.split(r"^## ", text, flags=re.M)[1:]:
        head, _, body = block.partition("\n")
        module, number = head.split()
        out[(module, int(number))] = " ".join(body.split())
    return out


def worked_answer(module: str, number: int) -> WorkedAnswer:
    """Exercise ``number`` of solution module ``module`` ("ex05_preemption" or "ex05")."""
    path = solution_module(module)
    sections = _sections(path)
    if number not in sections:
        raise ValueError(f"{path.name} has no exercise {number} (it has {sorted(sections)})")
    title, defs = sections[number]
    why = _explanations().get((path.stem, number))
    if why is None:
        raise ValueError(f"solutions/{EXPLANATIONS}: no section '## {path.stem} {number}'")
    return WorkedAnswer(path.stem, number, title, _answer_code(path, defs), why)


def exercises_named(label: str) -> tuple[str, list[int]]:
    """(module, exercise numbers) a notebook cell's label names: "ex02.blocks_needed / partial_block_waste"
    -> ("ex02_paging", [1, 2])."""
    prefix, _, rest = label.partition(".")
    path = solution_module(prefix)
    words = set(re.findall(r"[A-Za-z_]\w*", rest))
    numbers = [n for n, (_, defs) in sorted(_sections(path).items()) if any(d.name in words for d in defs)]
    return path.stem, numbers


# --- the record of grades ---------------------------------------------------------------------------


def record_grades(impl_dir: Path, outcomes: dict[str, dict[int, str]]) -> None:
    """Keep in ``impl_dir`` the outcome ("failed", "passed", "not attempted") of each exercise just graded;
    the other exercises keep theirs."""
    path = Path(impl_dir) / GRADES_FILE
    try:
        grades = json.loads(path.read_text())
    except (OSError, ValueError):
        grades = {}
    for module, by_number in outcomes.items():
        grades.setdefault(module, {}).update({str(n): o for n, o in by_number.items()})
    path.write_text(json.dumps(grades, indent=1, sort_keys=True) + "\n")


def last_grade(module: str, number: int, impl_dir: Path) -> Optional[str]:
    """How the last grade of exercise ``number`` of ``module`` went in ``impl_dir``, or None if never graded."""
    path = Path(impl_dir) / GRADES_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text()).get(module, {}).get(str(number))
    except ValueError:
        return None


# --- in the notebook ---------------------------------------------------------------------------------


def _display(answers: list[WorkedAnswer], summary: str) -> None:
    try:
        from IPython import get_ipython
        from IPython.display import HTML, display

        in_notebook = get_ipython() is not None and hasattr(get_ipython(), "kernel")
    except ImportError:
        in_notebook = False
    for a in answers:
        line = summary.format(module=a.module, number=a.number, title=a.title)
        if in_notebook:
            display(HTML(a.html(line)))
        else:
            print(line + "\n\n" + a.text())


def offer(label: str, impl_dir: Path) -> list[WorkedAnswer]:
    """Under an exercise's cell: the worked answers of the exercises ``label`` names whose last grade in
    ``impl_dir`` failed, folded (nothing before a failed grade). Returns those offered."""
    if not (Path(impl_dir) / GRADES_FILE).is_file():
        return []
    module, numbers = exercises_named(label)
    answers = [worked_answer(module, n) for n in numbers if last_grade(module, n, impl_dir) == "failed"]
    _display(answers, "Your last grade failed exercise {number} ({title}): its worked answer (click to open)")
    return answers


def offer_failed(module: str, impl_dir: Path) -> list[WorkedAnswer]:
    """After grading ``module`` (a prefix such as "ex05" will do): the worked answers of its exercises
    that failed, folded."""
    path = solution_module(module)
    answers = [
        worked_answer(path.stem, n) for n in sorted(_sections(path)) if last_grade(path.stem, n, impl_dir) == "failed"
    ]
    _display(answers, "Exercise {number} ({title}) failed: its worked answer (click to open)")
    return answers


def show(exercise: str, number: Optional[int], impl_dir: Path) -> list[WorkedAnswer]:
    """The worked answer of an exercise whose last grade failed, by a cell's label ("ex05.swap_or_recompute")
    or by module and number ("ex05", 1). Before a failed grade it says how to grade instead."""
    if number is None:
        module, numbers = exercises_named(exercise)
    else:
        module, numbers = solution_module(exercise.partition(".")[0]).stem, [number]
    answers = []
    for n in numbers:
        if last_grade(module, n, impl_dir) == "failed":
            answers.append(worked_answer(module, n))
        else:
            ex = module.split("_")[0]
            print(
                f"{module} exercise {n}: no failed grade yet (make grade EX={ex[2:]}, or impl.grade({ex!r}) "
                f"in a cell); its worked answer opens after one."
            )
    _display(answers, "Worked answer, exercise {number} ({title}) (click to open)")
    return answers
