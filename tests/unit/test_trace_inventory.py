"""Real inventories in (docs/trace.md): the trace's node CSV and a YAML/JSON node list become
nodes with their own CPUs, memory, GPU count and GPU model (``nodeType``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aios_blocks.trace.inventory import GPU_MEMORY_MIB, InventoryError, load_nodes, parse_nodes, summary

CSV = """sn,cpu_milli,memory_mib,gpu,model
openb-node-0000,64000,262144,2,P100
openb-node-0227,32000,262144,0,nan
openb-node-0229,96000,786432,8,V100M32
"""


def test_csv_rows_become_nodes_with_their_own_capacity_and_model() -> None:
    nodes = parse_nodes(CSV, "openb")
    assert [n.id for n in nodes] == ["openb-node-0000", "openb-node-0227", "openb-node-0229"]
    p100, cpu_only, v100 = nodes
    assert (p100.cpu, p100.memory, len(p100.gpus)) == (64.0, 262144, 2)
    assert {g.model for g in p100.gpus} == {"P100"} and p100.gpus[0].memory == 16 * 1024
    assert p100.labels["nodeType"] == "P100" and p100.cluster == "openb"
    assert cpu_only.gpus == [] and cpu_only.cpu == 32.0 and "nodeType" not in cpu_only.labels
    assert v100.gpus[7].id == "openb-node-0229-g7" and v100.gpus[0].memory == 32 * 1024
    assert summary(nodes)["gpus_by_model"] == {"P100": 2, "V100M32": 8}


def test_yaml_and_json_node_lists() -> None:
    yaml_text = """
nodes:
  - {id: a1, cpu: 16, memory: 65536, gpus: 4, model: A10, labels: {rack: r1}}
  - {id: x1, cpu_milli: 8000, memory_mib: 1024, gpus: 1, model: X9, gpuMemory: 40960}
"""
    a1, x1 = parse_nodes(yaml_text, "c1")
    assert (a1.cpu, a1.memory, len(a1.gpus), a1.gpus[0].memory) == (16.0, 65536, 4, GPU_MEMORY_MIB["A10"])
    assert a1.labels == {"rack": "r1", "nodeType": "A10"}
    assert (x1.cpu, x1.gpus[0].model, x1.gpus[0].memory) == (8.0, "X9", 40960)
    (j,) = parse_nodes('[{"id": "t1", "cpu": 4, "memory": 8192, "gpus": 1, "model": "T4"}]', "c1", fmt="json")
    assert j.gpus[0].memory == 16 * 1024


def test_unknown_model_needs_its_memory_and_the_override_gives_it() -> None:
    text = "sn,cpu_milli,memory_mib,gpu,model\nn1,1000,1024,1,H100\n"
    with pytest.raises(InventoryError, match=r"unknown GPU model 'H100'.*--gpu-memory H100=MIB"):
        parse_nodes(text, "c")
    (n,) = parse_nodes(text, "c", gpu_memory={"H100": 81920})
    assert n.gpus[0].memory == 81920


@pytest.mark.parametrize(("text", "message"), [
    ("sn,cpu_milli,gpu,model\nn1,1,1,T4\n", "CSV header lacks memory_mib"),
    ("sn,cpu_milli,memory_mib,gpu,model\nn1,abc,1024,1,T4\n", "line 2: cpu_milli must be a number"),
    ("sn,cpu_milli,memory_mib,gpu,model\nn1,1000,1024,2,\n", "line 2: 2 GPU\\(s\\) but no model"),
    ("sn,cpu_milli,memory_mib,gpu,model\nn.1,1000,1024,0,\n", "line 2: node id 'n.1' is not a valid id"),
    ("sn,cpu_milli,memory_mib,gpu,model\nn1,1000,1024,0,\nn1,1000,1024,0,\n", "node id 'n1' appears twice"),
    ("sn,cpu_milli,memory_mib,gpu,model\nn1,1000,-5,0,\n", "memory_mib must be >= 0"),
    ("nodes: 3\n", "expected a list of nodes"),
    ("[]", "the node list is empty"),
])
def test_bad_node_lists_are_refused_with_the_row_and_why(text: str, message: str) -> None:
    with pytest.raises(InventoryError, match=message):
        parse_nodes(text, "c")


def test_the_shipped_trace_node_list_loads_whole() -> None:
    path = Path(__file__).resolve().parents[2] / "bench/traces/openb-2023/openb_node_list_gpu_node.csv"
    info = summary(load_nodes(path, "openb"))
    assert (info["nodes"], info["gpus"]) == (1213, 6212)
    assert info["gpus_by_model"] == {"A10": 2, "G2": 4392, "G3": 312, "P100": 265, "T4": 842, "V100M16": 195, "V100M32": 204}
    assert info["assumed_gpu_memory"] == ["G2", "G3"]


def test_every_bad_row_is_named_at_once() -> None:
    """Only the first bad row was said: a fix, a run, the next row, another run."""
    text = "sn,cpu_milli,memory_mib,gpu,model\nn1,-5,1024,2,ZZZ\nn2,1000,abc,1,T4\nn3,1000,1024,1,T4\nn3,1000,1024,1,T4\n"
    with pytest.raises(InventoryError) as exc:
        parse_nodes(text, "c")
    assert str(exc.value).splitlines() == ["line 2: cpu_milli must be >= 0, got '-5'", "line 3: memory_mib must be a number, got 'abc'",
                                           "node id 'n3' appears twice"]
    many = "sn,cpu_milli,memory_mib,gpu,model\n" + "".join(f"n{i},-1,1024,0,\n" for i in range(25))
    with pytest.raises(InventoryError) as exc:
        parse_nodes(many, "c")
    assert len(str(exc.value).splitlines()) == 21 and str(exc.value).endswith("... and 5 more")
    with pytest.raises(InventoryError, match=r"nodes\[0\]: expected a mapping, got int\nnodes\[1\]: missing the node id"):
        parse_nodes("[3, {cpu: 1, memory: 1}]", "c")
