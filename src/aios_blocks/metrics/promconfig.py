"""The Prometheus scrape config of a running system (``blocks prometheus-config``), and the
service-discovery documents the collector serves (Prometheus ``http_sd_configs``).

Two jobs:

* ``aios-workers``: every worker's ``/metrics`` (parser, gateway, controller, executor, the
  collector...), label ``kind`` (and ``cluster`` for a pinned worker). ``honor_labels: true``: an
  executor's series carry their own ``instance`` label (the block's instance), which must not be
  renamed ``exported_instance``. A node agent's own ``/metrics`` (``--metrics-port``) is one of
  them, kind ``agent`` (its heartbeats carry the URL; ``workers.health`` announces it).
* ``aios-instances``: every block instance's own ``/metrics``, target labels ``block``,
  ``instance`` (the instance id, replacing host:port), ``cluster``, ``node``.

With the collector's discovery URL the targets follow the system as it changes (``http_sd``);
``static`` lists the targets of this moment instead (for a Prometheus that cannot reach the
collector).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NotRequired, TypedDict
from urllib.parse import urlsplit

from ..schemas.records import BlockMap, MetricsTarget

WORKERS_JOB = "aios-workers"
INSTANCES_JOB = "aios-instances"


def _address(url: str) -> tuple[str, str]:
    """``http://h:p/path`` -> (``h:p``, ``/path``)."""
    parts = urlsplit(url)
    return parts.netloc, parts.path or "/metrics"


class TargetGroup(TypedDict):
    """A Prometheus target group (http_sd and ``static_configs``): addresses and their labels."""

    targets: list[str]
    labels: dict[str, str]


class ScrapeJob(TypedDict):
    """One ``scrape_configs`` entry of the YAML (``config``): http_sd or static targets."""

    job_name: str
    scrape_interval: str
    honor_labels: NotRequired[bool]
    http_sd_configs: NotRequired[list[dict[str, str]]]
    static_configs: NotRequired[list[TargetGroup]]


def worker_targets(targets: list[MetricsTarget]) -> list[TargetGroup]:
    """http_sd document of the workers' registered targets (``state.metrics``)."""
    out: list[TargetGroup] = []
    for t in sorted(targets, key=lambda t: str(t.get("id", ""))):
        addr, path = _address(str(t["url"]))
        labels = {"kind": str(t.get("kind", "")), "worker": str(t.get("id", ""))}
        if t.get("cluster"):
            labels["cluster"] = str(t["cluster"])
        if path != "/metrics":
            labels["__metrics_path__"] = path
        out.append({"targets": [addr], "labels": labels})
    return out


def instance_targets(maps: Mapping[str, BlockMap], clusters: dict[str, str]) -> list[TargetGroup]:
    """http_sd document of the instances of the blocks' instance maps (any that has an endpoint
    and is not stopping)."""
    out: list[TargetGroup] = []
    for bid in sorted(maps):
        for iid, rec in sorted((maps[bid].get("instances") or {}).items()):
            endpoint = rec.get("endpoint") or ""
            if not endpoint or rec.get("state") == "stopping":
                continue
            addr, _ = _address(endpoint)
            out.append({"targets": [addr], "labels": {"block": bid, "instance": iid, "cluster": clusters.get(bid, ""),
                                                      "node": str(rec.get("node", ""))}})
    return out


def config(sd_url: str | None = None, workers: list[TargetGroup] | None = None,
           instances: list[TargetGroup] | None = None, scrape_interval: str = "15s",
           refresh_interval: str = "30s") -> str:
    """The YAML: ``sd_url`` (the collector's ``http://host:port``) -> http_sd jobs; else the given
    static target groups."""
    def job(name: str, path: str, static: list[TargetGroup] | None, honor: bool) -> ScrapeJob:
        j: ScrapeJob = {"job_name": name, "scrape_interval": scrape_interval}
        if honor:
            j["honor_labels"] = True
        if sd_url:
            j["http_sd_configs"] = [{"url": f"{sd_url.rstrip('/')}/sd/{path}", "refresh_interval": refresh_interval}]
        else:
            j["static_configs"] = static or []
        return j

    doc = {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
        "scrape_configs": [job(WORKERS_JOB, "workers", workers, True), job(INSTANCES_JOB, "instances", instances, False)],
    }
    import yaml  # here: the collector process, which imports this module for the targets, writes no YAML

    header = "# Prometheus scrape config of an aios-blocks system (`blocks prometheus-config`; docs/metrics.md)\n"
    return header + yaml.safe_dump(doc, sort_keys=False)
