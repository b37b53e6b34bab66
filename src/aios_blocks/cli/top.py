"""``blocks top [BID]``: the metrics collector's latest samples (``state.metrics``) as a table: one
row per block, or with a block id one row per instance of it (docs/metrics.md names the fields)
and the autoscaler's latest tick for it (``state.autoscale``: what it decided and why, also when
nothing changed)."""

from __future__ import annotations

import asyncio
import time
from typing import Any, NotRequired, TypedDict, final

import msgspec
from rich.table import Table

from ..handlers.autoscale import Latest
from ..schemas.records import BlockSample, InstanceSample
from ..state.store import Store


@final
class AllBlocks(TypedDict):
    """``blocks top``'s data without a block id: every block's latest sample."""

    blocks: dict[str, BlockSample]


@final
class OneBlock(TypedDict):
    """``blocks top BID``'s data: the block's latest sample, its instances' and the autoscaler's
    latest tick (when it has one)."""

    block: BlockSample | None
    instances: dict[str, InstanceSample]
    autoscaler: NotRequired[Latest | None]


async def read(store: Store, bid: str | None) -> AllBlocks | OneBlock:
    """What ``blocks top`` shows, as data (``--json`` prints this): ``{"blocks": {bid: sample}}``,
    or ``{"block": sample | None, "instances": {iid: sample}}`` for one block."""
    if bid is None:
        samples = await store.metrics.blocks()
        # the collector's last sample of a deleted block stays until it is overwritten or expires:
        # only blocks that still exist (and are not deleted) are shown
        records = await asyncio.gather(*(store.get_block(b) for b in samples))
        return {"blocks": {b: s for (b, s), rec in zip(samples.items(), records, strict=True)
                           if rec is not None and rec.get("status") != "deleted"}}
    out: OneBlock = {"block": await store.metrics.block(bid), "instances": await store.metrics.instances(bid)}
    raw = await store.autoscale.state(bid)
    if raw:
        try:
            out["autoscaler"] = msgspec.json.decode(raw).get("latest") or None
        except msgspec.DecodeError:
            pass
    return out


def autoscaler_line(latest: Latest, now: float) -> str:
    """The autoscaler's latest tick in one line."""
    head = f"autoscaler ({_age(latest.get('t'), now)} ago): "
    if latest.get("failed"):
        return head + f"tick failed, count stays {latest.get('current')}: {latest['failed']}"
    if latest.get("skipped"):
        return head + f"skipped ({latest['skipped']})"
    move = f"{latest.get('current')} -> {latest.get('desired')}" if latest.get("desired") != latest.get("current") \
        else f"stays {latest.get('current')}"
    rules = "; ".join(latest.get("rules") or [])
    return head + f"{move}, proposal {_n(latest.get('raw'))} ({latest.get('reason') or 'no reason given'})" + (f"; {rules}" if rules else "")


def _n(v: Any, nd: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.{nd}f}" if v != int(v) or nd == 0 else f"{int(v)}"
    return str(v)


def _age(t: Any, now: float) -> str:
    return "-" if not isinstance(t, int | float) else f"{max(0.0, now - t):.0f}s"


def table(data: AllBlocks | OneBlock, bid: str | None = None, now: float | None = None) -> Table:
    now = time.time() if now is None else now
    if "blocks" in data:
        t = Table(title="blocks (metrics collector, latest samples)", title_justify="left")
        for col in ("block", "cluster", "ready", "inflight", "queue", "rate/s", "errors/s", "rejected/s",
                    "latency ms", "dispatch p99 ms", "age"):
            t.add_column(col, justify="left" if col in ("block", "cluster") else "right", no_wrap=col in ("block", "cluster"))
        for bid, s in sorted(data["blocks"].items()):
            t.add_row(bid, s.get("cluster", ""), f"{s.get('ready', 0)}/{s.get('instances', 0)}", _n(s.get("inflight"), 0),
                      _n(s.get("queue"), 0), _n(s.get("rate")), _n(s.get("error_rate"), 2), _n(s.get("rejected_rate"), 2),
                      _n(s.get("latency_mean_ms")), _n(s.get("dispatch_p99_ms")), _age(s.get("t"), now))
        return t
    b = data.get("block")
    title = f"block {bid or ''}" + (
        f"  rate {_n(b.get('rate'))}/s  inflight {_n(b.get('inflight'), 0)}  queue {_n(b.get('queue'), 0)}"
        f"  rejected {_n(b.get('rejected_rate'), 2)}/s  retries {_n(b.get('retry_rate'), 2)}/s"
        f"  policy {_n(b.get('policy_mean_us'))} us  age {_age(b.get('t'), now)}" if b else "")
    t = Table(title=title, title_justify="left")
    latest = data.get("autoscaler")
    if latest:
        t.caption, t.caption_justify = autoscaler_line(latest, now), "left"
    for col in ("instance", "node", "state", "up", "inflight", "running", "waiting", "rate/s", "errors/s",
                "p50 ms", "p99 ms", "dispatch p99 ms"):
        t.add_column(col, justify="left" if col in ("instance", "node", "state") else "right", no_wrap=col in ("instance", "node"))
    for iid, inst in sorted(data.get("instances", {}).items()):
        t.add_row(iid, inst.get("node", ""), inst.get("state", ""), _n(inst.get("up")), _n(inst.get("inflight"), 0),
                  _n(inst.get("running"), 0), _n(inst.get("waiting"), 0), _n(inst.get("rate")), _n(inst.get("error_rate"), 2),
                  _n(inst.get("latency_p50_ms")), _n(inst.get("latency_p99_ms")), _n(inst.get("dispatch_p99_ms")))
    return t
