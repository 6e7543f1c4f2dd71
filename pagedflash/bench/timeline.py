"""Summary of a server's request timeline (``pagedflash serve --request-timeline PATH``): where the
time to the first token goes, phase by phase.

    python -m pagedflash.bench.timeline PATH [--skip N] [--json OUT]

Each request's consecutive stamps (in :data:`~pagedflash.entrypoints.openai.timeline.PHASES` order,
skipping those it lacks: ``received`` and ``reader`` exist with an engine process only) make its
gaps; a table gives each gap's mean, p50, p99 and max in ms over the requests that have both
stamps, then the spans: ``http -> sent`` (the server's time to the first token on the wire),
``added -> first_token`` (the engine's TTFT as the offline engine counts it, from ``add_request``),
``http -> finished``, and the engine steps a request waited (``steps_waiting``) and ran until its
first token (``steps_to_first_token``). ``--skip N`` leaves out the first N lines (warm-up requests
finish first).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pagedflash.bench.loadgen import percentile
from pagedflash.entrypoints.openai.timeline import PHASES

SPANS = (("http", "sent", "server TTFT, handler to first token written"),
         ("added", "first_token", "engine TTFT, from add_request as offline"),
         ("http", "finished", "whole request"))
COUNTS = ("steps_waiting", "steps_to_first_token")


def load(path, skip: int = 0) -> list[dict]:
    """The timeline's records after the first ``skip``; a line that is not a JSON object raises
    ``ValueError`` naming the file and the line."""
    if skip < 0:
        raise ValueError(f"skip must be >= 0, got {skip}")
    records = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON line ({e})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{n}: expected a JSON object, got {type(record).__name__}")
            records.append(record)
    return records[skip:]


def gaps(record: dict) -> list[tuple[str, str, float]]:
    """``(from, to, seconds)`` between the record's consecutive stamps."""
    present = [(phase, record[phase]) for phase in PHASES if record.get(phase) is not None]
    return [(a, b, tb - ta) for (a, ta), (b, tb) in zip(present, present[1:])]


def _stats(xs: list[float], scale: float) -> dict:
    xs = [x * scale for x in xs]
    return dict(n=len(xs), mean=sum(xs) / len(xs), p50=percentile(xs, 50), p99=percentile(xs, 99), max=max(xs))


def summarize(records: list[dict]) -> list[dict]:
    """Rows of the summary: each gap (``kind="gap"``), each span (ms) and each step count, with
    ``n, mean, p50, p99, max`` over the records that have it."""
    by_gap: dict[tuple[str, str], list[float]] = {}
    for record in records:
        for a, b, dt in gaps(record):
            by_gap.setdefault((a, b), []).append(dt)
    order = {phase: i for i, phase in enumerate(PHASES)}
    rows = [dict(kind="gap", name=f"{a} -> {b}", **_stats(xs, 1e3))
            for (a, b), xs in sorted(by_gap.items(), key=lambda kv: (order[kv[0][1]], order[kv[0][0]]))]
    for a, b, what in SPANS:
        xs = [r[b] - r[a] for r in records if r.get(a) is not None and r.get(b) is not None]
        if xs:
            rows.append(dict(kind="span", name=f"{a} -> {b}: {what}", **_stats(xs, 1e3)))
    for key in COUNTS:
        xs = [r[key] for r in records if r.get(key) is not None]
        if xs:
            rows.append(dict(kind="steps", name=key, **_stats(xs, 1.0)))
    return rows


def table(rows: list[dict], title: str):
    from pagedflash.bench.report import Table

    return Table("timeline", title, {"name": "phase (ms; steps: count)", "n": "n", "mean": "mean", "p50": "p50",
                                     "p99": "p99", "max": "max"}, rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pagedflash.bench.timeline", description=__doc__.split("\n\n")[0])
    ap.add_argument("path", type=Path, help="a --request-timeline file (JSON lines)")
    ap.add_argument("--skip", type=int, default=0, help="leave out the first N requests (warm-ups)")
    ap.add_argument("--json", type=Path, default=None, help="also write the summary rows here")
    args = ap.parse_args(argv)
    try:
        records = load(args.path, args.skip)
    except (OSError, ValueError) as e:
        print(f"timeline: {e}", file=sys.stderr)
        return 2
    if not records:
        print(f"timeline: {args.path} holds no request after the first {args.skip}", file=sys.stderr)
        return 1
    from pagedflash.bench.report import markdown

    modes = sorted({str(r.get("mode")) for r in records})
    rows = summarize(records)
    print(markdown(table(rows, f"{args.path.name}: {len(records)} requests, engine {'/'.join(modes)}")), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(dict(path=str(args.path), requests=len(records), modes=modes, rows=rows),
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
