"""What can never work is refused at once, with the reason: an unknown policyRuleURI at
`component add` and at parse; a gang that no cluster can hold at post_dry_run (not after rounds of
allocation)."""

from __future__ import annotations

import json
from pathlib import Path

from aios_blocks.cli.client import event_kind

from .conftest import COMPONENT, System
from .test_cli import blocks


def test_component_add_refuses_an_unknown_builtin_and_lists_the_known_ones(system: System, tmp_path: Path) -> None:
    comp = json.loads(json.dumps(COMPONENT))
    comp["componentURI"] = "aios://test/typo"
    comp["policies"][1]["policyRuleURI"] = "builtin:binpak"
    f = tmp_path / "typo.json"
    f.write_text(json.dumps(comp))
    r = blocks(system, "component", "add", str(f))
    assert r.returncode == 4, r.stdout + r.stderr
    assert "$.policies[1].policyRuleURI" in r.stderr and "unknown built-in policy 'builtin:binpak'" in r.stderr
    assert "builtin:binpack, builtin:cluster-rank, builtin:spread" in r.stderr
    assert "aios://test/typo" not in blocks(system, "component", "list").stdout


async def test_the_parser_rejects_an_unknown_policy_uri_with_its_path(system: System) -> None:
    spec = {"blockComponentURI": COMPONENT["componentURI"], "blockId": "typo-1", "minInstances": 1, "maxInstances": 1,
            "policyRulesSpec": [{"values": {"name": "resourceAllocator", "policyRuleURI": "builtin:binpak"}}]}
    _, kind, env = await system.submit_and_wait(spec)
    assert kind == "rejected"
    [err] = [e for e in env["data"]["errors"] if e["path"] == "$.policyRulesSpec[0].values.policyRuleURI"]
    assert "unknown built-in policy 'builtin:binpak'" in err["message"] and "builtin:spread" in err["message"]


async def test_a_gang_no_cluster_can_hold_fails_at_once_with_the_counts(system: System) -> None:
    await system.client.add_sim_cluster("c1", nodes=1, gpus=2)
    await system.client.add_sim_cluster("c2", nodes=1, gpus=1)
    spec = {"blockComponentURI": COMPONENT["componentURI"], "blockId": "gang-3", "minInstances": 3, "maxInstances": 3}
    _, kind, env = await system.submit_and_wait(spec)
    assert kind == "failed"
    assert env["data"]["reason"] == "no cluster can hold minInstances (3) at once: c1 fits 2, c2 fits 1"
    kinds = [event_kind(s) for s, _, _ in await system.client.history("gang-3")]
    assert "allocation.failed" not in kinds and "placement" not in kinds  # no allocation round at all
    assert kinds.count("parsed") == 1 and kinds.count("post_dry_run") == 1
    # a gang that fits still goes through
    _, kind, _ = await system.submit_and_wait({**spec, "blockId": "gang-2", "minInstances": 2})
    assert kind == "ready"
