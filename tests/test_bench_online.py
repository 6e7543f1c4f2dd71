"""``pagedflash bench online`` against a stand-in OpenAI-compatible server with known delays
(tests/openai_standin.py, on 127.0.0.1): the metric arithmetic, the arrival process, the
concurrency cap, failures and timeouts, the sweep's files, a launched server, the offline side."""

import asyncio
import json
import math
import random
import statistics
import sys
from pathlib import Path

import pytest
from openai_standin import StandIn

from pagedflash import cli
from pagedflash.bench import loadgen, loadgen_procs, online, online_offline

STANDIN = Path(__file__).with_name("openai_standin.py")
TOKENS = loadgen.TokenSpace(100)


def _run(server, requests, **kw):
    kw.setdefault("timeout", 20.0)
    return asyncio.run(loadgen.run_load(requests, base_url=server.url, model="standin", **kw))


def _requests(n, out=5, prompt=4):
    return loadgen.random_requests(n, input_len=(prompt, prompt), output_len=(out, out), tokens=TOKENS)


# ---------------------------------------------------------------- arithmetic


def test_percentile_and_summary_arithmetic():
    assert loadgen.percentile([1, 2, 3, 4], 50) == 2.5  # numpy's linear interpolation
    assert loadgen.percentile(list(range(1, 11)), 90) == pytest.approx(9.1)
    assert loadgen.percentile([7.0], 99) == 7.0 and loadgen.percentile([], 50) is None
    rs = [loadgen.RequestResult(ok=True, prompt_tokens=10, output_tokens=5, ttft=0.1, e2el=0.5, itl=[0.1] * 4),
          loadgen.RequestResult(ok=True, prompt_tokens=20, output_tokens=3, ttft=0.3, e2el=0.5, itl=[0.1, 0.1]),
          loadgen.RequestResult(ok=True, prompt_tokens=6, output_tokens=1, ttft=0.2, e2el=0.2),
          loadgen.RequestResult(ok=False, error="boom", prompt_tokens=99, output_tokens=0)]
    assert [r.tpot for r in rs] == [pytest.approx(0.1), pytest.approx(0.1), None, None]
    s = loadgen.summarize(rs, 2.0, {"ttft": 250, "tpot": 100.5})
    assert (s["completed"], s["failed"], s["input_tokens"], s["output_tokens"]) == (3, 1, 36, 9)
    assert s["request_throughput"] == 1.5 and s["output_throughput"] == 4.5 and s["input_throughput"] == 18
    assert s["ttft_mean_ms"] == pytest.approx(200) and s["ttft_p50_ms"] == pytest.approx(200)
    assert s["ttft_p90_ms"] == pytest.approx(280) and s["e2el_p50_ms"] == pytest.approx(500)
    assert s["tpot_mean_ms"] == pytest.approx(100) and s["itl_p99_ms"] == pytest.approx(100)
    # the 0.3 s TTFT misses 250 ms; one token meets any TPOT bound; a failure never counts
    assert s["good_requests"] == 2 and s["goodput"] == 1.0 and s["first_error"] == "boom"
    assert loadgen.parse_goodput(["ttft:500", "tpot:50", "e2el:2e3"]) == {"ttft": 500, "tpot": 50, "e2el": 2000}
    for bad in ("ttfb:5", "ttft", "ttft:-1", "tpot:x"):
        with pytest.raises(ValueError, match="--goodput"):
            loadgen.parse_goodput([bad])


def test_streamed_timings_match_the_servers_delays():
    with StandIn(ttft_s=0.1, itl_s=0.03) as server:
        results, duration = _run(server, _requests(3, out=5), max_concurrency=1)
    assert server.bodies[0]["stream_options"] == {"include_usage": True} and server.bodies[0]["ignore_eos"]
    assert all(isinstance(t, int) for t in server.bodies[0]["prompt"]) and len(server.bodies[0]["prompt"]) == 4
    # lower bounds are strict (the server sleeps before each write); upper ones leave room for a loaded
    # machine, where a chunk read late also shortens the gap after it
    for r in results:
        assert r.ok and r.error == "" and (r.prompt_tokens, r.output_tokens, r.chunks) == (4, 5, 5)
        assert 0.1 <= r.ttft < 0.1 + 0.15, r.ttft
        assert r.e2el >= 0.1 + 4 * 0.03 and r.e2el == pytest.approx(r.ttft + sum(r.itl), abs=0.03)
        assert len(r.itl) == 4 and 0.025 < statistics.median(r.itl) < 0.03 + 0.05, r.itl
        assert r.tpot == pytest.approx((r.e2el - r.ttft) / 4)
    assert duration >= sum(r.e2el for r in results) - 1e-3  # one at a time


def test_chunks_carrying_several_tokens_count_each_token():
    """4 tokens a chunk, running usage per chunk: 12 tokens in 3 chunks -> 8 gaps of itl / 4."""
    with StandIn(ttft_s=0.02, itl_s=0.08, tokens_per_chunk=4, usage_per_chunk=True) as server:
        (r,), _ = _run(server, _requests(1, out=12))
    assert r.ok and r.chunks == 3 and r.output_tokens == 12
    assert len(r.itl) == 8 and r.itl[:4] == [r.itl[0]] * 4 and r.itl[4:] == [r.itl[4]] * 4, r.itl
    assert 0.015 < statistics.mean(r.itl) < 0.02 + 0.02 and sum(r.itl) >= 0.16 - 0.03
    assert r.tpot == pytest.approx((r.e2el - r.ttft) / 11)


# ---------------------------------------------------------------- arrivals and concurrency


def test_poisson_arrivals_are_seeded():
    a = loadgen.arrival_offsets(2000, 50.0, seed=3)
    assert a == loadgen.arrival_offsets(2000, 50.0, seed=3) != loadgen.arrival_offsets(2000, 50.0, seed=4)
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert a[0] == 0 and all(g >= 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(1 / 50, rel=0.1)
    assert statistics.stdev(gaps) == pytest.approx(1 / 50, rel=0.15)  # exponential: sd = mean
    assert loadgen.arrival_offsets(5, math.inf) == [0.0] * 5
    with pytest.raises(ValueError, match="request_rate"):
        loadgen.arrival_offsets(3, 0)
    with StandIn(ttft_s=0.0, itl_s=0.0) as server:
        results, _ = _run(server, _requests(8, out=2), rate=20.0, seed=7)
    sent = [r.start for r in results]
    want = loadgen.arrival_offsets(8, 20.0, seed=7)
    assert all(-0.002 < x - y < 0.1 for x, y in zip(sent, want)), (sent, want)  # never early
    arrived = [t - min(server.arrivals) for t in sorted(server.arrivals)]
    assert all(abs(x - y) < 0.15 for x, y in zip(arrived, want)), (arrived, want)


def test_max_concurrency_caps_requests_in_flight():
    with StandIn(ttft_s=0.05, itl_s=0.01) as server:
        results, _ = _run(server, _requests(9, out=3), max_concurrency=3)
    assert all(r.ok for r in results) and server.max_inflight == 3
    with StandIn(ttft_s=0.3, itl_s=0.01) as server:
        _run(server, _requests(6, out=2))
    assert server.max_inflight == 6  # uncapped, all at once


def test_failures_and_timeouts_end_the_request_not_the_run():
    reqs = _requests(4, out=3) + _requests(2, out=7)
    with StandIn(ttft_s=0.01, itl_s=0.01, fail_max_tokens=7) as server:
        results, _ = _run(server, reqs)
    assert [r.ok for r in results] == [True] * 4 + [False] * 2
    assert results[-1].error == "HTTP 500: injected failure"
    with StandIn(ttft_s=2.0, itl_s=0.0) as server:
        results, duration = _run(server, _requests(2), timeout=0.3)
    assert all(not r.ok and r.error == "timed out after 0.3 s" for r in results) and duration < 1.5
    results, _ = asyncio.run(loadgen.run_load(_requests(1), base_url=f"http://127.0.0.1:{online.free_port()}",
                                              model="m", timeout=5.0))
    assert not results[0].ok and "Connect" in results[0].error


# ---------------------------------------------------------------- workloads


def test_workloads_are_seeded_and_exact():
    a = loadgen.random_requests(20, input_len=(5, 9), output_len=(2, 4), tokens=TOKENS, seed=1)
    assert a == loadgen.random_requests(20, input_len=(5, 9), output_len=(2, 4), tokens=TOKENS, seed=1)
    b = loadgen.random_requests(20, input_len=(5, 9), output_len=(2, 4), tokens=TOKENS, seed=1, content_seed="x")
    assert [(r.prompt_len, r.max_tokens) for r in a] == [(r.prompt_len, r.max_tokens) for r in b]
    assert [r.prompt for r in a] != [r.prompt for r in b]
    assert all(len(r.prompt) == r.prompt_len and 5 <= r.prompt_len <= 9 and 2 <= r.max_tokens <= 4 for r in a)
    assert all(3 <= t < 100 for r in a for t in r.prompt)
    s = loadgen.shared_prefix_requests(7, groups=3, system_len=6, suffix_len=(2, 3), output_len=(1, 1), tokens=TOKENS)
    assert [r.prompt[:6] for r in s[:3]] == [r.prompt[:6] for r in s[3:6]] and len({tuple(r.prompt[:6]) for r in s}) == 3
    assert all(8 <= len(r.prompt) == r.prompt_len <= 9 for r in s)
    with pytest.raises(ValueError, match="input_len"):
        loadgen.random_requests(2, input_len=(5, 3), output_len=(1, 1), tokens=TOKENS)


def test_sharegpt_file(tmp_path):
    convs = [{"conversations": [{"from": "human", "value": f"q {i} " * (i + 1)}, {"from": "gpt", "value": "a b c"}]}
             for i in range(5)]
    convs += [{"conversations": [{"from": "gpt", "value": "x"}, {"from": "human", "value": "y"}]},  # wrong order
              {"conversations": [{"from": "human", "value": "only"}]}, {"id": 3}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    reqs = loadgen.sharegpt_requests(path, 5, seed=0)
    assert sorted(r.prompt_len for r in reqs) == [2, 4, 6, 8, 10] and {r.max_tokens for r in reqs} == {3}
    assert all(isinstance(r.prompt, str) for r in reqs)

    class Chars:
        encode = staticmethod(lambda text: [ord(c) for c in text])

    reqs = loadgen.sharegpt_requests(path, 2, tokenizer=Chars, seed=0)
    assert all(isinstance(r.prompt, list) and r.prompt_len == len(r.prompt) and r.max_tokens == 5 for r in reqs)
    with pytest.raises(ValueError, match="only 5 of its 8 entries"):
        loadgen.sharegpt_requests(path, 6)
    with pytest.raises(ValueError, match="cannot read"):
        loadgen.sharegpt_requests(tmp_path / "missing.json", 1)


# ---------------------------------------------------------------- the command


def test_sweep_writes_json_markdown_and_plot(tmp_path, capsys):
    with StandIn(ttft_s=0.01, itl_s=0.005) as server:
        rc = cli.main(["bench", "online", "--quick", "--num-prompts", "8", "--out", str(tmp_path), "--base-url", server.url,
                       "--vocab-size", "64", "--request-rates", "40,inf", "--max-concurrency", "2,8",
                       "--goodput", "ttft:5", "e2el:60000", "--save-requests", "--num-warmups", "2"])
    assert rc == 0
    doc = json.loads((tmp_path / "online.json").read_text(), parse_constant=pytest.fail)  # strict JSON: no inf
    rows = doc["tables"]["runs"]["rows"]
    assert [(r["rate"], r["max_concurrency"]) for r in rows] == [(40.0, 2), ("inf", 2), (40.0, 8), ("inf", 8)]
    for r in rows:
        assert r["completed"] == 8 and r["failed"] == 0 and r["output_tokens"] == pytest.approx(r["output_throughput"] * r["duration_s"])
        assert r["good_requests"] == 0 and r["goodput"] == 0  # every TTFT >= 10 ms > 5 ms
        assert 0 < r["client_cpu_pct"] < 400
        assert all(r[f"{m}_{k}_ms"] > 0 for m in loadgen.METRICS for k in ("mean", "p50", "p90", "p99"))
    assert len(doc["tables"]["latency"]["rows"]) == 16 and doc["args"]["model"] == "standin"
    assert len(server.bodies) == 4 * (8 + 2)  # warmups before every point
    # every point sends the same lengths with new tokens (the two warmups are the same at every point)
    prompts = [tuple(b["prompt"]) for b in server.bodies]
    assert len(set(prompts)) == 4 * 8 + 2
    lengths = lambda ps: sorted(map(len, ps))  # requests sent together may arrive in either order
    assert set(prompts[2:10]).isdisjoint(prompts[12:20]) and lengths(prompts[2:10]) == lengths(prompts[12:20])
    detail = json.loads((tmp_path / "online_requests.json").read_text())
    assert len(detail) == 4 and all(len(d["requests"]) == 8 for d in detail)
    assert (tmp_path / "online.png").read_bytes()[:4] == b"\x89PNG"
    assert "goodput req/s" in (tmp_path / "online.md").read_text()
    assert "wrote" in capsys.readouterr().out


def test_client_processes_split_a_point(tmp_path, monkeypatch):
    """--client-processes 2: the same counts as one process, the cap held across both, seeded send
    times kept; a client process killed during the last point fails its share of the requests."""
    class KillsInTheLastPoint(loadgen_procs.ClientPool):
        points = 0

        def _collect(self, workers, deadlines, kind, since):
            if kind == "results":
                type(self).points += 1
                if self.points == 4:
                    self.procs[1].kill()
            return super()._collect(workers, deadlines, kind, since)

    monkeypatch.setattr(loadgen_procs, "ClientPool", KillsInTheLastPoint)
    argv = ["--vocab-size", "64", "--num-prompts", "9", "--input-len", "4", "--output-len", "3", "--num-warmups", "0",
            "--request-rates", "20,inf", "--max-concurrency", "3,9", "--save-requests"]
    rows = {}
    for procs in (2, 1):
        with StandIn(ttft_s=0.05, itl_s=0.01) as server:
            rc = online.main([*argv, "--base-url", server.url, "--out", str(tmp_path / str(procs)),
                              "--client-processes", str(procs)])
        assert rc == (1 if procs == 2 else 0)
        rows[procs] = json.loads((tmp_path / str(procs) / "online.json").read_text())["tables"]["runs"]["rows"]
        assert max(server.inflight_at_arrival[:18]) == 3  # the points capped at 3 (shares 2 + 1)
    keys = ("completed", "failed", "input_tokens", "output_tokens", "short_outputs")
    counts = {procs: [[r[k] for k in keys] for r in rows[procs][:3]] for procs in rows}
    assert counts[2] == counts[1] == [[9, 0, 36, 27, 0]] * 3
    for r in rows[2][:3]:
        assert 50 <= r["ttft_p50_ms"] < 200 and 8 < r["itl_p50_ms"] < 60 and 0 < r["client_cpu_pct"] < 400
    last = rows[2][3]  # process 1 held requests 1, 3, 5, 7
    assert (last["completed"], last["failed"]) == (5, 4) and "client process 1 exited" in last["first_error"]
    detail = json.loads((tmp_path / "2" / "online_requests.json").read_text())
    sent = [r["start"] for r in detail[2]["requests"]]  # rate 20, cap 9: nothing waits for a slot
    want = loadgen.arrival_offsets(9, 20.0, seed=2)  # point i draws with --seed + i
    assert all(-0.002 < x - y < 0.1 for x, y in zip(sent, want)), (sent, want)


def test_bad_arguments_exit_2(tmp_path, capsys):
    assert online.main(["--quick", "--out", str(tmp_path)]) == 2  # token ids without a vocabulary
    assert "--vocab-size" in capsys.readouterr().err
    for argv in (["--dataset", "sharegpt"], ["--goodput", "ttft"], ["--request-rates", "1,0"],
                 ["--max-concurrency", "0"], ["--input-len", "a:b"], ["--extra-body", "[1]"],
                 ["--client-processes", "0"]):
        with pytest.raises(SystemExit) as e:
            online.main(argv)
        assert e.value.code == 2


def test_failed_requests_exit_1(tmp_path, capsys):
    with StandIn(ttft_s=0.0, itl_s=0.0, fail_max_tokens=4) as server:
        rc = online.main(["--base-url", server.url, "--vocab-size", "64", "--num-prompts", "6", "--input-len", "3",
                          "--output-len", "4", "--num-warmups", "0", "--out", str(tmp_path), "--api-key", "k1",
                          "--extra-body", '{"top_k": 3}'])
    assert rc == 1 and server.auth == ["Bearer k1"] * 6 and all(b["top_k"] == 3 for b in server.bodies)
    assert "injected failure" in capsys.readouterr().err
    doc = json.loads((tmp_path / "online.json").read_text())
    assert doc["tables"]["runs"]["rows"][0]["failed"] == 6


def test_launched_server_is_started_and_stopped(tmp_path, capsys):
    rc = online.main(["--quick", "--vocab-size", "64", "--out", str(tmp_path), "--server-timeout", "30",
                      "--server-command", f"{{python}} {STANDIN}", "--launch-server", "--ttft-ms", "5"])
    assert rc == 0
    doc = json.loads((tmp_path / "online.json").read_text())
    assert doc["tables"]["runs"]["rows"][0]["completed"] == 4 and doc["offline"] == {}
    assert doc["args"]["launch_server"] == ["--ttft-ms", "5"]
    assert (tmp_path / "online_server.log").exists()
    rc = online.main(["--quick", "--vocab-size", "64", "--out", str(tmp_path), "--server-timeout", "30",
                      "--server-command", f"{sys.executable} -c 'raise SystemExit(3)'", "--launch-server"])
    assert rc == 2 and "exited with 3 before answering /health" in capsys.readouterr().err
    rc = online.main(["--quick", "--vocab-size", "64", "--out", str(tmp_path), "--server-timeout", "30",
                      "--server-grace", "0.5", "--server-command", f"{{python}} {STANDIN}", "--launch-server",
                      "--ignore-sigterm"])
    assert rc == 0 and "server stopped (exit -9" in capsys.readouterr().out  # killed after the grace period


def test_offline_side_builds_the_servers_engine():
    """The server's own parser and engine builder: its arguments reach the LLM, which serves the
    workload in-process (the tiny model, capped at one sequence; text encoded as the server does)."""
    pytest.importorskip("fastapi")
    pytest.importorskip("pagedflash.entrypoints.openai.api_server")
    config = online_offline.server_model_config(["--max-num-seqs", "4", "--port", "1"])
    assert config.vocab_size == 512
    with pytest.raises(SystemExit):
        online_offline.server_model_config(["--no-such-option"])
    rng = random.Random(0)
    spec = dict(server_args=["--max-num-seqs", "4", "--no-enable-prefix-caching"],
                prompts=[[rng.randrange(3, 512) for _ in range(5)], "a text prompt, as ShareGPT's"],
                max_tokens=[3, 2], warmup=[[5, 6]],
                warmup_max_tokens=[1], ignore_eos=True, temperature=0.0, max_num_seqs=1)
    stats = online_offline.run(spec)
    assert stats["output_tokens"] == 5 and stats["num_requests"] == 2 and stats["errors"] == []
    assert stats["prefix_cache_hit_rate"] == 0.0  # --no-enable-prefix-caching reached the engine
    assert stats["output_tokens_per_s"] > 0 and stats["ttft_p99_ms"] >= stats["ttft_p50_ms"] > 0
    assert stats["itl_p99_ms"] >= stats["itl_p50_ms"] > 0


def test_against_pagedflash_serve_with_the_offline_comparison(tmp_path):
    """End to end: ``pagedflash serve`` (the tiny model, CPU) launched, loaded, stopped; then the
    offline engine on the same requests in a fresh process."""
    for module in ("fastapi", "uvicorn", "httpx", "pagedflash.entrypoints.openai.api_server"):
        pytest.importorskip(module)
    rc = online.main(["--num-prompts", "2", "--input-len", "4:6", "--output-len", "2:3", "--num-warmups", "0",
                      "--out", str(tmp_path), "--server-timeout", "120", "--timeout", "120", "--save-requests",
                      "--launch-server", "--max-num-seqs", "4"])
    assert rc == 0
    doc = json.loads((tmp_path / "online.json").read_text())
    (row,) = doc["tables"]["runs"]["rows"]
    reqs = loadgen.random_requests(2, input_len=(4, 6), output_len=(2, 3), tokens=loadgen.TokenSpace(512))
    assert row["completed"] == 2 and row["output_tokens"] == sum(r.max_tokens for r in reqs)  # usage is exact
    assert row["input_tokens"] == sum(r.prompt_len for r in reqs)
    (point,) = json.loads((tmp_path / "online_requests.json").read_text())
    assert [r["chunks"] for r in point["requests"]] == [r.max_tokens for r in reqs]  # one token a chunk
    assert row["offline_output_throughput"] > 0 and row["online_over_offline"] > 0
    assert row["offline_itl_p50_ms"] > 0 and row["itl_over_offline"] > 0
    assert doc["offline"]["uncapped"]["output_tokens"] == row["output_tokens"]
    assert "Finished server process" in (tmp_path / "online_server.log").read_text()
