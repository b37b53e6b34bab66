"""The policy registry and the state epoch in Redis (a mixin of ``state.store.Store``)."""

from __future__ import annotations

import time
from typing import Any

from ..schemas.policy_io import PolicySource
from . import scripts
from .keys import EPOCH_KEY, POLICIES, policy_key, policy_version_key


def policy_head(h: dict[str, Any]) -> PolicySource | None:
    """A policy's latest version from its hash as read (``policy_get(name)``; the parser reads it
    in a pipeline of its own reads): None when it has none."""
    if not h:
        return None
    h["version"] = int(h["version"])
    return h  # type: ignore[return-value]


class PolicyRecords:
    """``Store``'s methods over the policy registry and the epoch guard."""

    r: Any

    # -- policy registry -------------------------------------------------------------------
    async def policy_put(self, name: str, source: str, language: str) -> int:
        key = policy_key(name)
        await self.r.sadd(POLICIES, name)  # the list of names is in another Redis Cluster slot
        pipe = self.r.pipeline(transaction=True)
        pipe.hincrby(key, "version", 1)
        pipe.hset(key, mapping={"source": source, "language": language, "updated": time.time()})
        version, _ = await pipe.execute()
        await self.r.hset(f"{key}:v{version}", mapping={"source": source, "language": language})
        return int(version)

    async def policy_get(self, name: str, version: int | None = None) -> PolicySource | None:
        key = policy_key(name)
        h = await self.r.hgetall(key)
        if version is None:
            return policy_head(h)
        if not h:
            return None
        if int(h["version"]) != version:
            old = await self.r.hgetall(f"{key}:v{version}")
            if not old:
                return None
            h = {**old, "version": version}
        h["version"] = int(h["version"])
        return h

    async def policy_has(self, name: str, version: int) -> bool:
        """Whether version ``version`` of policy ``name`` is stored (every version is kept under
        its own key, the latest too: ``policy_put``, ``policy_store``, ``blocks recover``)."""
        return bool(await self.r.exists(policy_version_key(name, version)))

    async def policy_names(self) -> list[str]:
        return sorted(await self.r.smembers(POLICIES))

    # -- recovery support (event-sourced registry, epoch guard) -----------------------------------
    async def policy_store(self, name: str, version: int, source: str, language: str) -> None:
        """Record registry version ``version`` (already published as ``policy.updated``); the
        head moves only forward, so replays and late writers never roll it back."""
        key = policy_key(name)
        await self.r.hset(f"{key}:v{version}", mapping={"source": source, "language": language})
        await self.r.sadd(POLICIES, name)  # another Redis Cluster slot than the head's
        await self._policy_head(keys=[key], args=[name, str(version), source, language, str(time.time())])

    @property
    def _policy_head(self) -> Any:
        return self.r.register_script(scripts.POLICY_HEAD)

    async def epoch(self) -> str | None:
        """The state epoch: set when Redis holds valid state (fresh system, or after ``blocks
        recover``). Absent = Redis lost its state: workers wait instead of acting on emptiness."""
        return await self.r.get(EPOCH_KEY)

    async def set_epoch(self, value: str, only_if_absent: bool = False) -> bool:
        return bool(await self.r.set(EPOCH_KEY, value, nx=only_if_absent))
