"""A block naming a registry policy the registry does not hold (``registry:NAME``, ``registry:NAME@V``,
``NAME.py``) is refused by the parser, with every other problem of its spec (``handlers.parse.
registry_check`` / ``unregistered``): it passed the parse before and failed only at its dry_run and
allocation. The registry is read through the store, with the parser's other reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aios_blocks.bus.catalog import E
from aios_blocks.handlers import parse
from aios_blocks.schemas.policy_io import PolicySource
from aios_blocks.testing import MemorySystem

PACKER = """
class Packer:
    def __init__(self, rule_id, settings, parameters):
        pass

    def eval(self, parameters, input, context):
        nodes = input["payload"]["cluster_metrics"]["nodes"]
        for nid in sorted(nodes):
            free = [g["id"] for g in nodes[nid]["gpus"] if not g.get("used")]
            if free:
                return {"node_id": nid, "gpus": free[:1]}
        return {"node_id": "", "gpus": []}
"""

COMPONENT: dict[str, Any] = {
    "componentURI": "aios://test/model",
    "policies": [{"name": "clusterAllocator", "policyRuleURI": "builtin:cluster-rank"},
                 {"name": "resourceAllocator", "policyRuleURI": "registry:gone"}],
}


def _registry(**heads: int) -> tuple[Any, Any]:
    """A lookup and a version check over policies ``name -> latest version`` (versions 1..latest)."""

    async def lookup(name: str, version: int | None) -> PolicySource | None:
        latest = heads.get(name)
        if latest is None or (version is not None and not 1 <= version <= latest):
            return None
        return {"source": "", "language": "python", "version": version or latest}  # type: ignore[typeddict-item]

    async def has(name: str, version: int) -> bool:
        return 1 <= version <= heads.get(name, 0)

    return lookup, has


async def test_every_unregistered_policy_is_an_error_with_its_path_and_the_spec_s_other_problems() -> None:
    lookup, has = _registry(packer=3, scaler=1)
    doc = {"blockComponentURI": "aios://test/model", "minInstances": 3, "maxInstances": 1, "policyRulesSpec": [
        {"values": {"name": "autoscaler", "policyRuleURI": "registry:packer@9"}},
        {"name": "loadBalancer", "policyRuleURI": "policies/nope.py"},
        {"values": {"name": "stabilityChecker", "policyRuleURI": "registry:scaler@1"}}]}
    versions, unknown = await parse.registry_check(lookup, doc, COMPONENT, has=has)
    assert versions == {}
    by_path = {e.path: e.message for e in unknown}
    assert sorted(by_path) == ["$.<component>.policies[1].policyRuleURI", "$.policyRulesSpec[0].values.policyRuleURI",
                               "$.policyRulesSpec[1].policyRuleURI"], unknown
    gone = by_path["$.<component>.policies[1].policyRuleURI"]
    assert "resourceAllocator policy 'registry:gone'" in gone and "no policy 'gone' is registered" in gone
    assert "blocks policy add gone FILE" in gone
    nine = by_path["$.policyRulesSpec[0].values.policyRuleURI"]
    assert "policy 'packer' has no version 9 (its latest is version 3)" in nine and "registry:packer for the latest" in nine
    nope = by_path["$.policyRulesSpec[1].policyRuleURI"]
    assert "no policy 'nope' is registered (the registry entry named by the file's stem)" in nope
    assert "blocks policy add nope policies/nope.py" in nope
    # listed with the spec's own problems, in one outcome
    out = parse.build(doc, COMPONENT, "b1", versions, priority_classes={}, unknown=unknown)
    assert out.ir is None
    paths = [e.path for e in out.errors]
    assert "$.minInstances" in paths and set(by_path) <= set(paths), out.errors


async def test_a_registered_policy_is_pinned_and_an_overridden_one_is_not_checked() -> None:
    lookup, has = _registry(packer=3)
    doc = {"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1,
           "policyRulesSpec": [{"values": {"name": "resourceAllocator", "policyRuleURI": "registry:packer"}}]}
    versions, unknown = await parse.registry_check(lookup, doc, COMPONENT, has=has)
    assert (versions, unknown) == ({"resourceAllocator": 3}, [])  # the component's registry:gone is overridden
    pinned = {**doc, "policyRulesSpec": [{"values": {"name": "resourceAllocator", "policyRuleURI": "registry:packer@2"}}]}
    assert await parse.registry_check(lookup, pinned, COMPONENT, has=has) == ({}, [])
    assert await parse.registry_check(lookup, pinned, COMPONENT) == ({}, [])  # no ``has``: the lookup of that version


def test_a_registry_uri_with_a_version_that_is_no_number_is_left_to_the_spec_s_validation() -> None:
    """``registry:x@abc`` made ``registry_policies`` raise ValueError in the parser's handler (the
    create was never answered); the URI's own error says what is wrong."""
    doc = {"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1,
           "policyRulesSpec": [{"values": {"name": "resourceAllocator", "policyRuleURI": "registry:x@abc"}}]}
    assert parse.registry_policies(doc, None) == {} and parse.registry_refs(doc, None) == []
    out = parse.build(doc, COMPONENT, "b1", {}, priority_classes={})
    assert any("is not registry:NAME or registry:NAME@VERSION" in e.message for e in out.errors), out.errors


async def test_the_in_memory_system_rejects_the_create_and_places_it_once_the_policy_is_added() -> None:
    async with MemorySystem.open() as s:
        await s.add_component(policies=COMPONENT["policies"])
        await s.add_sim_cluster("c1", nodes=1, gpus=2)
        bid = await s.submit({"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1,
                              "policyRulesSpec": [{"values": {"name": "autoscaler", "policyRuleURI": "registry:auto@2"}}]})
        await s.run()
        (rejected,) = s.bus.events(E.block_rejected, bid=bid)
        assert [e["path"] for e in rejected["errors"]] == ["$.<component>.policies[1].policyRuleURI",
                                                          "$.policyRulesSpec[0].values.policyRuleURI"], rejected
        block = await s.store.get_block(bid) or {}
        assert block.get("status") == "rejected" and "no policy 'gone' is registered" in block.get("reason", "")
        assert not s.bus.events(E.block_selection, bid=bid) and not s.bus.events(E.block_allocation_failed, bid=bid)
        # registered: the same spec is placed (the version it pins is stored)
        await s.store.policy_put("gone", PACKER, "python")
        await s.store.policy_put("auto", "class A:\n    def eval(self, p, i, c):\n        return {}\n", "python")
        await s.store.policy_put("auto", "class A:\n    def eval(self, p, i, c):\n        return {}\n", "python")
        bid = await s.submit({"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1,
                              "policyRulesSpec": [{"values": {"name": "autoscaler", "policyRuleURI": "registry:auto@1"}}]})
        await s.run()
        block = await s.store.get_block(bid) or {}
        assert block.get("status") == "ready", block
        assert block["ir"]["policies"]["resourceAllocator"]["version"] == 1


def test_the_in_process_trace_replay_says_it_has_no_registry(tmp_path: Path) -> None:
    """``blocks trace replay --in-process --policy registry:NAME`` placed nothing and reported every
    task failed ("placement refused"): the in-process replay has no registry to read it from."""
    from typer.testing import CliRunner

    from aios_blocks.cli.main import app

    (tmp_path / "nodes.csv").write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,1,V100M32\n")
    (tmp_path / "pods.csv").write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\nt0,1000,1024,1,1000\n")
    r = CliRunner().invoke(app, ["trace", "replay", str(tmp_path / "nodes.csv"), str(tmp_path / "pods.csv"),
                                 "--in-process", "--policy", "fgd", "--policy", "registry:gone"])
    assert r.exit_code == 2, r.output
    assert "--in-process has no policy registry for registry:gone" in " ".join(r.output.split()), r.output
