"""Bad input at volume: every malformed create gets exactly one ``rejected`` event (one whose
subject names no valid id: on ``aios.block._invalid.rejected``), nothing is dead-lettered, no
worker dies, and good blocks submitted in between all become ready."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import msgspec
import pytest

from aios_blocks.recovery.rebuild import read_stream

from ..integration.conftest import System
from .conftest import explain, settled_check, size, spec, wait_terminal

GOOD = spec(maxInstances=1, resources={"gpus": 0, "cpu": 0, "memory": 0})
MAX_PAYLOAD = 8 * 1024 * 1024  # the embedded server's max_payload


def _bad(i: int) -> tuple[str, bytes, str]:
    """(subject, body, expected outcome: 'rejected' | 'invalid')."""
    kind = i % 8
    bid = f"bad-{i}"
    subj = f"aios.block.{bid}.create"
    if kind == 0:
        return subj, b"{not json " + str(i).encode(), "rejected"
    if kind == 1:
        return subj, json.dumps({"blockComponentURI": i, "minInstances": "x", "maxInstances": []}).encode(), "rejected"
    if kind == 2:
        return subj, json.dumps({**GOOD, f"field{i}": {"x": i}}).encode(), "rejected"
    if kind == 3:
        return subj, (json.dumps(GOOD)[:-1] + ', "blockInitData": ' + '{"a":' * 100 + "1" + "}" * 100 + "}").encode(), "rejected"
    if kind == 4:
        return subj, b'{"blockComponentURI": "\xff\xfe\xfd", "minInstances": 1, "maxInstances": 1}', "rejected"
    if kind == 5:
        return subj, json.dumps([GOOD, i] if i % 2 else "just a string").encode(), "rejected"
    if kind == 6:  # ids that are not ids: wildcard tokens, dots, a Redis hash tag
        token = ["*", f"a{i}.b", "{x}", f"dot{i}.x.y"][(i // 8) % 4]
        return f"aios.block.{token}.create", json.dumps(GOOD).encode(), "invalid"
    return subj, json.dumps({**GOOD, "minInstances": 3, "maxInstances": 1}).encode(), "rejected"


async def test_bad_input_at_volume(chaos: System) -> None:
    c = chaos.client
    await c.add_sim_cluster("c0", nodes=2, gpus=2)
    n = size(320, 10_000)
    expected_rejected: set[str] = set()
    expected_invalid: Counter[str] = Counter()
    good: set[str] = set()
    dups: set[str] = set()
    futs: list[Any] = []

    async def pub(subject: str, body: bytes, msg_id: str) -> None:
        futs.append(await c.bus.js.publish_async(subject, body, headers={"Nats-Msg-Id": msg_id}))
        if len(futs) >= 256:
            await asyncio.gather(*futs)
            futs.clear()

    for i in range(n):
        subject, body, outcome = _bad(i)
        await pub(subject, body, f"bad:{i}")
        if outcome == "rejected":
            expected_rejected.add(subject.split(".")[2])
        else:
            expected_invalid[subject.removeprefix("aios.block.").removesuffix(".create")] += 1
        if i % 25 == 0:
            bid = f"good-{i}"
            good.add(bid)
            await pub(f"aios.block.{bid}.create", json.dumps(GOOD).encode(), f"good:{i}")
        if i % 100 == 50:  # the same block id twice, two different bodies: one block, one rejection
            bid = f"dup-{i}"
            dups.add(bid)
            await pub(f"aios.block.{bid}.create", json.dumps(GOOD).encode(), f"dup:{i}:a")
            await pub(f"aios.block.{bid}.create", json.dumps({**GOOD, "parameters": {"v": 2}}).encode(), f"dup:{i}:b")
    await asyncio.gather(*futs)

    # payloads around the limit: just under is stored and rejected by the parser (too large);
    # just over is refused by NATS itself - nothing enters the stream
    filler = "x" * (MAX_PAYLOAD - 4096)
    for j in range(size(1, 3)):
        await c.bus.publish_raw(f"aios.block.huge-{j}.create", json.dumps({**GOOD, "blockInitData": {"x": filler}}).encode(), f"huge:{j}")
        expected_rejected.add(f"huge-{j}")
    with pytest.raises(Exception, match=r"(?i)payload"):
        await c.bus.publish_raw("aios.block.over-0.create", b"x" * (MAX_PAYLOAD + 1), "over:0")

    status = await wait_terminal(c, good | dups, timeout=size(180, 900))
    assert {b: s for b, s in status.items() if s != "ready"} == {}
    assert len(status) == len(good | dups)

    rejected: Counter[str] = Counter()
    letters: Counter[str] = Counter()
    invalid: Counter[str] = Counter()

    def on_msg(subject: str, raw: bytes, seq: int, ts: float) -> None:
        if subject.startswith("aios.dlq."):
            letters[msgspec.json.decode(raw)["data"]["subject"]] += 1
        elif subject == "aios.block._invalid.rejected":
            invalid[msgspec.json.decode(raw)["data"]["block_id"]] += 1
        else:
            rejected[subject.split(".")[2]] += 1

    want_rejected = len(expected_rejected) + len(dups)
    for _ in range(size(60, 300)):  # bounded: until every bad message is answered
        rejected.clear()
        letters.clear()
        invalid.clear()
        await read_stream(c.bus, on_msg, filters=["aios.block.*.rejected", "aios.dlq.>"])
        if sum(rejected.values()) >= want_rejected and sum(invalid.values()) >= sum(expected_invalid.values()):
            break
        await asyncio.sleep(1.0)
    assert {b: k for b, k in rejected.items() if k != 1} == {}, "a message was rejected more than once"
    assert set(rejected) == expected_rejected | dups
    assert invalid == expected_invalid and letters == Counter()
    assert "over-0" not in rejected
    assert chaos.supervisor.restarts == 0  # no worker died of its input
    rep = await settled_check(c, good | dups | expected_rejected)
    assert rep.ok, explain(rep)
