"""The tree passes the project's lint (ruff with ``[tool.ruff]`` of pyproject.toml, as ``make lint``
runs it), so a lint error fails CI instead of waiting for someone to run ``make lint``. Only with the
ruff that constraints.txt pins: a newer one may add rules to the selected sets (``make test-latest``
upgrades it), which is a lint update to make on purpose, not a test failure."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_passes():
    pytest.importorskip("ruff", reason="ruff is in the test extra; not installed here")
    pinned = re.search(r"^ruff==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M)
    version = subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True, text=True).stdout.split()
    if pinned is None or version[-1:] != [pinned.group(1)]:
        pytest.skip(f"ruff {' '.join(version[1:])} is not the pinned {pinned and pinned.group(1)}")
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "pagedflash", "tests", "tools"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
