"""``tools/admission_cost.py`` (the prefix-hit admission figure of docs/performance.md v40) runs and
reports one figure, at small sizes."""

import subprocess
import sys

from helpers import ROOT, child_env

TOOL = ROOT / "tools" / "admission_cost.py"


def test_admission_cost_reports_a_figure():
    run = subprocess.run([sys.executable, str(TOOL), "--prefix", "64", "--suffix", "8", "--requests", "4",
                          "--rounds", "2"], capture_output=True, text=True, timeout=120, env=child_env())
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("3 prefix hits of 64 + 8 ids, page 16: ") and "ms a request" in run.stdout


def test_bad_sizes_are_refused():
    run = subprocess.run([sys.executable, str(TOOL), "--requests", "1"], capture_output=True, text=True, timeout=120,
                         env=child_env())
    assert run.returncode == 2 and "--requests: expected an int >= 2, got 1" in run.stderr
