"""The set-up's torch step on a machine without CUDA (``make install``, which ``make lab`` and ``make test``
run first): the CPU build from PyTorch's CPU wheel index when it answers, else the default index, quickly.

The Makefile runs against a stand-in environment whose ``python`` records every ``-m pip`` / ``-m jupyter``
command instead of running it (and has no torch), so nothing is installed; the index is a local HTTP
server (reachable) or a closed local port (unreachable), given through ``TORCH_CPU_INDEX``.
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("make") is None or os.name != "posix", reason="needs make and sh")

FAKE_PYTHON = """#!/bin/sh
echo "$*" >> "{log}"
case "$*" in *"{fail}"*) exit 1 ;; esac
case "$1" in
  -m) exit 0 ;;
  -c) case "$2" in *"import torch"*) exit 1 ;; esac ;;
esac
exec "{python}" "$@"
"""


def _install(
    tmp_path: Path, index: str, fail: str = "no command fails"
) -> tuple[subprocess.CompletedProcess, list[str]]:
    work = tmp_path / "work"  # not a git checkout: the git filter step does nothing
    venv = work / "venv"
    (venv / "bin").mkdir(parents=True)
    for name in ("pyproject.toml", "constraints.txt"):
        shutil.copy(ROOT / name, work / name)
    log = tmp_path / "commands.log"
    py = venv / "bin" / "python"
    py.write_text(FAKE_PYTHON.format(log=log, python=sys.executable, fail=fail))
    py.chmod(0o755)
    path = os.pathsep.join(
        p
        for p in os.environ.get("PATH", "").split(os.pathsep)
        if p and not os.path.exists(os.path.join(p, "nvidia-smi"))
    )  # a machine without CUDA
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "MFLAGS", "PIP_INDEX"))}
    env.update(PATH=path, GIT_CEILING_DIRECTORIES=str(tmp_path))
    proc = subprocess.run(
        ["make", "-f", str(ROOT / "Makefile"), "install", f"VENV={venv}", f"TORCH_CPU_INDEX={index}"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if fail == "no command fails":
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert (venv / ".minillm-installed").exists()
    return proc, log.read_text().splitlines()


def _pip_installs(commands: list[str]) -> list[str]:
    return [c for c in commands if c.startswith("-m pip install") and "--upgrade pip" not in c]


def test_without_cuda_torch_comes_from_the_cpu_index(tmp_path):
    (tmp_path / "index" / "whl" / "cpu" / "torch").mkdir(parents=True)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "index"))
    handler.log_message = lambda *args: None
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:  # a local stand-in index
        threading.Thread(target=server.serve_forever, daemon=True).start()
        index = f"http://127.0.0.1:{server.server_address[1]}/whl/cpu"
        try:
            proc, commands = _install(tmp_path, index)
        finally:
            server.shutdown()
    installs = _pip_installs(commands)
    assert "CPU build, from PyTorch's CPU wheel index" in proc.stdout, proc.stdout
    torch = installs[0].split()
    assert torch[-1] == "torch==2.13.0"
    assert torch[torch.index("--index-url") + 1] == index
    assert "--extra-index-url" in torch, "the default index as an extra one, so torch's own dependencies resolve"
    assert "--retries" in torch and torch[torch.index("--retries") + 1] == "0"
    assert installs[1].split()[-4:] == ["-e", ".[dev]", "-c", "constraints.txt"] and len(installs) == 2, installs
    assert any("labextension disable" in c and "announcements" in c for c in commands), "the news pop-up is off"


def test_an_unreachable_cpu_index_falls_back_to_the_default_index(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc, commands = _install(tmp_path, f"http://127.0.0.1:{port}/whl/cpu")
    installs = _pip_installs(commands)
    assert "PyTorch's CPU wheel index is unreachable: torch 2.13.0 from the default index" in proc.stdout
    assert installs[0] == "-m pip install -q torch==2.13.0", installs
    assert not any("--index-url" in c for c in installs), "the unreachable index is not tried again by pip"
    assert installs[1].split()[-4:] == ["-e", ".[dev]", "-c", "constraints.txt"] and len(installs) == 2, installs


def _closed_port_index() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/whl/cpu"


@pytest.mark.parametrize(
    "fail, step, advice",
    [
        ("install -q torch==", "step 3 (torch==2.13.0)", "this step is skipped once torch imports"),
        (".[dev]", "step 4 (pip install -e .[dev])", "CONSTRAINTS= installs the newest versions"),
    ],
)
def test_a_failed_step_is_named_with_what_to_do(tmp_path, fail, step, advice):
    proc, commands = _install(tmp_path, _closed_port_index(), fail=fail)
    assert proc.returncode != 0
    assert f"[install] FAILED at {step}:" in proc.stdout and advice in proc.stdout, proc.stdout
    assert not (tmp_path / "work" / "venv" / ".minillm-installed").exists(), "a failed set-up is tried again"


def test_the_tested_versions_and_the_newest_are_two_environments():
    """``make test`` installs with constraints.txt; ``make test-latest`` without it, upgrading, elsewhere."""
    dry = subprocess.run(
        ["make", "-n", "--no-print-directory", "test-latest"], cwd=ROOT, capture_output=True, text=True, timeout=60
    ).stdout
    assert "install VENV=.venv-latest CONSTRAINTS=" in dry
    assert "--upgrade --upgrade-strategy eager" in dry and "not slow and not browser" in dry
