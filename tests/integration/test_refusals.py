"""What can never work is refused at once, with the reason: an unknown policyRuleURI at
`component add` and at parse; a gang that no cluster can hold at post_dry_run (not after rounds of
allocation)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
    assert ("builtin:best-fit, builtin:binpack, builtin:cluster-rank, builtin:dot-product, builtin:fgd, builtin:fgd-plus, "
            "builtin:gpu-clustering, "
            "builtin:gpu-packing, builtin:least-inflight, builtin:least-queue, builtin:preempt-min, builtin:probe-threshold, builtin:queue-depth, "
            "builtin:random, builtin:rebalance-min, builtin:round-robin, builtin:spread, builtin:target-inflight") in r.stderr
    assert "aios://test/typo" not in blocks(system, "component", "list").stdout


async def test_the_parser_rejects_an_unknown_policy_uri_with_its_path(system: System) -> None:
    spec = {"blockComponentURI": COMPONENT["componentURI"], "blockId": "typo-1", "minInstances": 1, "maxInstances": 1,
            "policyRulesSpec": [{"values": {"name": "resourceAllocator", "policyRuleURI": "builtin:binpak"}}]}
    _, kind, env = await system.submit_and_wait(spec)
    assert kind == "rejected"
    [err] = [e for e in env["data"]["errors"] if e["path"] == "$.policyRulesSpec[0].values.policyRuleURI"]
    assert "unknown built-in policy 'builtin:binpak'" in err["message"] and "builtin:spread" in err["message"]


async def test_a_registry_policy_that_is_not_stored_is_refused_at_parse_with_the_spec_s_other_problems(
    system: System, tmp_path: Path
) -> None:
    """``registry:NAME`` of no stored policy and ``registry:NAME@V`` of no stored version: refused by
    the parser (``rejected``, every problem listed, ``blocks explain`` says why), not placed and
    failed at its dry_run and allocation; once added, the same spec is placed."""
    await system.client.add_sim_cluster("c1", nodes=1, gpus=2)
    await system.client.policy_put("packer", SLOW_ON_C2, "python")
    spec = tmp_path / "typo.yaml"
    spec.write_text("blockComponentURI: aios://test/model\nblockId: reg-1\nminInstances: 2\nmaxInstances: 1\n"
                    "policyRulesSpec:\n- values: {name: resourceAllocator, policyRuleURI: 'registry:packr'}\n"
                    "- values: {name: autoscaler, policyRuleURI: 'registry:packer@4'}\n")
    r = blocks(system, "submit", str(spec), "--wait")
    assert r.returncode == 4, r.stdout + r.stderr
    out = " ".join(r.stderr.split())
    assert "$.minInstances" in out, out
    assert ("$.policyRulesSpec[0].values.policyRuleURI: resourceAllocator policy 'registry:packr': no policy "
            "'packr' is registered; add it first (blocks policy add packr FILE)") in out, out
    assert "$.policyRulesSpec[1].values.policyRuleURI: autoscaler policy 'registry:packer@4': policy 'packer' " \
           "has no version 4 (its latest is version 1)" in out, out
    kinds = [event_kind(s) for s, _, _ in await system.client.history("reg-1")]
    assert "rejected" in kinds and "selection" not in kinds and "allocation.failed" not in kinds, kinds
    r = blocks(system, "explain", "reg-1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no policy 'packr' is registered" in " ".join(r.stdout.split()), r.stdout
    # on the public create subject, a block that names a stored policy and version is placed
    _, kind, env = await system.submit_and_wait(
        {"blockComponentURI": COMPONENT["componentURI"], "blockId": "reg-2", "minInstances": 1, "maxInstances": 1,
         "policyRulesSpec": [{"values": {"name": "resourceAllocator", "policyRuleURI": "registry:packer@1"}}]})
    assert kind == "ready", env["data"]


async def test_a_gang_no_cluster_can_hold_fails_at_once_with_the_counts(system: System) -> None:
    await system.client.add_sim_cluster("c1", nodes=1, gpus=2)
    await system.client.add_sim_cluster("c2", nodes=1, gpus=1)
    spec = {"blockComponentURI": COMPONENT["componentURI"], "blockId": "gang-3", "minInstances": 3, "maxInstances": 3,
            "queue": False}  # (--no-queue: else it waits in the pending queue, test_pending_queue.py)
    _, kind, env = await system.submit_and_wait(spec)
    assert kind == "failed"
    assert env["data"]["reason"] == "no cluster can hold minInstances (3) at once: c1 fits 2, c2 fits 1"
    kinds = [event_kind(s) for s, _, _ in await system.client.history("gang-3")]
    assert "allocation.failed" not in kinds and "placement" not in kinds  # no allocation round at all
    assert kinds.count("parsed") == 1 and kinds.count("post_dry_run") == 1
    # a gang that fits still goes through
    _, kind, _ = await system.submit_and_wait({**spec, "blockId": "gang-2", "minInstances": 2})
    assert kind == "ready"


SLOW_ON_C2 = """
import time

from aios_blocks.policies.builtin.resource import BinPackPolicy


class SlowOnC2(BinPackPolicy):
    def eval(self, parameters, input_data, context):
        if input_data["action"] == "dry_run" and input_data["payload"]["cluster"]["id"] == "c2":
            time.sleep(1.5)  # a busy controller: c2 answers well after the gather's deadline
        return super().eval(parameters, input_data, context)
"""


@pytest.fixture
def short_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOS_DRY_RUN_DEADLINE_S", "0.3")  # inherited by the worker processes


async def test_a_cluster_short_of_the_gang_does_not_end_the_round_before_a_slower_one_with_room(
    short_deadline: None, system: System
) -> None:
    """c1 answers at once that it holds 2 of a gang of 3; c2, which holds it, answers after the
    deadline. The round must wait for c2 (a short answer is not a usable one), not fail the block
    with "c2: none" the moment the deadline passes."""
    await system.client.policy_put("slow-c2", SLOW_ON_C2, "python")
    await system.client.add_sim_cluster("c1", nodes=1, gpus=2)
    await system.client.add_sim_cluster("c2", nodes=1, gpus=4)
    spec = {"blockComponentURI": COMPONENT["componentURI"], "blockId": "gang-slow", "minInstances": 3, "maxInstances": 3,
            "policyRulesSpec": [{"values": {"name": "resourceAllocator", "policyRuleURI": "registry:slow-c2"}}]}
    _, kind, env = await system.submit_and_wait(spec, timeout=60)
    assert kind == "ready", env["data"]
    history = await system.client.history("gang-slow")
    results = {a["cluster_id"]: a for s, e, _ in history if s.endswith(".post_dry_run") for a in e["data"]["answers"]}
    assert (results["c1"]["placeable"], results["c1"]["shortfall"]) == (2, 1)
    assert (results["c2"]["placeable"], results["c2"]["shortfall"]) == (3, 0)
    [post] = [e["data"] for s, e, _ in history if s.endswith(".post_dry_run")]
    assert post["cluster_id"] == "c2" and post["missing"] == []
