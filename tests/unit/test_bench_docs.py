"""The benchmark figures reach the docs: the whole table in docs/benchmarks.md, five headline
lines in the README (both between markers, rewritten by ``make bench``)."""

from __future__ import annotations

from pathlib import Path

from bench import common

ROOT = Path(__file__).resolve().parents[2]
META = {"machine": {"date": "2026-01-01", "git_commit": "abc"}, "command": "make bench", "seconds": 1.0}


def _rows() -> list[common.Row]:
    return [
        common.row("2 placement 10x100x8", "blocks/s end to end (create->ready, 1 instance), burst", 21.5, "blocks/s"),
        common.row("2 placement 10x100x8", "create->ready p50, unloaded", 130.0, "ms"),
        common.row("6 peer: Ray placement groups", "ours / Ray: throughput", 0.5, "x"),
        common.row("recovery", "blocks recover from 1M stored events", float("nan"), "s"),
    ]


def test_summary_names_headline_figures_and_skips_missing_ones() -> None:
    text = common.summary(_rows(), META)
    lines = text.splitlines()
    assert lines[0].startswith("- Placement, 10 clusters x 100 nodes x 8 GPUs: blocks/s (burst) **21.5** blocks/s")
    assert "create->ready p50 **130** ms" in lines[0]
    assert any("ours/Ray throughput **0.50** x" in line for line in lines)
    assert not any(line.startswith("- Recovery") for line in lines)  # NaN: module failed, left out
    assert "docs/benchmarks.md" in lines[-1]


def test_publish_docs_writes_table_and_summary_between_their_markers(tmp_path: Path) -> None:
    readme, bench = tmp_path / "README.md", tmp_path / "benchmarks.md"
    readme.write_text(f"intro\n{common.SUMMARY_BEGIN}\nold\n{common.SUMMARY_END}\nafter\n")
    bench.write_text(f"x\n{common.DOC_BEGIN}\nold\n{common.DOC_END}\n")
    written = common.publish_docs(_rows(), META, targets=[bench], summary_targets=[readme])
    assert written == [bench, readme]
    r = readme.read_text()
    assert "old" not in r and r.startswith("intro\n") and r.endswith("after\n") and "**21.5**" in r
    assert "| group | figure |" not in r  # the README gets the summary, not the table
    assert "| 2 placement 10x100x8 | create->ready p50, unloaded | 130 | ms |" in bench.read_text()


def test_repository_docs_have_the_markers() -> None:
    readme = (ROOT / "README.md").read_text()
    assert common.SUMMARY_BEGIN in readme and common.DOC_BEGIN not in readme
    assert common.DOC_BEGIN in (ROOT / "docs" / "benchmarks.md").read_text()
