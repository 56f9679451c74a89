"""Published tables equal their committed results files (pipeline/reports/published.py).

Every `<!-- results FILE KIND METRIC -->` block of README.md and docs/*.md must be, to the
character, the report's own Markdown computed from FILE; a changed digit is named with its
file and line; and a report's results file renders what the report itself printed, so the
file is a faithful record of the command's output."""
from __future__ import annotations

import shutil

import polars as pl
import pytest

from pipeline.reports import offline, online, published

from conftest import REPO


def _all_blocks() -> list[published.Block]:
    return [b for doc in published.documents(REPO) for b in published.blocks(doc)]


def test_every_published_block_equals_its_results_file():
    found = _all_blocks()
    assert any(b.kind == "offline" for b in found), "no published offline table"
    problems = [p for b in found if (p := published.difference(b, REPO)) is not None]
    assert not problems, "\n".join(problems)


def test_every_committed_results_file_is_published():
    named = {b.results for b in _all_blocks()}
    files = {str(p.relative_to(REPO)) for p in (REPO / "docs" / "results").glob("*.csv")}
    assert files <= named, f"results files no table is rendered from: {sorted(files - named)}"


def test_a_changed_digit_is_named_with_its_file_and_line(tmp_path):
    block = next(b for b in _all_blocks() if b.kind == "offline")
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    shutil.copytree(REPO / "docs" / "results", root / "docs" / "results")    # the page's other blocks read theirs
    lines = block.doc.read_text().splitlines()
    # the first table row after the caption: change its last digit of the first cell
    row = next(k for k in range(block.line, block.line + len(block.body)) if lines[k].startswith("| grpo"))
    i = max(k for k, ch in enumerate(lines[row]) if ch.isdigit() and k < lines[row].index("±"))
    lines[row] = lines[row][:i] + str((int(lines[row][i]) + 1) % 10) + lines[row][i + 1:]
    doc = root / "docs" / "page.md"
    doc.write_text("\n".join(lines) + "\n")
    (changed,) = [b for b in published.blocks(doc) if b.results == block.results]
    message = published.difference(changed, root)
    assert message is not None and message.startswith(f"{doc}:{row + 1}:") and block.results in message
    assert published.write(doc, root)
    assert all(published.difference(b, root) is None for b in published.blocks(doc))


def test_a_block_without_its_closing_marker_is_refused(tmp_path):
    doc = tmp_path / "page.md"
    doc.write_text("text\n<!-- results docs/results/x.csv offline mean@8 -->\n| a |\n")
    with pytest.raises(ValueError, match=r"page.md:2: results block without its closing"):
        published.blocks(doc)


def _offline_evals(summary: pl.DataFrame) -> pl.DataFrame:
    """The evaluations an offline report.csv was summarized from (its seed columns, melted)."""
    seeds = [c for c in summary.columns if c.startswith(offline.SEED)]
    return (summary.select("cell", "update", "method", "train.t_ref", *seeds)
            .unpivot(index=["cell", "update", "method", "train.t_ref"], on=seeds, variable_name="seed",
                     value_name="accuracy")
            .with_columns(pl.col("seed").str.strip_prefix(offline.SEED).cast(pl.Int64))
            .select("cell", "method", "seed", "update", "accuracy", "train.t_ref"))


def test_the_offline_results_file_renders_what_the_report_printed(tmp_path):
    """report.csv, written by the report and read back, gives the report's own Markdown:
    nothing is lost in the CSV's digits."""
    block = next(b for b in _all_blocks() if b.kind == "offline")
    evals = _offline_evals(published.read_results(REPO / block.results))
    summary = offline.summarize(evals)
    summary.write_csv(tmp_path / "report.csv")          # as offline.write writes it
    rendered = published.render("offline", published.read_results(tmp_path / "report.csv"), block.metric)
    assert rendered == offline.markdown(summary, block.metric) and "Paired differences" in rendered


def test_the_online_results_file_renders_what_the_report_printed(tmp_path):
    """evals.csv, written by the online report and read back, gives its final and paired
    tables as the report printed them (real evaluations: the committed offline results, laid
    out as two online cells per method)."""
    block = next(b for b in _all_blocks() if b.kind == "offline")
    evals = _offline_evals(published.read_results(REPO / block.results))
    evals = (evals.rename({"train.t_ref": "t_ref"})
             .with_columns(pl.lit(4).alias("N"), pl.lit(128).alias("planned_updates")))
    text, _ = online.write(evals, pl.DataFrame(), tmp_path, block.metric)
    rendered = published.render("online", published.read_results(tmp_path / "evals.csv"), block.metric)
    assert text.startswith(rendered.rstrip("\n")) and "Paired differences" in rendered


def test_the_corrections_results_file_renders_the_reports_differences(tmp_path):
    """corrections.csv, written by the corrections report and read back, renders README's
    pivot: each entry the report's own paired difference at one decimal, bold exactly where
    Holm's p < 0.05, 'identical' for a method equal to the reference on every seed, and the
    count of differences that hold equal to the report's (real evaluations: the committed
    offline results as online cells, plus a copy of GRPO+TIS under another name)."""
    from pipeline.reports import compare, corrections

    block = next(b for b in _all_blocks() if b.kind == "offline")
    evals = _offline_evals(published.read_results(REPO / block.results))
    evals = (evals.rename({"train.t_ref": "t_ref"})
             .with_columns(pl.lit(4).alias("N"), pl.lit(128).alias("planned_updates")))
    twin = (evals.filter(pl.col("method") == "grpo_tis")
            .with_columns(pl.lit("icepop").alias("method"), pl.col("cell").str.replace("grpo_tis", "icepop")))
    evals = pl.concat([evals, twin])
    _, _, csv = corrections.write(evals, pl.DataFrame(), pl.DataFrame(), pl.DataFrame(), tmp_path, block.metric)
    rendered = published.render("corrections", published.read_results(tmp_path / "corrections.csv"), block.metric)
    seeds = corrections.per_seed(evals, pl.DataFrame())
    _, pairs = corrections.paired(seeds)
    rows = {line.split(" | ")[0].lstrip("| "): line.rstrip(" |").split(" | ")[1:]
            for line in rendered.splitlines() if line.startswith("| ") and not line.startswith("| minus")}
    settings = csv["setting"].unique(maintain_order=True).to_list()
    assert rows[corrections.title_of("icepop")] == ["identical"] * len(settings)
    for r in pairs.filter(~pl.col("identical")).iter_rows(named=True):
        entry = rows[corrections.title_of(r["method"])][settings.index(r["point"])]
        text = compare.difference_text(r, 100.0, digits=1).replace("-", "\u2212")
        assert entry.startswith(f"**{text}**" if r["p_holm"] < 0.05 else text), (entry, text)
    held = pairs.filter(pl.col("p").is_not_null() & (pl.col("p_holm") < 0.05)).height
    tested = pairs.filter(pl.col("p").is_not_null()).height
    assert f"over the {tested} differences that are tests, {held} hold" in rendered
