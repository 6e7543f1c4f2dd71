"""The tree passes the project's lint (ruff with ``[tool.ruff]`` of pyproject.toml, as ``make lint``
runs it), so a lint error fails CI instead of waiting for someone to run ``make lint``."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_passes():
    pytest.importorskip("ruff", reason="ruff is in the test extra; not installed here")
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "pagedflash", "tests", "tools"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
