"""The code, the tests and the notebooks' sources pass ruff's checks, the code and the tests are as `ruff format`
lays them out, and the engine (minillm/core, engine.py, executor.py)
passes mypy with Optional values narrowed, with the settings in pyproject.toml (``make lint`` runs all three)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_is_clean():
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"ruff check . (`ruff check --fix .` fixes some):\n{proc.stdout}{proc.stderr}"


def test_ruff_format_leaves_the_code_as_it_is():
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"ruff format --check . (`ruff format .` formats):\n{proc.stdout}{proc.stderr}"


@pytest.mark.slow
def test_mypy_is_clean_on_the_core():
    """``make lint``'s type check: mypy on the engine with the settings in pyproject.toml ([tool.mypy])."""
    pytest.importorskip("mypy", reason="mypy is in the dev extra: make install brings it")
    proc = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"mypy (make lint):\n{proc.stdout}{proc.stderr}"
