"""Benchmark reports: result tables (terminal and markdown), the JSON files, and plots.

Every bench builds :class:`Table` objects and hands them to :func:`print_table` and
:func:`write_results`; plots go through :func:`plot` / :func:`heatmap` (matplotlib, optional).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedflash.bench.common import has_gpu, human, timing_description
from pagedflash.bench.hbm import hbm_bandwidth

# ---------------------------------------------------------------- tables and results


@dataclass
class Table:
    """Rows are dicts; ``columns`` maps the printed keys (in order) to their headers. JSON gets
    every key of every row, the printed table only the columns."""

    name: str
    title: str
    columns: dict[str, str]
    rows: list[dict] = field(default_factory=list)
    note: str = ""


def fmt(x) -> str:
    if isinstance(x, bool) or x is None:
        return "-" if x is None else str(x)
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        if x == 0:
            return "0"
        if abs(x) >= 100:
            return f"{x:.0f}"
        if abs(x) >= 10:
            return f"{x:.1f}"
        return f"{x:.2f}" if abs(x) >= 0.1 else f"{x:.3g}"
    return str(x)


def markdown(table: Table) -> str:
    keys = list(table.columns)
    lines = [f"### {table.title}", "", "| " + " | ".join(table.columns.values()) + " |",
             "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(row.get(k)) for k in keys) + " |" for row in table.rows]
    if table.note:
        lines += ["", table.note]
    return "\n".join(lines) + "\n"


def print_table(table: Table) -> None:
    """rich on a terminal, markdown otherwise (a log or a pipe keeps every column)."""
    if sys.stdout.isatty():
        try:
            from rich.console import Console
            from rich.table import Table as RichTable

            t = RichTable(title=table.title, caption=table.note or None)
            for header in table.columns.values():
                t.add_column(header, justify="right")
            for row in table.rows:
                t.add_row(*(fmt(row.get(k)) for k in table.columns))
            Console().print(t)
            return
        except ImportError:
            pass
    print(markdown(table), flush=True)


def print_summary(summary: dict) -> None:
    print("summary: " + ", ".join(f"{k} = {fmt(v)}" for k, v in summary.items()), flush=True)


def env_info(quick: bool) -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "quick": quick,
        "timing": timing_description(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    info["device"] = torch.cuda.get_device_name() if has_gpu() else platform.processor() or "cpu"
    info["hbm"] = dataclasses.asdict(hbm_bandwidth())  # what every bandwidth bound and "of peak" divides by
    info["interpreter"] = os.environ.get("TRITON_INTERPRET", "0") == "1"
    return info


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, torch.dtype):
        return str(x).removeprefix("torch.")
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def write_results(name: str, tables: Sequence[Table], out: Path, *, quick: bool, summary: dict | None = None) -> Path:
    """Write ``<out>/<name>.json`` (every row, environment, summary) and ``<out>/<name>.md``."""
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "bench": name,
        "env": env_info(quick),
        "summary": summary or {},
        "tables": {t.name: {"title": t.title, "columns": t.columns, "note": t.note, "rows": t.rows} for t in tables},
    }
    path = out / f"{name}.json"
    path.write_text(json.dumps(_jsonable(doc), indent=1))
    (out / f"{name}.md").write_text("\n".join(markdown(t) for t in tables))
    return path


# ---------------------------------------------------------------- plots


def panels_by_batch(rows: Sequence[dict], batches, panel) -> list[dict]:
    """One plot panel per batch size that has rows: ``panel(b, rows_of_b, ns)`` builds it, with the
    sequence lengths ``ns`` (each row's ``"n"``) as the x values."""
    panels = []
    for b in batches:
        sel = [r for r in rows if r["B"] == b]
        if sel:
            panels.append(panel(b, sel, [r["n"] for r in sel]))
    return panels


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _pyplot_for(path: Path):
    """pyplot, with ``path``'s folder created; None (and a note) when matplotlib is missing."""
    try:
        plt = _pyplot()
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    return plt


def plot(path: Path, panels: Sequence[dict], *, ncols: int = 4, logx: bool = True) -> Path | None:
    """Line plots, one panel per dict ``{"title", "xlabel", "ylabel", "series": {label: (xs, ys)}}``
    (optionally ``"hline": (y, label)``); points whose y is a status string (OOM, n/a) are skipped."""
    plt = _pyplot_for(path)
    if plt is None:
        return None
    ncols = max(1, min(ncols, len(panels)))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.4 * nrows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        for label, (xs, ys) in panel["series"].items():
            pts = [(x, y) for x, y in zip(xs, ys) if isinstance(y, (int, float))]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        if logx:
            ax.set_xscale("log", base=2)
            xs = sorted({x for xs, _ in panel["series"].values() for x in xs})
            ax.set_xticks(xs, [human(x) for x in xs])
            ax.minorticks_off()
        ax.set_title(panel["title"], fontsize=9)
        ax.set_xlabel(panel.get("xlabel", ""))
        ax.set_ylabel(panel.get("ylabel", ""))
        if "hline" in panel:
            y, label = panel["hline"]
            ax.axhline(y, color="gray", linestyle="--", linewidth=1, label=label)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def heatmap(path: Path, values: list[list[float | str]], *, rows: Sequence, cols: Sequence, title: str,
            xlabel: str, ylabel: str) -> Path | None:
    """A heat map with each cell's value written in it; the colour is the value over its row's
    minimum (so each row shows which column is best). Status strings are shown uncoloured."""
    plt = _pyplot_for(path)
    if plt is None:
        return None
    grid = []
    for row in values:
        nums = [v for v in row if isinstance(v, (int, float))]
        low = min(nums) if nums else 1.0
        grid.append([v / low if isinstance(v, (int, float)) and low > 0 else float("nan") for v in row])
    fig, ax = plt.subplots(figsize=(1.0 * len(cols) + 2.5, 0.55 * len(rows) + 1.8))
    im = ax.imshow(grid, cmap="RdYlGn_r", aspect="auto", vmin=1.0)
    ax.set_xticks(range(len(cols)), [str(c) for c in cols])
    ax.set_yticks(range(len(rows)), [str(r) for r in rows])
    for i, row in enumerate(values):
        for j, v in enumerate(row):
            ax.text(j, i, fmt(v), ha="center", va="center", fontsize=7, color="black")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    fig.colorbar(im, ax=ax, label="time / row best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
