"""A Redis state as plain values, and its canonical digest.

An *image* maps each ``aios:*`` key to its value: ``str`` (string), ``dict`` (hash), ``set`` (set)
or :class:`ZSet` (sorted set, member -> score). The fold (``recovery.fold``) renders one from
the stream; ``recovery.rebuild`` reads one from Redis and writes one back. Two images describe the
same state when their :func:`digest` is equal.

What the digest leaves out, and why:

* ``aios:ctx:*`` - policies' shared context: a cache whose writes are not events, so it cannot
  be rebuilt (policies must treat an empty context as a cold cache);
* ``aios:gather:*`` - scratch state of a dry_run gather; its ``decided`` token and TTL are not
  in the stream (recover rebuilds the open gathers of blocks still selecting);
* ``aios:meta:*`` - the state epoch (changes on every recover by design) and the clusters' state
  indexes (counters of changes, not state; ``Store.state_index``);
* ``aios:heartbeats`` - last heartbeat per node: liveness, sent on core NATS, never stored;
* ``aios:metrics:*`` - the metrics collector's windows and the workers' /metrics targets: scraped
  figures with a TTL, never events (docs/metrics.md); kind ``telemetry``, not read as state;
  likewise the health checker's and autoscaler's live keys (``LIVE``: leases, passive counts,
  tick memory);
* ``aios:tenants:limits`` and ``aios:tenant:{T}:pending`` - kind ``kept``: the tenants'
  pending-create limits, copied into Redis by ``blocks tenant add`` from the data dir's auth file
  (their source, not an event), and each tenant's set of creates the parser counts (it drops those
  no longer pending when it counts; ``state.tenants``): neither digested nor dropped by recover;
* an instance's ``since`` (when it was placed: the controller's clock live, the placement event's
  time when rebuilt; the scale_down default's "newest first" needs only the order);
* block ``updated`` (a wall-clock time) and ``version`` (counts CAS transitions, including
  retried ones that publish nothing new); the block list's scores (creation times);
* the scale target (``desired``, ``desired_seq``, ``desired_request``, ``desired_reason``) of a
  block that ended (deleted, failed, rejected): it moves nothing any more, and a target stored
  just before a delete may have been applied live (handled before the delete) or refused (after
  it), which the stream does not say, so the fold cannot know which (the next create of the id
  starts a fresh record);
* a block's ``short`` mark (``schemas.condition``): the reconciler writes it after its
  ``block.degraded`` and keeps its figures and reason up to date silently, and clears a block's
  that left ``ready`` at its next pass, where the fold clears it with the step; the fold keeps the
  mark its events give (the console shows it, and a recover keeps it), Redis the reconciler's;
* a policy head's ``updated`` time;
* usage counters that are zero (``cpu_used``, ``g:*:n``...): Redis keeps a field at "0" after a
  reserve+release where the fold may never have created it; both mean "nothing used".

Numbers are compared as numbers (Lua and Python print floats differently) and JSON fields as
decoded JSON (key order and spacing differ between msgspec, pydantic and cjson). GPU lists of an
instance are compared as sets: a reused reservation lists its GPUs in Lua table order.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from ..schemas.records import JSON, JSONObject

_json = msgspec.json


class ZSet(dict[str, float]):
    """A sorted set in an image: member -> score."""


Image = dict[str, Any]

#: prefixes of keys the digest leaves out (see the module docstring)
VOLATILE = ("aios:ctx:", "aios:gather:", "aios:meta:", "aios:heartbeats")
#: prefixes of measurements (the metrics collector's windows, the workers' /metrics targets): they
#: change every second by themselves, so they are neither state nor rebuilt nor dropped by recover
#: (they expire on their own)
TELEMETRY = ("aios:metrics:",)
#: block services' own live state, kept like telemetry: the health checker's leases and the
#: executors' passive counts (``aios:health:``), the autoscaler's copies, leases and tick memory,
#: the controllers' claims on instances being replaced (``aios:meta:{b:<bid>}:replace:<iid>``),
#: the queue walker's lease (``aios:meta:queue:lease``, taken at its first pass, as the
#: reconciler's is under ``aios:health:``) and the rebalancer's (``aios:meta:rebalance:lease``,
#: likewise): each changes by itself, is never an event, and expires or is rewritten on its own
LIVE = ("aios:health:", "aios:meta:autoscalers", "aios:meta:{b:", "aios:meta:queue:lease",
        "aios:meta:rebalance:lease")
#: configuration copied into Redis from outside the stream (``blocks tenant add``'s limits) and the
#: parser's self-cleaning count of each tenant's pending creates: not state the stream holds, so
#: neither in the digest nor dropped by recover (``state.tenants``, docs/security.md "Tenants")
KEPT = ("aios:tenants:", "aios:tenant:")
#: prefixes of keys the stream rebuilds
REBUILT = (
    "aios:component:", "aios:clusters", "aios:{c:", "aios:nodeindex", "aios:block:", "aios:blocks",
    "aios:aff:", "aios:policy:", "aios:policies", "aios:nodeinst:", "aios:vcindex",
    "aios:priorityclasses", "aios:quotas",  # docs/priority.md
)


def classify(key: str) -> str:
    """``volatile``, ``rebuilt``, ``telemetry``, ``kept`` or ``unknown`` (a key this version does
    not know: reported)."""
    if key.startswith(TELEMETRY) or key.startswith(LIVE):
        return "telemetry"
    if key.startswith(KEPT):
        return "kept"
    if key.startswith(VOLATILE):
        return "volatile"
    if key.startswith(REBUILT):
        return "rebuilt"
    return "unknown"


def _j(raw: str) -> JSON:
    try:
        return _json.decode(raw)
    except msgspec.DecodeError:
        return raw


def _f(raw: str | None) -> float:
    try:
        return round(float(raw or 0), 6)
    except ValueError:
        return float("nan")


_USAGE = ("cpu_used", "mem_used")
#: a block's scale target, and the statuses in which it no longer counts (the module docstring)
_DESIRED = ("desired", "desired_seq", "desired_request", "desired_reason")
_ENDED = ("deleted", "failed", "rejected")
#: a block's fields the digest leaves out (the module docstring): its clocks and its short mark
_CLOCKS = ("updated", "version", "short")


def _node(h: dict[str, str]) -> JSONObject:
    out: JSONObject = {}
    for k, v in h.items():
        if k == "spec":
            out[k] = _j(v)
        elif k == "healthy":
            out[k] = v
        elif k == "agent":
            if v:  # "" (the simulated fleet) is what an absent field means too
                out[k] = v
        elif k in ("cpu", "memory") or k.endswith(":total"):
            out[k] = _f(v)
        elif k in _USAGE or k.startswith("g:"):
            if _f(v) != 0:
                out[k] = _f(v)
        else:
            out[k] = v
    return out


def _reservation(h: dict[str, str]) -> JSONObject:
    gpus = _j(h.get("gpus", "{}"))
    gpus = {g: _f(str(m)) for g, m in gpus.items()} if isinstance(gpus, dict) else {}
    return {
        "node": h.get("node"), "block": h.get("block"), "cpu": _f(h.get("cpu")), "mem": _f(h.get("mem")),
        "gpus": gpus, "exclusive": _f(h.get("exclusive")),
    }


def _instances(h: dict[str, str]) -> JSONObject:
    out: JSONObject = {}
    for iid, raw in h.items():
        v = _j(raw)
        if isinstance(v, dict):
            gpus = v.get("gpus")
            if isinstance(gpus, list):  # (GPU ids: text, ordered as before)
                v = {**v, "gpus": sorted(gpus, key=str)}
            v.pop("since", None)  # when it was placed: the controller's clock live, the event's rebuilt
        out[iid] = v
    return out


def _block(h: dict[str, str]) -> JSONObject:
    """A block's hash without its clocks and short mark, and without the scale targets of a block that ended (a target
    stored just before a delete is applied or refused by which the controller took first: the stream
    does not say; it moves nothing once the block ended)."""
    ended = h.get("status") in _ENDED
    out: JSONObject = {k: v for k, v in h.items() if k not in _CLOCKS and not (ended and k in _DESIRED)}
    if "ir" in h:
        out["ir"] = _j(h["ir"])
    return out


def normalise(key: str, value: Any) -> Any:
    """The comparable form of one key's value."""
    if isinstance(value, ZSet):
        return sorted(value)
    if isinstance(value, set):
        return sorted(value)
    if not isinstance(value, dict):
        return _j(value) if key.startswith("aios:component:") or ":vc:" in key else value
    if key.startswith("aios:block:"):
        return _instances(value) if key.endswith(":inst") else _block(value)
    if key.startswith("aios:{c:"):
        return _reservation(value) if ":res:" in key else _node(value)
    if key in ("aios:clusters",) or key.startswith("aios:aff:svc:"):
        return {k: _j(v) for k, v in value.items()}
    if key.startswith("aios:policy:"):
        return {k: v for k, v in value.items() if k != "updated"}
    return dict(value)


def canonical(img: Image) -> JSONObject:
    """Keys the digest covers, normalised."""
    return {k: normalise(k, v) for k, v in img.items() if classify(k) == "rebuilt"}


def digest(img: Image) -> str:
    doc = sorted(canonical(img).items())
    return hashlib.sha256(_json.encode(doc, order="sorted")).hexdigest()


def diff(a: Image, b: Image, limit: int = 20) -> list[str]:
    """Human-readable differences between two images (first ``limit``)."""
    ca, cb = canonical(a), canonical(b)
    out = []
    for key in sorted(set(ca) | set(cb)):
        va, vb = ca.get(key), cb.get(key)
        if va == vb:
            continue
        if isinstance(va, dict) and isinstance(vb, dict):
            fields = sorted(f for f in set(va) | set(vb) if va.get(f) != vb.get(f))
            detail = "; ".join(f"{f}: {_short(va.get(f))} != {_short(vb.get(f))}" for f in fields[:6])
        else:
            detail = f"{_short(va)} != {_short(vb)}"
        out.append(f"{key}: {detail}")
        if len(out) >= limit:
            break
    return out


def _short(v: Any, n: int = 160) -> str:
    s = "-" if v is None else _json.encode(v, order="sorted").decode()
    return s if len(s) <= n else s[:n] + "..."
