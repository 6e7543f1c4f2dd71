"""``tools/tune_moe.py --quick``: the MoE tile tuner's plumbing on tiny shapes under the interpreter
(every candidate checked against the reference; its times mean nothing here)."""

import importlib.util
from pathlib import Path

from pagedflash.ops import moe

_spec = importlib.util.spec_from_file_location("tune_moe", Path(__file__).resolve().parents[1] / "tools" / "tune_moe.py")
tune_moe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tune_moe)


def test_quick(capsys):
    assert tune_moe.main(["--quick", "--shapes", "tiny_swiglu"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and "ERROR" not in out
    for T in (1, 70):  # a decode and a prefill case, each with its timed candidates and a suggestion
        assert f"tiny_swiglu T={T}: current Tiles(" in out
        assert f"| tiny_swiglu | {T} |" in out
    assert "fused" in out and "gemv" in out and "part=dtype" in out and "Suggested tiles()" in out
    assert moe.TILES is None


def test_candidates_are_distinct_tiles():
    """Every candidate of the full run changes the current tiles, none twice; the other grouping form
    only where T <= 16."""
    for T, k, E in [(1, 8, 128), (4, 4, 32), (64, 8, 128), (8192, 4, 32)]:
        current = moe.tiles(T, k, E)
        found = tune_moe.candidates(current, T, T <= 64, quick=False)
        tiles = [t for _, t in found]
        assert current not in tiles and len(set(tiles)) == len(tiles)
        assert any(t.direct != current.direct for t in tiles) == (1 < T <= 16)
        assert all(t.direct and t.fused_sum and t.bm == 1 for t in tiles if t.gemv)
        assert any(t.gemv for t in tiles) == (T <= 16)
