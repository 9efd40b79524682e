"""The series stands on its own: no text refers to a source the reader cannot open.

Every claim in the notebooks, the engine, the kernels, the exercises, the README and docs/ comes from the
run, is worked out in the text, or cites published work (Orca, vLLM, Sarathi-Serve, ...). This test
fails on phrases that point at unpublished notes instead ("the seeds", "seed text", "seed concept");
random-number seeds are fine ("seed=3", "seeds the queries", "the seeds 0 to 7").
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKED = [
    *sorted((ROOT / "notebooks").glob("*.py")),
    *sorted((ROOT / "notebooks").glob("*.ipynb")),
    *sorted((ROOT / "minillm").rglob("*.py")),
    *sorted((ROOT / "kernels").rglob("*.py")),
    *sorted((ROOT / "exercises").glob("*.py")),
    *sorted((ROOT / "solutions").glob("*.py")),
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
SOURCE_REFERENCE = re.compile(
    r"\bthe seeds\b(?!\s+\d)|\bseeds'|\bseed text\b|\bseed concepts?\b"
    r"|\bseeds_(?:example|exercise)",
    re.IGNORECASE,
)


def references(text: str) -> list[str]:
    return [
        f"line {n}: {line.strip()[:100]}"
        for n, line in enumerate(text.splitlines(), 1)
        if SOURCE_REFERENCE.search(line)
    ]


def test_the_pattern_tells_a_source_reference_from_a_random_seed():
    assert references("The seeds' Figure 4") and references("the seeds: about 20x") and references("Seed concept: x")
    assert references("from the seed text") and references("def seeds_example(b):")
    assert not references("SamplingParams(seed=3)") and not references("``seed`` seeds the queries")
    assert not references("runs on the seeds 0 to 7") and not references("The seed of completion i")


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_reference_to_a_source_the_reader_cannot_open(path):
    found = references(path.read_text(encoding="utf-8"))
    assert not found, (
        f"{path.relative_to(ROOT)} refers to a source the reader cannot open; say it in the text, "
        "show it from the run, or cite the published work:\n  " + "\n  ".join(found)
    )
