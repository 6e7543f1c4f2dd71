"""``pagedflash serve --request-timeline PATH``: one JSON line per request with its stamps in order,
with the engine loop in a thread and in a child process, and the summary of ``pagedflash.bench.timeline``.
"""

import json

import pytest
from test_serve import GREEDY, MODEL, LiveServer
from test_serve_process import ProcessServer

from pagedflash.bench import timeline as summary
from pagedflash.entrypoints.openai.timeline import PHASES

ENGINE = ("submit", "picked", "added", "scheduled", "first_token")  # stamps every admitted request has
HANDLER = ("http", "handler", "sent", "finished")


def run_requests(server) -> None:
    client = server.client()
    list(client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2, stream=True, **GREEDY))
    client.completions.create(model=MODEL, prompt=[[8, 9], [10, 11, 12]], max_tokens=2, **GREEDY)
    list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                        stream=True, **GREEDY))


def check_lines(path, mode: str) -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 4  # a stream, a batch of two, a chat stream
    extra = ("received", "reader") if mode == "process" else ()
    for r in records:
        assert r["mode"] == mode and r["finish_reason"] == "length" and r["request_id"] is not None
        for phase in ENGINE + HANDLER + extra:
            assert isinstance(r.get(phase), float), (phase, r)
        assert all(phase in ENGINE + HANDLER + extra for phase in PHASES if phase in r)
        stamps = [r[phase] for phase in PHASES if phase in r]
        assert stamps == sorted(stamps), r  # every phase at or after the one before it
        assert r["steps_waiting"] >= 0 and r["steps_to_first_token"] >= 1
    assert sorted(r["output_tokens"] for r in records) == [1, 2, 2, 2]
    batch = [r for r in records if not r["stream"]]
    assert len(batch) == 2 and batch[0]["request"] == batch[1]["request"] and {r["index"] for r in batch} == {0, 1}
    return records


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_timeline_lines_in_order_and_summarized(tmp_path, mode, capsys):
    path = tmp_path / "timeline.jsonl"
    server = (ProcessServer if mode == "process" else LiveServer)("--request-timeline", str(path))
    try:
        run_requests(server)
    finally:
        server.stop()
    records = check_lines(path, mode)

    rows = {row["name"]: row for row in summary.summarize(records)}
    chain = ["http", "submit", *(("received",) if mode == "process" else ()), "picked", "added", "scheduled",
             "first_token", *(("reader",) if mode == "process" else ()), "handler", "sent", "finished"]
    for a, b in zip(chain, chain[1:]):
        row = rows[f"{a} -> {b}"]
        assert row["n"] == 4 and 0 <= row["p50"] <= row["p99"] <= row["max"]
    assert rows["steps_to_first_token"]["n"] == 4
    assert summary.main([str(path), "--skip", "1", "--json", str(tmp_path / "s.json")]) == 0
    assert "| added -> scheduled |" in capsys.readouterr().out
    assert json.loads((tmp_path / "s.json").read_text())["requests"] == 3


def test_summary_refuses_a_bad_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"http": 1.0}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2: expected a JSON object"):
        summary.load(path)
    with pytest.raises(ValueError, match="skip must be >= 0"):
        summary.load(path, -1)
