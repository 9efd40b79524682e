"""JupyterLab's save hook for the course (``make lab`` sets it): running a notebook leaves ``git status``
clean.

The notebooks are committed without outputs, and git's ``nbstripout`` filter strips them when a notebook
is staged, so ``git diff`` shows nothing for a notebook that was only run. ``git status`` still lists it:
the file's size changed, and git calls a file of another size modified without running the filter.
After each save this hook asks git, through the filter, whether the notebook differs from what git
holds; if not, ``git add`` records the file's new size (the content staged is the same), and
``git status`` is clean again. A notebook whose cells you changed stays modified.
"""

from __future__ import annotations

import subprocess
from pathlib import Path


def refresh_git_index(os_path: str, model: dict, contents_manager=None, **_) -> bool:
    """Jupyter's ``FileContentsManager.post_save_hook``. Returns whether git's record was refreshed
    (False outside a git checkout, without git, for other files, or for a notebook with changes)."""
    if model.get("type") != "notebook":
        return False
    path = Path(os_path)
    try:
        diff = subprocess.run(
            ["git", "diff", "--quiet", "--", path.name], cwd=path.parent, capture_output=True, timeout=60
        )
        if diff.returncode != 0:  # changed cells (1), or not a git checkout, or not tracked (128)
            return False
        tracked = subprocess.run(
            ["git", "ls-files", "--error-unmatch", "--", path.name], cwd=path.parent, capture_output=True, timeout=60
        )
        if tracked.returncode != 0:
            return False
        added = subprocess.run(["git", "add", "--", path.name], cwd=path.parent, capture_output=True, timeout=60)
        return added.returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
