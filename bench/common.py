"""Shared pieces of the benchmarks: result rows, percentiles, the raw limits, servers, machine
info and the results writer.

Contract for a bench module (``bench/<name>.py``): ``figures(quick: bool = False) -> list[dict]``
returning rows made by :func:`row`, and a ``main()`` for standalone use. ``bench/run_all.py`` runs
the raw limit first and publishes it here (:func:`set_raw`); other modules read it with
:func:`raw` (and measure it themselves when run alone).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
if str(ROOT) not in sys.path:  # `python bench/x.py` from the repo root
    sys.path.insert(0, str(ROOT))

Row = dict[str, Any]

#: raw limits of this stack on this machine (filled by run_all, or by bench.raw when run alone)
_RAW: dict[str, float] = {}

#: the raw-limit keys other modules use
JS_PUBLISH = "jetstream_publish_ack_per_s"
JS_STEP = "jetstream_step_per_s"
REDIS_RESERVE = "redis_reserve_per_s"


@contextlib.contextmanager
def env_set(name: str, value: str) -> Iterator[None]:
    """``name=value`` in this process's environment (the workers a stack spawns inherit it), the
    previous value (or none) back afterwards."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def row(group: str, figure: str, value: float, unit: str, of_raw_limit: float | None = None, note: str = "") -> Row:
    """One figure. ``of_raw_limit``: the figure as a fraction of the stack's raw limit (see docs)."""
    return {
        "group": group, "figure": figure, "value": float(value), "unit": unit,
        "of_raw_limit": None if of_raw_limit is None else float(of_raw_limit), "note": note,
    }


def pct(xs: Iterable[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100); NaN for no data."""
    s = sorted(xs)
    if not s:
        return float("nan")
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def run(coro: Any) -> Any:
    """Run a coroutine on uvloop when installed (the workers use it too), else asyncio."""
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        import asyncio

        return asyncio.run(coro)


def set_raw(rows: list[Row]) -> None:
    """Remember the raw limits from ``bench.raw``'s rows (keyed by their ``key`` note field)."""
    for r in rows:
        if r.get("key"):
            _RAW[r["key"]] = r["value"]


def raw(key: str) -> float | None:
    return _RAW.get(key)


def fraction(value: float, key: str, per_unit: float = 1.0) -> float | None:
    """``value`` (a rate) times ``per_unit`` (stream messages per unit, say) over the raw limit."""
    limit = _RAW.get(key)
    return (value * per_unit / limit) if limit else None


def floor_fraction(measured_s: float, steps: float, extra_s: float = 0.0) -> float | None:
    """For a latency or cost: the raw floor (``steps`` raw JetStream steps + ``extra_s``) over the
    measured time (1.0 = as fast as the raw stack allows)."""
    step = _RAW.get(JS_STEP)
    if not step or measured_s <= 0:
        return None
    return (steps / step + extra_s) / measured_s


@contextlib.asynccontextmanager
async def servers(tag: str = "bench") -> AsyncIterator[tuple[str, str, Path]]:
    """(nats url, redis url, data dir): ``AIOS_NATS_URL``/``AIOS_REDIS_URL`` when both are set,
    else embedded servers in a fresh temp dir (stopped and removed on exit)."""
    nats_url, redis_url = os.environ.get("AIOS_NATS_URL"), os.environ.get("AIOS_REDIS_URL")
    data = Path(tempfile.mkdtemp(prefix=f"aios-{tag}-"))
    if nats_url and redis_url:
        try:
            yield nats_url, redis_url, data
        finally:
            shutil.rmtree(data, ignore_errors=True)
        return
    from aios_blocks.runtime.embedded import EmbeddedServers

    srv = EmbeddedServers(data_dir=data).start()
    try:
        yield srv.nats_url, srv.redis_url, data
    finally:
        srv.stop()
        shutil.rmtree(data, ignore_errors=True)


def _cmd(args: list[str]) -> str:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=10, cwd=ROOT).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_info(redis_url: str | None = None) -> dict[str, Any]:
    """What a run is comparable by: cpus, model, python, server versions, commit, date."""
    from aios_blocks.runtime.embedded import nats_binary, redis_binary

    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": _cmd(["git", "rev-parse", "HEAD"]),
        "git_dirty": bool(_cmd(["git", "status", "--porcelain", "--untracked-files=no"])),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    with contextlib.suppress(Exception):
        info["nats_server"] = _cmd([nats_binary(), "--version"])
    with contextlib.suppress(Exception):
        info["redis_server"] = _cmd([redis_binary(), "--version"])
    with contextlib.suppress(Exception):
        import nats
        import redis

        info["nats_py"] = nats.__version__
        info["redis_py"] = redis.__version__
    info["nats_sync"] = os.environ.get("AIOS_NATS_SYNC", "always")
    return info


def write_results(rows: list[Row], meta: dict[str, Any], name: str = "latest.json") -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps({**meta, "rows": rows}, indent=2))
    return path


#: where the latest full run goes: the whole table into docs/benchmarks.md ("Latest run"), a
#: five-line summary of the headline figures into README "Performance"; ``run_all`` rewrites both
#: after a full ``make bench`` (each between its markers)
DOC_BEGIN, DOC_END = "<!-- bench:begin -->", "<!-- bench:end -->"
SUMMARY_BEGIN, SUMMARY_END = "<!-- bench-summary:begin -->", "<!-- bench-summary:end -->"
DOC_TARGETS = (ROOT / "docs" / "benchmarks.md",)
SUMMARY_TARGETS = (ROOT / "README.md",)

#: the README summary: (label, group starts with, figure starts with) per figure, one line per group
SUMMARY_LINES: tuple[tuple[str, tuple[tuple[str, str, str], ...]], ...] = (
    ("Placement, 10 clusters x 100 nodes x 8 GPUs", (
        ("blocks/s (burst)", "2 placement 10x100x8", "blocks/s end to end"),
        ("create->ready p50", "2 placement 10x100x8", "create->ready p50, unloaded"),
        ("instance placements/s", "2 placement 10x100x8", "instance placements/s"),
    )),
    ("Placement, 10 clusters x 1,000 nodes x 8 GPUs", (
        ("blocks/s (burst)", "2 placement 10x1000x8", "blocks/s end to end"),
        ("create->ready p50", "2 placement 10x1000x8", "create->ready p50, unloaded"),
        ("p99 at 80% of peak", "2 placement 10x1000x8", "create->ready p99 at 80%"),
    )),
    ("Core targets, 10 x 100 x 8, as `blocks up` runs (simulated start 0), Ray on the same workload", (
        ("blocks/s", "2 core targets", "blocks/s end to end"),
        ("Ray groups/s", "2 core targets", "Ray: placement groups/s"),
        ("ours/Ray", "2 core targets", "blocks/s / Ray"),
        ("placements/s", "2 core targets", "instance placements/s"),
        ("placements/Ray", "2 core targets", "placements/s / Ray"),
        ("CPU per block", "2 core targets", "CPU per block"),
    )),
    ("Against Ray placement groups, same run (with the 50 ms simulated start)", (
        ("Ray groups/s", "6 peer", "Ray: placement groups/s"),
        ("ours/Ray throughput", "6 peer", "ours / Ray: throughput"),
        ("ours/Ray p50 latency", "6 peer", "ours / Ray: p50 latency"),
    )),
    ("Raw limits of the stack", (
        ("JetStream acked publish", "1 raw limit", "JetStream publish, ack awaited"),
        ("Redis reservation round trip", "1 raw limit", "Redis RESERVE_GANG"),
    )),
    ("Recovery", (
        ("1M stored events rebuilt in", "recovery", "blocks recover from 1M"),
        ("rate", "recovery", "recover rate at 1M"),
    )),
)


def markdown(rows: list[Row], meta: dict[str, Any]) -> str:
    """The run as markdown: one line of machine info, then the table (what the docs show)."""
    lines = [_run_line(meta), "",
             "| group | figure | value | unit | of raw limit | note |", "|---|---|---:|---|---:|---|"]
    for r in rows:
        frac = r.get("of_raw_limit")
        cells = [r["group"], r["figure"], fmt(r["value"]), r["unit"], "" if frac is None else f"{frac:.3f}", r.get("note", "")]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    return "\n".join(lines)


def _run_line(meta: dict[str, Any]) -> str:
    m = meta.get("machine", {})
    redis = " ".join(str(m.get("redis_server", "")).split()[:3])
    facts = [
        f"Run {m.get('date', '?')}", f"commit {str(m.get('git_commit', ''))[:10] or '?'}{' (dirty tree)' if m.get('git_dirty') else ''}",
        f"{m.get('cpu_count', '?')} x {m.get('cpu_model', '?')}", f"Python {m.get('python', '?')}",
        str(m.get("nats_server", "")), redis, f"JetStream sync {m.get('nats_sync', '?')}",
    ]
    took = f"`{meta.get('command', 'make bench')}` took {meta.get('seconds', '?')} s"
    return ", ".join(f for f in facts if f) + f", {took}."


def summary(rows: list[Row], meta: dict[str, Any]) -> str:
    """Five lines of headline figures for the README (a figure the run lacks is left out), then
    the run line and a link to the full table."""
    out = []
    for title, picks in SUMMARY_LINES:
        parts = []
        for label, group, figure in picks:
            r = next((r for r in rows if r["group"].startswith(group) and r["figure"].startswith(figure)), None)
            if r is not None and r["value"] == r["value"]:
                parts.append(f"{label} **{fmt(r['value'])}**{' ' + r['unit'] if r['unit'] else ''}")
        if parts:
            out.append(f"- {title}: " + ", ".join(parts))
    out += ["", _run_line(meta) + " Every figure: [docs/benchmarks.md](docs/benchmarks.md#latest-run)."]
    return "\n".join(out)


def replace_marked(path: Path, body: str, begin: str = DOC_BEGIN, end: str = DOC_END) -> bool:
    """Put ``body`` between the markers in ``path``; False (file untouched) when they are missing."""
    if not path.exists():
        return False
    text = path.read_text()
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        return False
    path.write_text(text[: start + len(begin)] + "\n" + body.strip("\n") + "\n" + text[stop:])
    return True


def publish_docs(rows: list[Row], meta: dict[str, Any], targets: Iterable[Path] = DOC_TARGETS,
                 summary_targets: Iterable[Path] = SUMMARY_TARGETS) -> list[Path]:
    """Write the run's table into every target and its summary into every summary target that
    has the markers; returns those written."""
    table, short = markdown(rows, meta), summary(rows, meta)
    written = [p for p in targets if replace_marked(p, table)]
    return written + [p for p in summary_targets if replace_marked(p, short, SUMMARY_BEGIN, SUMMARY_END)]


def print_table(rows: list[Row], title: str = "aios-blocks benchmarks") -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title, show_lines=False)
    for col, just in (("group", "left"), ("figure", "left"), ("value", "right"), ("unit", "left"),
                      ("of raw limit", "right"), ("note", "left")):
        t.add_column(col, justify=just, overflow="fold")
    for r in rows:
        frac = r.get("of_raw_limit")
        t.add_row(r["group"], r["figure"], fmt(r["value"]), r["unit"], "" if frac is None else f"{frac:.3f}", r.get("note", ""))
    Console(width=200).print(t)


def fmt(v: float) -> str:
    if v != v:  # NaN
        return "n/a"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def standalone(figures: Any, quick: bool | None = None, module: str | None = None) -> None:
    """``main()`` of a module: run its figures (``--quick``), print them, write results/<module>.json."""
    quick = ("--quick" in sys.argv) if quick is None else quick
    started = time.time()
    rows = figures(quick=quick)
    name = module or Path(sys.modules[figures.__module__].__file__ or "bench").stem
    print_table(rows, title=f"{name} ({'quick' if quick else 'full'})")
    write_results(rows, {"machine": machine_info(), "quick": quick, "seconds": round(time.time() - started, 1)}, f"{name}.json")
