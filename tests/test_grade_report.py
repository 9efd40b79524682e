"""``make grade EX=NN`` reads at a glance: one line per grader, only the graded code's lines where it
failed, and a last line "k of n parts pass" (tests/conftest.py's ``--grade`` report)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs make grade in subprocesses

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(sys.executable).parent.parent
STAMP = VENV / ".minillm-installed"
LINE = re.compile(r"^  (PASS|FAIL|SKIP)  (\S+)(  \((.*)\))?$")


def _stubs(tmp_path: Path) -> Path:
    """Freshly generated, untouched stubs (what a student starts from)."""
    out = tmp_path / "stubs"
    proc = subprocess.run(
        [sys.executable, "scripts/make_exercises.py", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def _grade_with_pytest(impl_dir: Path, ex: str, k: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            f"ex{ex}",
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
            *(["-k", k] if k else []),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**_env(), "MINILLM_IMPL": str(impl_dir)},
    )


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "MFLAGS", "PYTEST_"))}


@pytest.mark.skipif(shutil.which("make") is None or not STAMP.exists(), reason="needs make and an installed .venv")
def test_make_grade_on_untouched_stubs(tmp_path):
    stubs = _stubs(tmp_path)
    proc = subprocess.run(
        ["make", "-s", "-o", str(STAMP), "grade", "EX=01", f"VENV={VENV}", f"GRADE_IMPL={stubs}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(),
    )
    out = proc.stdout.rstrip("\n").split("\n")
    assert proc.returncode == 0, (
        "grading ran: the verdict is the last line, not the exit status\n" + proc.stdout[-3000:] + proc.stderr
    )
    graded = [ln for ln in out if LINE.match(ln)]
    assert graded and all(LINE.match(ln).group(1) == "FAIL" for ln in graded), proc.stdout
    assert out[-1] == f"0 of {len(graded)} parts pass", out[-1]
    assert len(out) <= len(graded) + 3, f"{len(out)} lines for {len(graded)} graders:\n" + proc.stdout
    for ln in graded:
        detail = LINE.match(ln).group(4) or ""
        assert re.match(rf"not implemented yet: {re.escape(str(stubs))}/ex01_\w+\.py:\d+ in \w+$", detail), ln
    names = [LINE.match(ln).group(2) for ln in graded]
    assert len(set(names)) == len(names), "one line per grader"
    # An untouched stub is no attempt: the record says so, and no worked answer opens.
    from minillm.worked_answers import last_grade, offer

    assert {last_grade("ex01_batching", n, stubs) for n in range(1, 6)} == {"not attempted"}
    assert offer("ex01.kv_cache_bytes", stubs) == [] and "Worked answers" not in proc.stdout


def test_a_failure_shows_the_students_lines_only(tmp_path):
    """A wrong answer shows the grader's message; an exception shows the frames of the student's file (not
    the grader's, nor the engine's) and the exception."""
    d = tmp_path / "mine"
    d.mkdir()
    src = (ROOT / "solutions" / "ex01_batching.py").read_text()
    # one function crashes, one returns a wrong number
    ret_mbs = re.search(r"def max_batch_size\(.*?\n    return ([^\n]+)\n", src, re.S)
    ret_kv = re.search(r"def kv_cache_bytes\(.*?\n    return ([^\n]+)\n", src, re.S)
    assert ret_mbs and ret_kv, "solutions/ex01_batching.py changed shape: update this test"
    src = src.replace(ret_mbs.group(0), ret_mbs.group(0).replace(ret_mbs.group(1), "1 // (len([]))"))
    src = src.replace(ret_kv.group(0), ret_kv.group(0).replace(ret_kv.group(1), f"({ret_kv.group(1)}) + 1"))
    (d / "ex01_batching.py").write_text(src)
    crash_line = src.split("\n").index("    return 1 // (len([]))") + 1

    proc = _grade_with_pytest(d, "01")
    out = proc.stdout.rstrip("\n").split("\n")
    graded = [ln for ln in out if LINE.match(ln)]
    passed = sum(LINE.match(ln).group(1) == "PASS" for ln in graded)
    assert 0 < passed < len(graded), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert out[-1] == f"{passed} of {len(graded)} parts pass"
    assert f"{d}/ex01_batching.py:{crash_line} in max_batch_size" in proc.stdout
    assert "ZeroDivisionError" in proc.stdout
    assert "kv_cache_bytes" in proc.stdout and "expected" in proc.stdout, "a wrong answer shows the grader's message"
    empty = [ln for ln in graded if LINE.match(ln).group(1) == "FAIL" and ln.rstrip().endswith("()")]
    assert not empty, f"failures reported without a message: {empty}"
    for noise in ("tests/graders", "minillm/", "Traceback", "____", "site-packages"):
        assert noise not in proc.stdout, f"{noise!r} in the report:\n{proc.stdout}"
    # The two exercises answered wrongly (and decode_step_time, which calls kv_cache_bytes) open their
    # worked answers in the notebook; the exercises answered with the reference code open none.
    from minillm.worked_answers import offer

    assert "Worked answers open for ex01 exercise 1, ex01 exercise 2, ex01 exercise 3: " in proc.stdout
    for n, label in enumerate(("ex01.kv_cache_bytes", "ex01.max_batch_size", "ex01.decode_step_time"), 1):
        assert [a.number for a in offer(label, d)] == [n], label
    for label in ("ex01.completion_times", "ex01.plan_step"):
        assert offer(label, d) == [], label


def test_a_bare_assert_in_a_grader_shows_both_values(tmp_path):
    """Graders are loaded with pytest's assert rewriting: a grader's plain ``assert got == want`` is reported as
    a sentence, the check as the grader writes it and the two values compared (here: int8 rounding halves up,
    not to even), not as pytest's introspection."""
    d = tmp_path / "mine"
    d.mkdir()
    src = (ROOT / "solutions" / "ex02b_kv_quant.py").read_text()
    assert "        return torch.round(y).to(torch.int8)\n" in src, "solutions/ex02b changed shape: update this test"
    (d / "ex02b_kv_quant.py").write_text(
        src.replace(
            "        return torch.round(y).to(torch.int8)\n", "        return torch.floor(y + 0.5).to(torch.int8)\n"
        )
    )
    proc = _grade_with_pytest(d, "02b")
    out = proc.stdout.rstrip("\n").split("\n")
    i = next(i for i, ln in enumerate(out) if LINE.match(ln) and "quantize_block_by_hand" in ln)
    assert LINE.match(out[i]).group(1) == "FAIL", proc.stdout[-3000:]
    assert out[i + 1].strip().startswith("your code does not pass the grader's check: "), proc.stdout[-3000:]
    assert "the left side is [[[1, -127]" in out[i + 2] and "the right side [[[0, -127]" in out[i + 2], proc.stdout[
        -3000:
    ]


def test_a_graders_message_is_shown_without_pytests_introspection(tmp_path):
    """A grader's ``assert got == want, message`` on a wrong answer (SJF aging with the wrong sign) shows the
    grader's sentence alone: not the introspection pytest appends to it (``assert {...} == {...}``, "Omitting 5
    identical items", ``+  where ...``), and times written to the millisecond."""
    d = tmp_path / "mine"
    d.mkdir()
    src = (ROOT / "solutions" / "ex03_policies.py").read_text()
    right = "        return self.remaining(req) - self.aging * max(0.0, now - req.arrival_time)\n"
    assert right in src, "solutions/ex03_policies.py changed shape: update this test"
    (d / "ex03_policies.py").write_text(src.replace(right, right.replace(" - self.aging", " + self.aging")))
    proc = _grade_with_pytest(d, "03", k="sjf")
    out = proc.stdout.rstrip("\n").split("\n")
    failed = [LINE.match(ln) for ln in out if LINE.match(ln) and LINE.match(ln).group(1) == "FAIL"]
    assert len(failed) >= 3 and all(m.group(4) for m in failed), proc.stdout[-3000:] + proc.stderr[-3000:]
    for noise in ("assert ", "Omitting", "+  where", "Differing items", "RequestMetrics("):
        assert noise not in proc.stdout, f"{noise!r} in the report:\n{proc.stdout}"
    assert not re.search(r"\d\.\d{6,} s", proc.stdout), f"unrounded times in the report:\n{proc.stdout}"


def test_grading_from_a_notebook_cell_offers_the_worked_answer_after_a_failure_only(tmp_path, monkeypatch, capsys):
    """``impl.grade("01")`` in a cell prints the report and offers, folded, the worked answers of the exercises
    it failed: a wrong answer opens its exercise's, the reference answer none."""
    from minillm import impl

    src = (ROOT / "solutions" / "ex01_batching.py").read_text()
    for name, wrong in (("reference", False), ("wrong", True)):
        d = tmp_path / name
        d.mkdir()
        ret = re.search(r"def kv_cache_bytes\(.*?\n    return ([^\n]+)\n", src, re.S)
        text = src.replace(ret.group(0), ret.group(0).replace(ret.group(1), f"2 * ({ret.group(1)})")) if wrong else src
        (d / "ex01_batching.py").write_text(text)
        monkeypatch.setenv(impl.ENV, str(d))
        got = impl.grade("01", k="kv_cache_bytes_matches_the_formula")
        out = capsys.readouterr().out
        assert ("\n0 of 1 parts pass\n" if wrong else "\n1 of 1 parts pass") in out, out
        assert [a.number for a in got] == ([1] if wrong else []), out
        assert ("Worked answer, ex01_batching exercise 1" in out) == wrong, out
