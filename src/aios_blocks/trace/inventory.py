"""Real inventories in: a node list (the Alibaba GPU trace's CSV, or a YAML/JSON list) -> ``Node``
records with their own CPUs, memory, GPU count and GPU model (``nodeType``). Pure: no I/O but
reading the file given. See docs/trace.md "Importing an inventory".

CSV columns (cluster-trace-gpu-v2023's ``openb_node_list_*.csv``): ``sn,cpu_milli,memory_mib,gpu,model``.
YAML/JSON: ``{"nodes": [{"id", "cpu" | "cpu_milli", "memory" | "memory_mib", "gpus", "model",
"gpuMemory"?, "labels"?}]}`` or the bare list.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import NotRequired, TypedDict, cast

from ..schemas.policy_io import as_float, as_int
from ..schemas.spec import Gpu, Node, check_id

#: one entry of a node list: a CSV row (text) or a YAML/JSON mapping (any JSON value)
Row = Mapping[str, object]

#: MiB of one GPU of each model of the trace. V100M16/M32, T4, P100 and A10 are the NVIDIA parts'
#: sizes; G1-G3 are undisclosed internal codes: the figures are ASSUMED (G1/G2 16 GiB, G3 32 GiB).
GPU_MEMORY_MIB: dict[str, int] = {
    "V100M16": 16 * 1024,
    "V100M32": 32 * 1024,
    "T4": 16 * 1024,
    "P100": 16 * 1024,
    "A10": 24 * 1024,
    "G1": 16 * 1024,  # assumed (undisclosed)
    "G2": 16 * 1024,  # assumed (undisclosed)
    "G3": 32 * 1024,  # assumed (undisclosed)
}
#: the models whose memory is an assumption, not a published figure
ASSUMED_MODELS = frozenset({"G1", "G2", "G3"})
NODE_TYPE_LABEL = "nodeType"
_NO_MODEL = {"", "nan", "none", "null", "-"}


class InventorySummary(TypedDict):
    """``blocks trace inventory``'s counts of a node list (:func:`summary`)."""

    nodes: int
    gpu_nodes: int
    gpus: int
    cpu: float
    memory_mib: int
    gpus_by_model: dict[str, int]
    #: the models whose GPU memory is an assumption (``ASSUMED_MODELS``)
    assumed_gpu_memory: list[str]
    #: added by ``blocks cluster import`` (its ``--json``): nodes with a GPU topology, whether
    #: the cluster is new, whether the nodes were registered (not a dry run)
    gpu_topology_nodes: NotRequired[int]
    new_cluster: NotRequired[bool]
    registered: NotRequired[bool]


class InventoryError(ValueError):
    """A node list that cannot be imported; the message says which rows and why, one line each."""


#: the most rows' problems one error lists (then how many more)
MAX_PROBLEMS = 20


def _num(row: Row, where: str, *names: str, default: float | None = None) -> float:
    for name in names:
        value = row.get(name)
        if value is None or value == "":
            continue
        try:
            out = as_float(value)
        except (TypeError, ValueError):
            raise InventoryError(f"{where}: {name} must be a number, got {value!r}") from None
        if out < 0 or out != out:
            raise InventoryError(f"{where}: {name} must be >= 0, got {value!r}")
        return out
    if default is not None:
        return default
    raise InventoryError(f"{where}: missing {' or '.join(names)}")


def _node_id(row: Row, where: str) -> str:
    nid = str(row.get("sn") or row.get("id") or row.get("name") or "").strip()
    if not nid:
        raise InventoryError(f"{where}: missing the node id (sn or id)")
    try:
        check_id(nid, "node id")
    except ValueError as exc:
        raise InventoryError(f"{where}: {exc}") from None
    return nid


def _gpu_count(row: Row, where: str) -> int:
    count = _num(row, where, "gpu", "gpus", default=0)
    if count != int(count) or count > 64:
        raise InventoryError(f"{where}: gpu count must be a whole number from 0 to 64, got {count:g}")
    return int(count)


def _model(row: Row, where: str, count: int) -> str:
    model = str(row.get("model") or "").strip()
    if model.lower() in _NO_MODEL:
        model = ""
    if count and not model:
        raise InventoryError(f"{where}: {count} GPU(s) but no model")
    return model


def _gpus(row: Row, where: str, nid: str, count: int, model: str, table: dict[str, int]) -> list[Gpu]:
    """``count`` GPUs of ``model``, each of the entry's ``gpuMemory``, else the table's figure."""
    if not count:
        return []
    mem = row.get("gpuMemory") or row.get("gpu_memory_mib")
    if mem in (None, ""):
        if model not in table:
            raise InventoryError(
                f"{where}: unknown GPU model {model!r}: give its memory (--gpu-memory {model}=MIB, or gpuMemory "
                f"in the entry); known: {', '.join(sorted(table))}")
        mem = table[model]
    return [Gpu(id=f"{nid}-g{i}", model=model, memory=as_int(mem)) for i in range(count)]


def node_from_row(row: Row, cluster: str, where: str, gpu_memory: dict[str, int] | None = None,
                  labels: dict[str, str] | None = None) -> Node:
    """One node list entry -> a ``Node``: CPUs from ``cpu_milli`` (thousandths) or ``cpu`` (cores),
    memory from ``memory_mib``/``memory`` (MiB), ``gpu``/``gpus`` GPUs of ``model``, each of the
    model's memory (``gpuMemory`` in the entry, else ``gpu_memory``, else :data:`GPU_MEMORY_MIB`)."""
    table = {**GPU_MEMORY_MIB, **(gpu_memory or {})}
    nid = _node_id(row, where)
    cpu = _num(row, where, "cpu_milli") / 1000 if row.get("cpu_milli") not in (None, "") else _num(row, where, "cpu")
    memory = int(_num(row, where, "memory_mib", "memory"))
    count = _gpu_count(row, where)
    model = _model(row, where, count)
    gpus = _gpus(row, where, nid, count, model, table)
    # a mapping in a valid entry (anything else fails here, as it always did)
    given = cast(Mapping[object, object], row.get("labels") or {})
    node_labels = {**(labels or {}), **{str(k): str(v) for k, v in given.items()}}
    if model:
        node_labels.setdefault(NODE_TYPE_LABEL, model)
    try:
        return Node(id=nid, cluster=cluster, cpu=cpu, memory=memory, gpus=gpus, labels=node_labels)
    except ValueError as exc:
        raise InventoryError(f"{where}: {exc}") from None


def parse_nodes(text: str, cluster: str, fmt: str = "auto", gpu_memory: dict[str, int] | None = None,
                labels: dict[str, str] | None = None) -> list[Node]:
    """The nodes of a node list: ``fmt`` ``csv``, ``yaml``/``json`` or ``auto`` (a first line with
    ``sn,`` or commas and no colon reads as CSV). Node ids must be unique. Every bad entry is said
    at once (the first :data:`MAX_PROBLEMS`, then how many more)."""
    if fmt == "auto":
        first = text.lstrip().split("\n", 1)[0]
        fmt = "csv" if ("," in first and ":" not in first and not first.startswith(("[", "{", "-"))) else "yaml"
    nodes: list[Node] = []
    problems: list[str] = []
    for row, where in _entries(text, fmt, problems):
        try:
            nodes.append(node_from_row(row, cluster, where, gpu_memory, labels))
        except InventoryError as exc:
            problems.append(str(exc))
    seen: set[str] = set()
    for n in nodes:
        if n.id in seen:
            problems.append(f"node id {n.id!r} appears twice")
        seen.add(n.id)
    if problems:
        more = f"\n... and {len(problems) - MAX_PROBLEMS} more" if len(problems) > MAX_PROBLEMS else ""
        raise InventoryError("\n".join(problems[:MAX_PROBLEMS]) + more)
    if not nodes:
        raise InventoryError("the node list is empty")
    return nodes


def _entries(text: str, fmt: str, problems: list[str]) -> Iterator[tuple[Row, str]]:
    """A node list's entries, each with where it is (``line N`` of a CSV, ``nodes[i]``); an entry
    that is no mapping goes to ``problems``. Raises InventoryError for a list that cannot be read."""
    if fmt == "csv":
        reader = csv.DictReader(io.StringIO(text))
        missing = {"sn", "cpu_milli", "memory_mib", "gpu", "model"} - set(reader.fieldnames or [])
        if missing:
            raise InventoryError(f"CSV header lacks {', '.join(sorted(missing))} (expected sn,cpu_milli,memory_mib,gpu,model)")
        for i, row in enumerate(reader, start=2):
            yield row, f"line {i}"
        return
    if fmt not in ("yaml", "json"):
        raise InventoryError(f"unknown format {fmt!r} (csv, yaml, json)")
    import yaml

    try:
        data = json.loads(text) if fmt == "json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise InventoryError(f"not valid {fmt.upper()}: {exc}") from None
    entries = data.get("nodes") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise InventoryError("expected a list of nodes, or {nodes: [...]}")
    for i, entry in enumerate(entries):
        if isinstance(entry, dict):
            yield entry, f"nodes[{i}]"
        else:
            problems.append(f"nodes[{i}]: expected a mapping, got {type(entry).__name__}")


def load_nodes(path: Path, cluster: str, gpu_memory: dict[str, int] | None = None,
               labels: dict[str, str] | None = None) -> list[Node]:
    """:func:`parse_nodes` of a file; the format from its suffix (.csv, .yaml/.yml, .json)."""
    suffix = path.suffix.lower()
    fmt = {".csv": "csv", ".yaml": "yaml", ".yml": "yaml", ".json": "json"}.get(suffix, "auto")
    return parse_nodes(path.read_text(encoding="utf-8"), cluster, fmt, gpu_memory, labels)


def summary(nodes: list[Node]) -> InventorySummary:
    """Node, GPU, CPU and memory counts, and GPUs per model."""
    models: dict[str, int] = {}
    for n in nodes:
        for g in n.gpus:
            models[g.model] = models.get(g.model, 0) + 1
    return {
        "nodes": len(nodes), "gpu_nodes": sum(1 for n in nodes if n.gpus), "gpus": sum(models.values()),
        "cpu": round(sum(n.cpu for n in nodes), 3), "memory_mib": sum(n.memory for n in nodes),
        "gpus_by_model": dict(sorted(models.items())),
        "assumed_gpu_memory": sorted(m for m in models if m in ASSUMED_MODELS),
    }
