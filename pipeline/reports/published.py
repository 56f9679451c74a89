"""Published tables from committed results files: a table in README or docs/ can no longer
drift from what the command that produced it prints.

A published table is a block of Markdown between two markers:

    <!-- results docs/results/offline-t-ref.csv offline mean@8 -->
    ...the tables, exactly as the report prints them...
    <!-- /results -->

The marker names a results file (a CSV a report wrote, committed under docs/results/; the
path relative to the repository root), its kind, and the metric the captions name. The
block must equal `render(kind, frame, metric)`, the report's own Markdown computed from that
file, to the character:

- `offline`: the file is an offline report's report.csv (pipeline/reports/offline.py:
  mean ± std per cell and update, each seed's value in `seed_<seed>` columns); the block is
  its accuracy table and the paired tables (offline.markdown).
- `online`: the file is an online report's evals.csv (pipeline/reports/online.py: every
  evaluation, base included, with each cell's columns); the block is the final-accuracy
  table, the staleness / refresh pivots and the paired tables (online.tables).
- `summary`: the file lists a table's entries (`row`, `title`: its column, `method`,
  `point`: a grid point, and the `results` file and `kind` of the experiment it comes
  from); the block is one table of paired differences to GRPO+TIS, one decimal (README's).
- `corrections`: the file is a corrections report's corrections.csv (pipeline/reports/
  corrections.py: one row per method and setting); the block is the reference's finals, the
  pivot of each method's paired difference to it (one decimal, **bold** where it holds with
  Holm's adjustment over the table), the median 95 % half-width per column, the difference
  each column resolves at 80 % power (corrections.resolution), and the
  differences that hold.

`python -m pipeline.reports.published` checks every block of README.md and docs/*.md and
names each that differs (file, marker line, the first differing line); `--write` rewrites
the blocks from their files (each file written whole, atomically). The test suite runs the
check (tests/test_published.py).
"""
from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from pipeline.core.store import write_text_atomic
from pipeline.reports import compare, corrections, offline, online, stats

ROOT = Path(__file__).resolve().parents[2]
OPEN = re.compile(r"^<!-- results (\S+) (\S+) (\S+) -->$")
CLOSE = "<!-- /results -->"


def _offline(frame: pl.DataFrame, metric: str, root: Path) -> str:
    return offline.markdown(frame, metric)


def _online(frame: pl.DataFrame, metric: str, root: Path) -> str:
    return online.tables(frame, metric)


def _paired_to_reference(kind: str, frame: pl.DataFrame) -> pl.DataFrame:
    per_seed = (online.seed_finals(online.in_cell_order(frame)) if kind == "online"
                else offline.seed_finals(frame))
    ref, pairs = compare.paired_to_reference(per_seed)
    if ref != compare.REFERENCE:
        raise ValueError(f"a summary row's experiment has no {compare.REFERENCE} to pair with")
    return pairs


def _minus(text: str) -> str:
    return text.replace("-", "\u2212")


def _summary(spec: pl.DataFrame, metric: str, root: Path) -> str:
    """README's one table: rows (`row`) of paired differences to GRPO+TIS, one column per
    method (`title`), each entry read from its own experiment's results file (`results`,
    `kind`) at a grid point (`point`): difference [95 % interval] at one decimal, and the
    method's stalls where any; '–' where the experiment lacks the method."""
    titles = spec["title"].unique(maintain_order=True).to_list()
    rows: dict[str, dict[str, str]] = {}
    frames: dict[str, pl.DataFrame] = {}
    for r in spec.iter_rows(named=True):
        if r["results"] not in frames:
            frames[r["results"]] = _paired_to_reference(r["kind"], read_results(root / r["results"]))
        pairs = frames[r["results"]]
        hit = pairs.filter((pl.col("method") == r["method"]) & (pl.col("point") == r["point"]))
        if not hit.height:
            raise ValueError(f"{r['results']} has no paired row for {r['method']} at {r['point']!r}")
        d = hit.row(0, named=True)
        text = _minus(compare.difference_text(d, 100.0, digits=1))
        stalled = not d["stalls"].startswith("0/")
        rows.setdefault(r["row"], {})[r["title"]] = text + (f", {d['stalls']} stalled" if stalled else "")
    head = [f"| minus GRPO+TIS | {' | '.join(titles)} |", "|" + "---|" * (len(titles) + 1)]
    return "\n".join(head + [f"| {row} | " + " | ".join(cells.get(t, "\u2013") for t in titles) + " |"
                             for row, cells in rows.items()]) + "\n"


def _setting_title(setting: str) -> str:
    return setting.replace("N=", "N = ")


def _correction_cell(r: dict, n_seeds: int, alpha: float) -> str:
    """One entry of the corrections pivot: 'identical', or the difference [interval] in
    points (bold where Holm's p < alpha), n where fewer seeds paired, stalls where any."""
    if r["identical"]:
        return "identical"
    text = _minus(compare.difference_text({"diff": r["diff"], "low": r["diff_low"], "high": r["diff_high"]},
                                          100.0, digits=1))
    if r["p_holm"] is not None and r["p_holm"] < alpha:
        text = f"**{text}**"
    if r["diff_n"] != n_seeds:
        text += f", n = {r['diff_n']}"
    return text + (f", {r['stalled']}/{r['seeds']} stalled" if r["stalled"] else "")


def _corrections(frame: pl.DataFrame, metric: str, root: Path) -> str:
    """README's corrections table from corrections.csv: the reference's final accuracy per
    setting, each other method minus it per setting, the median half-width of the 95 %
    intervals per column (the table's resolution), and the differences Holm's adjustment
    keeps."""
    alpha = 1.0 - stats.LEVEL
    ref = frame["reference"][0]
    settings = frame["setting"].unique(maintain_order=True).to_list()
    n_seeds = int(frame["seeds"].max())  # type: ignore[arg-type]
    finals = {r["setting"]: r["mean"] for r in frame.filter(pl.col("method") == ref).iter_rows(named=True)}
    lead = (f"{corrections.title_of(ref)}, the reference, final {metric} (%): "
            + ", ".join(f"{100 * finals[s]:.1f} {'at ' if s != corrections.OFFLINE else ''}{_setting_title(s)}"
                        for s in settings if s in finals) + f"; n = {n_seeds} seeds.")
    others = frame.filter(pl.col("method") != ref)
    rows = {(r["method"], r["setting"]): r for r in others.iter_rows(named=True)}
    lines = [lead, "", f"| minus {corrections.title_of(ref)} | " + " | ".join(map(_setting_title, settings)) + " |",
             "|" + "---|" * (len(settings) + 1)]
    for m in others["method"].unique(maintain_order=True).to_list():
        lines.append(f"| {corrections.title_of(m)} | " + " | ".join(
            _correction_cell(rows[(m, s)], n_seeds, alpha) if (m, s) in rows else "\u2013" for s in settings) + " |")
    tested = others.filter(pl.col("p").is_not_null())     # the report's tests: identical rows have no p
    res = corrections.resolution(tested, "diff_low", "diff_high", "diff_n", "setting")
    lines += ["", "Median 95 % half-width: " + ", ".join(
        f"\u00b1{100 * res[s][0]:.1f} ({_setting_title(s)})" for s in settings if s in res) + ".",
              "Resolved at 80 % power (paired t, two-sided 5 % per test, the column's median spread): "
              + ", ".join(f"{100 * res[s][1]:.1f} ({_setting_title(s)})" for s in settings if s in res) + "."]
    held = tested.filter(pl.col("p_holm") < alpha)
    names = "; ".join(f"{corrections.title_of(r['method'])} at {_setting_title(r['setting'])} "
                      f"({_minus(format(100 * r['diff'], '+.1f'))})" for r in held.iter_rows(named=True))
    lines.append(f"With Holm's adjustment over the {tested.height} differences that are tests, {held.height} "
                 f"hold" + (f": {names}." if names else "."))
    return "\n".join(lines) + "\n"


RENDERERS: dict[str, Callable[[pl.DataFrame, str, Path], str]] = {
    "offline": _offline, "online": _online, "summary": _summary, "corrections": _corrections}


@dataclass(frozen=True)
class Block:
    """One published block: where it is (file, 1-based line of its opening marker, the
    lines between the markers), and what it is computed from."""
    doc: Path
    line: int
    results: str
    kind: str
    metric: str
    body: list[str]


def read_results(path: Path) -> pl.DataFrame:
    """A results CSV with every column as the report wrote it; seed columns and `t_ref`
    kept as their text ("fixed" next to numbers reads as text, as in the report)."""
    if not path.is_file():
        raise FileNotFoundError(f"results file {path} not found")
    return pl.read_csv(path, infer_schema_length=None)


def render(kind: str, frame: pl.DataFrame, metric: str, root: Path = ROOT) -> str:
    if kind not in RENDERERS:
        raise ValueError(f"unknown results kind {kind!r}: one of {sorted(RENDERERS)}")
    return RENDERERS[kind](frame, metric, root)


def blocks(doc: Path) -> list[Block]:
    """The published blocks of one Markdown file; an opening marker without its closing one
    is an error naming the file and line."""
    lines = doc.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = OPEN.match(lines[i])
        if m:
            try:
                end = lines.index(CLOSE, i + 1)
            except ValueError:
                raise ValueError(f"{doc}:{i + 1}: results block without its closing '{CLOSE}'") from None
            found.append(Block(doc, i + 1, m.group(1), m.group(2), m.group(3), lines[i + 1:end]))
            i = end
        i += 1
    return found


def expected(block: Block, root: Path = ROOT) -> list[str]:
    return render(block.kind, read_results(root / block.results), block.metric, root).rstrip("\n").splitlines()


def difference(block: Block, root: Path = ROOT) -> str | None:
    """None where the block equals its results file's rendering; else a one-line message
    naming the file, the marker's line and the first line that differs."""
    want, have = expected(block, root), block.body
    for k in range(max(len(want), len(have))):
        w = want[k] if k < len(want) else "<end of table>"
        h = have[k] if k < len(have) else "<end of block>"
        if w != h:
            return (f"{block.doc}:{block.line + 1 + k}: the table of {block.results} ({block.kind}) differs: "
                    f"printed {w!r}, published {h!r}")
    return None


def documents(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def write(doc: Path, root: Path = ROOT) -> bool:
    """Rewrite every block of `doc` from its results file; True when anything changed."""
    lines = doc.read_text().splitlines()
    changed = False
    for block in reversed(blocks(doc)):     # from the end: earlier line numbers stay valid
        want = expected(block, root)
        if want != block.body:
            lines[block.line:block.line + len(block.body)] = want
            changed = True
    if changed:
        write_text_atomic(doc, "\n".join(lines) + "\n")
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--write", action="store_true", help="rewrite the blocks from their results files")
    args = parser.parse_args(argv)
    problems = []
    for doc in documents():
        if args.write and write(doc):
            print(f"rewrote {doc.relative_to(ROOT)}")
        problems += [p for b in blocks(doc) if (p := difference(b)) is not None]
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
