"""Smoke tests of the command line: ``bench --quick`` end to end (tables, JSON, PNG) and the kernel
checks of ``demo``, in-process and in seconds under the interpreter. They check plumbing and that
every pagedflash case passed its correctness check; the figures themselves mean nothing here."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, child_env

from pagedflash import cli
from pagedflash.demo import print_kernel_checks, run_kernel_checks


def _bench(name: str, out: Path) -> dict:
    assert cli.main(["bench", name, "--quick", "--out", str(out)]) == 0
    doc = json.loads((out / f"{name}.json").read_text())
    assert doc["bench"] == name and doc["env"]["quick"] is True
    assert (out / f"{name}.md").stat().st_size > 0
    return doc


def _png(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path


def _measured(value) -> bool:
    """A timed cell holds a number; a status (FAIL, error, OOM, n/a) is a string."""
    return isinstance(value, (int, float))


def test_bench_prefill_quick(tmp_path, capsys):
    doc = _bench("prefill", tmp_path)
    memory, tput = doc["tables"]["memory"]["rows"], doc["tables"]["tflops"]["rows"]
    assert [r["N"] for r in memory] and {"naive", "pagedflash", "sdpa_flash", "sdpa_cudnn"} <= memory[0].keys()
    assert {(r["causal"], r["N"]) for r in tput} == {(c, n) for c in (False, True) for n in (16, 32)}
    for row in tput:
        assert _measured(row["dense"]) and _measured(row["varlen"]), row
        assert {"flash", "cudnn", "vs_flash", "vs_cudnn", "varlen_vs_dense", "dense_err"} <= row.keys()
    assert doc["summary"]["failures"] == 0
    _png(tmp_path / "prefill_tflops.png")
    assert "Prefill TFLOP/s" in capsys.readouterr().out


def test_bench_decode_quick(tmp_path):
    doc = _bench("decode", tmp_path)
    splits, grid = doc["tables"]["splits"]["rows"], doc["tables"]["grid"]["rows"]
    for row in splits:
        assert all(_measured(row[k]) for k in ("s1", "s2", "auto")), row
        assert row["best_split"] in (1, 2) and row["auto_over_best"] > 0
    for row in grid:
        assert _measured(row["us"]) and _measured(row["tbps"]) and {"cudnn_us", "flash_us", "vs_cudnn"} <= row.keys()
    assert {"geomean_pf_vs_cudnn", "geomean_auto_over_best", "failures"} <= doc["summary"].keys()
    fp8 = doc["tables"]["fp8"]["rows"]
    assert fp8 and all(_measured(r["fp8_us"]) and _measured(r["bf16_us"]) and r["err_unquant"] is not None
                       for r in fp8)
    _png(tmp_path / "decode_splits.png")
    _png(tmp_path / "decode_grid.png")


def test_bench_paged_quick(tmp_path):
    doc = _bench("paged", tmp_path)
    decode = doc["tables"]["paged_decode"]["rows"]
    assert decode and all(_measured(r["contig_us"]) and _measured(r["p1_over"]) and _measured(r["p16_over"])
                          for r in decode)
    chunked = doc["tables"]["chunked_prefill"]["rows"]
    assert chunked and all(_measured(r["p16_tflops"]) and _measured(r["dense_tflops"]) for r in chunked)
    assert all(_measured(r["p16_fp8_tflops"]) and r["p16_fp8_err_unquant"] is not None for r in chunked)
    fp8 = doc["tables"]["fp8_paged"]["rows"]
    assert fp8 and all(_measured(r["fp8_us"]) and r["page"] == 16 for r in fp8)
    decode64 = doc["tables"]["paged_decode_d64"]["rows"]
    assert decode64 and all(_measured(r["p16_over"]) for r in decode64)
    assert "D=64" in doc["tables"]["fp8_paged_d64"]["title"]
    fp8_64 = doc["tables"]["fp8_paged_d64"]["rows"]
    assert fp8_64 and all(_measured(r["fp8_us"]) for r in fp8_64)
    off, on = doc["tables"]["prefix_caching"]["rows"]
    assert off["mode"] == "off" and on["mode"] == "on"
    assert on["computed"] < off["computed"] and _measured(on["speedup"]) and on["ideal"] > 1
    _png(tmp_path / "paged_decode.png")


def test_kernel_checks_table(capsys):
    rows = run_kernel_checks("cuda" if torch.cuda.is_available() else "cpu")
    names = " ".join(r["kernel"] for r in rows)
    for kernel in ("prefill dense", "causal", "window", "softcap", "varlen", "paged", "decode contiguous",
                   "append", "merge_attn_states", "write_kv_cache"):
        assert kernel in names
    failed = [r for r in rows if not r["ok"]]
    assert not failed, failed
    assert print_kernel_checks(rows)
    assert "rel. error" in capsys.readouterr().out


def test_wrong_kernel_is_reported_not_timed(tmp_path, monkeypatch):
    """A kernel whose output is wrong (here: zeros, which an absolute tolerance would accept at long
    context) gives FAIL cells, no figure, and exit status 1."""
    import pagedflash

    real = pagedflash.flash_attn_with_kvcache
    monkeypatch.setattr(pagedflash, "flash_attn_with_kvcache", lambda q, *a, **k: torch.zeros_like(real(q, *a, **k)))
    assert cli.main(["bench", "decode", "--quick", "--out", str(tmp_path)]) == 1
    doc = json.loads((tmp_path / "decode.json").read_text())
    assert doc["summary"]["failures"] > 0
    assert all(row["us"] == "FAIL" for row in doc["tables"]["grid"]["rows"])


def test_bench_rejects_unknown_arguments(capsys):
    assert cli.main(["bench", "decode", "--quick", "--bogus"]) == 2
    assert "--bogus" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_bench_without_gpu_exits_2():
    proc = subprocess.run([sys.executable, "-m", "pagedflash", "bench", "prefill"], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "need a CUDA GPU" in proc.stderr and "--quick" in proc.stderr


def test_tune_parses_cells_and_tiles():
    """`bench tune` options name what they sweep; a malformed one stops with the item it could not read."""
    from pagedflash.bench.tune import _parse_cell, _parse_tiles

    assert _parse_cell("4x16384") == (4, 16384, 32, 8, 128, torch.bfloat16)
    assert _parse_cell("1x1024@16/16/64/fp16") == (1, 1024, 16, 16, 64, torch.float16)
    assert _parse_tiles(None) is None
    assert _parse_tiles("64:4:3,128:4:2:tma,64:4:3:g2,32:4:4:tma:g1") == [
        (64, 4, 3, False), (128, 4, 2, True), (64, 4, 3, False, 2), (32, 4, 4, True, 1)]
    for bad in ("64:4:3:x", "64:4:3:g0", "64:4:3:g2:tma", "64:4:3:tma:g2:g2"):
        with pytest.raises(SystemExit, match=f"--tiles: .*{bad}"):
            _parse_tiles(bad)
    with pytest.raises(SystemExit, match="--cells: dtype"):
        _parse_cell("1x1024@16/16/64/int8")


def test_flush_option_sets_the_timing_default(tmp_path, monkeypatch):
    """``--flush read`` makes every time_ms call that does not choose its own flush clean L2 by a read
    (the run's recorded method says so); the default stays do_bench's zeroing; a bad value is refused."""
    from pagedflash.bench import common

    monkeypatch.setattr(common, "_TIMING", dict(common._TIMING))
    assert cli.main(["bench", "prefill", "--quick", "--flush", "read", "--out", str(tmp_path)]) == 0
    monkeypatch.setattr(common, "has_gpu", lambda: True)  # timing_description's GPU wording
    assert common._TIMING["flush"] == "read" and "256 MB read" in common.timing_description()
    common.set_timing()
    assert common._TIMING["flush"] == "zero" and "do_bench" in common.timing_description()
    with pytest.raises(ValueError, match="flush must be 'zero' or 'read', got None"):
        common.set_timing(flush=None)
    with pytest.raises(SystemExit):
        cli.main(["bench", "prefill", "--quick", "--flush", "none"])
