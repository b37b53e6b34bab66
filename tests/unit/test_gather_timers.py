"""The gateway's deadline timers live in Redis, not the stream: due ones are claimed once (a
lease), moved or dropped when handled (the store's scripts on fakeredis)."""

from __future__ import annotations

import fakeredis

from aios_blocks.state.store import Store


async def test_due_timers_are_claimed_once_and_come_back_after_their_lease() -> None:
    st = Store(fakeredis.aioredis.FakeRedis(decode_responses=True))
    await st.gather_open("b1", 7, 0, ["c1"], deadline=100.0)
    await st.gather_open("b2", 8, 1, ["c1"], deadline=200.0)
    await st.gather_open("b1", 7, 0, ["c1"], deadline=999.0)  # reopened (redelivery): the first deadline stays
    assert await st.gather_claim_due(now=50.0) == ([], 100.0)
    claimed, nxt = await st.gather_claim_due(now=150.0, lease_s=30)
    assert claimed == [("b1", 7, 0)] and nxt == 180.0  # b1 leased until 180
    assert (await st.gather_claim_due(now=160.0))[0] == []  # nobody else gets it while leased
    assert (await st.gather_claim_due(now=181.0))[0] == [("b1", 7, 0)]  # its claimer died: back
    await st.gather_timer("b1", 7, 0, None)  # handled: gone
    await st.gather_timer("b2", 8, 1, 500.0)  # not decidable yet: later
    assert await st.gather_claim_due(now=400.0) == ([], 500.0)
    assert (await st.gather_claim_due(now=500.0))[0] == [("b2", 8, 1)]
