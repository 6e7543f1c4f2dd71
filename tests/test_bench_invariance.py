"""Issue 32's measurements on the CPU interpreter, at tiny sizes: ``bench decode/prefill
--batch-invariant`` (each grid point also timed in the mode, its ratio per point and the geometric
means), ``bench serve --batch-invariant`` (the engine of a section built with the mode off and on,
the on/off ratios), and ``bench invariance --quick`` (greedy outputs under load, with preemption,
chunked prefill and prefix hits, equal to each request served alone for 100 % of requests with the
mode on). Times mean nothing here; the plumbing, the fields and the equality do."""

import json

import pytest
import torch

from pagedflash import cli
from pagedflash.bench import decode, invariance, prefill, serve
from pagedflash.bench.serve_invariant import itl_summary, throughput_summary


def _doc(out, name: str) -> dict:
    return json.loads((out / f"{name}.json").read_text())


def _number(x) -> bool:
    return isinstance(x, float) and x > 0


def test_decode_and_prefill_time_each_point_in_both_modes(tmp_path, monkeypatch):
    q = decode.QUICK
    monkeypatch.setitem(decode.QUICK, "seed", {**q["seed"], "lens": (32,), "splits": (1,)})
    monkeypatch.setitem(decode.QUICK, "grid", {**q["grid"], "batches": (2,)})
    monkeypatch.setitem(decode.QUICK, "fp8", {**q["fp8"], "batches": (2,)})
    monkeypatch.setitem(prefill.QUICK, "lens", (16,))
    assert cli.main(["bench", "decode", "--quick", "--batch-invariant", "--out", str(tmp_path)]) == 0
    doc = _doc(tmp_path, "decode")
    (grid,), (fp8,) = doc["tables"]["grid"]["rows"], doc["tables"]["fp8"]["rows"]
    assert all(_number(grid[k]) for k in ("us", "inv_us", "inv_x", "p16_us", "p16_inv_us", "p16_inv_x"))
    assert _number(fp8["fp8_inv_x"]) and "inv_x" in doc["tables"]["grid"]["columns"]
    summary = doc["summary"]
    assert summary["failures"] == 0
    assert all(_number(summary[k]) for k in ("geomean_invariant_x", "geomean_invariant_x_paged",
                                              "geomean_invariant_x_fp8"))

    assert cli.main(["bench", "prefill", "--quick", "--batch-invariant", "--out", str(tmp_path)]) == 0
    doc = _doc(tmp_path, "prefill")
    rows = doc["tables"]["tflops"]["rows"]
    assert len(rows) == 2 and all(_number(r["dense_inv_x"]) and _number(r["varlen_inv_x"]) for r in rows)
    assert _number(doc["summary"]["geomean_invariant_x"]) and doc["summary"]["failures"] == 0


def test_option_refused_where_it_means_nothing(capsys):
    assert cli.main(["bench", "paged", "--quick", "--batch-invariant"]) == 2
    assert "--batch-invariant is for decode, prefill, serve" in capsys.readouterr().err
    assert serve.main(["--quick", "--batch-invariant", "--tensor-parallel-size", "2", "--sections", "throughput"]) == 2
    assert "--batch-invariant times one-GPU engines" in capsys.readouterr().err


def test_serve_runs_the_engine_in_both_modes_in_turns(tmp_path, monkeypatch, capsys):
    """Two rounds: engines built off, on, off, on; each mode's row its median run (the lower of two)."""
    monkeypatch.setitem(serve.QUICK, "num_requests", 2)
    monkeypatch.setitem(serve.QUICK, "output", (2, 2))
    monkeypatch.setattr(serve, "_warm", lambda *args: None)  # no timing figure is read here
    built, engine = [], serve.LLM

    def llm(*args, batch_invariant=False, **kwargs):  # the engines in the order they are built
        built.append(batch_invariant)
        return engine(*args, batch_invariant=batch_invariant, **kwargs)

    monkeypatch.setattr(serve, "LLM", llm)
    assert serve.main(["--quick", "--sections", "throughput", "--no-hf", "--batch-invariant", "--rounds", "2",
                       "--out", str(tmp_path)]) == 0
    assert built == [False, True] * 2
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("pagedflash engine")]
    runs = {mode: [float(line.split(": ")[1].split()[0]) for line in printed if (", batch-invariant" in line) == mode]
            for mode in (False, True)}
    doc = _doc(tmp_path, "serve")
    off, on = doc["tables"]["throughput"]["rows"]
    assert (off["invariant"], on["invariant"]) == ("off", "on") and "batch-invariant" in on["system"]
    for row, mode in ((off, False), (on, True)):
        assert len(runs[mode]) == 2 and f"{row['tok_s']:.0f}" == f"{min(runs[mode]):.0f}"
        assert row["note"].endswith("median of 2 runs: " + " / ".join(f"{x:.0f}" for x in runs[mode]) + " tok/s")
    assert "inv_x" not in off and on["inv_x"] == pytest.approx(off["tok_s"] / on["tok_s"])
    assert doc["summary"]["throughput_invariant_x"] == on["inv_x"]
    assert serve.main(["--quick", "--sections", "throughput", "--rounds", "0"]) == 2
    assert "--rounds must be >= 1, got 0" in capsys.readouterr().err


def test_median_run_is_a_whole_run_and_its_note_lists_every_run():
    def run(tok_s, steps):
        return dict(tok_s=tok_s, seconds=1 / tok_s, note=f"{steps} steps")

    assert serve._median_run([run(3.0, 7), run(1.0, 8), run(2.0, 9)]) == dict(
        run(2.0, 9), note="9 steps; median of 3 runs: 3 / 1 / 2 tok/s")
    assert serve._median_run([run(4.0, 1), run(1.0, 2), run(3.0, 3), run(2.0, 4)])["tok_s"] == 2.0  # the lower middle
    assert serve._median_run([run(5.0, 6)]) == run(5.0, 6)  # one run: its own note


def test_serve_ratios_pair_rows_by_point():
    def row(graphs, inv, batch, ctx, itl):
        return dict(graphs=graphs, invariant=inv, batch=batch, context=ctx, itl_ms=itl)

    rows = [row("on", "off", 1, 16, 2.0), row("on", "off", 1, 48, 4.0), row("on", "on", 1, 16, 2.2),
            row("on", "on", 1, 48, 4.4), row("off", "off", 32, 16, 10.0), row("off", "on", 32, 16, 12.0)]
    summary = {}
    itl_summary(rows, summary)
    assert rows[2]["inv_x"] == pytest.approx(1.1) and rows[3]["inv_x"] == pytest.approx(1.1)
    assert summary == {"itl_invariant_x_b1": pytest.approx(1.1), "itl_invariant_x_b32_eager": pytest.approx(1.2)}
    tput = [dict(system="engine", invariant="off", tok_s=100.0), dict(system="engine", invariant="on", tok_s=80.0),
            dict(system="transformers", tok_s=10.0)]
    throughput_summary(tput, summary)
    assert summary["throughput_invariant_x"] == pytest.approx(1.25) and "inv_x" not in tput[2]
    # a point one mode skipped (its pool could not hold the batch) leaves its batch without a mean
    skipped = [r for r in rows if not (r["invariant"] == "off" and r["batch"] == 1 and r["context"] == 48)]
    for r in skipped:
        r.pop("inv_x", None)
    summary = {}
    itl_summary(skipped, summary)
    assert summary == {"itl_invariant_x_b32_eager": pytest.approx(1.2)}


def test_invariance_quick_all_equal_with_the_mode_on(tmp_path, capsys):
    assert invariance.main(["--quick", "--modes", "on", "--logprobs", "0", "--out", str(tmp_path)]) == 0
    (row,) = _doc(tmp_path, "invariance")["tables"]["invariance"]["rows"]
    assert row["mode"] == "on" and row["equal_pct"] == 100 and row["logprobs_equal_pct"] == 100
    assert row["same_weights"] and row["errors"] == 0
    # the loaded run went through what the check is about
    assert row["preemptions"] > 0 and row["hit_requests"] > 0 and row["chunked"] > 0
    if not torch.cuda.is_available():  # the CPU result is the kernels' only with the row-exact dot
        assert "row_exact_interpreter_dot" in capsys.readouterr().out


def test_invariance_refuses_bad_arguments(capsys):
    assert invariance.main(["--quick", "--modes", "sometimes"]) == 2
    assert "--modes" in capsys.readouterr().err
    assert invariance.main(["--quick", "--num-blocks", "2"]) == 2
    assert "does not fit" in capsys.readouterr().err
    assert invariance.main(["--quick", "--num-requests", "0"]) == 2
    assert "--num-requests: expected an int >= 1, got 0" in capsys.readouterr().err
