"""Cells compared over seeds (the statistics of stats.py on report frames).

Input: `per_seed`, one row per cell and seed: `cell` (the grid label, "ggpo
updates_per_step=16"; the method alone without a grid), `method`, `seed`, `value` (a final
accuracy, a diagnostic), `update` (where the value was taken) and `stopped` (the seed's cell
stopped before its last update). A cell's grid point is its label without the method
("updates_per_step=16"; "" without a grid), so every method is compared at each point
whatever else its label holds.

- `paired_to_reference`: each method minus the reference (GRPO+TIS, `grpo_tis`, where the
  experiment has it, else its first method) at every grid point, paired by seed.
- `paired_along_axes`: within a method, each value of a grid axis minus the axis's first
  value, the other axes held, paired by seed.
Both return one row per comparison (mean difference, sd, t-interval, n, p, the seeds,
both cells' stalls k/n) and print with `markdown_paired`; `cell_text` prints one cell.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import polars as pl

from pipeline.reports import stats

REFERENCE = "grpo_tis"       # GRPO+TIS: the paired tables' reference where an experiment has it
_PART = re.compile(r"(\S+)=(.*?)(?= \S+=|$)")


def reference_method(methods: list[str]) -> str:
    """grpo_tis where the experiment has it, else its first method."""
    return REFERENCE if REFERENCE in methods else methods[0]


def grid_point(label: str, method: str) -> str:
    """The label without its method: 'updates_per_step=16 lr=1e-4', '' without a grid."""
    return label[len(method):].strip() if label.startswith(method) else label


def axes(point: str) -> dict[str, str]:
    """'updates_per_step=16 lr=1e-4' -> {'updates_per_step': '16', 'lr': '1e-4'}."""
    return {m.group(1): m.group(2) for m in _PART.finditer(point)}


def join_point(values: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in values.items())


class Cells:
    """per_seed grouped by cell, in first-seen (grid) order: values, updates and stops by seed."""

    def __init__(self, per_seed: pl.DataFrame):
        self.order: list[str] = per_seed["cell"].unique(maintain_order=True).to_list()
        self.method: dict[str, str] = {}
        self.value: dict[str, dict[Any, float]] = {}
        self.update: dict[str, dict[Any, int]] = {}
        self.stopped: dict[str, dict[Any, bool]] = {}
        for r in per_seed.iter_rows(named=True):
            c = r["cell"]
            self.method[c] = r["method"]
            self.value.setdefault(c, {})[r["seed"]] = r["value"]
            self.update.setdefault(c, {})[r["seed"]] = r["update"]
            self.stopped.setdefault(c, {})[r["seed"]] = bool(r["stopped"])
        self.methods: list[str] = list(dict.fromkeys(self.method[c] for c in self.order))

    def point(self, cell: str) -> str:
        return grid_point(cell, self.method[cell])

    def stalls(self, cell: str) -> stats.Stalls:
        return stats.stalls(self.stopped[cell].values())

    def find(self, method: str, point: str) -> str | None:
        return next((c for c in self.order if self.method[c] == method and self.point(c) == point), None)


def _row(cells: Cells, cell: str, other: str, extra: dict[str, Any]) -> dict[str, Any] | None:
    est = stats.paired(cells.value[cell], cells.value[other])
    if est is None:
        return None
    return extra | {"diff": est.mean, "sd": est.sd, "low": est.low, "high": est.high, "n": est.n, "p": est.p,
                    "seeds": " ".join(map(str, est.seeds)), "stalls": cells.stalls(cell).text(),
                    "stalls_other": cells.stalls(other).text()}


def paired_to_reference(per_seed: pl.DataFrame, reference: str | None = None) -> tuple[str, pl.DataFrame]:
    """(the reference method, one row per method other than it and grid point): method,
    point, reference, diff (method - reference), sd, low, high, n, p, seeds, stalls (the
    method's cell), stalls_other (the reference's)."""
    cells = Cells(per_seed)
    ref = reference or reference_method(cells.methods)
    rows = []
    for cell in cells.order:
        if cells.method[cell] == ref:
            continue
        other = cells.find(ref, cells.point(cell))
        row = _row(cells, cell, other, {"method": cells.method[cell], "point": cells.point(cell),
                                        "reference": ref}) if other else None
        rows += [row] if row else []
    return ref, pl.DataFrame(rows)


def paired_along_axes(per_seed: pl.DataFrame) -> pl.DataFrame:
    """Within each method: for every grid axis, each cell whose value of it is not the
    axis's first (grid order) minus the cell with the first value and the other axes the
    same; method, point, axis, value, base, diff, sd, low, high, n, p, seeds, stalls,
    stalls_other (the base cell's)."""
    cells = Cells(per_seed)
    first: dict[str, str] = {}
    for cell in cells.order:
        for k, v in axes(cells.point(cell)).items():
            first.setdefault(k, v)
    rows = []
    for cell in cells.order:
        values = axes(cells.point(cell))
        for k, v in values.items():
            if v == first[k]:
                continue
            base = cells.find(cells.method[cell], join_point(values | {k: first[k]}))
            row = _row(cells, cell, base, {"method": cells.method[cell], "point": cells.point(cell), "axis": k,
                                           "value": v, "base": first[k]}) if base else None
            rows += [row] if row else []
    return pl.DataFrame(rows)


def difference_text(r: dict[str, Any], scale: float, digits: int = 2) -> str:
    """A paired row's difference: '-3.21 [-8.10, +1.68]' or '-3.21 (n=1, no interval)'."""
    if r["low"] is None:
        return f"{scale * r['diff']:+.{digits}f} (n=1, no interval)"
    return f"{scale * r['diff']:+.{digits}f} [{scale * r['low']:+.{digits}f}, {scale * r['high']:+.{digits}f}]"


def markdown_paired(frame: pl.DataFrame, title: str, scale: float = 100.0,
                    label: Callable[[dict[str, Any]], list[str]] | None = None, head: list[str] | None = None) -> str:
    """Paired rows as Markdown: the row's label columns (default: method, grid point),
    the difference with its 95 % interval, n, p, the seeds and both cells' stalls k/n."""
    head = head or ["method", "grid point"]
    label = label or (lambda r: [r["method"], r["point"] or "-"])
    lines = [title, "", "| " + " | ".join(head + ["difference [95% interval]", "n", "p", "seeds", "stalls",
                                                  "stalls (other)"]) + " |", "|" + "---|" * (len(head) + 6)]
    for r in frame.iter_rows(named=True):
        p = stats.p_text(r["p"]) if r["p"] is not None else "-"
        lines.append("| " + " | ".join(label(r) + [difference_text(r, scale), str(r["n"]), p, r["seeds"],
                                                   r["stalls"], r["stalls_other"]]) + " |")
    return "\n".join(lines) + "\n"


AXIS_COLUMNS: dict[str, Any] = {     # markdown_paired's columns for paired_along_axes rows
    "head": ["method", "grid point", "difference of"],
    "label": lambda r: [r["method"], r["point"], f"{r['axis']}={r['value']} - {r['axis']}={r['base']}"]}


def cell_text(values: dict[Any, float], stopped: dict[Any, bool], updates: dict[Any, int], scale: float = 100.0,
              digits: int = 2) -> str:
    """One cell over its seeds: 'mean ± sd' (the mean alone for one seed) when no seed or
    every seed stalled; each seed's value, a stalled one with its stop, when the cell is
    bimodal (stats module: some but not all seeds stalled)."""
    s = stats.stalls(stopped.values())
    if not s.bimodal:
        est = stats.summary(list(values.values()))
        return (f"{scale * est.mean:.{digits}f}" if est.sd is None
                else f"{scale * est.mean:.{digits}f} ± {scale * est.sd:.{digits}f}")
    return ", ".join(f"{seed}: {scale * v:.{digits}f}" + (f" (stopped at {updates[seed]})" if stopped[seed] else "")
                     for seed, v in values.items())
