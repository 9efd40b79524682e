"""The Stepper as a reader meets it: JupyterLab in headless Chromium, clicks on its buttons.

Starts JupyterLab on a free localhost port (token auth) in a temporary folder holding
``tests/browser_nb/stepper_smoke.ipynb``, opens it in Debian's Chromium through Playwright,
runs every cell, then, reading what the page shows:

* clicks the first widget's Step button twice: the step counter and the KV block map change;
* steps the second: a request that arrived during a step is listed as such, the queue's counts
  stay inside their panel with a long request id, the KV map's labels (``×3`` on shared blocks
  in narrow cells) never overlap, and cached free blocks are drawn apart, with a legend entry;
* the third (speculative decoding): the step's tokens fill a visible part of the batch bar and
  the draft guesses are marked accepted / rejected;
* the fourth, run to the end by its own cell: a banner says why Step is off; Reset, then Step;
* with the file browser open, every widget (a four-engine LockstepStepper among them) fits its
  cell's output in the 1,400 px window.

A full-page screenshot is copied to /tmp/minillm_browser.png and one per widget is kept under
``test-artifacts/browser/`` (``MINILLM_ARTIFACTS`` to move it) for CI to keep.

Without Chromium (or Playwright) the test skips, unless ``MINILLM_REQUIRE_BROWSER=1`` (CI
sets it): then it fails and says what is missing. Never downloads a browser.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # drives JupyterLab in headless Chromium

HERE = Path(__file__).parent
NOTEBOOK = HERE / "browser_nb" / "stepper_smoke.ipynb"
COURSE_NOTEBOOKS = ("04_prefix_caching.ipynb", "05_preemption.ipynb")
COURSE_TIMEOUT = 900  # s: Run All of a course notebook on a CPU (Triton's interpreter)
SCREENSHOT_COPY = Path("/tmp/minillm_browser.png")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]
BOOT_TIMEOUT = 120  # s: JupyterLab answering
KERNEL_TIMEOUT = 300  # s: kernel up, torch imported, the engine built, the widget drawn
STEP_TIMEOUT = 120  # s: one click on Step reflected on screen


def _missing_browser(reason: str):
    if os.environ.get("MINILLM_REQUIRE_BROWSER") == "1":
        pytest.fail(
            f"browser test required (MINILLM_REQUIRE_BROWSER=1) but {reason}. Install Debian's "
            "Chromium (`apt-get install -y chromium`) and the Python package `playwright`; "
            "do not download a browser through playwright.",
            pytrace=False,
        )
    pytest.skip(f"{reason} (set MINILLM_REQUIRE_BROWSER=1 to make this a failure)")


def _chromium() -> str:
    for cand in (
        os.environ.get("MINILLM_CHROMIUM"),
        "/usr/bin/chromium",
        shutil.which("chromium"),
        shutil.which("chromium-browser"),
    ):
        if cand and os.path.exists(cand):
            return cand
    _missing_browser("Chromium was not found at /usr/bin/chromium or on PATH")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read()


@pytest.fixture
def jupyter_lab(tmp_path):
    """A JupyterLab server of this venv in a temp dir; yields (base url, token, root dir)."""
    root = tmp_path / "lab"
    root.mkdir()
    shutil.copy(NOTEBOOK, root / NOTEBOOK.name)
    for name in COURSE_NOTEBOOKS:  # the course's notebooks whose widgets the cells also step
        shutil.copy(HERE.parent / "notebooks" / name, root / name)
    # No news or update toasts over the page (and no request to a website for them).
    notif = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    notif.mkdir(parents=True)
    (notif / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False, "doNotDisturbMode": True})
    )
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ)
    # Keep the user's Jupyter state out: config, data (kernelspecs), runtime files in tmp.
    for var, sub in (
        ("JUPYTER_CONFIG_DIR", "cfg"),
        ("JUPYTER_RUNTIME_DIR", "run"),
        ("JUPYTER_DATA_DIR", "data"),
        ("IPYTHONDIR", "ipython"),
    ):
        env[var] = str(tmp_path / sub)
    env["JUPYTER_PLATFORM_DIRS"] = "1"
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("OMP_NUM_THREADS", "1")  # tiny tensors: one thread is as fast, and shares the CPU well
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent)] + [p for p in [env.get("PYTHONPATH")] if p])
    cmd = [
        sys.executable,
        "-m",
        "jupyter",
        "lab",
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        "--LabApp.expose_app_in_browser=True",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        f"--LabApp.user_settings_dir={tmp_path / 'settings'}",
        f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",
        "--LabApp.extension_manager=readonly",
        "--ServerApp.terminals_enabled=False",
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")  # CI runs as root
    log = open(tmp_path / "jupyter.log", "wb")
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + BOOT_TIMEOUT
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"JupyterLab exited with {proc.returncode}:\n"
                    + (tmp_path / "jupyter.log").read_text(errors="replace")[-3000:]
                )
            try:
                status, _ = _get(f"{base}/api/status?token={token}")
                if status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                tail = (tmp_path / "jupyter.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"JupyterLab did not answer within {BOOT_TIMEOUT}s:\n{tail}")
            time.sleep(0.5)
        yield base, token, root
    finally:
        # Shut the server (and its kernels) down cleanly, then make sure the process group is gone.
        try:
            req = urllib.request.Request(f"{base}/api/shutdown?token={token}", method="POST", data=b"")
            urllib.request.urlopen(req, timeout=10)
        except OSError:
            pass
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        log.close()


def _stepper_state(page) -> dict:
    """What the widget shows: its step counter, and the fill colours of the KV map's cells."""
    return page.evaluate("""() => {
        const root = document.querySelector('.minillm-stepper');
        if (!root) return null;
        const step = root.querySelector('.mlw-step');
        const plots = root.querySelectorAll('.js-plotly-plot');
        const kv = plots.length ? plots[plots.length - 1] : null;
        const fills = kv ? Array.from(kv.querySelectorAll('g.trace.bars path')).map(
            p => (p.style.fill || p.getAttribute('fill') || '') + '|' + (p.getAttribute('d') || '')) : [];
        const title = kv ? (kv.querySelector('.gtitle') || {}).textContent : null;
        return {step: step ? step.textContent.trim() : null, plots: plots.length,
                kv_title: title, kv_paths: fills};
    }""")


@pytest.fixture
def chromium():
    """Chromium's path, once Playwright is importable too (checked before JupyterLab starts)."""
    path = _chromium()
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        _missing_browser("the Python package playwright is not installed")
    return path


@pytest.mark.browser
@pytest.mark.timeout(900)
def test_stepper_in_jupyterlab(chromium, jupyter_lab, tmp_path):
    from playwright.sync_api import sync_playwright

    base, token, root = jupyter_lab
    shot = tmp_path / "stepper.png"
    console: list[str] = []

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            page.set_default_timeout(60_000)
            page.goto(f"{base}/lab/tree/{NOTEBOOK.name}?token={token}&reset", wait_until="domcontentloaded")
            page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=KERNEL_TIMEOUT * 1000)
            page.wait_for_function(
                "() => window.jupyterapp && window.jupyterapp.commands"
                " && window.jupyterapp.commands.hasCommand('notebook:run-all-cells')",
                timeout=KERNEL_TIMEOUT * 1000,
            )
            _wait_kernel_idle(page)
            page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
            try:
                page.wait_for_selector(".minillm-stepper .mlw-step", timeout=KERNEL_TIMEOUT * 1000)
                page.wait_for_function(
                    "() => document.querySelectorAll('.minillm-stepper .js-plotly-plot g.trace.bars').length > 0",
                    timeout=KERNEL_TIMEOUT * 1000,
                )
            except Exception:
                page.screenshot(path=str(shot), full_page=True)
                shutil.copy(shot, SCREENSHOT_COPY)
                raise AssertionError(
                    "the Stepper did not appear; console:\n"
                    + "\n".join(console[-40:])
                    + "\noutputs:\n"
                    + _outputs_text(page)
                )
            _wait_kernel_idle(page)
            before = _stepper_state(page)
            assert before["step"] == "step -", before["step"]
            assert before["plots"] == 2

            step_button = page.locator(".minillm-stepper").first.locator("button.mlw-step-button")
            seen = [before]
            click_seconds = []  # from the click to the new step on screen (printed: a record, not a limit)
            for want in ("step 0", "step 1"):
                t0 = time.perf_counter()
                step_button.click()
                page.wait_for_function(
                    "(want) => { const e = document.querySelector('.minillm-stepper .mlw-step');"
                    " return e && e.textContent.trim() === want; }",
                    arg=want,
                    timeout=STEP_TIMEOUT * 1000,
                )
                click_seconds.append(time.perf_counter() - t0)
                page.wait_for_timeout(600)  # let plotly finish redrawing
                seen.append(_stepper_state(page))
            shown = ", ".join(f"{t:.2f}" for t in click_seconds)
            print(f"\nStep clicks to the step on screen: {shown} s (load {os.getloadavg()[0]:.1f})")
            after = seen[-1]
            page.locator(".minillm-stepper").first.scroll_into_view_if_needed()
            page.screenshot(path=str(shot), full_page=True)
            shutil.copy(shot, SCREENSHOT_COPY)
            _keep_artifact(page.locator(".minillm-stepper").first, "stepper.png")

            details = _check_details(page)
            spec = _check_speculative(page)
            finished = _check_finished_then_reset(page)
            fits = _check_widths(page)
        finally:
            browser.close()

    assert [s["step"] for s in seen] == ["step -", "step 0", "step 1"]
    # The block map on screen changed with each step: its title and its cells.
    assert before["kv_title"] != seen[1]["kv_title"] != after["kv_title"], [s["kv_title"] for s in seen]
    assert "after step 1" in after["kv_title"]
    assert before["kv_paths"] != seen[1]["kv_paths"] != after["kv_paths"]
    assert shot.exists() and shot.stat().st_size > 10_000

    # An arrival during a step is on screen; counts stay inside the queue panel; labels never overlap.
    arrived, shared, ended = details["step 0"], details["step 1"], details["end"]
    assert "arrived during this step" in arrived["queue"] and "Arrived during the step" in arrived["reasons"]
    assert "a-request-with-a-very-long-name-0042" in arrived["queue"]
    assert arrived["bar_texts"] >= 2  # "A p17", "unused 47": the segment-label check below has labels
    for name, st in details.items():
        assert st["counts_outside"] == [] and (st["counts"] > 0 or name == "end"), (name, st["counts_outside"])
        assert st["label_overlaps"] == [], (name, st["label_overlaps"])
        assert st["bar_text_outside"] == [], (name, st["bar_text_outside"])  # labels fit their segment
    assert any("\u00d73" in t for t in shared["labels"]), shared["labels"]
    # Cached free blocks: their own outline and fill, and an entry in the legend.
    assert "cached prefix, free (reusable)" in ended["legend"]
    assert ended["cached_cells"] > 0 and arrived["cached_cells"] == 0
    # Speculative decoding: the tokens fill a visible part of the bar, the guesses are marked.
    assert {"draft guess accepted", "draft guess rejected"} <= set(spec["legend"])
    assert spec["guess_px"] >= 0.1 * spec["axis_px"], spec
    assert spec["accepted"] + spec["rejected"] >= 1 and spec["bar_text_outside"] == [], spec
    # A widget its own cell ran to the end says why Step is off, and Reset brings it back.
    assert "Press Reset" in finished["banner"] and finished["step_disabled"]
    assert finished["after_reset"] == "step -" and finished["after_step"] == "step 0"
    # With the file browser open, every widget fits its cell's output: nothing sticks out on the right.
    assert fits["file_browser_px"] >= 200 and fits["outputs"] >= 5, fits
    assert fits["too_wide"] == [], fits["too_wide"]


ARTIFACTS = Path(os.environ.get("MINILLM_ARTIFACTS", HERE.parent / "test-artifacts")) / "browser"

# What the i-th Stepper on the page shows, read from the DOM: its step counter, panels, the
# queue's counts against the panel's edge, the KV map's labels (boxes that overlap), cells
# drawn as cached, the legends, and the batch bar's draft-guess segments.
_WIDGET_JS = """(i) => {
    const root = document.querySelectorAll('.minillm-stepper')[i];
    const txt = (sel) => { const e = root.querySelector(sel); return e ? e.innerText : ''; };
    const plots = root.querySelectorAll('.js-plotly-plot');
    const batch = plots[0], kv = plots[plots.length - 1];
    const queue = root.querySelector('.mlw-queue');
    const panel = queue.closest('.widget-html').getBoundingClientRect();
    const counts = Array.from(queue.querySelectorAll('.mlw-count'));
    const outside = counts.filter(c => c.getBoundingClientRect().right > panel.right + 0.5)
                          .map(c => c.innerText);
    const labels = Array.from(kv.querySelectorAll('.scatterlayer .textpoint text'))
                        .filter(t => t.textContent.trim() !== '');
    const boxes = labels.map(t => t.getBoundingClientRect());
    const overlaps = [];
    for (let a = 0; a < boxes.length; a++) for (let b = a + 1; b < boxes.length; b++) {
        const p = boxes[a], q = boxes[b];
        if (p.left < q.right - 0.5 && q.left < p.right - 0.5 && p.top < q.bottom - 0.5 && q.top < p.bottom - 0.5)
            overlaps.push(labels[a].textContent + ' / ' + labels[b].textContent);
    }
    const strokes = (plot, rgb) => Array.from(plot.querySelectorAll('.barlayer path'))
        .filter(p => !p.closest('.legend') && p.getBoundingClientRect().width > 0
                     && (p.style.stroke || '').replace(/ /g, '') === rgb);
    const width = (ps) => ps.reduce((s, p) => s + p.getBoundingClientRect().width, 0);
    const acc = strokes(batch, 'rgb(46,125,50)'), rej = strokes(batch, 'rgb(214,39,40)');
    const axis = batch.querySelector('.nsewdrag');
    const legend = (plot) => Array.from(plot.querySelectorAll('.legend .legendtext')).map(e => e.textContent);
    const barTexts = Array.from(batch.querySelectorAll('.barlayer .point text')).filter(t => t.textContent.trim());
    const barText = Array.from(batch.querySelectorAll('.barlayer .point')).filter(pt => {
        const t = pt.querySelector('text'), p = pt.querySelector('path');
        if (!t || !p || !t.textContent.trim()) return false;
        const a = t.getBoundingClientRect(), b = p.getBoundingClientRect();
        return a.left < b.left - 1 || a.right > b.right + 1;
    }).map(pt => pt.querySelector('text').textContent);
    const step = root.querySelector('.mlw-step');
    const stepButton = root.querySelector('button.mlw-step-button');
    return {step: step ? step.textContent.trim() : null, queue: queue.innerText, reasons: txt('.mlw-reasons'),
            banner: txt('.mlw-finished'), step_disabled: stepButton ? stepButton.disabled : null,
            counts: counts.length, counts_outside: outside, labels: labels.map(t => t.textContent),
            label_overlaps: overlaps, bar_text_outside: barText, bar_texts: barTexts.length,
            cached_cells: strokes(kv, 'rgb(125,139,153)').length,
            legend: legend(kv), batch_legend: legend(batch),
            accepted: acc.length, rejected: rej.length, guess_px: width(acc) + width(rej),
            axis_px: axis ? axis.getBoundingClientRect().width : 0};
}"""


def _widget(page, i: int) -> dict:
    return page.evaluate(_WIDGET_JS, i)


def _click_and_wait(page, i: int, button: str, want: str) -> None:
    """Click a button of the i-th Stepper; wait until its step counter reads ``want``."""
    page.locator(".minillm-stepper").nth(i).locator(f"button.{button}").click()
    page.wait_for_function(
        "([i, want]) => { const r = document.querySelectorAll('.minillm-stepper')[i];"
        " const e = r && r.querySelector('.mlw-step'); return e && e.textContent.trim() === want; }",
        arg=[i, want],
        timeout=STEP_TIMEOUT * 1000,
    )
    page.wait_for_timeout(600)  # let plotly finish redrawing


def _keep_artifact(locator, name: str) -> None:
    """A screenshot of one widget, kept under test-artifacts/browser/ (CI keeps it)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    locator.scroll_into_view_if_needed()
    locator.screenshot(path=str(ARTIFACTS / name))


def _check_details(page) -> dict:
    """The second widget: arrivals during a step, a long id, shared then cached blocks."""
    out = {}
    for want in ("step 0", "step 1"):
        _click_and_wait(page, 1, "mlw-step-button", want)
        out[want] = _widget(page, 1)
        _keep_artifact(page.locator(".minillm-stepper").nth(1), f"details_{want.replace(' ', '')}.png")
    root = page.locator(".minillm-stepper").nth(1)
    root.locator("input[type=number]").first.fill("50")
    root.locator("input[type=number]").first.press("Enter")
    root.locator("button.mlw-run-button").click()
    page.wait_for_function(
        "() => { const r = document.querySelectorAll('.minillm-stepper')[1];"
        " return r && r.querySelector('.mlw-finished'); }",
        timeout=STEP_TIMEOUT * 1000,
    )
    page.wait_for_timeout(600)
    out["end"] = _widget(page, 1)
    _keep_artifact(root, "details_end.png")
    return out


def _check_speculative(page) -> dict:
    """The third widget: stepped three times by its cell; draft guesses in the batch bar."""
    st = _widget(page, 2)
    st["legend"] = st["batch_legend"]
    _keep_artifact(page.locator(".minillm-stepper").nth(2), "speculative.png")
    return st


def _check_finished_then_reset(page) -> dict:
    """The fourth widget, run to the end by its cell: a banner says so; Reset, then Step."""
    st = _widget(page, 3)
    _keep_artifact(page.locator(".minillm-stepper").nth(3), "finished.png")
    out = {"banner": st["banner"], "step_disabled": st["step_disabled"]}
    _click_and_wait(page, 3, "mlw-reset-button", "step -")
    out["after_reset"] = _widget(page, 3)["step"]
    _click_and_wait(page, 3, "mlw-step-button", "step 0")
    out["after_step"] = _widget(page, 3)["step"]
    return out


# Each widget's output against its right edge: every element (a plot counts as its <svg>, not
# plotly's invisible drag layers) ends inside it, and nothing scrolls sideways.
_WIDTHS_JS = """() => {
    const fb = document.querySelector('#filebrowser');
    const outs = Array.from(document.querySelectorAll('.jp-OutputArea-output'))
        .filter(o => o.querySelector('.minillm-stepper, .minillm-lockstep'));
    const tooWide = [];
    outs.forEach((o, i) => {
        const edge = o.getBoundingClientRect().right + 1;
        const parts = Array.from(o.querySelectorAll('*')).filter(e => !(e instanceof SVGElement)
                                                                   || e.classList.contains('main-svg'));
        const out = parts.filter(e => { const b = e.getBoundingClientRect(); return b.width > 0 && b.right > edge; });
        if (out.length || o.scrollWidth > o.clientWidth + 1)
            tooWide.push({output: i, width: Math.round(o.getBoundingClientRect().width),
                          right: Math.round(Math.max(...out.map(e => e.getBoundingClientRect().right), 0) - edge),
                          first: out.slice(0, 3).map(e => e.tagName + '.' + (e.getAttribute('class') || ''))});
    });
    return {file_browser_px: fb ? fb.getBoundingClientRect().width : 0, outputs: outs.length, too_wide: tooWide};
}"""


def _check_widths(page) -> dict:
    """A 1,400 px window with JupyterLab's file browser open (about 970 px for a cell's output):
    every widget on the page, the four-engine LockstepStepper included, fits its output."""
    page.evaluate("() => window.jupyterapp.commands.execute('filebrowser:activate')")
    page.wait_for_timeout(1500)  # the panel opens, the notebook narrows, plotly redraws
    _keep_artifact(page.locator(".minillm-lockstep").first, "lockstep_four.png")
    page.screenshot(path=str(ARTIFACTS / "file_browser_open.png"))
    return page.evaluate(_WIDTHS_JS)


def _wait_kernel_idle(page, timeout: float = KERNEL_TIMEOUT) -> None:
    """Until the notebook's kernel reports idle (JupyterLab's execution indicator)."""
    page.wait_for_function(
        """() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
                   const k = w && w.sessionContext && w.sessionContext.session
                             && w.sessionContext.session.kernel;
                   return !!k && k.status === 'idle' && Array.from(document.querySelectorAll(
                       '.jp-InputPrompt')).every(e => !e.textContent.includes('*')); }""",
        timeout=timeout * 1000,
        polling=500,
    )


def _outputs_text(page) -> str:
    try:
        return page.evaluate(
            "() => Array.from(document.querySelectorAll('.jp-OutputArea-output'))"
            ".map(e => e.innerText).join('\\n---\\n')"
        )[-3000:]
    except Exception as e:  # pragma: no cover - diagnostics only
        return f"(could not read outputs: {e})"


# Every Step button on the page: enabled, or its widget says why not (the finished banner).
_STEPPABLE_JS = """() => Array.from(document.querySelectorAll('.minillm-lockstep, .minillm-stepper'))
    .filter(r => r.querySelector('button.mlw-step-button') && !r.parentElement.closest('.minillm-lockstep'))
    .map(r => { const b = r.querySelector('.mlw-finished');
                return {title: r.innerText.split('\\n')[0],
                        disabled: r.querySelector('button.mlw-step-button').disabled,
                        banner: b ? b.innerText : '',
                        steps: Array.from(r.querySelectorAll('.mlw-step')).map(e => e.textContent.trim())}; })"""


@pytest.mark.browser
@pytest.mark.timeout(COURSE_TIMEOUT + 300)
@pytest.mark.parametrize("name", COURSE_NOTEBOOKS)
def test_course_widgets_can_be_stepped_after_run_all(chromium, jupyter_lab, name):
    """A student runs every cell of a course notebook, scrolls up and presses Step: it steps (or
    the widget says it has finished and offers Reset)."""
    from playwright.sync_api import sync_playwright

    base, token, root = jupyter_lab
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(60_000)
            page.goto(f"{base}/lab/tree/{name}?token={token}&reset", wait_until="domcontentloaded")
            page.wait_for_function(
                "() => window.jupyterapp && window.jupyterapp.commands"
                " && window.jupyterapp.commands.hasCommand('notebook:run-all-cells')",
                timeout=KERNEL_TIMEOUT * 1000,
            )
            _wait_kernel_idle(page)
            page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
            page.wait_for_selector("button.mlw-step-button", timeout=COURSE_TIMEOUT * 1000)
            _wait_kernel_idle(page, COURSE_TIMEOUT)
            widgets = page.evaluate(_STEPPABLE_JS)
            assert widgets, f"{name}: no step-through widget on the page"
            for w in widgets:
                assert not w["disabled"] or "Press Reset" in w["banner"], (name, w)
            first = page.locator("button.mlw-step-button").first
            first.scroll_into_view_if_needed()
            assert first.is_enabled(), (name, widgets[0])
            t0 = time.perf_counter()
            first.click()
            page.wait_for_function(
                """() => { const b = document.querySelector('button.mlw-step-button');
                           const r = b.closest('.minillm-lockstep') || b.closest('.minillm-stepper');
                           const s = Array.from(r.querySelectorAll('.mlw-step'));
                           return s.length && s.every(e => e.textContent.trim() === 'step 0'); }""",
                timeout=STEP_TIMEOUT * 1000,
            )
            first_click = time.perf_counter() - t0  # (printed: a record, not a limit)
            print(f"\n{name}: first Step click to step 0 on screen {first_click:.2f} s (load {os.getloadavg()[0]:.1f})")
            page.wait_for_timeout(600)
            _keep_artifact(
                page.locator("button.mlw-step-button").first.locator(
                    "xpath=ancestor::*[contains(@class,'minillm-lockstep')"
                    " or contains(@class,'minillm-stepper')][last()]"
                ),
                f"{name.split('_')[0]}_first_widget.png",
            )
        finally:
            browser.close()


def test_browser_notebook_runs_headless(tmp_path):
    """The same notebook, executed by nbclient (no browser): it builds and displays a Stepper."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    shown = 0
    for cell in nb.cells:
        out = cell.get("outputs", [])
        assert not [o for o in out if o.get("output_type") == "error"], json.dumps(out)[:800]
        shown += sum("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in out)
    assert shown == 5  # four Steppers and a LockstepStepper


def test_missing_browser_skips_or_fails(monkeypatch):
    """Without a browser: a skip on a developer's machine, a failure where CI requires it."""
    monkeypatch.delenv("MINILLM_REQUIRE_BROWSER", raising=False)
    with pytest.raises(pytest.skip.Exception, match="MINILLM_REQUIRE_BROWSER=1"):
        _missing_browser("Chromium was not found")
    monkeypatch.setenv("MINILLM_REQUIRE_BROWSER", "1")
    with pytest.raises(pytest.fail.Exception, match="apt-get install -y chromium"):
        _missing_browser("Chromium was not found")
