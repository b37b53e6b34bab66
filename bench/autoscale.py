"""The autoscaler: how fast it reacts to a load step, how much it over- or under-provisions, whether
it flaps under a steady load, how fast it gives instances back.

Two views:

* **simulated** (in process, fake clock, the real ``handlers.autoscale.decide`` and the real
  ``builtin:target-inflight``): a block serving tasks of 0.2 s; 10 tasks/s, then a step to
  100 tasks/s (10x), 60 s at that rate, 120 s at that rate +-10 % (uniform noise per second), then
  nothing. Instances become ready ``start delay`` after a decision (0.05 s and 5 s). Figures: step ->
  decision, decision -> all needed instances ready, instance-seconds over / under the need
  (``ceil(ongoing / target)``) over the run, direction reversals in the steady phase, load gone ->
  back at ``minInstances``. The same trace through a model of **Ray Serve's documented defaults**
  (``target_ongoing_requests`` 2, ``upscale_delay_s`` 30, ``downscale_delay_s`` 600,
  ``look_back_period_s`` 30, smoothing factors 1; when ``ray[serve]`` is importable the values are
  read from ``ray.serve.config.AutoscalingConfig``) is the anchor.
* **end to end** (real servers and workers: executor, metrics collector, autoscaler, controller,
  simulated instances serving HTTP with a 0.2 s service time): open-loop tasks through the
  executors, 5/s then 50/s (10x), then none. From the stream: step -> the first ``block.autoscaled``,
  decision -> the ``placement`` of the instances it asked for, -> their ``instance.added``
  (serving), and load gone -> the count back at ``minInstances``. The block uses short windows
  (``stableWindowS`` 20, ``downscaleDelayS`` 10) to keep the run bounded. Placement and serving
  need a controller that reaches ``block.scale.target``; without one they read n/a.
* **tick cost**: one autoscaler process deciding 500 blocks (100 with ``--quick``) on real Redis
  and NATS: a tick that changes nothing, and one that changes every block.

    .venv/bin/python -m bench.autoscale [--quick]
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import time
from dataclasses import dataclass
from typing import Any

try:
    from . import common
except ImportError:  # run as a script
    import common  # type: ignore[no-redef]

import itertools

from aios_blocks.handlers import autoscale as a
from aios_blocks.policies.builtin.autoscale import TargetInflightPolicy

GROUP = "autoscaler"
SERVICE_S = 0.2
TARGET = 2.0


# -- the simulated view ------------------------------------------------------------------------------
def trace(quick: bool, seed: int = 11) -> tuple[list[float], dict[str, int]]:
    """Tasks/s per second, and where each phase starts (seconds)."""
    rnd = random.Random(seed)
    base, high = 10.0, 100.0
    ph = {"step": 30, "steady": 90, "zero": 210 if not quick else 150, "end": 400 if not quick else 300}
    rates = []
    for t in range(ph["end"]):
        if t < ph["step"]:
            rates.append(base)
        elif t < ph["steady"]:
            rates.append(high)
        elif t < ph["zero"]:
            rates.append(high * rnd.uniform(0.9, 1.1))
        else:
            rates.append(0.0)
    return rates, ph


@dataclass
class SimResult:
    step_to_decision_s: float
    decision_to_ready_s: float
    over_is: float
    under_is: float
    reversals: int
    to_min_s: float


def simulate(rates: list[float], ph: dict[str, int], start_delay_s: float, decide: Any, lo: int = 1, hi: int = 20,
             tick: float = 2.0, dt: float = 0.05) -> SimResult:
    """Run the trace; ``decide(now, current, ongoing_samples) -> new count`` once per tick."""
    pending: list[tuple[float, int]] = []  # (ready at, count change)
    ready = lo
    target = lo
    samples: list[tuple[float, float]] = []
    over = under = 0.0
    decisions: list[tuple[float, int, int]] = []
    # ticks out of phase with the step and the samples; a sample reports the second before it
    t, next_tick, next_sample = 0.0, tick + 0.7, 1.0
    end = float(len(rates))
    while t < end:
        rate = rates[int(t)]
        ongoing = rate * SERVICE_S
        need = max(lo, min(hi, math.ceil(ongoing / TARGET - 1e-9)))
        for at, n in [p for p in pending if p[0] <= t]:
            ready += n
            pending.remove((at, n))
        over += max(0, ready - need) * dt
        under += max(0, need - ready) * dt
        if t >= next_sample:  # the collector: a sample a second, of the second before
            samples.append((t, rates[max(0, int(t) - 1)] * SERVICE_S))
            next_sample += 1.0
        if t >= next_tick:
            new = decide(t, target, samples)
            if new != target:
                decisions.append((t, target, new))
                if new > target:
                    pending.append((t + start_delay_s, new - target))
                else:
                    ready -= target - new  # a removal takes effect at once (drained)
                target = new
            next_tick += tick
        t += dt
    ups = [d for d in decisions if d[0] >= ph["step"] and d[2] > d[1]]
    first = ups[0][0] if ups else float("nan")
    need_high = math.ceil(100.0 * SERVICE_S / TARGET)
    reached = [d[0] for d in decisions if d[2] >= need_high and d[0] >= ph["step"]]
    moves = [1 if d[2] > d[1] else -1 for d in decisions if d[0] >= ph["step"] and d[0] < ph["zero"]]
    rev = sum(1 for x, y in itertools.pairwise(moves) if x != y)
    at_min = [d[0] for d in decisions if d[0] >= ph["zero"] and d[2] == lo]
    return SimResult(first - ph["step"], (reached[0] + start_delay_s - first) if reached else float("nan"), over, under, rev,
                     (at_min[0] - ph["zero"]) if at_min else float("nan"))


def ours(params: a.Params, lo: int = 1, hi: int = 20) -> Any:
    pol = TargetInflightPolicy("sim.autoscaler", {}, {})
    state = a.State(gen=1)

    def decide(now: float, current: int, samples: list[tuple[float, float]]) -> int:
        nonlocal state
        ongoing = samples[-1][1]
        raw = pol.eval({"target": TARGET}, a.policy_input("sim", {}, {"inflight": ongoing, "queue": 0.0}, current, lo, hi, state), {})
        out, state = a.decide(now, current, raw["desired"], lo, hi, params, state)
        return out.desired

    return decide


def ray_defaults() -> tuple[dict[str, float], str]:
    """Ray Serve's documented autoscaling defaults (from ``AutoscalingConfig`` when installed)."""
    doc = {"target_ongoing_requests": 2.0, "upscale_delay_s": 30.0, "downscale_delay_s": 600.0, "look_back_period_s": 30.0,
           "metrics_interval_s": 10.0, "upscaling_factor": 1.0, "downscaling_factor": 1.0}
    try:
        from ray.serve.config import AutoscalingConfig  # type: ignore[import-not-found,unused-ignore]

        cfg = AutoscalingConfig()
        got = {k: float(getattr(cfg, k) or doc[k]) for k in doc if hasattr(cfg, k)}
        return {**doc, **got}, "ray.serve.config.AutoscalingConfig()"
    except Exception:
        return doc, "Ray Serve docs (ray not importable)"


def ray_model(cfg: dict[str, float], lo: int = 1, hi: int = 20, tick: float = 2.0) -> Any:
    """Ray Serve's default policy as documented: the mean ongoing requests over the look-back
    period over the target gives the desired count; a decision counter must reach
    ``upscale_delay_s / tick`` (``downscale_delay_s / tick``) consecutive ticks before a change."""
    counter = 0

    def decide(now: float, current: int, samples: list[tuple[float, float]]) -> int:
        nonlocal counter
        window = [v for t, v in samples if t >= now - cfg["look_back_period_s"]] or [0.0]
        desired = max(lo, min(hi, math.ceil(sum(window) / len(window) / cfg["target_ongoing_requests"] - 1e-9)))
        if desired > current:
            counter = max(counter, 0) + 1
            if counter * tick >= cfg["upscale_delay_s"]:
                counter = 0
                return desired
        elif desired < current:
            counter = min(counter, 0) - 1
            if -counter * tick >= cfg["downscale_delay_s"]:
                counter = 0
                return desired
        else:
            counter = 0
        return current

    return decide


def simulated(quick: bool) -> list[common.Row]:
    rows: list[common.Row] = []
    rates, ph = trace(quick)
    cfg, source = ray_defaults()
    for delay in (0.05, 5.0):
        for name, decide in (("ours (defaults)", ours(a.Params())), ("Ray Serve defaults (model)", ray_model(cfg))):
            r = simulate(rates, ph, delay, decide)
            g = f"{GROUP} (simulated, start {delay:g} s)"
            note = f"{name}; 10->100 tasks/s of 0.2 s, target 2 in flight per instance" + (f"; {source}" if "Ray" in name else "")
            rows += [
                common.row(g, f"{name}: step -> decision", r.step_to_decision_s, "s", None, note),
                common.row(g, f"{name}: decision -> need ready", r.decision_to_ready_s, "s", None, "first decision to 10 instances ready"),
                common.row(g, f"{name}: over-provisioned", r.over_is, "instance-s", None, f"whole run ({len(rates)} s)"),
                common.row(g, f"{name}: under-provisioned", r.under_is, "instance-s", None, f"whole run ({len(rates)} s)"),
                common.row(g, f"{name}: reversals (step + steady +-10 %)", float(r.reversals), "", None,
                           f"{ph['zero'] - ph['step']} s from the step"),
                common.row(g, f"{name}: load 0 -> back to min", r.to_min_s, "s", None,
                           f"within {len(rates) - ph['zero']} s" if not math.isnan(r.to_min_s) else
                           f"not within {len(rates) - ph['zero']} s"),
            ]
    return rows


# -- end to end ----------------------------------------------------------------------------------------
COMPONENT = {
    "componentURI": "aios://bench/autoscaled",
    "resources": {"gpus": 0, "cpu": 1, "memory": 512},
    "policies": [
        {"name": "clusterAllocator", "policyRuleURI": "builtin:cluster-rank"},
        {"name": "resourceAllocator", "policyRuleURI": "builtin:spread"},
    ],
}
AUTOSCALER_PARAMS = {"target": 2, "stableWindowS": 20, "burstWindowS": 4, "downscaleDelayS": 10, "upscaleDelayS": 2}


async def _load(client: Any, bid: str, rate: float, seconds: float, stats: dict[str, int]) -> None:
    """Open loop: ``rate`` tasks/s for ``seconds`` (each task answered in its own task)."""
    if rate <= 0:
        await asyncio.sleep(seconds)
        return
    tasks: set[asyncio.Task[Any]] = set()

    async def one() -> None:
        try:
            status, _, _ = await client.task(bid, b'{"x": 1}', timeout=30)
            stats["ok" if status < 400 else "refused"] = stats.get("ok" if status < 400 else "refused", 0) + 1
        except Exception:
            stats["error"] = stats.get("error", 0) + 1

    start = time.monotonic()
    n = 0
    while (elapsed := time.monotonic() - start) < seconds:
        due = int(elapsed * rate) + 1
        while n < due:
            t = asyncio.get_running_loop().create_task(one())
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            n += 1
        await asyncio.sleep(min(0.02, 1 / rate))
    if tasks:
        await asyncio.wait(tasks, timeout=35)


async def _e2e(start_delay_s: float, quick: bool) -> list[common.Row]:
    from aios_blocks.cli.client import Client, event_kind
    from aios_blocks.runtime.supervisor import DEFAULT_LAYOUT, Supervisor

    g = f"{GROUP} (end to end, start {start_delay_s:g} s)"
    env_before = {k: os.environ.get(k) for k in ("AIOS_SIM_START_DELAY_S",)}
    os.environ["AIOS_SIM_START_DELAY_S"] = str(start_delay_s)
    try:
        async with common.servers("autoscale") as (nats_url, redis_url, data):
            sup = Supervisor(nats_url, redis_url, layout=dict(DEFAULT_LAYOUT), log_dir=str(data / "logs")).start()
            client = await Client.open(nats_url, redis_url)
            events: list[tuple[float, str, dict[str, Any]]] = []
            try:
                await client.add_component(COMPONENT)
                await client.add_sim_cluster("asb", nodes=4, gpus=0)
                spec = {"blockComponentURI": COMPONENT["componentURI"], "minInstances": 1, "maxInstances": 12,
                        "parameters": {"sim": {"serviceTimeMs": SERVICE_S * 1000}},
                        "policyRulesSpec": [{"values": {"name": "autoscaler", "policyRuleURI": "builtin:target-inflight",
                                                        "parameters": AUTOSCALER_PARAMS}}]}
                bid = await client.submit(spec)
                kind, _ = await client.wait(bid, 120)
                if kind != "ready":
                    raise RuntimeError(f"block ended {kind}; see {data / 'logs'}")

                async def follow() -> None:
                    async for subject, env in client.follow(bid, from_start=False):
                        events.append((time.time(), event_kind(subject), env.get("data") or {}))

                watcher = asyncio.get_running_loop().create_task(follow())
                stats: dict[str, int] = {}
                base, high = 5.0, 50.0
                await _load(client, bid, base, 10 if quick else 15, stats)  # warm: the collector's windows fill
                step_at = time.time()
                await _load(client, bid, high, 20 if quick else 30, stats)
                zero_at = time.time()
                back_at = None
                deadline = time.time() + 60
                while time.time() < deadline:
                    insts = await client.store.instances(bid)
                    # back at min by a decision of the autoscaler (a count that never grew is not "back")
                    if sum(1 for r in insts.values() if r.get("status") != "removing") <= 1 and any(
                            k == "autoscaled" and t > zero_at and d.get("desired") == 1 for t, k, d in events):
                        back_at = time.time()
                        break
                    await asyncio.sleep(0.5)
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await watcher
            finally:
                await client.close()
                sup.stop()
    finally:
        for k, v in env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    ups = [(t, d) for t, k, d in events if k == "autoscaled" and step_at <= t < zero_at and d.get("desired", 0) > d.get("current", 0)]
    first_t, first = ups[0] if ups else (float("nan"), {})
    rid = first.get("request_id", "")
    placed = [t for t, k, d in events if k == "placement" and t >= first_t]
    added = [t for t, k, _ in events if k.startswith("instance.") and k.endswith(".added") and t >= first_t]
    downs = [d for t, k, d in events if k == "autoscaled" and step_at <= t < zero_at and d.get("desired", 0) < d.get("current", 0)]
    moves = [1 if d.get("desired", 0) > d.get("current", 0) else -1 for t, k, d in events if k == "autoscaled" and t < zero_at]
    rev = sum(1 for x, y in itertools.pairwise(moves) if x != y)
    na = "n/a: no controller reached the target (block.scale.target not consumed yet)"
    return [
        common.row(g, "step 5 -> 50 tasks/s -> decision", first_t - step_at, "s", None,
                   f"first block.autoscaled ({first.get('current')} -> {first.get('desired')}); goal <= 5 s" if ups else "no decision"),
        common.row(g, "decision -> placement", (placed[0] - first_t) if placed else float("nan"), "s", None,
                   f"request {rid}" if placed else na),
        common.row(g, "decision -> new instance serving", (added[0] - first_t) if added else float("nan"), "s", None,
                   "first instance.added after the decision" if added else na),
        common.row(g, "reversals under load", float(rev), "", None, f"{len(ups)} up, {len(downs)} down decisions under load"),
        common.row(g, "load 0 -> back to min", (back_at - zero_at) if back_at else float("nan"), "s", None,
                   "stableWindowS 20, downscaleDelayS 10" if back_at else na),
        common.row(g, "tasks answered / refused / failed", float(stats.get("ok", 0)), "tasks", None,
                   f"{stats.get('refused', 0)} refused, {stats.get('error', 0)} failed"),
    ]


async def _tick_cost(n: int) -> list[common.Row]:
    """One autoscaler process deciding ``n`` blocks (real Redis and NATS; records written
    straight to Redis as the controller and the collector would): a tick that changes nothing,
    and one that changes every block (two events each)."""
    import msgspec

    from aios_blocks.state.keys import block_key
    from aios_blocks.workers.autoscaler import Autoscaler
    from aios_blocks.workers.base import Worker

    g = f"{GROUP} (tick cost, {n} blocks)"
    async with common.servers("autoscale-tick") as (nats_url, redis_url, _data):
        w = await Worker.open(nats_url, redis_url, "bench-autoscaler")
        try:
            pipe = w.store.r.pipeline(transaction=False)
            now = time.time()
            samples = {}
            for b in range(n):
                bid = f"ast-{b}"
                ir = {"blockId": bid, "minInstances": 1, "maxInstances": 50, "policies": {"autoscaler": {
                    "name": "autoscaler", "policyRuleURI": "builtin:target-inflight", "parameters": {"target": 2, "upscaleDelayS": 0}}}}
                pipe.hset(block_key(bid), mapping={"status": "ready", "gen": "1", "ir": msgspec.json.encode(ir).decode()})
                pipe.hset(f"aios:block:{bid}:inst", mapping={f"{bid}-{i}": msgspec.json.encode(
                    {"node": "n", "gpus": [], "status": "running", "cluster": "c"}).decode() for i in range(4)})
                samples[bid] = ({"t": now, "cluster": "c", "instances": 4, "inflight": 8.0, "queue": 0.0},
                                {f"{bid}-{i}": {"t": now, "inflight": 2.0} for i in range(4)})
            await pipe.execute()
            await w.store.metrics.write(samples, 60, 600)
            scaler = Autoscaler(w, holder="bench")
            hold = []
            for _ in range(5):
                t0 = time.perf_counter()
                res = await scaler.tick()
                hold.append(time.perf_counter() - t0)
            assert all(r.what == "hold" for r in res.values()), {r.what for r in res.values()}
            for blk, _ in samples.values():  # 4x the load: every block grows
                blk["inflight"] = 32.0
                blk["t"] = time.time()
            await w.store.metrics.write(samples, 60, 600)
            t0 = time.perf_counter()
            res = await scaler.tick()
            change = time.perf_counter() - t0
            changed = sum(1 for r in res.values() if r.what == "changed")
        finally:
            await w.close()
    return [
        common.row(g, "tick, nothing changes (p50 of 5)", sorted(hold)[2] * 1000, "ms", None,
                   f"{sorted(hold)[2] / n * 1e6:.0f} us per block: leases, reads, policy, rules, state write"),
        common.row(g, "tick, every block changes", change * 1000, "ms", None,
                   f"{changed} blocks changed: + block.autoscaled and block.scale.target each"),
    ]


def figures(quick: bool = False) -> list[common.Row]:
    rows = simulated(quick)
    rows += common.run(_tick_cost(100 if quick else 500))
    for delay in ((0.05,) if quick else (0.05, 5.0)):
        rows += common.run(_e2e(delay, quick))
    return rows


if __name__ == "__main__":
    common.standalone(figures)
