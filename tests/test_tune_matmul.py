"""tools/tune_matmul.py: the weights it derives from a model shape (against the published configs),
its copy of matmul's K-chunk rule, its candidate grid, its suggested rule, and a ``--smoke`` run of
the decode objective end to end on the CPU interpreter (its times mean nothing; the output's form is
what is checked)."""

import importlib.util
from pathlib import Path

import pytest
import torch
from helpers import ON_GPU

from pagedflash.ops import matmul as mm

_PATH = Path(__file__).resolve().parents[1] / "tools" / "tune_matmul.py"
_spec = importlib.util.spec_from_file_location("tune_matmul", _PATH)
tm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tm)


def test_projections_match_the_published_shapes():
    # Llama-3.2-1B: hidden 2048, intermediate 8192, 32 q / 8 kv heads of 64, vocab 128256, 16 layers
    assert tm.projections("llama-3.2-1b") == {
        "qkv": (3072, 2048, 16), "o_proj": (2048, 2048, 16), "gate_up": (16384, 2048, 16),
        "down": (2048, 8192, 16), "lm_head": (128256, 2048, 1)}
    # Llama-3-8B: hidden 4096, intermediate 14336, 32 q / 8 kv heads of 128, vocab 128256, 32 layers
    assert tm.projections("llama-3-8b") == {
        "qkv": (6144, 4096, 32), "o_proj": (4096, 4096, 32), "gate_up": (28672, 4096, 32),
        "down": (4096, 14336, 32), "lm_head": (128256, 4096, 1)}
    # Qwen3-30B-A3B: attention (32 / 4 heads of 128, o_proj from 4096 to 2048), 128 experts' router,
    # no dense MLP (its experts run in fused_moe), an untied 151936 x 2048 LM head
    assert tm.projections("qwen3-30b-a3b") == {
        "qkv": (5120, 2048, 48), "o_proj": (2048, 4096, 48), "router": (128, 2048, 48),
        "lm_head": (151936, 2048, 1)}
    assert tm.projections("gpt-oss-20b")["router"] == (32, 2880, 24)
    # Qwen1.5-MoE-A2.7B: 16 / 16 heads of 128, 60 experts' router and the shared expert's gate, the
    # shared expert of 5632
    assert tm.projections("qwen1.5-moe-a2.7b") == {
        "qkv": (6144, 2048, 24), "o_proj": (2048, 2048, 24), "router": (61, 2048, 24),
        "shared_gate_up": (11264, 2048, 24), "shared_down": (2048, 5632, 24), "lm_head": (151936, 2048, 1)}


def test_projections_share_a_label_when_shapes_repeat(monkeypatch):
    cfg = {**tm.shape_config("tiny"), "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4}
    monkeypatch.setattr(tm, "shape_config", lambda name, small=False: cfg)
    assert tm.projections("tiny") == {"qkv": (192, 64, 2), "o_proj+down": (64, 64, 4), "gate_up": (128, 64, 2),
                                      "lm_head": (512, 64, 1)}


@pytest.mark.parametrize("n,k", [(48, 4096), (64, 2048), (256, 8192), (2048, 2048), (128, 512)])
def test_chunked_is_matmul_tile_rule(monkeypatch, n, k):
    cpu = torch.device("cpu")
    plain = mm.tile(n, k, torch.float16, cpu)
    monkeypatch.setattr(mm, "CHUNK_K", True)
    with_chunks = mm.tile(n, k, torch.float16, cpu)
    assert tm.chunked(plain, n, k, tm.num_sms(cpu)) == (with_chunks if with_chunks.chunk_k else None)


def test_sweep_grid():
    assert {t.block_n for t in tm.SWEEP} == {16, 32, 64, 128, 256}
    for t in tm.SWEEP:
        assert t.block_m == mm.BLOCK_M and t.block_n * t.block_k <= 16384 and t.chunk_k == 0
        assert t.stages * (t.block_m + t.block_n) * t.block_k * 2 <= tm.SMEM
    assert len(tm.SWEEP) == len(set(tm.SWEEP)) <= 32
    assert not tm.fits(mm.Tile(64, 64, 128, 4, 3, 8), 32, 2880) and tm.fits(mm.Tile(64, 32, 128, 4, 3, 8), 32, 2880)


def test_suggest_picks_one_tile_per_n_and_merges_neighbours():
    a, b, c = (mm.Tile(64, bn, 128, 4, 3, 8) for bn in (16, 32, 128))
    weights = [(2048, {a: 0.9, b: 0.5}), (2048, {a: 0.6, b: 0.8, c: 0.1}), (3072, {a: 0.9, c: 0.2}),
               (16384, {c: 0.9, a: 0.3, b._replace(chunk_k=1024): 0.95})]
    # N = 2048: a's geomean 0.73 beats b's 0.63 (c was not timed on both)
    assert tm.suggest(weights) == ("N <= 3072: Tile(64, 16, 128, 4, 3, 8); "
                                   "else: Tile(64, 32, 128, 4, 3, 8) + CHUNK_K")
    assert tm.suggest(weights[:1]) == "every N: Tile(64, 16, 128, 4, 3, 8)"


@pytest.mark.skipif(ON_GPU, reason="--smoke runs the interpreter's CPU tensors; on a GPU the tool times cuda ones")
def test_smoke_decode_objective_end_to_end(tmp_path, capsys):
    out = tmp_path / "tune.log"
    tm.main(["--smoke", "--shape", "llama-3.2-1b", "--objective", "decode", "--rows", "1,8,70", "--sweep",
             "--chunk-k", "--out", str(out)])
    lines = capsys.readouterr().out.strip().splitlines()
    summary = lines[lines.index(next(s for s in lines if s.startswith("== summary llama-3.2-1b"))):]
    assert "objective decode" in summary[0] and len(summary) == 1 + 5 + 4
    for line, label in zip(summary[1:6], ("qkv 128x64 x2", "o_proj 64x64 x2", "gate_up 256x64 x2",
                                          "down 64x128 x2", "lm_head 512x64 x1")):
        assert line.startswith(f"{label}: current bn64 bk64 w4 s2 ") and "; best bn" in line
        assert line.count("[1:") == 3 and line.count(" | 70:") == 2  # decode rows, then the prefill row
        assert "; rule [1:" in line and " 70:" in line.split("; rule ")[1]  # matmul's own choice per M
    assert summary[6].startswith("decode step us (weights x per step): M=1: cuBLAS ") and "M=8:" in summary[6]
    assert "M=70" not in summary[6]
    assert summary[7].startswith("suggested rule (llama-3.2-1b): ") and "Tile(64, " in summary[7]
    assert summary[8].startswith("every timed tile gives the first timed tile's bits: ")
    assert summary[8].endswith(" of 5 weights")
    assert lines[-1].startswith(f"full log: {out}")
    log = out.read_text()
    assert log.strip().splitlines()[-len(summary) - 1:] == lines[-len(summary) - 1:]  # the file ends as stdout
    assert "bn16 bk64 w4 s2" in log and "bn32 bk64 w4 s2 chunks 64" in log  # the narrow tiles and K chunks
    assert "bitwise row invariance (M=1, 32, 70): cuBLAS: True" in log
    assert "other tiles whose output is bitwise the first timed tile's (M=70): " in log


@pytest.mark.parametrize("argv,message", [
    (["--rows", "1,x"], "argument --rows: expected comma-separated positive row counts"),
    (["--shape", "llama-9b"], "argument --shape: expected one of"),
    (["--objective", "decode", "--rows", "128,8192"], "argument --objective decode: --rows needs an M <= 64"),
])
def test_bad_arguments_name_the_argument(capsys, argv, message):
    with pytest.raises(SystemExit):
        tm.main(["--smoke", *argv])
    assert message in capsys.readouterr().err


@pytest.mark.skipif(ON_GPU, reason="--smoke runs the interpreter's CPU tensors; on a GPU the tool times cuda ones")
def test_smoke_warp_sweep_times_16_row_tiles(tmp_path):
    out = tmp_path / "tune.log"
    tm.main(["--smoke", "--shape", "llama-3.2-1b", "--objective", "decode", "--rows", "1,3", "--warp-sweep",
             "--out", str(out)])
    log = out.read_text()
    assert sum(" bm16 bn16 bk64 w1 s2 " in line and "refused" not in line for line in log.splitlines()) >= 5  # ranked
