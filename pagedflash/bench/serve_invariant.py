"""``bench serve --batch-invariant``: the ``throughput`` and ``itl`` sections build their engine
with the batch-invariant mode off, then on (``LLM(batch_invariant=True)``: attention in the kernels'
invariant mode, every projection through :func:`pagedflash.ops.matmul.matmul`), in the same run, on
the same workload; each row of the mode on gets ``inv_x``, its time over the mode off's at the same
point (throughput: the inverse ratio of output tokens/s; ITL: the ratio of median gaps). Issue 32's
target: at most :data:`TARGET`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pagedflash.bench.common import geomean

TARGET = 1.25
COLUMNS = {"invariant": "batch-invariant", "inv_x": "inv x"}
NOTE = ("batch-invariant on: LLM(batch_invariant=True), the same workload in the same run; inv x = its time over "
        f"the mode off's at the same point (throughput: tok/s off / on; ITL: gap on / off); target <= {TARGET}x "
        "(issue 32)")


def engine_modes(enabled: bool) -> tuple[bool, ...]:
    """The ``batch_invariant`` values a section builds its engine with: off, then on with the option."""
    return (False, True) if enabled else (False,)


def label(on: bool) -> str:
    return "on" if on else "off"


def time_ratios(rows: Iterable[dict], point: Callable[[dict], tuple], seconds: Callable[[dict], float | None]) -> list[float]:
    """Set ``inv_x`` on each row of the mode on: ``seconds(row)`` over ``seconds`` of the row of the
    mode off with the same ``point(row)``. Rows without an ``invariant`` key (baselines) are left
    alone. Returns the ratios set, in row order."""
    rows = [r for r in rows if "invariant" in r]
    off = {point(r): r for r in rows if r["invariant"] == "off"}
    ratios = []
    for r in rows:
        base = off.get(point(r)) if r["invariant"] == "on" else None
        if base is not None and seconds(base) and seconds(r):
            r["inv_x"] = seconds(r) / seconds(base)
            ratios.append(r["inv_x"])
    return ratios


def throughput_summary(rows: list[dict], summary: dict) -> None:
    """``throughput_invariant_x``: the engine's time for the workload, mode on over off."""
    ratios = time_ratios(rows, lambda r: (), lambda r: 1 / r["tok_s"] if r.get("tok_s") else None)
    if ratios:
        summary["throughput_invariant_x"] = ratios[0]


def itl_summary(rows: list[dict], summary: dict) -> None:
    """``itl_invariant_x_b{B}``: the geometric mean over contexts of the ITL ratio at batch B with
    CUDA graphs (``..._eager`` without); none where a context has no ratio (a point one mode skipped:
    a mean over fewer contexts would read as the same figure)."""
    time_ratios(rows, lambda r: (r["graphs"], r["batch"], r["context"]), lambda r: r["itl_ms"])
    for graphs in ("on", "off"):
        for batch in sorted({r["batch"] for r in rows}):
            cell = [r for r in rows if r["graphs"] == graphs and r["batch"] == batch]
            on = {r["context"]: r.get("inv_x") for r in cell if r["invariant"] == "on"}
            if set(on) != {r["context"] for r in cell} or None in on.values():
                continue
            x = geomean(on.values())
            if isinstance(x, float):
                summary[f"itl_invariant_x_b{batch}" + ("" if graphs == "on" else "_eager")] = x
