"""The CLI's rendering of recorded events, in-process through typer's CliRunner over real servers
(embedded NATS JetStream and Redis, the real worker processes): ``replay`` prints each stored
event of a block with its detail (candidates, the chosen cluster and scores, the placement, the
policy calls), ``explain`` the selection round, why the cluster won and the instances, ``get`` and
``list`` the block as stored; the commands a user types first, with their own exit codes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aios_blocks.cli.main import app
from aios_blocks.runtime.embedded import EmbeddedServers
from aios_blocks.runtime.supervisor import DEFAULT_GROUPS, Supervisor

from .conftest import COMPONENT

pytestmark = pytest.mark.integration


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[CliRunner]:
    import os

    data = tmp_path / "data"
    servers = EmbeddedServers(data_dir=data).start()
    sup = Supervisor(servers.nats_url, servers.redis_url, log_dir=str(data / "logs"), role_env=servers.worker_env,
                     groups=DEFAULT_GROUPS).start()
    for key in [k for k in os.environ if k.startswith("AIOS_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("AIOS_NATS_URL", sup.nats_url)
    monkeypatch.setenv("AIOS_REDIS_URL", sup.redis_url)
    monkeypatch.setenv("COLUMNS", "240")
    try:
        yield CliRunner()
    finally:
        sup.stop()
        servers.stop()


def _ok(cli: CliRunner, *args: str) -> str:
    r = cli.invoke(app, list(args))
    assert r.exit_code == 0, (args, r.output)
    return r.stdout


def test_replay_and_explain_render_what_was_recorded(cli: CliRunner, tmp_path: Path) -> None:
    comp = tmp_path / "component.json"
    comp.write_text(json.dumps(COMPONENT))
    _ok(cli, "component", "add", str(comp))
    _ok(cli, "cluster", "add", "c1", "--nodes", "2", "--gpus", "2")
    spec = tmp_path / "b.yaml"
    spec.write_text("blockComponentURI: aios://test/model\nblockId: cli-r\nminInstances: 1\nmaxInstances: 1\n")
    out = _ok(cli, "submit", str(spec), "--wait")
    assert "ready" in out

    block = json.loads(_ok(cli, "get", "cli-r", "--json"))
    [(iid, inst)] = block["instances"].items()
    lines = _ok(cli, "replay", "cli-r").splitlines()
    assert lines[0].startswith("replay cli-r: ") and lines[0].endswith(" events")
    # seq, time, block, event, detail; the policy calls indented under their step
    by_kind = {ln.split()[3]: ln for ln in lines[1:] if len(ln.split()) > 3 and ln.split()[0].isdigit()}
    assert list(by_kind)[:4] == ["submitted", "parsed", "selection", "post_dry_run"] and list(by_kind)[-1] == "ready"
    assert "candidates=['c1'] filtered={}" in by_kind["selection"]
    assert "chosen=c1 scores={'c1': 1.0}" in by_kind["post_dry_run"]
    assert f"{iid}@{inst['node']}{inst['gpus']}" in by_kind["placement"]
    assert f"instances=['{iid}']" in by_kind["ready"]
    assert f"node={inst['node']} gpus={inst['gpus']}" in by_kind[f"instance.{iid}.added"]
    calls = [ln.split()[1:3] for ln in lines if ln.strip().startswith("policy ")]
    # no resourceAllocator.dry_run: a first round whose one candidate is the built-in
    # clusterAllocator's asks none (workers/gateway.skip_reason)
    assert calls == [["clusterAllocator.selection", "builtin:cluster-rank"],
                     ["clusterAllocator.post_dry_run", "builtin:cluster-rank"], ["resourceAllocator.allocation", "builtin:binpack"]]
    # the answer post_dry_run decided on, which no dry_run gave: the replay says so (explain does)
    assert any(ln.strip() == "dry_run cluster=c1 score=1.0 (dry run skipped: c1 is the only candidate)" for ln in lines)

    text = _ok(cli, "explain", "cli-r")
    assert "block cli-r: ready" in text
    assert "clusterAllocator chose c1 with score 1" in text
    assert iid in text and inst["node"] in text
    assert "3 policy calls, 0 failed" in text

    listed = _ok(cli, "list")
    assert "cli-r" in listed and "ready" in listed
    r = cli.invoke(app, ["get", "nowhere-1"])
    assert r.exit_code == 1 and "nowhere-1" in r.output, r.output
