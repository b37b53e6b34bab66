"""``blocks explain``: fold a block's recorded events (from the stream alone) into the why of its
placement - candidates and why others were filtered, each cluster's dry_run score and node/GPUs,
why the final cluster won, each instance's node and GPUs, every failure with its reason - and of
its size: each instance target asked for (by whom), each autoscaler decision (from, to, the
policy's proposal and reason, the framework's rules) and failed autoscaler tick - and of its
health: the health checker's verdicts on each instance (with their reasons) and failed ticks;
for Adaptive affinity entries, the adapt stage's table (per node p50 and weight multiplier) and
each instance's base and adapted weights with why.
"""

from __future__ import annotations

from typing import Any


def _kind(subject: str) -> str:
    parts = subject.split(".", 3)
    return parts[3] if len(parts) == 4 else subject


def _dry_run(r: dict[str, Any], out: dict[str, Any], data: dict[str, Any]) -> None:
    """One cluster's dry_run answer in its round."""
    r["dry_run"][data.get("cluster_id", "")] = {
        "score": data.get("score", 0.0),
        "node": (data.get("node_info") or {}).get("node_id", ""),
        "gpus": (data.get("node_info") or {}).get("gpus", []),
        "error": data.get("error", ""),
        "rejected_nodes": data.get("rejected_nodes", {}),
        "node_scores": data.get("node_scores", {}),
        "adapt": data.get("adapt") or {},
    }
    if data.get("adapt"):
        out["adapt"] = data["adapt"]


def explain(events: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "block_id": "",
        "status": "unknown",
        "reason": "",
        "rounds": [],
        "instances": {},
        "failures": [],
        "decisions": {"count": 0, "errors": 0, "total_us": 0, "by_policy": {}},
        "rejected_errors": [],
        "targets": [],
        "autoscaler": {"decisions": [], "failures": []},
        #: the latest adapt stage table a placement (or dry_run) used: {} without Adaptive entries
        "adapt": {},
    }
    rounds: dict[int, dict[str, Any]] = {}

    def rnd(n: int) -> dict[str, Any]:
        if n not in rounds:
            rounds[n] = {"round": n, "candidates": [], "filtered": {}, "dry_run": {}, "chosen": "", "why": "", "missing": []}
        return rounds[n]

    for subject, env in events:
        kind = _kind(subject)
        raw = env.get("data")
        data: dict[str, Any] = raw if isinstance(raw, dict) else {}
        out["block_id"] = out["block_id"] or subject.split(".")[2]
        n = int(data.get("attempt", 0) or 0)
        if kind in ("submitted", "create"):  # create: stored in AIOS by versions before AIOS_INTAKE
            out["status"] = "submitted"
        elif kind == "parsed":
            out["status"] = "parsed"
        elif kind == "rejected":
            out["status"] = "rejected"
            out["rejected_errors"] = data.get("errors", [])
            out["reason"] = "; ".join(f"{e['path']}: {e['message']}" for e in out["rejected_errors"])
        elif kind == "selection":
            r = rnd(n)
            r["candidates"] = data.get("candidates", [])
            r["filtered"] = data.get("filtered", {})
        elif kind == "dry_run.result":  # stored apart by versions before answers went into post_dry_run
            _dry_run(rnd(n), out, data)
        elif kind == "post_dry_run":
            r = rnd(n)
            for a in data.get("answers") or []:
                if isinstance(a, dict):
                    _dry_run(r, out, a)
            r["chosen"] = data.get("cluster_id", "")
            r["missing"] = data.get("missing", [])
            scores = data.get("scores", {})
            if r["chosen"]:
                others = ", ".join(f"{c} {s:g}" for c, s in sorted(scores.items()) if c != r["chosen"])
                r["why"] = f"clusterAllocator chose {r['chosen']} with score {scores.get(r['chosen'], 0):g}" + (
                    f" (others: {others})" if others else ""
                )
        elif kind == "allocation.failed":
            out["failures"].append({"step": "allocation", "round": int(data.get("request_id") or 0), "reason": data.get("reason", "")})
        elif kind == "placement":
            if data.get("adapt"):
                out["adapt"] = data["adapt"]
            for p in data.get("placements", []):
                out["instances"][p["instance_id"]] = {
                    "node": p["node_id"], "gpus": p["gpus"], "action": data.get("action", ""), "status": "placed",
                    "replaces": data.get("replaces", ""),
                }
                if p.get("adaptive"):
                    out["instances"][p["instance_id"]]["adaptive"] = p["adaptive"]
        elif kind.startswith("instance."):
            iid, event = kind.split(".")[1], kind.rsplit(".", 1)[1]
            inst = out["instances"].setdefault(iid, {"node": data.get("node_id", ""), "gpus": data.get("gpus", []), "action": ""})
            if event == "verdict":  # the health checker's (docs/health.md): the instance's health, not its status
                inst["health"] = data.get("verdict", "")
                inst.setdefault("verdicts", []).append({"verdict": data.get("verdict", ""), "reason": data.get("reason", ""),
                                                        "policy": data.get("policy", "")})
                continue
            inst["status"] = {"added": "running", "removed": "removed"}.get(event, event)
            if data.get("reason"):
                inst["reason"] = data["reason"]
            if event in ("failed", "unhealthy"):  # an agent's report: kept, whatever the instance's later status
                inst.setdefault("failures", []).append({"event": event, "reason": data.get("reason", "")})
                out["failures"].append({"step": f"instance {iid}" + (" health" if event == "unhealthy" else ""),
                                        "reason": data.get("reason", "")})
        elif kind == "health.failed":
            out["failures"].append({"step": "health_check", "reason": data.get("reason", "")})
        elif kind in ("scale.failed", "reassignment.failed"):
            out["failures"].append({"step": data.get("step", kind.split(".")[0]), "reason": data.get("reason", "")})
        elif kind == "scale.target":
            out["targets"].append({"time": env.get("time", ""), "target": data.get("target"), "source": data.get("source", ""),
                                   "reason": data.get("reason", ""), "request_id": data.get("request_id", "")})
        elif kind == "autoscaled":
            out["autoscaler"]["decisions"].append({
                "time": env.get("time", ""), "from": data.get("current"), "to": data.get("desired"), "proposal": data.get("raw"),
                "reason": data.get("reason", ""), "rules": data.get("rules", []), "in_burst": data.get("in_burst", False),
                "stable": data.get("stable"), "burst": data.get("burst"), "inputs": data.get("inputs", {}),
                "request_id": data.get("request_id", ""),
            })
        elif kind == "autoscale.failed":
            out["autoscaler"]["failures"].append({"time": env.get("time", ""), "reason": data.get("reason", ""),
                                                  "count": data.get("current"), "quiet": data.get("quiet", 0)})
        elif kind in ("ready", "failed", "deleted"):
            out["status"] = kind
            if kind == "failed":
                out["reason"] = data.get("reason", "")
                out["failures"].append({"step": "block", "reason": out["reason"]})
        calls = [data] if kind == "decision" else [x for x in data.get("decisions") or [] if isinstance(x, dict)]
        calls += [x for a in data.get("answers") or [] if isinstance(a, dict)
                  for x in a.get("decisions") or [] if isinstance(x, dict)]
        for call in calls:
            d = out["decisions"]
            d["count"] += 1
            d["total_us"] += int(call.get("duration_us", 0))
            if call.get("error"):
                d["errors"] += 1
            key = f"{call.get('kind')}:{call.get('policy')}@{call.get('version') or call.get('uri')}"
            per = d["by_policy"].setdefault(key, {"calls": 0, "us": 0, "actions": {}})
            per["calls"] += 1
            per["us"] += int(call.get("duration_us", 0))
            per["actions"][call.get("action", "?")] = per["actions"].get(call.get("action", "?"), 0) + 1
    out["rounds"] = [rounds[k] for k in sorted(rounds)]
    return out
