"""Our top-level ``kernels`` package must not pass for Hugging Face's ``kernels`` hub package.

``transformers`` asks "is ``kernels`` installed, and which version?" and, if it believes
so, imports ``from kernels import get_kernel, ...`` -- which would fail on ours. Its probe
(``transformers.utils.import_utils._is_package_available``) goes:

1. ``importlib.util.find_spec("kernels")``: finds our package. Unavoidable.
2. The version, by distribution name: ``importlib.metadata.version("kernels")`` (no such
   distribution), then the distributions that ``packages_distributions()`` maps the
   import name to. Installed editable or as a wheel, setuptools lists ``kernels`` in
   minillm's ``top_level.txt``, so this reads *minillm's* version.
3. With no metadata at all (not installed), it imports the package and reads
   ``__version__``: we define none, so it gets "N/A".

Then ``is_kernels_available`` requires ``KERNELS_MIN_VERSION <= version`` (and, in newer
releases, ``< KERNELS_MAX_VERSION``); older releases required the metadata lookup of
step 2 by the name ``kernels`` itself. Either way the answer is False, as long as
minillm's version stays below Hugging Face ``kernels``' minimum: that is what we check.
"""

import importlib.metadata
import importlib.util
import re
from pathlib import Path

import pytest
import torch
from packaging.version import Version

import_utils = pytest.importorskip("transformers.utils.import_utils")

REPO = Path(__file__).resolve().parents[1]
PROJECT_VERSION = re.search(r'^version\s*=\s*"([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)


def _is_kernels_available() -> bool:
    for cached in (import_utils.is_kernels_available, getattr(import_utils, "_package_distribution_mapping", None)):
        getattr(cached, "cache_clear", lambda: None)()
    return bool(import_utils.is_kernels_available())


def test_the_kernels_transformers_finds_is_ours():
    import kernels

    spec = importlib.util.find_spec("kernels")
    assert spec is not None and spec.origin == kernels.__file__ and hasattr(kernels, "paged_attention")
    assert not hasattr(kernels, "__version__"), "a __version__ here is what transformers reads when uninstalled"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("kernels")  # Hugging Face's package installed beside ours would clash


def test_transformers_is_kernels_available_is_false():
    assert not _is_kernels_available()


@pytest.mark.parametrize("install", ["editable or wheel", "not installed"])
def test_probe_is_false_however_minillm_is_installed(install, monkeypatch):
    """Replay the probe for both outcomes of step 2, whatever this checkout's install."""
    real_version = importlib.metadata.version

    def version(name):
        if name == "minillm":
            if install == "not installed":
                raise importlib.metadata.PackageNotFoundError(name)
            return PROJECT_VERSION
        return real_version(name)

    mapping = {"kernels": ["minillm"]} if install != "not installed" else {}
    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(import_utils, "_package_distribution_mapping", lambda: mapping, raising=False)
    monkeypatch.setattr(import_utils, "PACKAGE_DISTRIBUTION_MAPPING", mapping, raising=False)  # older releases
    assert not _is_kernels_available()
    monkeypatch.undo()
    _is_kernels_available()  # leave the real answer cached


def test_minillm_version_stays_below_hub_kernels_minimum():
    minimum = getattr(import_utils, "KERNELS_MIN_VERSION", "0.9.0")
    assert Version(PROJECT_VERSION) < Version(minimum), (
        f"minillm {PROJECT_VERSION} >= {minimum}: transformers would read it as the version of a Hugging Face "
        "`kernels` install (see this module's docstring)"
    )
    dists = importlib.metadata.packages_distributions().get("kernels", [])
    assert set(dists) <= {"minillm"}, dists


def test_tiny_llama_forward_with_our_kernels_importable():
    import kernels  # noqa: F401  (importable and imported: transformers must not care)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (2, 7, 64) and torch.isfinite(logits).all()
