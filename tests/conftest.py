"""Shared test set-up: offline, seeded, small."""

import os
import re
from pathlib import Path

# On a machine without CUDA, Triton's interpreter must be chosen before anything imports
# Triton (transformers' model modules may): see kernels/_triton_setup.py.
if not os.path.exists("/dev/nvidia0") and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MINILLM_IMPL", "solutions")

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


# ---------------------------------------------------------------------------------------------------------
# `make grade EX=NN` (pytest --grade): a report a student reads at a glance. One line per grader; where it
# failed, only what concerns the graded code: the lines of *your* file the error passed through (never the
# grader's or the engine's), or the grader's message when your function returned a wrong answer; last, a
# line "k of n parts pass".


def pytest_addoption(parser):
    parser.addoption(
        "--grade",
        action="store_true",
        default=False,
        help="grading report: one line per grader, the graded code's lines where it failed, "
        "and a last line 'k of n parts pass' (make grade EX=NN)",
    )


def pytest_configure(config):
    if config.getoption("--grade"):
        config.pluginmanager.register(GradeReport(config), "minillm-grade-report")


def grader_exercises(path) -> list[tuple[int, tuple[int, ...]]]:
    """(first line, exercise numbers) of each section of a grader module: a line ``# --- Exercise N: ...``
    opens exercise N's graders; another ``# --- ...`` line (graders of several exercises at once, such as
    "All three, inside the engine") opens a section that counts for every exercise above it."""
    out, numbers = [], []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.startswith("# --- "):
            m = re.match(r"# --- Exercise (\d+)", line)
            if m:
                numbers.append(int(m.group(1)))
            out.append((i, (int(m.group(1)),) if m else tuple(numbers)))
    return out


class GradeReport:
    MAX_MESSAGE_LINES = 6

    def __init__(self, config):
        self.config = config
        self.outcomes: dict[str, str] = {}  # nodeid -> "passed" / "failed" / "skipped"
        self.exercise: dict[str, tuple[str, tuple[int, ...]]] = {}  # nodeid -> (solution module, exercises)
        self.unattempted: set[str] = set()  # failed because a stub raised NotImplementedError

    def _write(self, line: str = "") -> None:
        self.config.pluginmanager.getplugin("terminalreporter").write_line(line)

    # -- what is said about one failure ---------------------------------------------------------------------
    @staticmethod
    def _impl_dir():
        from pathlib import Path

        from minillm import impl

        try:
            return impl.impl_dir(), Path(impl.REPO_ROOT)
        except FileNotFoundError:
            return None, Path(impl.REPO_ROOT)

    def detail(self, excinfo) -> list[str]:
        """The lines shown under a failed grader."""
        from pathlib import Path

        graded, root = self._impl_dir()

        def show(path) -> str:
            path = Path(path)
            try:
                return str(path.relative_to(root))
            except ValueError:
                return str(path)

        def ours(path) -> bool:
            return graded is not None and Path(path).resolve().is_relative_to(graded.resolve())

        exc = excinfo.value
        kind = type(exc).__name__
        if isinstance(exc, SyntaxError) and exc.filename and ours(exc.filename):
            return [f"{show(exc.filename)}:{exc.lineno}: {kind}: {exc.msg}"]
        frames = [e for e in excinfo.traceback if ours(e.path)]
        message = str(exc).strip()
        if isinstance(exc, NotImplementedError) and frames:
            e = frames[-1]
            return [f"not implemented yet: {show(e.path)}:{e.lineno + 1} in {e.name}"]
        lines = []
        for e in frames:
            lines.append(f"{show(e.path)}:{e.lineno + 1} in {e.name}")
            try:
                lines.append("    " + str(e.statement).strip().splitlines()[0])
            except Exception:
                pass
        text = message.splitlines() or [""]
        if isinstance(exc, AssertionError) and not frames and text[0].startswith("assert "):
            return self.bare_assert(excinfo, text[0])
        if isinstance(exc, AssertionError) and not frames:
            # the grader's message, without pytest's introspection of the comparison appended below it
            cut = next((i for i, t in enumerate(text) if t.startswith("assert ")), len(text))
            text = text[:cut]
        if len(text) > self.MAX_MESSAGE_LINES:
            text = text[: self.MAX_MESSAGE_LINES] + ["..."]
        if frames or not isinstance(exc, AssertionError):
            text[0] = f"{kind}: {text[0]}" if text[0] else kind
        return lines + text

    COMPARISON = re.compile(r"^assert (.+?) (==|!=|<=|>=|<|>) (.+)$")

    def bare_assert(self, excinfo, first: str) -> list[str]:
        """A grader's ``assert`` without a message, as a sentence: the check as the grader writes it, and the
        two values pytest compared (``first`` is the first line of pytest's report of it)."""
        statement = " ".join(str(excinfo.traceback[-1].statement).split()).removeprefix("assert ")
        lines = [f"your code does not pass the grader's check: {statement}"]
        m = self.COMPARISON.match(first)
        if m:
            lines.append(f"    the left side is {m.group(1)}, the right side {m.group(3)}")
        else:
            lines.append(f"    pytest evaluated it as: {first.removeprefix('assert ')}")
        return lines

    # -- hooks ------------------------------------------------------------------------------------------------
    def pytest_collection_finish(self, session):
        from minillm import impl

        sections = {}
        for item in session.items:
            code = getattr(getattr(item, "function", None), "__code__", None)
            if code is None or not Path(code.co_filename).parent.name == "graders":
                continue
            if code.co_filename not in sections:
                sections[code.co_filename] = grader_exercises(code.co_filename)
            numbers = [n for line, n in sections[code.co_filename] if line <= code.co_firstlineno]
            if numbers:
                self.exercise[item.nodeid] = (Path(code.co_filename).stem, numbers[-1])
        graded, root = self._impl_dir()
        where = graded.relative_to(root) if graded is not None and graded.is_relative_to(root) else graded
        marks = self.config.option.markexpr or "all exercises"
        self._write(f"Grading {marks} against {where}/ ({impl.ENV}={impl.which()}): {len(session.items)} parts")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        if report.failed and call.excinfo is not None:
            report.grade_detail = self.detail(call.excinfo)
            if call.excinfo.errisinstance(NotImplementedError):
                self.unattempted.add(item.nodeid)

    @pytest.hookimpl(tryfirst=True)
    def pytest_report_teststatus(self, report, config):
        if report.when == "call" or not report.passed:
            return ("error" if report.when != "call" and report.failed else report.outcome), "", ""
        return "", "", ""

    def pytest_runtest_logreport(self, report):
        if report.when != "call" and report.passed:
            return
        name = report.nodeid.split("::")[-1]
        name = name[len("test_") :] if name.startswith("test_") else name
        name = name.split("_", 1)[1] if name[:2] == "ex" and name[2:4].isdigit() else name
        if report.when == "teardown" and self.outcomes.get(report.nodeid) == "passed":
            self.outcomes[report.nodeid] = "failed"
        elif report.nodeid in self.outcomes:
            return
        else:
            self.outcomes[report.nodeid] = report.outcome
        label = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP"}[report.outcome]
        if report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
            self._write(f"  {label}  {name}" + (f"  ({reason.removeprefix('Skipped: ')})" if reason else ""))
            return
        detail = getattr(report, "grade_detail", []) if report.failed else []
        if len(detail) == 1:
            self._write(f"  {label}  {name}  ({detail[0]})")
            return
        self._write(f"  {label}  {name}")
        for line in detail:
            self._write(f"          {line}")

    def record_exercises(self) -> list[tuple[str, int]]:
        """Each graded exercise's outcome, kept in the graded folder for the notebooks (``minillm.worked_answers``):
        "failed" if a grader failed on an attempt (not on a stub's NotImplementedError), "passed" if all
        passed, else "not attempted". Returns the failed exercises."""
        from minillm import worked_answers

        graded, _ = self._impl_dir()
        by_exercise: dict[tuple[str, int], list[str]] = {}
        for nodeid, outcome in self.outcomes.items():
            module, numbers = self.exercise.get(nodeid, (None, ()))
            if outcome == "failed" and nodeid in self.unattempted:
                outcome = "not attempted"
            for n in numbers:
                by_exercise.setdefault((module, n), []).append(outcome)
        verdict = {
            key: "failed" if "failed" in got else "passed" if set(got) <= {"passed", "skipped"} else "not attempted"
            for key, got in by_exercise.items()
        }
        if graded is not None and verdict:
            outcomes: dict[str, dict[int, str]] = {}
            for (module, n), v in verdict.items():
                outcomes.setdefault(module, {})[n] = v
            worked_answers.record_grades(graded, outcomes)
        return sorted(key for key, v in verdict.items() if v == "failed")

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter):
        failed = self.record_exercises()
        if failed:
            first = failed[0][0].split("_")[0]
            terminalreporter.write_line(
                "Worked answers open for "
                + ", ".join(f"{m.split('_')[0]} exercise {n}" for m, n in failed)
                + f": re-run their cells in the notebook, or impl.show_worked_answer({first!r}, {failed[0][1]})"
            )
        passed = sum(o == "passed" for o in self.outcomes.values())
        skipped = sum(o == "skipped" for o in self.outcomes.values())
        counted = len(self.outcomes) - skipped
        terminalreporter.write_line(f"{passed} of {counted} parts pass" + (f" ({skipped} skipped)" if skipped else ""))
