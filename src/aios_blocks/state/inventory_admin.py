"""Node drain / remove and cluster remove in Redis: each an atomic script in the cluster's slot,
so a placement (``RESERVE_GANG``, which refuses a draining node) and a removal never interleave.

A drained node keeps its hash with ``drain = 1``: its node view reads as not healthy (nothing new
is placed on it; a virtual cluster replaces it) and says ``draining``.
"""

from __future__ import annotations

from typing import Any

from .keys import (
    CLUSTERS,
    HEARTBEATS,
    NODE_INDEX,
    cluster_nodes_key,
    index_key,
    node_inst_key,
    node_key,
    vc_set_key,
)
from .store import Store

# usage fields that say an instance holds something on the node (``idle`` below)
_IDLE = r"""
local function idle(nk)
  local h = redis.call('HGETALL', nk)
  for i = 1, #h, 2 do
    local f, v = h[i], h[i+1]
    if (f == 'cpu_used' or f == 'mem_used' or string.match(f, '^g:.*:n$')) and math.abs(tonumber(v) or 0) > 1e-9 then
      return false
    end
  end
  return true
end
"""

# KEYS: node, index   ARGV[1]: "1" drain, "0" undrain.  Returns 1, or 0 when the node is unknown.
NODE_DRAIN = r"""
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if ARGV[1] == '1' then redis.call('HSET', KEYS[1], 'drain', '1') else redis.call('HDEL', KEYS[1], 'drain') end
redis.call('INCR', KEYS[2])
return 1
"""

# KEYS: node, the cluster's node set, index   ARGV[1]: node id
# Returns {1, ""} or {0, reason}
NODE_REMOVE = _IDLE + r"""
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, 'no node ' .. ARGV[1]} end
if redis.call('HGET', KEYS[1], 'drain') ~= '1' then return {0, 'node ' .. ARGV[1] .. ' is not drained: blocks node drain ' .. ARGV[1]} end
if not idle(KEYS[1]) then return {0, 'node ' .. ARGV[1] .. ' still runs instances (being moved?)'} end
local place = redis.call('HGET', KEYS[1], 'vc')
if place then return {0, 'node ' .. ARGV[1] .. ' is in virtual cluster ' .. place .. ' (it is replaced there first)'} end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
redis.call('INCR', KEYS[3])
return {1, ''}
"""

# KEYS: the cluster's node set, its virtual cluster set, index   ARGV[1]: node key prefix
# Returns {1, node ids...} or {0, reason}
CLUSTER_REMOVE = _IDLE + r"""
local vcs = redis.call('SCARD', KEYS[2])
if vcs > 0 then return {0, 'it holds ' .. vcs .. ' virtual cluster(s): remove them first'} end
local nodes = redis.call('SMEMBERS', KEYS[1])
local busy = {}
for _, nid in ipairs(nodes) do
  if not idle(ARGV[1] .. nid) then table.insert(busy, nid) end
end
if #busy > 0 then return {0, 'instances still run on ' .. table.concat(busy, ', ', 1, math.min(#busy, 10))} end
for _, nid in ipairs(nodes) do redis.call('DEL', ARGV[1] .. nid) end
redis.call('DEL', KEYS[1])
redis.call('INCR', KEYS[3])
local out = {1}
for _, nid in ipairs(nodes) do table.insert(out, nid) end
return out
"""


class InventoryAdmin:
    def __init__(self, store: Store):
        self.store = store
        self.r: Any = store.r
        self._drain = self.r.register_script(NODE_DRAIN)
        self._remove = self.r.register_script(NODE_REMOVE)
        self._remove_cluster = self.r.register_script(CLUSTER_REMOVE)

    async def drain(self, cid: str, nid: str, drain: bool = True) -> bool:
        return bool(await self._drain(keys=[node_key(cid, nid), index_key(cid)], args=["1" if drain else "0"]))

    async def remove_node(self, cid: str, nid: str) -> str:
        """Remove a drained idle node; "" when done, else why not."""
        ok, why = await self._remove(keys=[node_key(cid, nid), cluster_nodes_key(cid), index_key(cid)], args=[nid])
        if not ok:
            return str(why)
        pipe = self.r.pipeline(transaction=False)
        pipe.hdel(NODE_INDEX, nid)
        pipe.delete(node_inst_key(nid))
        pipe.zrem(HEARTBEATS, nid)
        await pipe.execute()
        return ""

    async def remove_cluster(self, cid: str) -> tuple[list[str], str]:
        """Remove a cluster with nothing running and no virtual cluster: (its nodes, "") or
        ([], why not). The nodes go in the same atomic step as the check."""
        if await self.r.hget(CLUSTERS, cid) is None:
            return [], f"no cluster {cid!r}"
        out = await self._remove_cluster(keys=[cluster_nodes_key(cid), vc_set_key(cid), index_key(cid)],
                                         args=[node_key(cid, "")])
        if not out[0]:
            return [], str(out[1])
        nodes = [str(n) for n in out[1:]]
        pipe = self.r.pipeline(transaction=False)
        pipe.hdel(CLUSTERS, cid)
        for nid in nodes:
            pipe.hdel(NODE_INDEX, nid)
            pipe.delete(node_inst_key(nid))
            pipe.zrem(HEARTBEATS, nid)
        await pipe.execute()
        return nodes, ""
