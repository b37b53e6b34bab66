"""Every user-supplied string that becomes a NATS subject token or a Redis key part is validated:
block, cluster, node and instance ids, policy names, component URIs, GPU ids and labels."""

from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import ValidationError

from aios_blocks.cli.client import Client
from aios_blocks.handlers import parse
from aios_blocks.schemas.spec import BlockSpec, Cluster, Component, Gpu, Node, check_id

GOOD_IDS = ["a", "b1", "my-block_2", "A" * 128, "0abc"]
#: subject wildcards and separators, Redis key separators, glob and hash-tag characters, spaces,
#: control characters, non-ASCII look-alikes, empty and over-long values
BAD_IDS = ["", "a.b", "*", ">", "a*", "a>", "a b", " a", "a\n", "a\x00", "{c}", "a:b", "a/b", "-a", "_a", "a" * 129,
           "blöck", "a\u200b", "$JS", "a,b", "a[1]", "a?"]


@pytest.mark.parametrize("value", GOOD_IDS)
def test_valid_ids_pass(value: str) -> None:
    assert check_id(value) == value


@pytest.mark.parametrize("value", [*BAD_IDS, None, 5, b"ab"])
def test_injecting_ids_are_refused(value: Any) -> None:
    with pytest.raises(ValueError, match="not a valid id"):
        check_id(value, "block id")


#: Client calls that put a user-given id into a subject or key, with the bad id in each place.
CLIENT_CALLS = {
    "submit": lambda c, v: c.submit({"blockComponentURI": "aios://m", "blockId": v}),
    "policy_put": lambda c, v: c.policy_put(v, "def f(): pass", "python"),
    "scale": lambda c, v: c.scale(v),
    "delete": lambda c, v: c.delete(v),
    "reassign block": lambda c, v: c.reassign(v, "i1"),
    "reassign instance": lambda c, v: c.reassign("b1", v),
    "history": lambda c, v: c.history(v),
    "wait": lambda c, v: c.wait(v, 1),
}


@pytest.mark.parametrize("call", sorted(CLIENT_CALLS))
@pytest.mark.parametrize("value", ["a*", "*.x", ">", "a>", "a.b", "a b", "", " ", "a\n"])
async def test_client_refuses_bad_ids_before_touching_nats_or_redis(call: str, value: str) -> None:
    """No bus, no store: a ValueError naming the id proves nothing was published or read first."""
    client = Client(None, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"{re.escape(repr(value))} is not a valid id"):
        await CLIENT_CALLS[call](client, value)


@pytest.mark.parametrize("value", BAD_IDS)
def test_models_refuse_bad_ids_everywhere_an_id_is_a_token(value: str) -> None:
    with pytest.raises(ValidationError):
        BlockSpec(blockComponentURI="aios://m", blockId=value, minInstances=1, maxInstances=1)
    with pytest.raises(ValidationError):
        Cluster(id=value)
    with pytest.raises(ValidationError):
        Node(id=value, cluster="c1")
    with pytest.raises(ValidationError):
        Node(id="n1", cluster=value)


def test_spec_with_an_injecting_id_is_rejected_with_its_path() -> None:
    for bid in ("a.b", "*", "x>"):
        out = parse.build({"blockComponentURI": "aios://m", "blockId": bid, "minInstances": 1, "maxInstances": 1}, None, "b")
        assert out.ir is None and any(e.path == "$.blockId" for e in out.errors), bid


@pytest.mark.parametrize("uri", ["aios://models/llama-8b-instruct", "x", "oci://reg.io/org/img:1.2@sha256:ab",
                                 "https://h/p?v=1&x=%20", "aios://a/b_c~d"])
def test_component_uris(uri: str) -> None:
    assert Component(componentURI=uri).componentURI == uri
    assert BlockSpec(blockComponentURI=uri, minInstances=1, maxInstances=1).blockComponentURI == uri


@pytest.mark.parametrize("uri", ["aios://m/{tag}", "aios://m/*", "aios://m/[a]", "a b", "aios://m\n", "\xff\xfe",
                                 'aios://"q"', "aios://m\\x", "/abs", "x" * 513, ""])
def test_component_uris_that_could_break_a_key_or_a_pattern_are_refused(uri: str) -> None:
    with pytest.raises(ValidationError):
        Component(componentURI=uri)
    with pytest.raises(ValidationError):
        BlockSpec(blockComponentURI=uri, minInstances=1, maxInstances=1)


def test_spec_with_a_bad_component_uri_is_rejected_with_its_path() -> None:
    out = parse.build({"blockComponentURI": "aios://m/{x}", "minInstances": 1, "maxInstances": 1}, None, "b")
    assert out.ir is None and any(e.path == "$.blockComponentURI" for e in out.errors)


@pytest.mark.parametrize("labels", [{"rack": "0"}, {"region": "eu"}, {"trust-domain": "attested"},
                                    {"topology.kubernetes.io/zone": "eu-1a"}, {"gpu": ""}, {"v": "1.5"},
                                    {"owner": "team@corp"}])
def test_labels(labels: dict[str, str]) -> None:
    assert Cluster(id="c", labels=labels).labels == labels
    assert Node(id="n", cluster="c", labels=labels).labels == labels


@pytest.mark.parametrize("labels", [{"": "x"}, {"a b": "x"}, {"*": "x"}, {"k>": "x"}, {"{k}": "x"}, {"k": "a b"},
                                    {"k": "*"}, {"k": ">"}, {"k": "{x}"}, {"k": "x\n"}, {"k": "x" * 257},
                                    {"k": '"q"'}, {"-k": "x"}, {"k\x00": "x"}])
def test_labels_that_could_inject_are_refused(labels: dict[str, str]) -> None:
    with pytest.raises(ValidationError):
        Cluster(id="c", labels=labels)
    with pytest.raises(ValidationError):
        Node(id="n", cluster="c", labels=labels)


@pytest.mark.parametrize("gid", ["c1-n0-g0", "GPU-8f3c2a1e-1234-5678-9abc-def012345678", "MIG-GPU-8f3c/1/0", "0"])
def test_gpu_ids(gid: str) -> None:
    assert Gpu(id=gid).id == gid


@pytest.mark.parametrize("gid", ["", "g 0", "{g}", "g*", "g\n", "x" * 129, ":g"])
def test_gpu_ids_that_could_break_hash_fields_are_refused(gid: str) -> None:
    with pytest.raises(ValidationError):
        Gpu(id=gid)
