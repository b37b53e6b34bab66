"""The web console's figures (issue 37, docs/console.md): a real `blocks up` with the trace's
whole inventory (1,213 nodes, 6,212 GPUs, `blocks cluster import`) and N blocks submitted through
the front door, then

* server time per view: p50 / p95 of GETs of each view's JSON on localhost (the page draws it);
* an event on screen: stored (the stream's timestamp) -> received on the server-sent events;
* the past-moment view: the overview at the last sequence but one (the stream folded again);
* an open page, idle: the console process's CPU over 20 s with one SSE client connected;
* with ``--shots``: first contentful paint of each page in chromium, and the screenshots of
  docs/console/*.png (the GPU map of the whole trace cluster).

Run: ``.venv/bin/python bench/console.py --blocks 10000 --shots``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "bench" / "traces" / "openb-2023" / "openb_node_list_gpu_node.csv"
SHOTS = ROOT / "docs" / "console"
COMPONENT = {
    "componentURI": "aios://bench/console",
    "image": "aios/bench:1",
    "resources": {"gpus": 1, "gpuMemory": 0, "cpu": 1, "memory": 1024, "gpuShare": 0.0},
    "policies": [{"name": "clusterAllocator", "policyRuleURI": "builtin:cluster-rank", "parameters": {}, "settings": {}},
                 {"name": "resourceAllocator", "policyRuleURI": "builtin:binpack", "parameters": {}, "settings": {}}],
}


def cli(data_dir: Path, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "aios_blocks.cli", *args, "--data-dir", str(data_dir)],
                         capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise SystemExit(f"blocks {' '.join(args)}: {out.stdout}{out.stderr}")
    return out.stdout


def get(url: str) -> tuple[float, bytes]:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as r:
        body = r.read()
    return time.perf_counter() - t0, body


async def read_all(data_dir: Path) -> list[tuple[str, bytes, int, float]]:
    """Every stored message, (subject, body, seq, ts)."""
    from aios_blocks.bus.nats_bus import Bus
    from aios_blocks.recovery.rebuild import read_stream
    from aios_blocks.runtime.locate import resolve_urls

    urls = resolve_urls(data_dir, "admin")
    assert urls
    bus = await Bus.open(urls[0], source="bench/console")
    msgs: list[tuple[str, bytes, int, float]] = []
    try:
        await read_stream(bus, lambda s, raw, seq, ts: msgs.append((s, raw, seq, ts)))
    finally:
        await bus.close()
    return msgs


def dump_stream(data_dir: Path, path: Path) -> int:
    """Every stored message pickled to ``path``: the input of ``bench/console_past.py`` and of
    profiling the views offline."""
    import pickle

    msgs = asyncio.run(read_all(data_dir))
    path.write_bytes(pickle.dumps(msgs, protocol=pickle.HIGHEST_PROTOCOL))
    return len(msgs)


def pcts(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return statistics.median(xs), xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]


async def submit_all(data_dir: Path, n: int, window: int = 200) -> None:
    from aios_blocks.cli.client import Client
    from aios_blocks.runtime.locate import resolve_urls

    urls = resolve_urls(data_dir, "admin")
    assert urls
    c = await Client.open(*urls)
    try:
        await c.add_component(COMPONENT)
        sem = asyncio.Semaphore(window)

        async def one(i: int) -> None:
            async with sem:
                await c.submit({"blockComponentURI": COMPONENT["componentURI"], "minInstances": 1, "maxInstances": 2,
                                "parameters": {"name": f"bench block {i}"}})

        await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await c.close()


def console_pid(up_pid: int) -> int:
    for p in psutil.Process(up_pid).children(recursive=True):
        if "aios_blocks.console" in " ".join(p.cmdline()):
            return p.pid
    raise SystemExit("no console process")


class Rows(list[tuple[str, str]]):
    """The figures, each printed as it is measured."""

    def append(self, item: tuple[str, str]) -> None:
        print(f"  {item[0]}: {item[1]}", flush=True)
        super().append(item)

    def __iadd__(self, items: object) -> Rows:
        for item in items:  # type: ignore[attr-defined]
            self.append(item)
        return self


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--blocks", type=int, default=10_000)
    ap.add_argument("--shots", action="store_true", help="first contentful paint in chromium, and docs/console/*.png")
    ap.add_argument("--settle-s", type=float, default=600, help="wait at most this long for every block to end")
    ap.add_argument("--dump", type=Path, help="also write the stream's messages here (pickle), for bench/console_past.py")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="aios-console-bench-"))
    data = base / "data"
    env = {k: v for k, v in os.environ.items() if k not in ("AIOS_NATS_URL", "AIOS_REDIS_URL", "AIOS_DATA_DIR")}
    up = subprocess.Popen([sys.executable, "-m", "aios_blocks.cli", "up", "--data-dir", str(data)], env=env, cwd=base,
                          stdout=open(base / "up.log", "wb"), stderr=subprocess.STDOUT)
    rows = Rows()
    try:
        deadline = time.monotonic() + 120
        url = ""
        while not url:
            time.sleep(0.3)
            try:
                url = json.loads((data / "endpoints.json").read_text()).get("console", "").rstrip("/") + "/"
            except (OSError, ValueError):
                url = ""
            if url == "/":
                url = ""
            assert time.monotonic() < deadline and up.poll() is None, (base / "up.log").read_text()
        while True:
            try:
                get(url + "api/whoami")
                break
            except OSError:
                time.sleep(0.3)
        cli(data, "cluster", "import", str(TRACE), "--cluster", "openb")
        t0 = time.perf_counter()
        asyncio.run(submit_all(data, args.blocks))
        print(f"submitted {args.blocks} blocks in {time.perf_counter() - t0:.1f}s", flush=True)
        settle = time.monotonic() + args.settle_s
        while True:
            o = json.loads(get(url + "api/overview")[1])
            total = sum(o["blocks"].values())
            # (settled: every block ready, failed or waiting for capacity in the pending queue)
            pending = sum(o["blocks"].get(s, 0) for s in ("parsed", "selecting", "allocating", "placing", "deleting"))
            if total >= args.blocks and not pending:
                break
            if time.monotonic() > settle:
                print(f"not settled: {o['blocks']}", flush=True)
                break
            time.sleep(2)
        o = json.loads(get(url + "api/overview")[1])
        bid = json.loads(get(url + "api/blocks?status=ready&per=1")[1])["rows"][0]["id"]
        node = json.loads(get(url + "api/gpumap")[1])["nodes"][0][0]
        views = {"overview": "api/overview", "gpumap": "api/gpumap", "blocks page": "api/blocks?page=3",
                 "blocks search": "api/blocks?q=block%2042&status=ready", "block": f"api/block/{bid}",
                 "gpu": f"api/gpu?node={node}"}
        for name, path in views.items():
            # the views are kept per stream sequence: asked again before a new event, the same
            # bytes are sent; "computed" asks a new query each time (an unknown parameter makes a
            # new cache key), the cost of the first request after an event
            times = [get(url + path)[0] for _ in range(30)]
            cold = [get(url + path + ("&" if "?" in path else "?") + f"bench={i}")[0] for i in range(30)]
            p50, p95 = pcts(times)
            c50, c95 = pcts(cold)
            size = len(get(url + path)[1])
            rows.append((f"server time, {name}", f"p50 {p50 * 1000:.1f} ms, p95 {p95 * 1000:.1f} ms; computed: p50 "
                         f"{c50 * 1000:.1f} ms, p95 {c95 * 1000:.1f} ms ({size / 1024:.1f} KiB)"))
        rows.append(("state", f"{o['totals']['nodes']} nodes, {o['totals']['gpus']} GPUs, blocks {o['blocks']}, last seq {o['seq']}"))
        if args.dump:
            rows.append(("stream dumped", f"{dump_stream(data, args.dump)} messages to {args.dump}"))
        # the past moment: folded again from the stream (a new sequence each time: no cache)
        past = [get(url + f"api/overview?seq={o['seq'] - 1 - i}")[0] for i in range(3)]
        rows.append(("past moment (overview at seq N)", f"median {statistics.median(past):.2f} s over a {o['seq']}-event stream"))
        # an event on screen: stored -> received on the SSE stream, for 20 blocks
        lat: list[float] = []
        stop = threading.Event()

        def listen() -> None:
            with urllib.request.urlopen(url + "api/events?subject=aios.block.*.parsed", timeout=120) as r:
                for raw in r:
                    line = raw.decode().strip()
                    if line.startswith("data: "):
                        ev = json.loads(line[6:])
                        if "ts" in ev:  # (not the hello)
                            lat.append(time.time() - ev["ts"])
                    if stop.is_set() or len(lat) >= 20:
                        return

        th = threading.Thread(target=listen, daemon=True)
        th.start()
        time.sleep(1)
        asyncio.run(submit_all(data, 20, window=1))
        th.join(60)
        stop.set()
        if lat:
            p50, p95 = pcts(lat)
            rows.append(("event stored -> on the SSE stream", f"p50 {p50 * 1000:.0f} ms, p95 {p95 * 1000:.0f} ms ({len(lat)} events)"))
        # idle: one SSE client connected, nothing happening
        proc = psutil.Process(console_pid(up.pid))
        holder = urllib.request.urlopen(url + "api/events", timeout=120)
        time.sleep(2)
        c0 = sum(proc.cpu_times()[:2])
        time.sleep(20)
        idle = (sum(proc.cpu_times()[:2]) - c0) / 20
        holder.close()
        rows.append(("console process, a page open and idle", f"{idle * 100:.2f} % of one core; RSS {proc.memory_info().rss / 2**20:.0f} MiB"))
        if args.shots:
            rows += shots(url)
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
        shutil.rmtree(base, ignore_errors=True)
    width = max(len(k) for k, _ in rows)
    print(f"\nconsole figures ({args.blocks} blocks submitted, the trace's inventory; `{' '.join(sys.argv)}`)")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def shots(url: str) -> list[tuple[str, str]]:
    from playwright.sync_api import sync_playwright

    out = []
    SHOTS.mkdir(parents=True, exist_ok=True)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-dev-shm-usage"])
        page = b.new_context(viewport={"width": 1500, "height": 950}).new_page()
        for name, frag, sel in (("overview-trace", "#/", "#ov-nodes"), ("gpu-map-trace", "#/map", "#gpu-canvas"),
                                ("blocks-trace", "#/blocks", "#blocks-table")):
            page.goto(url + "?x=" + name + frag)
            page.wait_for_selector(sel, timeout=60_000)
            fcp = page.evaluate("performance.getEntriesByName('first-contentful-paint')[0]?.startTime || 0")
            drawn = page.evaluate("Number(document.getElementById('view').dataset.rendered) - performance.timeOrigin")
            out.append((f"chromium, {name}", f"first contentful paint {fcp:.0f} ms, view drawn {drawn:.0f} ms"))
            if name == "gpu-map-trace":
                page.locator("#gpu-canvas").click(position={"x": 6, "y": 26})  # the first node's first GPU
                page.wait_for_selector("#gpu-instances", timeout=10_000)
            page.screenshot(path=str(SHOTS / f"{name}.png"))
        b.close()
    return out


if __name__ == "__main__":
    main()
