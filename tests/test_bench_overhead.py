"""``pagedflash bench overhead``: runs on a CPU (no --quick needed there), writes its table, and
leaves pagedflash as it found it. The figures themselves mean nothing here."""

import json

import pytest
import torch

from pagedflash import cli, flash_attn_with_kvcache, validate
from pagedflash.bench import common, overhead
from pagedflash.ops import attention, combine, fastlaunch, scratch

COLUMNS = ("ours", "public", "checked", "checks", "launch", "replay", "sdpa", "vs_sdpa", "public_vs_sdpa",
           "ours_wall")


def test_bench_overhead_quick(tmp_path, capsys):
    assert cli.main(["bench", "overhead", "--quick", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "overhead.json").read_text())
    assert doc["bench"] == "overhead" and doc["env"]["quick"] is True
    rows = doc["tables"]["overhead"]["rows"]
    assert [r["workload"] for r in rows] == ["decode", "prefill", "paged decode", "varlen"]
    for row in rows:
        assert all(isinstance(row[c], float) and row[c] > 0 for c in COLUMNS), row
        assert row["sdpa_backend"] and isinstance(row["meets_target"], bool)
        assert row["launches"] >= 1 and row["replay"] < row["launch"], row
    summary = doc["summary"]
    assert summary["failures"] == 0 and summary["target"] == overhead.TARGET
    assert summary["direct_launch"] == fastlaunch.direct_status()  # on, off or why refused
    assert {"decode_vs_sdpa", "prefill_vs_sdpa", "paged_decode_vs_sdpa", "varlen_vs_sdpa"} <= summary.keys()
    assert (tmp_path / "overhead.md").stat().st_size > 0
    assert "Host time per eager call" in capsys.readouterr().out


def test_cpu_run_needs_no_quick_flag(tmp_path, monkeypatch):
    monkeypatch.setattr(overhead, "CALLS", 2)
    monkeypatch.setattr(overhead, "ROUNDS", 1)
    assert cli.main(["bench", "overhead", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "overhead.json").read_text())["env"]["quick"] is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="drives CPU tensors through the interpreter's launch")
def test_dry_run_launches_nothing_and_restores_everything():
    kernels = attention._attention_kernel, combine._combine_kernel
    state = fastlaunch.enabled(), fastlaunch.status(), scratch.CPU
    q, k = torch.randn(1, 1, 4, 32), torch.randn(1, 64, 2, 32)
    lens = torch.full((1,), 64, dtype=torch.int32)
    marker = torch.full((1, 1, 4, 32), 7.0)
    with torch.inference_mode(), validate.value_checks(False), overhead.dry_run():
        for _ in range(3):  # public once, then through the fast path's handle
            out, _ = attention.attention_forward(q, k, k, batch=1, max_seqlen_q=1, max_seqlen_k=64, sm_scale=0.2,
                                                 window=(-1, 0), softcap=0.0, seqused_k=lens, num_splits=2,
                                                 out=marker.clone())
        assert torch.equal(out, marker)  # no kernel ran
        assert all(p.slot.handle is not None for p in attention._PLANS.values())
    assert (attention._attention_kernel, combine._combine_kernel) == kernels
    assert (fastlaunch.enabled(), fastlaunch.status(), scratch.CPU) == state
    assert not attention._PLANS
    got = flash_attn_with_kvcache(q, k, k, cache_seqlens=64, num_splits=2)
    assert not torch.equal(got, marker) and got.isfinite().all()  # kernels run again


def test_host_us_times_a_loop():
    calls = []
    host, wall = common.host_wall_us(lambda: calls.append(1), calls=5, rounds=3, warmup=2)
    assert len(calls) == 2 + 5 * 3 and 0 < host <= wall
