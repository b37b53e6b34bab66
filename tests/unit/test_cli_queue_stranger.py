"""A stranger's pass over the queue, priority, rebalance and trace commands (no servers): bad
arguments are refused in one clear line, exit 2, before anything is looked for."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aios_blocks.cli.main import app


def test_rebalance_refuses_a_negative_max_moves(cli: CliRunner) -> None:
    """-1 was the option's hidden 'not given': --max-moves -5 ran with AIOS_REBALANCE_MAX_MOVES (8)."""
    r = cli.invoke(app, ["rebalance", "--dry-run", "--max-moves", "-5"])
    assert r.exit_code == 2, r.output
    assert "--max-moves" in r.output and "greater than or equal to 0" in r.output, r.output


def test_list_pending_names_a_victims_preemptor_once(cli: CliRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    """A victim's reason is 'preempted by B': the table said 'preempted by B (preempted by B)'."""
    from aios_blocks.cli import blocks

    victim = {"id": "lo", "scope": "_", "position": 1, "priority": 0, "priorityClass": "low", "age_s": 1.0,
              "reason": "preempted by hi", "preempted_by": "hi", "preempting": False, "deadline": 0.0}
    # a victim retried then waiting for another reason keeps who preempted it, said after that reason
    again = {**victim, "id": "lo2", "reason": "no cluster passed the filter rule"}
    monkeypatch.setattr(blocks, "_request", lambda *a, **k: [victim, again])
    r = cli.invoke(app, ["list", "--pending"])
    assert r.exit_code == 0, r.output
    assert r.output.count("preempted by hi") == 2, r.output
    assert "no cluster passed the filter rule; preempted by hi" in r.output, r.output


def test_explain_says_who_preempted_a_waiting_block_once() -> None:
    from aios_blocks.cli.pending import preempted_note

    note = "(it never preempts in turn)"
    assert preempted_note("preempted by hi", "hi", note) == " (it never preempts in turn)"
    assert preempted_note("no room", "hi", note) == "; preempted by hi (it never preempts in turn)"
    assert preempted_note("no room", "", note) == ""


def test_priority_class_add_names_every_problem_on_one_line(cli: CliRunner) -> None:
    """It printed pydantic's dump ('1 validation error for PriorityClass', the pattern, a URL)."""
    r = cli.invoke(app, ["priority-class", "add", "bad name!", "99999999999"])
    assert r.exit_code == 2, r.output
    out = " ".join(r.output.split())
    assert "name: String should match pattern" in out and "value: Input should be less than or equal to" in out, out
    assert "validation error" not in out and "errors.pydantic.dev" not in out, out


@pytest.mark.parametrize(("module", "args", "extra"), [
    ("matplotlib", ["trace", "replay", "n.csv", "p.csv", "--in-process", "--plot", "out.png"], "aios-blocks[trace]"),
    ("nkeys", ["sidecar-auth", "init", "--state-dir", "st"], "aios-blocks[sidecar-auth]"),
])
def test_a_missing_extra_is_named_with_its_brackets(cli: CliRunner, monkeypatch: pytest.MonkeyPatch, module: str,
                                                    args: list[str], extra: str) -> None:
    """Rich read '[trace]' as markup and printed pip install 'aios-blocks', which installs nothing new."""
    import sys

    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    r = cli.invoke(app, args)
    assert r.exit_code == 2, r.output
    assert f"pip install '{extra}'" in r.output, r.output


def test_trace_replay_refuses_every_policy_it_cannot_load_before_replaying(cli: CliRunner, tmp_path: Path) -> None:
    """-p bogus replayed the whole sample, each task 'placement refused', 0 % allocated, exit 0."""
    nodes, pods = tmp_path / "n.csv", tmp_path / "p.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,2,P100\n")
    pods.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1000,1024,1,1000\n")
    r = cli.invoke(app, ["trace", "replay", str(nodes), str(pods), "--in-process",
                         "-p", "bogus", "-p", "fgd", "-p", "nomod:X", "-p", "builtin:nope"])
    assert r.exit_code == 2, r.output
    out = " ".join(r.output.split())
    assert "--policy bogus: unknown policyRuleURI 'bogus'" in out and "the short names: random" in out, out
    assert "--policy nomod:X: No module named 'nomod'" in out and "--policy builtin:nope: unknown built-in" in out, out
    assert "--policy fgd" not in out and "allocation" not in out, out


def test_vcluster_get_wraps_a_long_line_instead_of_cutting_it(cli: CliRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    """Piped (80 columns) or narrow, the tree cut its job cluster's line at the width: '..., block b'."""
    from aios_blocks.cli import vcluster

    bid = "blk-dbbe55edf64f"
    node = {"type": "A100", "healthy": True, "place": f"job-{bid}", "idle": False}
    job = {"id": f"job-{bid}", "kind": "job", "revision": 1, "counts": {"A100": 2}, "replicaSets": {"A100": 2},
           "block": bid, "nodes": {"c3-n4": node}, "blocks": [bid], "jobClusters": []}
    top = {**job, "id": "batch", "kind": "divisible", "block": "", "blocks": [], "jobClusters": [job],
           "nodes": {"c3-n4": node}}
    monkeypatch.setenv("COLUMNS", "60")
    monkeypatch.setattr(vcluster, "_request", lambda *a, **k: {"primary": {"cluster": "c3", "nodes": 8, "unassigned": {}},
                                                               "vcluster": top})
    r = cli.invoke(app, ["vcluster", "get", "batch"])
    assert r.exit_code == 0, r.output
    assert f"block {bid}" in " ".join(r.output.split()), r.output


async def test_rebalance_names_every_unknown_cluster() -> None:
    """--cluster nope1 --cluster nope2 said only 'no cluster 'nope1''."""
    from aios_blocks.handlers import rebalance as hr
    from aios_blocks.workers.rebalancer import plan_rounds

    class Store:
        async def clusters(self) -> dict[str, dict[str, str]]:
            return {"c1": {}}

    async def invoke(rule: object, data: object) -> object:
        raise AssertionError("no plan before the clusters are checked")

    with pytest.raises(LookupError, match=r"^no cluster 'nope1', 'nope2'$"):
        await plan_rounds(Store(), invoke, {}, 1, 16, ["c1", "nope1", "nope2"], trigger=hr.Trigger.MANUAL)


def test_quota_set_names_every_problem_of_its_values_at_once(cli: CliRunner) -> None:
    """The first value that was not MODEL:RES=N stopped it: the others (an unknown resource, a bad
    borrowing limit) took a run each. A NaN amount was stored, and quota get then failed on it."""
    r = cli.invoke(app, ["quota", "set", "team-a", "--nominal", "*:gpus=8,foo=3", "--nominal", "gpus=8",
                         "--nominal", "A100:gpus=nan", "--borrowing-limit", "*:gpus=x"])
    assert r.exit_code == 2, r.output
    out = r.output
    for says in ("--nominal: 'gpus=8' is not MODEL:RESOURCE=N", "--nominal: 'gpus=nan' is not RESOURCE=N",
                 "--borrowing-limit: 'gpus=x' is not RESOURCE=N", "nominal.*.foo.[key]: Input should be 'gpus'"):
        assert says in out, out
    assert "No servers" not in out, out
    r = cli.invoke(app, ["quota", "set", "team-a", "--nominal", "A100:gpus=-1"])
    assert r.exit_code == 2 and "nominal: A100.gpus is -1.0: a quota amount is a finite number >= 0" in r.output, r.output
    assert "Value error" not in r.output, r.output
    from aios_blocks.schemas.priority import Quota

    for bad in (math.nan, math.inf):  # the schema too (the console and replayed events make quotas)
        with pytest.raises(ValueError, match="a quota amount is a finite number >= 0"):
            Quota(tenant="t", nominal={"*": {"gpus": bad}})


async def test_vcluster_requests_name_every_problem_of_their_arguments_at_once() -> None:
    """The id, then the limits, then the replica sets: each problem took a run of its own."""
    from aios_blocks.cli import vcluster

    with pytest.raises(ValueError) as exc:  # nothing is sent: the client (None here) is never used
        await vcluster.update(None, "bad id", 0, {"A100": 1, "B": "x"}, limits={"A100": [-1, 1]})  # type: ignore[arg-type]
    said = str(exc.value)
    for part in ("virtual cluster id 'bad id' is not a valid id", "--revision must be >= 1, got 0",
                 "--replica-sets: count of 'B' must be an integer, got 'x'", "--limits: limits of 'A100' must be [min, max]"):
        assert part in said, said
    with pytest.raises(ValueError) as exc:
        await vcluster.create(None, "v1", "bad cluster", {"A100": -1}, limits={"A100": [2, 1]})  # type: ignore[arg-type]
    said = str(exc.value)
    for part in ("cluster id 'bad cluster' is not a valid id", "--replica-sets: count of 'A100' must be >= 0, got -1",
                 "--limits: limits of 'A100'"):
        assert part in said, said


@pytest.mark.parametrize("args", [["node", "add", "n10", "--cluster", "c1"], ["cluster", "add", "c2", "--nodes", "2"]])
def test_gpus_that_the_topology_profile_contradicts_are_refused(cli: CliRunner, args: list[str]) -> None:
    """--gpus 4 --gpu-topology hybrid-cube-mesh-8 registered 8 GPUs, the 4 dropped unsaid."""
    r = cli.invoke(app, [*args, "--gpus", "4", "--gpu-topology", "hybrid-cube-mesh-8"])
    assert r.exit_code == 2, r.output
    assert "--gpus 4 but the GPU topology hybrid-cube-mesh-8 has 8 GPUs" in " ".join(r.output.split()), r.output
    r = cli.invoke(app, [*args, "--gpus", "8", "--gpu-topology", "hybrid-cube-mesh-8"])  # the same count: fine
    assert "No servers" in r.output, r.output


async def test_the_first_waiting_block_waits_behind_nobody() -> None:
    """explain said 'position 1 of 1 (behind <itself>)': head(scope, 0) read ZRANGE 0 -1, the whole queue."""
    import fakeredis

    from aios_blocks.cli.pending import why_waiting
    from aios_blocks.state.queue import PendingQueue
    from aios_blocks.state.store import Store

    store = Store(fakeredis.aioredis.FakeRedis(decode_responses=True))
    q = PendingQueue(store.r)
    await q.add("first", "_", 0, 1.0, 0.0)
    await q.add("second", "_", 0, 2.0, 0.0)
    assert await q.head("_", 0) == [] and await q.head("_", 1) == ["first"]

    async def pending(bid: str) -> dict[str, str]:
        return {"status": "pending", "reason": "no room"}

    store.get_block = pending  # type: ignore[method-assign,assignment]
    first, second = await why_waiting(store, "first"), await why_waiting(store, "second")
    assert first is not None and (first["position"], first["ahead"]) == (1, [])
    assert second is not None and (second["position"], second["ahead"]) == (2, ["first"])


def test_trace_replay_refuses_outputs_it_could_not_write_before_replaying(cli: CliRunner, tmp_path: Path) -> None:
    """--json in a missing directory failed after the whole replay (its figures not written)."""
    nodes, pods = tmp_path / "n.csv", tmp_path / "p.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,2,P100\n")
    pods.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1000,1024,1,1000\n")
    r = cli.invoke(app, ["trace", "replay", str(nodes), str(pods), "--in-process", "--json", str(tmp_path / "no" / "o.json"),
                         "--plot", str(tmp_path), "-p", "bogus"])
    assert r.exit_code == 2, r.output
    out = " ".join(r.output.split())
    assert f"--json {tmp_path / 'no' / 'o.json'}: there is no directory {tmp_path / 'no'}" in out, out
    assert f"--plot {tmp_path}: is a directory" in out and "--policy bogus" in out and "allocation" not in out, out


def test_top_of_a_block_without_metrics_says_so_at_once_live_too(cli: CliRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    """The live view of an unknown block drew an empty table every second, saying nothing."""
    import asyncio

    from aios_blocks.cli import blocks, top

    reads = []

    async def read(store: object, bid: str | None) -> dict[str, object]:
        reads.append(bid)
        if len(reads) > 1:
            raise KeyboardInterrupt  # (Ctrl-C) the old code's second refresh
        return {"block": None, "instances": {}}

    class C:
        store = None

    monkeypatch.setattr(top, "read", read)
    monkeypatch.setattr(blocks, "_request", lambda fn, *a, **k: asyncio.run(fn(C())))
    for args in (["top", "nope", "--interval", "0.1"], ["top", "nope", "--once"]):
        reads.clear()
        r = cli.invoke(app, args)
        assert r.exit_code == 1 and "no metrics for block nope" in r.output, (args, r.output)
        assert "┏" not in r.output, r.output  # no empty table
