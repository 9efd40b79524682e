"""``make lab`` on a fresh clone, as a new student (often root, in a container) runs it.

The clone is made from this checkout; its Makefile is the working tree's (the one under test), and it
reuses the installed environment (``VENV=`` this Python's environment, with ``make -o`` marking the
install step done, so nothing is reinstalled). A hostile ``~/.jupyter`` config (empty token, all
interfaces, news on) stands in for whatever the user has: ``make lab`` must not depend on it.

Checked: the printed URL (host, port, token) is the one served; the server listens on 127.0.0.1
only; a request without the token gets 403, with it 200; the news pop-up's plugin is disabled and
the extension manager cannot install; JupyterLab (and so every kernel) runs with OMP_NUM_THREADS=1;
stopping the process group leaves no process behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(sys.executable).parent.parent
STAMP = VENV / ".minillm-installed"
START_TIMEOUT = 120

pytestmark = [
    pytest.mark.slow,  # launches JupyterLab through make
    pytest.mark.skipif(not (shutil.which("make") and shutil.which("git")), reason="needs make and git"),
    pytest.mark.skipif(not STAMP.exists(), reason=f"needs an installed environment ({STAMP}: run make install)"),
]

HOSTILE_CONFIG = {
    "ServerApp": {"ip": "0.0.0.0", "token": "", "password": "", "open_browser": False, "port": 1},
    "IdentityProvider": {"token": ""},
    "LabApp": {"news_url": "https://example.invalid/news.xml", "extension_manager": "pypi"},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, token: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"token {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


def _listening_addresses(port: int) -> set[str]:
    """Local addresses listening on TCP ``port`` (Linux: /proc/net/tcp and tcp6, hex as the kernel writes)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(addr)
    return found


AS_USER = ["me", "an ordinary user"]  # as root (CI, containers): both; otherwise the first only


@pytest.fixture(params=AS_USER)
def as_user(request):
    """(prefix of the command, uid) to run ``make lab`` as: this process's user, or "nobody" when root."""
    if request.param == "me":
        return [], os.getuid()
    if os.getuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("running as an ordinary user is the first case here (needs root and setpriv to switch)")
    import pwd

    nobody = pwd.getpwnam("nobody")
    prefix = ["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups"]
    if (
        subprocess.run(
            [*prefix, "sh", "-c", f"'{VENV}/bin/python' -c 'import jupyterlab'"],
            capture_output=True,
            cwd="/",
            timeout=60,
        ).returncode
        != 0
    ):  # through a shell, as make runs it
        pytest.skip(f"user nobody cannot run {VENV}/bin/python (the interpreter lies in a private folder)")
    return prefix, nobody.pw_uid


@pytest.fixture
def workdir():
    """A folder every user can read (the other user's run needs it), removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix="minillm-lab-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _clone(dest: Path) -> Path:
    proc = subprocess.run(["git", "clone", "-q", str(ROOT), str(dest)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    shutil.copy(ROOT / "Makefile", dest / "Makefile")
    return dest


def test_make_lab_on_a_fresh_clone(as_user, workdir):
    prefix, uid = as_user
    clone = _clone(workdir / "minillm")
    home = workdir / "home"
    (home / ".jupyter").mkdir(parents=True)
    (home / ".jupyter" / "jupyter_server_config.json").write_text(json.dumps(HOSTILE_CONFIG))
    if uid != os.getuid():
        for p in [home, *home.rglob("*")]:
            os.chown(p, uid, -1)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "MAKE", "MFLAGS"))}
    env.update(HOME=str(home), JUPYTER_CONFIG_DIR=str(home / ".jupyter"), BROWSER="true")
    port = _free_port()
    proc = subprocess.Popen(
        [*prefix, "make", "-o", str(STAMP), "lab", f"VENV={VENV}", f"PORT={port}", "LAB_ARGS=--no-browser"],
        cwd=clone,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        url = token = None
        served = False
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline and proc.poll() is None and not served:
            m = next(
                (re.search(r"(http://\S+/lab\?token=(\w+))", ln) for ln in list(lines) if "JupyterLab:" in ln), None
            )
            if m:
                url, token = m.group(1), m.group(2)
                try:
                    served = _get(url.split("/lab?")[0] + "/api/status", token)[0] == 200
                except OSError:  # not listening yet
                    pass
            time.sleep(0.5)
        output = "".join(lines)
        assert proc.poll() is None, f"make lab exited ({proc.returncode}):\n{output[-3000:]}"
        assert url, f"make lab printed no URL within {START_TIMEOUT} s:\n{output[-3000:]}"
        assert served, f"nothing answered at {url} within {START_TIMEOUT} s:\n{output[-3000:]}"

        assert url == f"http://127.0.0.1:{port}/lab?token={token}", url
        assert len(token) >= 32, "a generated token, not an empty or user-chosen one"
        assert _listening_addresses(port) <= {"0100007F"}, "listens on 127.0.0.1 only"

        base = f"http://127.0.0.1:{port}"
        assert _get(f"{base}/api/status")[0] == 403, "a request without the token is refused"
        assert _get(f"{base}/api/status", "0" * len(token))[0] == 403, "a wrong token is refused"
        assert _get(f"{base}/api/status", token)[0] == 200
        status, page = _get(url)
        assert status == 200
        config = json.loads(re.search(r'id="jupyter-config-data"[^>]*>(.*?)</script>', page, re.S).group(1))
        assert "@jupyterlab/apputils-extension:announcements" in config["disabledExtensions"], "news pop-up off"
        assert config["news"] == {"disabled": True}
        assert config["extensionManager"]["can_install"] is False, "the extension manager cannot install"
        status, listing = _get(f"{base}/api/contents", token)
        names = {e["name"] for e in json.loads(listing)["content"]}
        assert status == 200 and "00_tour.ipynb" in names, names
        assert not any(n.endswith(".py") for n in names), f"the jupytext sources are hidden from the browser: {names}"
        assert ("--allow-root" in _cmdline_of_group(proc.pid)) == (uid == 0), "--allow-root as root only"
        assert _lab_environ(proc.pid).get("OMP_NUM_THREADS") == "1", "one torch thread, as the recorded times"
    finally:
        _stop(proc)


def _ps_group(pgid: int, columns: str) -> str:
    """``ps`` over the processes started by ``make lab`` (its own session: ``ps -g`` selects it), each
    command line whole (``-ww``: unlimited width, however long the path to the venv)."""
    return subprocess.run(["ps", "-ww", "-o", columns, "-g", str(pgid)], capture_output=True, text=True).stdout


def _cmdline_of_group(pgid: int) -> str:
    """The command lines of the processes started by ``make lab``."""
    return _ps_group(pgid, "args=")


def _lab_environ(pgid: int) -> dict:
    """The environment of the JupyterLab process started by ``make lab`` (its kernels inherit it)."""
    pids = _ps_group(pgid, "pid=,args=")
    lab = [ln.split()[0] for ln in pids.splitlines() if "jupyter lab" in ln or "jupyter-lab" in ln]
    assert lab, f"no JupyterLab process in make lab's process group {pgid}:\n{pids}"
    pid = lab[0]
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def _stop(proc: subprocess.Popen) -> None:
    """Stop the whole process group (make, the shell, JupyterLab) and check that nothing is left."""
    pgid = proc.pid
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
    left = _cmdline_of_group(pgid)
    os.killpg(pgid, signal.SIGKILL)
    pytest.fail(f"processes left after SIGTERM to the group:\n{left}")
