"""environment.yml (conda users) lists the same dependencies as pyproject.toml."""

import re

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _name_spec(req: str) -> tuple[str, str]:
    req = req.split(";")[0].strip()
    m = re.match(r"^([A-Za-z0-9_.\-]+)\s*(.*)$", req)
    return m.group(1).lower(), m.group(2).replace(" ", "")


def test_environment_yml_matches_pyproject():
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    want = dict(_name_spec(r) for r in py["dependencies"] + py["optional-dependencies"]["dev"])
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    have = dict(_name_spec(r) for r in pip if not r.startswith(("-e", "-c")))
    assert have == want
    assert "-c constraints.txt" in pip, "conda users install the tested versions too"


def test_torch_is_a_range_not_a_pin():
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch = next(r for r in py["dependencies"] if r.startswith("torch"))
    assert "==" not in torch and ">=" in torch


def test_license_is_an_spdx_expression():
    """A ``project.license`` table is deprecated (setuptools >= 77 warns on every install)."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert isinstance(data["project"]["license"], str), 'license = "MIT" (an SPDX expression), not a table'
    setuptools = next(r for r in data["build-system"]["requires"] if r.startswith("setuptools"))
    m = re.search(r">=\s*(\d+)", setuptools)
    assert m and int(m.group(1)) >= 77, "SPDX license strings need setuptools>=77 in [build-system]"


def test_notebook_outputs_are_kept_out_of_commits_by_a_git_filter():
    """``.gitattributes`` names the nbstripout filter, the dev extra installs it, ``make install`` defines it."""
    attributes = (ROOT / ".gitattributes").read_text().split("\n")
    assert "*.ipynb filter=nbstripout" in attributes
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "nbstripout" in dict(_name_spec(r) for r in py["optional-dependencies"]["dev"])
    makefile = (ROOT / "Makefile").read_text()
    assert "git config filter.nbstripout.clean" in makefile


def test_the_installed_packages_are_every_package_folder():
    """``pyproject.toml`` lists the packages by hand (``kernels/`` goes in as ``minillm_kernels``): a new
    sub-package of ``minillm/`` must be added there, or an install that is not editable would lack it."""
    tools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {
        ".".join(p.relative_to(ROOT).parts)
        for p in [ROOT / "minillm", *(ROOT / "minillm").rglob("*")]
        if p.is_dir() and p.name != "__pycache__" and p.name.isidentifier()
    }
    assert set(tools["packages"]) == folders | {"minillm_kernels"}  # a data folder too, or setuptools warns
    assert tools["package-dir"] == {"minillm_kernels": "kernels"}


def _pins() -> dict[str, str]:
    """constraints.txt as {normalized name: version}."""
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt pins exact versions: {line!r}"
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version.strip()
    return pins


def test_every_dependency_is_pinned_inside_its_range():
    """The README's commands install a tested set (constraints.txt); each pin satisfies pyproject.toml."""
    from packaging.requirements import Requirement

    py = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _pins()
    for text in py["dependencies"] + py["optional-dependencies"]["dev"]:
        req = Requirement(text)
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        assert name in pins, f"{req.name} is not pinned in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), f"{req.name}=={pins[name]} is outside {req}"
    makefile = (ROOT / "Makefile").read_text()
    assert "CONSTRAINTS     ?= constraints.txt" in makefile
    assert f"TORCH_VERSION   ?= {pins['torch']}" in makefile, "the torch the set-up installs is the pinned one"
