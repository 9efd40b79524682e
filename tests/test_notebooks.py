"""Every notebook in notebooks/ runs top to bottom, headless, on the reference answers.

Each notebook is executed by a fresh Jupyter kernel (nbclient) with ``MINILLM_IMPL=solutions``
and the Hugging Face hub offline. A cell that runs past ``CELL_HANG_LIMIT`` seconds is a hang; the
reader's budget (``NOTEBOOK_BUDGET`` seconds a notebook, ``CELL_LIMIT`` a cell, on a quiet 2-core CPU)
is printed, and held to with ``MINILLM_NOTEBOOK_LIMITS=1`` on a quiet machine: a verdict that
depended on the machine's speed would fail a student's busy laptop.
Widget cells run too: their Python side is exercised by the cells that click in code
(``stepper.step()``). Notebooks are discovered, so a new one is covered by being added.
Committed notebooks carry no outputs: the check reads what git holds (the staged notebook), not the
working file, so a student's copy with run notebooks passes; ``make install`` sets up the nbstripout
filter that strips outputs when a notebook is staged.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import nbformat
import pytest

pytestmark = pytest.mark.slow  # runs every notebook top to bottom

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
NOTEBOOK_BUDGET = int(os.environ.get("MINILLM_NOTEBOOK_TIMEOUT", "120"))  # seconds, a quiet 2-core machine
CELL_HANG_LIMIT = 900  # seconds: far past any cell's time on a slow machine, so reaching it means a hang


def _ids(paths):
    return [p.stem for p in paths]


def test_notebooks_exist():
    assert NOTEBOOKS, "no notebooks found in notebooks/"


def _git(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)


def in_git_checkout(path: Path) -> bool:
    return shutil.which("git") is not None and _git("rev-parse", "--show-toplevel", cwd=path.parent).returncode == 0


def staged_text(path: Path) -> str | None:
    """The file at ``path`` as git holds it for the next commit (the index: in a fresh checkout, the committed
    file), or ``None`` when git does not track it or ``path`` is not in a git checkout."""
    if not in_git_checkout(path):
        return None
    top = Path(_git("rev-parse", "--show-toplevel", cwd=path.parent).stdout.strip())
    blob = _git("show", f":{path.resolve().relative_to(top.resolve()).as_posix()}", cwd=path.parent)
    return blob.stdout if blob.returncode == 0 else None


def staged_notebook(path: Path):
    """``staged_text`` as a notebook; skips when ``path`` is not in a git checkout (fails under CI)."""
    if not in_git_checkout(path):
        why = "not a git checkout: what is committed cannot be read"
        if os.environ.get("CI"):
            pytest.fail(f"{why}; CI checks the committed notebooks, so it must run in a git checkout")
        pytest.skip(f"{why} (CI checks it)")
    text = staged_text(path)
    return None if text is None else nbformat.reads(text, as_version=4)


def cells_with_outputs(nb) -> list[int]:
    return [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_is_committed_without_outputs(path):
    nb = staged_notebook(path)
    if nb is None:
        pytest.skip(f"{path.name} is not tracked by git yet")
    nbformat.validate(nb)
    dirty = cells_with_outputs(nb)
    assert not dirty, (
        f"{path.name}: cells {dirty} carry outputs in git; `make install` sets up the nbstripout "
        "filter that strips them when the notebook is staged (then `git add` it again)"
    )


# The language_info JupyterLab saves into a run notebook (jupytext writes only the name).
JUPYTERLAB_LANGUAGE_INFO = {
    "codemirror_mode": {"name": "ipython", "version": 3},
    "file_extension": ".py",
    "mimetype": "text/x-python",
    "name": "python",
    "nbconvert_exporter": "python",
    "pygments_lexer": "ipython3",
    "version": "3.11.7",
}


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_running_a_notebook_does_not_dirty_a_commit(tmp_path):
    """A student runs a notebook (outputs saved in the working file): the check above still passes, and
    once ``make git-filter`` (part of ``make install``) has run, staging the notebook strips its outputs."""
    repo = tmp_path / "repo"
    (repo / "notebooks").mkdir(parents=True)
    shutil.copy(ROOT / ".gitattributes", repo / ".gitattributes")
    clean = NOTEBOOKS[0]
    path = repo / "notebooks" / clean.name
    committed = staged_text(clean)  # as git holds it: the student's working file may carry outputs
    if committed is not None:
        path.write_text(committed)
    else:
        shutil.copy(clean, path)
    for args in (["init", "-q"], ["add", "."], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c"]):
        assert _git(*args, cwd=repo).returncode == 0, args

    nb = nbformat.read(path, as_version=4)
    code = next(c for c in nb.cells if c.cell_type == "code")
    code.execution_count = 1
    code.outputs = [nbformat.v4.new_output("stream", name="stdout", text="ran\n")]
    nb.metadata["language_info"] = dict(JUPYTERLAB_LANGUAGE_INFO)  # what the kernel writes when JupyterLab saves
    nbformat.write(nb, path)
    assert cells_with_outputs(nbformat.read(path, as_version=4)), "the working file carries outputs"
    assert not cells_with_outputs(staged_notebook(path)), "the check reads what git holds"

    # Without the filter, staging takes the outputs along, and the check sees them.
    assert _git("add", str(path), cwd=repo).returncode == 0
    assert cells_with_outputs(staged_notebook(path))

    venv = Path(sys.executable).parent.parent
    proc = subprocess.run(
        ["make", "-s", "-f", str(ROOT / "Makefile"), "git-filter", f"VENV={venv}"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _git("add", "--renormalize", str(path), cwd=repo).returncode == 0
    staged = staged_notebook(path)
    assert not cells_with_outputs(staged), "the nbstripout filter strips outputs when a notebook is staged"
    assert nbformat.writes(staged) == nbformat.writes(
        nbformat.reads(committed, as_version=4) if committed is not None else nbformat.read(clean, as_version=4)
    )
    assert cells_with_outputs(nbformat.read(path, as_version=4)), "the working file keeps the student's outputs"
    assert _git("diff", "--quiet", cwd=repo).returncode == 0, "`git diff` shows no change for outputs alone"


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_notebook_saved_after_a_run_leaves_git_status_clean(tmp_path):
    """``make lab``'s save hook (minillm/lab_hooks.py): git lists a run notebook as modified (its size
    changed), the hook finds no change through the filter and refreshes git's record; a notebook
    whose cells changed stays modified."""
    from minillm.lab_hooks import refresh_git_index

    repo = tmp_path / "repo"
    (repo / "notebooks").mkdir(parents=True)
    shutil.copy(ROOT / ".gitattributes", repo / ".gitattributes")
    path = repo / "notebooks" / NOTEBOOKS[0].name
    committed = staged_text(NOTEBOOKS[0])
    path.write_text(committed if committed is not None else NOTEBOOKS[0].read_text())
    venv = Path(sys.executable).parent.parent
    assert _git("init", "-q", cwd=repo).returncode == 0
    make = ["make", "-s", "-f", str(ROOT / "Makefile"), "git-filter", f"VENV={venv}"]
    proc = subprocess.run(make, cwd=repo, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for args in (["add", "."], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c"]):
        assert _git(*args, cwd=repo).returncode == 0, args

    def status() -> str:
        return _git("status", "--porcelain", cwd=repo).stdout.strip()

    nb = nbformat.read(path, as_version=4)
    code = next(c for c in nb.cells if c.cell_type == "code")
    code.execution_count = 1
    code.outputs = [nbformat.v4.new_output("stream", name="stdout", text="ran\n")]
    nb.metadata["language_info"] = dict(JUPYTERLAB_LANGUAGE_INFO)
    nbformat.write(nb, path)
    assert status() == f"M notebooks/{path.name}", "without the hook, git lists a notebook that was only run"
    assert refresh_git_index(os_path=str(path), model={"type": "notebook"})
    assert status() == "", "after the hook a run notebook leaves git status clean"
    assert cells_with_outputs(nbformat.read(path, as_version=4)), "the working file keeps its outputs"

    code.source += "\n# the student's change"
    nbformat.write(nb, path)
    assert not refresh_git_index(os_path=str(path), model={"type": "notebook"})
    assert status() == f"M notebooks/{path.name}", "a notebook with changed cells stays modified"
    assert not refresh_git_index(os_path=str(tmp_path / "elsewhere.ipynb"), model={"type": "notebook"})


# The clean filter `make install` sets (see the Makefile): outputs, and the kernel's details in language_info.
LANGUAGE_INFO_KEYS = (
    "codemirror_mode",
    "file_extension",
    "mimetype",
    "nbconvert_exporter",
    "pygments_lexer",
    "version",
)
FILTER_ARGS = [
    "-m",
    "nbstripout",
    "--keep-id",
    "--extra-keys",
    " ".join(f"metadata.language_info.{k}" for k in LANGUAGE_INFO_KEYS),
]


def test_the_filter_leaves_built_notebooks_as_they_are():
    """Staging passes every notebook through the filter: a notebook without outputs must come out unchanged
    (else what is committed drifts from what ``jupytext --to ipynb`` writes from the ``.py`` sources)."""
    makefile = (ROOT / "Makefile").read_text()
    assert "-m nbstripout --keep-id --extra-keys '$(NBSTRIPOUT_KEYS)'" in makefile, (
        "the Makefile's filter uses other options"
    )
    keys = re.search(r"^NBSTRIPOUT_KEYS := ((?:.*\\\n)*.*)$", makefile, re.M)
    assert keys and keys.group(1).replace("\\\n", " ").split() == FILTER_ARGS[4].split(), (
        "the Makefile strips other keys"
    )
    clean = [str(p) for p in NOTEBOOKS if not cells_with_outputs(nbformat.read(p, as_version=4))]
    if not clean:
        pytest.skip("every notebook carries outputs here (run in this copy)")
    proc = subprocess.run(
        [sys.executable, *FILTER_ARGS, "--verify", *clean], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"nbstripout would change notebooks without outputs:\n{proc.stdout}{proc.stderr}"


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@pytest.mark.skipif(bool(os.environ.get("MINILLM_STUDENT_COPY")), reason="this is the student's copy being checked")
def test_a_students_copy_with_run_notebooks_passes_these_checks(tmp_path):
    """A fresh clone whose every notebook was run and saved by JupyterLab (outputs, execution counts, kernel
    metadata) passes this file's checks on committed notebooks, as ``make test`` runs them."""
    clone = tmp_path / "clone"
    assert subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], capture_output=True).returncode == 0
    shutil.copy(Path(__file__), clone / "tests" / Path(__file__).name)  # this file, as edited
    for path in sorted((clone / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for n, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
            cell.execution_count = n + 1
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"ran {n}\n")]
        nb.metadata["language_info"] = {"name": "python", "version": "3.11.7", "mimetype": "text/x-python"}
        nbformat.write(nb, path)
    env = {**os.environ, "MINILLM_STUDENT_COPY": "1"}
    env.pop("CI", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/test_notebooks.py",
            "-k",
            "committed_without_outputs or in_sync or does_not_dirty_a_commit",
        ],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "skipped" not in proc.stdout and f"{2 * len(NOTEBOOKS) + 1} passed" in proc.stdout, proc.stdout[-2000:]


# A number the prose quotes from a run is marked where it stands, <span title="from the run">67 ms</span>
# (a reader hovering it sees where it comes from), and must appear in the text the notebook's cells print.
QUOTED = re.compile(r'<span title="from the run">(.*?)</span>', re.S)


def printed_text(nb) -> str:
    """Everything the code cells printed or displayed as text (streams, text/plain, text/html)."""
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if out.output_type == "stream":
                parts.append(out.text)
            elif out.output_type in ("execute_result", "display_data"):
                parts += [out.data.get(kind, "") for kind in ("text/plain", "text/html")]
    return "\n".join(parts)


def quotes_not_printed(nb) -> list[str]:
    """The marked quotations of a run (``QUOTED``) that no output of the notebook contains."""
    printed = " ".join(printed_text(nb).split())
    quotes = [" ".join(q.split()) for c in nb.cells if c.cell_type == "markdown" for q in QUOTED.findall(c.source)]
    return [q for q in quotes if q not in printed]


PLOTLY = "application/vnd.plotly.v1+json"


def figures_missing_titles(nb) -> list[str]:
    """Each plotly figure the notebook's cells displayed (a widget's live figure is not in the outputs) needs a
    title, and every axis it shows a title: one line per missing one, naming the cell and the axis."""
    missing = []
    for i, cell in enumerate(nb.cells):
        outs = cell.get("outputs", []) if cell.cell_type == "code" else []
        for out in outs:
            fig = out.get("data", {}).get(PLOTLY) if out.output_type in ("execute_result", "display_data") else None
            if fig is None:
                continue
            layout = fig.get("layout", {})
            title = layout.get("title")
            title = title.get("text") if isinstance(title, dict) else title
            where = f"cell {i} ({cell.source.splitlines()[0][:60] if cell.source else ''})"
            if not title:
                missing.append(f"{where}: no figure title")
            used = {t.get(k, k[0]) for t in fig.get("data", []) for k in ("xaxis", "yaxis")}
            used = {f"{a[0]}axis{a[1:]}" for a in used}  # "x2" -> "xaxis2"
            for axis in sorted(used):
                ax = layout.get(axis, {})
                if ax.get("visible") is False:
                    continue
                text = ax.get("title", {}).get("text") if isinstance(ax.get("title"), dict) else ax.get("title")
                if not text and not (
                    axis.startswith("yaxis")
                    and axis != "yaxis"
                    and layout.get("yaxis", {}).get("title")
                    and ax.get("matches")
                ):
                    missing.append(f"{where}: {axis} has no title")
    return missing


def test_a_figure_without_titles_is_named():
    fig = {
        "data": [{"type": "scatter", "x": [1], "y": [1]}, {"type": "scatter", "xaxis": "x2", "yaxis": "y2"}],
        "layout": {
            "title": {"text": "t"},
            "xaxis": {"title": {"text": "batch size"}},
            "yaxis": {"title": {"text": "ms per step"}},
            "xaxis2": {"title": {"text": "s"}},
            "yaxis2": {},
        },
    }

    def notebook():
        return nbformat.v4.new_notebook(
            cells=[
                nbformat.v4.new_code_cell("fig", outputs=[nbformat.v4.new_output("display_data", data={PLOTLY: fig})])
            ]
        )

    assert figures_missing_titles(notebook()) == ["cell 0 (fig): yaxis2 has no title"]
    del fig["layout"]["title"]
    assert figures_missing_titles(notebook())[0] == "cell 0 (fig): no figure title"


def test_a_quoted_number_must_be_printed_by_the_run():
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell(
                "print(...)",
                outputs=[nbformat.v4.new_output("stream", name="stdout", text="a newcomer waits at most 67 ms\n")],
            ),
            nbformat.v4.new_markdown_cell(
                'Newcomers waited <span title="from the run">67 ms</span>, not <span title="from the run">75 ms</span>.'
            ),
        ]
    )
    assert quotes_not_printed(nb) == ["75 ms"]


CELL_LIMIT = 30  # seconds a cell may take on a quiet 2-core machine (checked with MINILLM_NOTEBOOK_LIMITS=1)


def cell_seconds(nb) -> list[tuple[float, int]]:
    """(seconds, cell index) of each executed code cell, from the timing nbclient records in its metadata."""
    from datetime import datetime

    out = []
    for i, cell in enumerate(nb.cells):
        ex = cell.get("metadata", {}).get("execution", {})
        start, end = ex.get("iopub.status.busy"), ex.get("shell.execute_reply")
        if cell.cell_type == "code" and start and end:
            t0, t1 = (datetime.fromisoformat(str(x).replace("Z", "+00:00")) for x in (start, end))
            out.append(((t1 - t0).total_seconds(), i))
    return out


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_runs_top_to_bottom(path, tmp_path):
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    env = dict(
        os.environ,
        MINILLM_IMPL="solutions",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONWARNINGS="ignore",
    )
    # The notebooks' tensors are tiny: one intra-op thread is as fast, and immune to oversubscription
    # when the machine is shared (two torch threads on two busy cores can be 30x slower).
    env.setdefault("OMP_NUM_THREADS", "1")
    client = NotebookClient(
        nb, timeout=CELL_HANG_LIMIT, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    t0 = time.monotonic()
    try:
        client.execute(env=env, cwd=str(path.parent))
    except CellExecutionError as e:
        pytest.fail(f"{path.name}: a cell failed\n{str(e)[-4000:]}", pytrace=False)
    elapsed = time.monotonic() - t0
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name}: error outputs {[(o.ename, o.evalue) for o in errors]}"
    stale = quotes_not_printed(nb)
    assert not stale, f"{path.name}: the prose quotes {stale} from the run, but no cell printed them"
    untitled = figures_missing_titles(nb)
    assert not untitled, f"{path.name}: figures need a title and axis titles with units: {untitled}"
    slowest = max(cell_seconds(nb), default=(0.0, -1))
    print(f"{path.name}: {elapsed:.1f} s, slowest cell {slowest[1]} {slowest[0]:.1f} s")
    # The reader's budget, opt-in on a quiet machine (MINILLM_NOTEBOOK_LIMITS=1): the notebook within
    # NOTEBOOK_BUDGET seconds and every cell within CELL_LIMIT. scripts/notebook_times.py prints each
    # notebook's and cell's CPU time, which a busy machine cannot inflate.
    if os.environ.get("MINILLM_NOTEBOOK_LIMITS") == "1":
        slow = [(round(t, 1), i) for t, i in cell_seconds(nb) if t > CELL_LIMIT]
        assert not slow, f"{path.name}: cells over {CELL_LIMIT} s (seconds, cell index): {slow}"
        assert elapsed <= NOTEBOOK_BUDGET, f"{path.name} took {elapsed:.0f} s (> {NOTEBOOK_BUDGET} s)"
    elif elapsed > NOTEBOOK_BUDGET:
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
        warnings.warn(
            f"{path.name} took {elapsed:.0f} s (> the {NOTEBOOK_BUDGET} s budget; load {load:.1f} on {cores} cores): "
            "MINILLM_NOTEBOOK_LIMITS=1 on a quiet machine holds it to the budget"
        )


PAIRED = sorted((ROOT / "notebooks").glob("*.py"))  # jupytext percent sources, each paired with its .ipynb


def test_every_notebook_has_a_jupytext_source():
    """Each notebook is written as a jupytext percent-format ``.py`` (reviewable as a file, diffable in git);
    the ``.ipynb`` beside it is what JupyterLab opens, generated with ``jupytext --to ipynb``."""
    sources = {p.stem for p in PAIRED}
    missing = [p.name for p in NOTEBOOKS if p.stem not in sources]
    assert not missing, f"notebooks without a .py source: {missing} (`jupytext --to py:percent` creates one)"


@pytest.mark.parametrize("path", PAIRED, ids=_ids(PAIRED))
def test_jupytext_source_and_notebook_are_in_sync(path):
    """A notebook written as a jupytext percent-format ``.py`` (its own source, edited as a file) and its
    ``.ipynb`` hold the same cells: after editing the ``.py``, run ``make notebooks``. Either the working
    ``.ipynb`` or the one staged in git must match: a student's edits in JupyterLab leave the committed one."""
    jupytext = pytest.importorskip("jupytext")
    ipynb = path.with_suffix(".ipynb")
    assert ipynb.exists(), f"{path.name} has no {ipynb.name}: run `jupytext --to ipynb notebooks/{path.name}`"
    want = [(c.cell_type, c.source) for c in jupytext.read(path).cells]
    have = [(c.cell_type, c.source) for c in nbformat.read(ipynb, as_version=4).cells]
    if have != want and in_git_checkout(ipynb) and staged_text(ipynb) is not None:
        have = [(c.cell_type, c.source) for c in nbformat.reads(staged_text(ipynb), as_version=4).cells]
    assert have == want, (
        f"{ipynb.name} differs from {path.name}: run `jupytext --to ipynb notebooks/{path.name}` and commit both"
    )
