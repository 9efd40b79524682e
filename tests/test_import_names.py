"""No import name of ours collides with a package our dependencies install.

Hugging Face's hub package is called ``kernels``, and ``transformers`` imports it
(``transformers/integrations/hub_kernels.py``: ``from kernels import ...``). Our ``kernels/`` folder is
therefore installed as ``minillm_kernels`` and has no ``__init__.py``: a regular package by the folder's
name would shadow Hugging Face's whenever the repository root is on ``sys.path`` (``python -m pytest``,
``python -c`` in the root), and from elsewhere Hugging Face's would shadow ours.

The names checked are every top-level name we put on the path: the packages ``pyproject.toml`` installs,
and what the repository root makes importable (folders with an ``__init__.py``, ``.py`` files). A folder
without ``__init__.py`` is at most a namespace portion, which any installed package of that name wins over.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def installed_top_level_names() -> set[str]:
    """The top-level import names ``pyproject.toml`` installs."""
    tools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {p.split(".")[0] for p in tools["packages"]}


def root_top_level_names(root: Path = ROOT) -> set[str]:
    """What the repository root on ``sys.path`` makes importable as a regular package or a module."""
    names = {p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    return names | {p.stem for p in root.glob("*.py")}


def colliding(ours: set[str]) -> dict[str, list[str]]:
    """Our names that another installed distribution also provides, with those distributions."""
    provided = importlib.metadata.packages_distributions()
    found = {name: sorted(set(provided.get(name, [])) - {"minillm"}) for name in ours}
    return {name: dists for name, dists in found.items() if dists}


def test_no_name_we_install_or_put_on_the_path_collides_with_a_dependency():
    ours = installed_top_level_names() | root_top_level_names()
    assert "minillm_kernels" in ours and "kernels" not in ours, sorted(ours)
    assert colliding(ours) == {}, "these import names are also another installed distribution's"


def test_the_check_sees_a_kernels_package_at_the_root(tmp_path):
    """The collision check itself can fail: a ``kernels/__init__.py`` at a root is seen as ours."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    assert "kernels" in root_top_level_names(tmp_path)
    provided = importlib.metadata.packages_distributions()
    if "kernels" in provided:  # Hugging Face's package is installed (transformers >= 5.25 needs it)
        assert colliding({"kernels"}) == {"kernels": sorted(set(provided["kernels"]) - {"minillm"})}


def test_the_kernels_folder_is_no_regular_package():
    assert (ROOT / "kernels" / "ops.py").exists()
    assert not (ROOT / "kernels" / "__init__.py").exists(), (
        "kernels/__init__.py would make `import kernels` from the repository root ours, not Hugging Face's"
    )


def test_the_kernels_are_imported_by_their_own_name():
    from minillm_kernels import ops

    assert Path(ops.__file__).resolve() == ROOT / "kernels" / "ops.py"
    assert callable(ops.paged_attention)


SCRIPT = """
import importlib.metadata, importlib.util, sys
from pathlib import Path
root = Path(sys.argv[1]).resolve()
import minillm
from minillm_kernels import ops
assert Path(ops.__file__).resolve() == root / "kernels" / "ops.py", ops.__file__
spec = importlib.util.find_spec("kernels")
if spec is not None and spec.origin is not None:          # a regular package named kernels: never ours
    assert Path(spec.origin).resolve().parent != root / "kernels", spec.origin
    import kernels                                        # Hugging Face's, beside the engine
    if importlib.util.find_spec("transformers.integrations.hub_kernels") is not None:
        from transformers.integrations import hub_kernels  # transformers' code that imports it
    print("hub kernels", importlib.metadata.version("kernels"))
import torch
from transformers import LlamaConfig, LlamaForCausalLM   # its modeling code uses the hub integration
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
torch.manual_seed(0)
logits = LlamaForCausalLM(cfg).eval()(torch.randint(0, 64, (1, 5))).logits
assert logits.shape == (1, 5, 64)
from minillm import LLM, SamplingParams
out = LLM("random", block_size=4, num_kv_blocks=8, max_model_len=16).generate(
    [[3, 4, 5]], SamplingParams(temperature=0, max_tokens=2))[0]
assert len(out.token_ids) == 2
print("ok")
"""


def _run_from(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), str(ROOT)], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_engine_and_transformers_hub_kernels_in_one_process_from_the_root():
    r = _run_from(ROOT)  # `python -c` puts the root first on sys.path
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


def test_engine_and_transformers_hub_kernels_in_one_process_from_elsewhere(tmp_path):
    r = _run_from(tmp_path)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr
    if importlib.util.find_spec("kernels") is not None:
        assert "hub kernels" in r.stdout, r.stdout
