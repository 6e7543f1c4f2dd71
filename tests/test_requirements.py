"""``make``'s versions live in one place each: torch and triton in the Makefile (installed only where
missing), everything else in constraints.txt (``make setup``'s pins); README's Requirements table
says the same versions, and every package an extra names is pinned there."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"constraints.txt: expected name==version, got {line!r}"
            pins[_norm(name)] = version.strip()
    return pins


def makefile_pins() -> dict[str, str]:
    text = (ROOT / "Makefile").read_text()
    return {name.lower(): re.search(rf"^{name} = (\S+)$", text, re.M).group(1) for name in ("TORCH", "TRITON")}


def readme_versions() -> dict[str, str]:
    """The Requirements table's CPU CI column by package (its first word, without backquotes)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Requirements\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 2 and cells[0] and not set(cells[0]) <= set("-"):
            rows[_norm(cells[0].split()[0].strip("`"))] = cells[1].split()[0].strip("`") if cells[1] else ""
    return rows


def test_readme_table_gives_make_versions():
    pins, table = {**constraints(), **makefile_pins()}, readme_versions()
    for name in ("torch", "triton", "pytest", "pytest-xdist", "hypothesis", "transformers", "tokenizers",
                 "safetensors", "numpy"):
        assert name in table, f"README Requirements: no row for {name}"
    for name, version in table.items():
        if name in pins:
            assert version == pins[name], f"README Requirements: {name} {version}, but make installs {pins[name]}"


def test_every_extra_is_pinned():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = constraints()
    for extra, requirements in project["optional-dependencies"].items():
        for requirement in requirements:
            name = _norm(re.match(r"[A-Za-z0-9_.-]+", requirement).group(0))
            assert name in pins, f"pyproject extra {extra!r} names {name}, which constraints.txt does not pin"
    assert "torch" not in pins and "triton" not in pins, "torch and triton are the Makefile's (kept where installed)"
