"""``tools/tune_moe.py --quick``: the MoE tile tuner's plumbing on tiny shapes under the interpreter
(every candidate checked against the reference; its times mean nothing here)."""

import importlib.util
import subprocess
import sys

from helpers import ROOT, child_env

from pagedflash.ops import moe

TOOL = ROOT / "tools" / "tune_moe.py"
_spec = importlib.util.spec_from_file_location("tune_moe", TOOL)
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


def test_quick_stack(monkeypatch, capsys):
    """``--stack``: the decode case timed per layer of the bench's stack (its copies made once, checked
    as the single call is); the prefill case as without it."""
    made = []
    stack_fn = tune_moe.bench_moe.stack_fn
    monkeypatch.setattr(tune_moe.bench_moe, "stack_fn", lambda case, layers: made.append(layers) or stack_fn(case, layers))
    assert tune_moe.main(["--quick", "--stack", "--shapes", "tiny_silu", "--labels", "tensor cores"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and "ERROR" not in out and "skipped" not in out and "tensor cores" in out
    assert "| tiny_silu | 1 |" in out and "| tiny_silu | 70 |" in out and "--stack: ours at decode sizes" in out
    assert made == [tune_moe.bench_moe.STACK]  # the decode case only
    assert moe.TILES is None


def test_candidates_are_distinct_tiles():
    """Every candidate of the full run changes the current tiles, none twice; the other grouping form
    only where T <= 16."""
    for T, k, E in [(1, 8, 128), (4, 4, 32), (64, 8, 128), (8192, 4, 32)]:
        current = moe.tiles(T, k, E)
        found = tune_moe.candidates(current, T, k, E, T <= 64, quick=False)
        tiles = [t for _, t in found]
        assert current not in tiles and len(set(tiles)) == len(tiles)
        assert any(t.direct != current.direct for t in tiles) == (1 < T <= 16)
        assert all(t.direct and t.fused_sum and t.bm == 1 for t in tiles if t.gemv)
        assert any(t.gemv for t in tiles) == (T <= 16)


def test_labels_pick_their_candidate_even_when_an_earlier_label_gives_the_same_tile():
    """--labels keeps the tiles of the labels named: "stages=3" at prefill is the tile "part=dtype
    stages=3" also gives (the current tiles keep partials in the input dtype), and is still tried."""
    current = moe.tiles(8192, 4, 32)
    assert not current.part_fp32
    want = [("stages=3", current._replace(stages=3))]
    assert tune_moe.candidates(current, 8192, 4, 32, False, quick=False, labels=["stages=3"]) == want
    assert ("stages=3", current._replace(stages=3)) not in tune_moe.candidates(current, 8192, 4, 32, False, quick=False)


def test_compile_check():
    """``--compile-check`` (a process of its own: the kernels compiled, not interpreted): the current
    tiles' kernels (the gemv form at one token) and the tensor-core candidates', for sm_90 with the
    wheel's ptxas, at the real shape; the weight-streaming loops pipelined."""
    run = subprocess.run([sys.executable, str(TOOL), "--compile-check", "--shapes", "qwen3_30b_a3b", "--tokens", "1",
                          "--labels", "tensor cores", "fused"], capture_output=True, text=True,
                         env=child_env(interpret=False), timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert lines[-1].endswith(" 0 failed")
    for label, kernel in [("current", "_gate_up_kernel"), ("current", "_down_sum_kernel"),
                          ("tensor cores", "_gate_up_kernel"), ("tensor cores", "_down_kernel"),
                          ("fused", "_down_sum_kernel")]:
        line = next(x for x in lines if f" {label} " in x and kernel in x)
        assert " 0 async copies" not in line, line
