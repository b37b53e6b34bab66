"""Atomic Lua scripts: the only places that change node capacity or a block's status.

Every key one script touches carries the same hash tag (``{c:<cluster>}`` for capacity), so the
scripts also run on Redis Cluster: a block lives in one cluster, so its gang is one slot.
"""

# KEYS: node1, res1, node2, res2, ..., [the cluster's state index]   ARGV[1]: JSON list of placements
# placement: {iid, block, node, cpu, mem, gpus: [...], gpu_mem, exclusive, vc?, gpu_share?}
# vc: the place the plan found the node in (its virtual cluster, "" = the primary's unassigned nodes)
# exclusive: the instance holds its GPUs whole; otherwise it shares them, taking gpu_mem MiB each
# and gpu_share thousandths of each one's compute (their sum on a GPU at most 1000: g:<gpu>:share)
# The state index (optional last key, ``Store.index_key``) is bumped only when capacity was taken.
# Returns {1, "ok"|"exists"} or {0, reason, node}
RESERVE_GANG = r"""
local p = cjson.decode(ARGV[1])
local n = #p
local existing = 0
for i = 1, n do
  if redis.call('EXISTS', KEYS[2*i]) == 1 then existing = existing + 1 end
end
if existing == n then return {1, 'exists', ''} end
if existing > 0 then return {0, 'some instances of this gang are already reserved', ''} end
local want = {}
local order = {}
for i = 1, n do
  local pl = p[i]
  local nk = KEYS[2*i-1]
  if redis.call('EXISTS', nk) == 0 then return {0, 'node ' .. pl.node .. ' does not exist', pl.node} end
  if redis.call('HGET', nk, 'healthy') ~= '1' then return {0, 'node ' .. pl.node .. ' is not healthy', pl.node} end
  if redis.call('HGET', nk, 'drain') == '1' then return {0, 'node ' .. pl.node .. ' is draining', pl.node} end
  if pl.vc ~= nil and (redis.call('HGET', nk, 'vc') or '') ~= pl.vc then
    return {0, 'node ' .. pl.node .. ' moved to another virtual cluster', pl.node}
  end
  local w = want[nk]
  if not w then
    w = {cpu = 0, mem = 0, gpus = {}, gorder = {}, node = pl.node}
    want[nk] = w
    table.insert(order, nk)
  end
  w.cpu = w.cpu + tonumber(pl.cpu)
  w.mem = w.mem + tonumber(pl.mem)
  local seen = {}
  for _, g in ipairs(pl.gpus) do
    if seen[g] then return {0, 'gpu ' .. g .. ' listed twice for one instance', pl.node} end
    seen[g] = true
    local total = tonumber(redis.call('HGET', nk, 'g:' .. g .. ':total'))
    if not total then return {0, 'gpu ' .. g .. ' is not on node ' .. pl.node, pl.node} end
    local gw = w.gpus[g]
    if not gw then
      gw = {mem = 0, n = 0, x = 0, share = 0}
      w.gpus[g] = gw
      table.insert(w.gorder, g)
    end
    local m = tonumber(pl.gpu_mem)
    if pl.exclusive then m = total; gw.x = 1 end
    pl['taken_' .. g] = m
    gw.mem = gw.mem + m
    gw.n = gw.n + 1
    if pl.gpu_share and not pl.exclusive then gw.share = gw.share + tonumber(pl.gpu_share) end
  end
end
for _, nk in ipairs(order) do
  local w = want[nk]
  local cpu_cap = tonumber(redis.call('HGET', nk, 'cpu') or '0')
  local cpu_used = tonumber(redis.call('HGET', nk, 'cpu_used') or '0')
  if cpu_used + w.cpu > cpu_cap + 1e-9 then
    return {0, 'node ' .. w.node .. ': cpu ' .. (cpu_cap - cpu_used) .. ' free, ' .. w.cpu .. ' asked', w.node}
  end
  local mem_cap = tonumber(redis.call('HGET', nk, 'memory') or '0')
  local mem_used = tonumber(redis.call('HGET', nk, 'mem_used') or '0')
  if mem_used + w.mem > mem_cap then
    return {0, 'node ' .. w.node .. ': memory ' .. (mem_cap - mem_used) .. ' MiB free, ' .. w.mem .. ' asked', w.node}
  end
  for _, g in ipairs(w.gorder) do
    local gw = w.gpus[g]
    local total = tonumber(redis.call('HGET', nk, 'g:' .. g .. ':total'))
    local used = tonumber(redis.call('HGET', nk, 'g:' .. g .. ':mem') or '0')
    local cnt = tonumber(redis.call('HGET', nk, 'g:' .. g .. ':n') or '0')
    local x = tonumber(redis.call('HGET', nk, 'g:' .. g .. ':x') or '0')
    if x == 1 then return {0, 'gpu ' .. g .. ' on ' .. w.node .. ' is held exclusively', w.node} end
    if cnt + gw.n > 1 and gw.x == 1 then
      return {0, 'gpu ' .. g .. ' on ' .. w.node .. ' is in use and sharing is not allowed', w.node}
    end
    if used + gw.mem > total then
      return {0, 'gpu ' .. g .. ' on ' .. w.node .. ': ' .. (total - used) .. ' MiB free, ' .. gw.mem .. ' asked', w.node}
    end
    if gw.share > 0 then
      local shared = tonumber(redis.call('HGET', nk, 'g:' .. g .. ':share') or '0')
      if shared + gw.share > 1000 then
        return {0, 'gpu ' .. g .. ' on ' .. w.node .. ': ' .. (1000 - shared) .. '/1000 of its compute free, ' .. gw.share .. ' asked', w.node}
      end
    end
  end
end
for i = 1, n do
  local pl = p[i]
  local nk = KEYS[2*i-1]
  redis.call('HINCRBYFLOAT', nk, 'cpu_used', pl.cpu)
  redis.call('HINCRBY', nk, 'mem_used', pl.mem)
  local taken = {}
  local share = (not pl.exclusive and pl.gpu_share) and tonumber(pl.gpu_share) or 0
  for _, g in ipairs(pl.gpus) do
    local m = pl['taken_' .. g]
    taken[g] = m
    redis.call('HINCRBY', nk, 'g:' .. g .. ':mem', m)
    redis.call('HINCRBY', nk, 'g:' .. g .. ':n', 1)
    if pl.exclusive then redis.call('HSET', nk, 'g:' .. g .. ':x', 1) end
    if share > 0 then redis.call('HINCRBY', nk, 'g:' .. g .. ':share', share) end
  end
  redis.call('HSET', KEYS[2*i], 'node', pl.node, 'block', pl.block, 'cpu', pl.cpu, 'mem', pl.mem,
    'gpus', cjson.encode(taken), 'exclusive', pl.exclusive and 1 or 0)
  if share > 0 then redis.call('HSET', KEYS[2*i], 'share', share) end
end
if KEYS[2*n+1] then redis.call('INCR', KEYS[2*n+1]) end
-- quota usage (KEYS[2n+2] usage hash, KEYS[2n+3] per-reservation amounts): in the same call
if KEYS[2*n+3] then
  for i = 1, n do
    local pl = p[i]
    if pl.quota and next(pl.quota) ~= nil then
      for f, a in pairs(pl.quota) do redis.call('HINCRBYFLOAT', KEYS[2*n+2], f, a) end
      redis.call('HSET', KEYS[2*n+3], pl.iid, cjson.encode(pl.quota))
    end
  end
end
return {1, 'ok', ''}
"""

# KEYS: node, res, [the cluster's state index, bumped when something was released], [quota usage,
# quota per-reservation amounts]; ARGV: [the instance id] (with the quota keys).
# Returns 1 if released, 0 if there was nothing to release (idempotent).
RELEASE = r"""
-- amounts are skipped when zero: Lua renders -0 as "-0", which HINCRBY rejects
local function give_back(key, field, amount, float)
  amount = tonumber(amount)
  if amount == 0 then return end
  if float then redis.call('HINCRBYFLOAT', key, field, -amount) else redis.call('HINCRBY', key, field, -amount) end
end
if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
local r = redis.call('HGETALL', KEYS[2])
local f = {}
for i = 1, #r, 2 do f[r[i]] = r[i+1] end
if redis.call('EXISTS', KEYS[1]) == 1 then
  give_back(KEYS[1], 'cpu_used', f.cpu, true)
  give_back(KEYS[1], 'mem_used', f.mem, false)
  for g, m in pairs(cjson.decode(f.gpus)) do
    give_back(KEYS[1], 'g:' .. g .. ':mem', m, false)
    redis.call('HINCRBY', KEYS[1], 'g:' .. g .. ':n', -1)
    if f.exclusive == '1' then redis.call('HSET', KEYS[1], 'g:' .. g .. ':x', 0) end
    if f.share then give_back(KEYS[1], 'g:' .. g .. ':share', f.share, false) end
  end
end
redis.call('DEL', KEYS[2])
if KEYS[3] then redis.call('INCR', KEYS[3]) end
-- quota usage (KEYS[4] usage hash, KEYS[5] per-reservation amounts, ARGV[1] the iid): taken back
if KEYS[5] then
  local q = redis.call('HGET', KEYS[5], ARGV[1])
  if q then
    for f, a in pairs(cjson.decode(q)) do
      if tonumber(a) ~= 0 then redis.call('HINCRBYFLOAT', KEYS[4], f, -tonumber(a)) end
    end
    redis.call('HDEL', KEYS[5], ARGV[1])
  end
end
return 1
"""

# The quota usage counters' version (the field ``v`` of the usage hash; ``policies.quota.from_fields``
# reads only ``tenant<TAB>model<TAB>resource`` fields). A cluster whose hash lacks it holds
# reservations made before the counters existed (or its hash was dropped): ``PriorityStore`` migrates
# it on first use. KEYS: quota usage, quota per-reservation amounts.  ARGV: JSON {iid: {field:
# amount}} (what the reservations without an entry add, computed from their blocks and nodes), the
# reservation key prefix (``res_key(cid, "")``), the version.  An entry is written only while its
# reservation exists and has none (one taken meanwhile was counted by RESERVE_GANG); entries whose
# reservation is gone are dropped; the usage is then the sum of the entries. Returns 1 if it
# migrated, 0 if the hash was already at the version.
QUOTA_MIGRATE = r"""
if redis.call('HGET', KEYS[1], 'v') == ARGV[3] then return 0 end
for iid, q in pairs(cjson.decode(ARGV[1])) do
  if redis.call('EXISTS', ARGV[2] .. iid) == 1 and redis.call('HEXISTS', KEYS[2], iid) == 0 then
    redis.call('HSET', KEYS[2], iid, cjson.encode(q))
  end
end
local all = redis.call('HGETALL', KEYS[2])
local sum, order = {}, {}
for i = 1, #all, 2 do
  if redis.call('EXISTS', ARGV[2] .. all[i]) == 0 then
    redis.call('HDEL', KEYS[2], all[i])
  else
    for f, a in pairs(cjson.decode(all[i + 1])) do
      if sum[f] == nil then table.insert(order, f); sum[f] = 0 end
      sum[f] = sum[f] + tonumber(a)
    end
  end
end
redis.call('DEL', KEYS[1])
for _, f in ipairs(order) do
  if sum[f] ~= 0 then redis.call('HSET', KEYS[1], f, string.format('%.17g', sum[f])) end
end
redis.call('HSET', KEYS[1], 'v', ARGV[3])
return 1
"""

# KEYS: due-gathers zset.  ARGV: now, lease seconds, limit.  Claims the gathers due by ``now``:
# each claimed member's score moves to now + lease (a claimer that dies gives it back when the
# lease runs out). Returns {members..., next due score or ''}.
CLAIM_DUE = r"""
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
local until_ = tonumber(ARGV[1]) + tonumber(ARGV[2])
for _, m in ipairs(due) do redis.call('ZADD', KEYS[1], until_, m) end
local nxt = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
due[#due + 1] = nxt[2] or ''
return due
"""

# KEYS: block.  ARGV: gen, allowed statuses ("*" or comma list), new status, JSON of extra fields,
# [the selection round the block must be in ('' or absent: any)].
# Compare-and-set on (gen, status[, attempt]); bumps version. Returns {1, version} or
# {0, current status} ({0, 'superseded:<attempt>'} for another round).
TRANSITION = r"""
local cur = redis.call('HMGET', KEYS[1], 'gen', 'status', 'version', 'attempt')
if not cur[1] then return {0, 'absent'} end
if ARGV[1] ~= '' and cur[1] ~= ARGV[1] then return {0, 'stale-gen:' .. cur[1]} end
if ARGV[5] and ARGV[5] ~= '' and (cur[4] or '0') ~= ARGV[5] then return {0, 'superseded:' .. (cur[4] or '0')} end
if ARGV[2] ~= '*' then
  local ok = false
  for s in string.gmatch(ARGV[2], '([^,]+)') do if s == cur[2] then ok = true end end
  if not ok then return {0, cur[2]} end
end
local v = redis.call('HINCRBY', KEYS[1], 'version', 1)
redis.call('HSET', KEYS[1], 'status', ARGV[3])
local extra = cjson.decode(ARGV[4])
for k, val in pairs(extra) do redis.call('HSET', KEYS[1], k, val) end
return {1, v}
"""

# KEYS: block.  ARGV: gen, spec digest, JSON fields, reusable statuses (comma-separated, from
# schemas.lifecycle.REUSABLE).  Creates the block record unless a live one exists.
# Returns {1, 'created'|'same'} or {0, reason}.
CREATE_BLOCK = r"""
local cur = redis.call('HMGET', KEYS[1], 'gen', 'status', 'digest')
if cur[1] then
  if cur[1] == ARGV[1] then return {1, 'same'} end
  local reusable = false
  for s in string.gmatch(ARGV[4], '([^,]+)') do if s == cur[2] then reusable = true end end
  if not reusable then
    return {0, 'block id already in use (status ' .. cur[2] .. ')'}
  end
end
redis.call('DEL', KEYS[1])
local extra = cjson.decode(ARGV[3])
for k, val in pairs(extra) do redis.call('HSET', KEYS[1], k, val) end
redis.call('HSET', KEYS[1], 'gen', ARGV[1], 'digest', ARGV[2], 'version', 1)
return {1, 'created'}
"""

#: a gather round's outcome, recorded once (HSETNX) and read back in the same step: the outcome
#: a decider publishes is the first one recorded, whichever copy or delivery decided it. A script
#: rather than MULTI/EXEC so it joins the gathered pipeline (state.autopipeline).
#: KEYS[1] the round's hash; ARGV[1] this decider's outcome
GATHER_SETTLE = r"""
redis.call('HSETNX', KEYS[1], 'outcome', ARGV[1])
return redis.call('HGET', KEYS[1], 'outcome')
"""

# KEYS: gather.  ARGV: cluster, JSON result, ttl.  Records one answer; returns {answered,
# expected, decided token or '', deadline or ''} (a late answer needs no second read to see
# whether its round is past its deadline and undecided).
GATHER_ADD = r"""
redis.call('HSET', KEYS[1], 'r:' .. ARGV[1], ARGV[2])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
local meta = redis.call('HMGET', KEYS[1], 'expected', 'decided', 'deadline')
local expected = cjson.decode(meta[1] or '[]')
local answered = 0
for _, c in ipairs(expected) do
  if redis.call('HEXISTS', KEYS[1], 'r:' .. c) == 1 then answered = answered + 1 end
end
return {answered, #expected, meta[2] or '', meta[3] or ''}
"""

# KEYS: policy head (the caller adds the name to the policies set: another Redis Cluster slot).
# ARGV: name, version, source, language, updated.
# Moves the registry head to ``version`` unless it already is at or past it.
POLICY_HEAD = r"""
local cur = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
if cur >= tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], 'version', ARGV[2], 'source', ARGV[3], 'language', ARGV[4], 'updated', ARGV[5])
return 1
"""

# KEYS: node, [the cluster's state index].  ARGV: "1" healthy / "0" unhealthy.
# Returns 1 if this call changed it (and bumped the index), else 0.
NODE_HEALTH_CAS = r"""
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if redis.call('HGET', KEYS[1], 'healthy') == ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'healthy', ARGV[1])
if KEYS[2] then redis.call('INCR', KEYS[2]) end
return 1
"""

# KEYS: the block's instances hash.  ARGV: instance id, new status (a lifecycle enum value),
# optionally the endpoint (JSON-encoded: set or replaced in the record).
# Sets the status inside the instance's record (the store writes records as compact JSON, so the
# one "status" member is replaced in place: no JSON round trip, which would turn an empty list
# into an object) and returns every instance record after the write (HGETALL), or false when the
# instance is not recorded. One step: a reader of the result sees its own write and all before it.
SET_INSTANCE_STATUS = r"""
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return false end
local status = '"status":"' .. ARGV[2] .. '"'
local new, n = string.gsub(raw, '"status":"[^"]*"', function() return status end, 1)
if n == 0 then return redis.error_reply('instance record without a status: ' .. ARGV[1]) end
if ARGV[3] then
  -- ARGV[3]: the endpoint, JSON-encoded by the caller (a function replacement: no % escapes)
  local ep = '"endpoint":' .. ARGV[3]
  local m
  new, m = string.gsub(new, '"endpoint":"[^"]*"', function() return ep end, 1)
  if m == 0 then new = '{' .. ep .. (string.sub(new, 2, 2) == '}' and '' or ',') .. string.sub(new, 2) end
end
redis.call('HSET', KEYS[1], ARGV[1], new)
return redis.call('HGETALL', KEYS[1])
"""

# KEYS: the block's instances hash, the block.  ARGV: instance id, new status, the endpoint
# (JSON-encoded, '' for none), the gang's minInstances, the instance ids the caller expects after
# the write (sorted, comma-joined), then TRANSITION's arguments for the block's ``ready`` step.
# SET_INSTANCE_STATUS, then, when at least minInstances run and the block has exactly the expected
# instances, TRANSITION: an ``added`` that makes its block ready in one step (``Store.
# set_status_then_ready``). Returns {} when the instance is not recorded (nothing written),
# {records} when the CAS was not tried (fewer run, or other instances than expected), else
# {records, TRANSITION's two results}. Two keys in two Redis Cluster slots: for one server only
# (on a Redis Cluster the caller takes SET_INSTANCE_STATUS and TRANSITION one after the other).
SET_STATUS_THEN_READY = (
    "local function set_status(KEYS, ARGV)\n" + SET_INSTANCE_STATUS + "\nend\n"
    + "local function transition(KEYS, ARGV)\n" + TRANSITION + "\nend\n"
    + r"""
local all = set_status({KEYS[1]}, {ARGV[1], ARGV[2], ARGV[3] ~= '' and ARGV[3] or nil})
if not all then return {} end
if all.err then return all end
local running, ids = 0, {}
for i = 1, #all, 2 do
  ids[#ids + 1] = all[i]
  if cjson.decode(all[i + 1]).status == 'running' then running = running + 1 end
end
table.sort(ids)
if running < tonumber(ARGV[4]) or table.concat(ids, ',') ~= ARGV[5] then return {all} end
local done = transition({KEYS[2]}, {ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10]})
return {all, done[1], done[2]}
""")

# KEYS: RESERVE_GANG's (two per placement, the cluster's state index, quota usage and quota
# reservations: 2n+3), then the block, its instances hash, the affinity lease hash, the nominations
# hash, one node-instance hash per record, one affinity service hash per index entry.  ARGV:
# RESERVE_GANG's JSON, the block id, '1' to drop the block's nomination ('' not), TRANSITION's four
# arguments for the block's step (all '' for none), the number of records, then (iid, record) per
# record and (lease, iid, node, entry) per index entry.
# RESERVE_GANG, then, only if it reserved, what ``Store.start_instances`` (no limit) writes, in its
# order: the step's CAS (its outcome not read, as there), the affinity index, the records (HSETNX:
# one recorded keeps its record) with their nodes' entries; then the nomination's HDEL (the gang's
# step, ``allocate.commit_start``). A refused reservation writes nothing. Returns RESERVE_GANG's
# three results and, after a reservation, the HDEL's. Keys of many Redis Cluster slots: for one
# server only (on a Redis Cluster the caller reserves, then records, as two calls).
RESERVE_THEN_START = (
    "local function reserve(KEYS, ARGV)\n" + RESERVE_GANG + "\nend\n"
    + "local function transition(KEYS, ARGV)\n" + TRANSITION + "\nend\n"
    + r"""
local n = #cjson.decode(ARGV[1])
local m = 2 * n + 3
local got = reserve({unpack(KEYS, 1, m)}, {ARGV[1]})
if got[1] ~= 1 then return got end
local bid = ARGV[2]
if ARGV[6] ~= '' then transition({KEYS[m + 1]}, {ARGV[4], ARGV[5], ARGV[6], ARGV[7]}) end
local k = tonumber(ARGV[8])
local a, nk = 9 + 2 * k, m + 5 + k
while a <= #ARGV do
  redis.call('HSET', KEYS[nk], ARGV[a + 1], ARGV[a + 3])
  redis.call('HSET', KEYS[m + 3], ARGV[a], ARGV[a + 2])
  a, nk = a + 4, nk + 1
end
for i = 1, k do
  redis.call('HSETNX', KEYS[m + 2], ARGV[7 + 2 * i], ARGV[8 + 2 * i])
  redis.call('HSET', KEYS[m + 4 + i], ARGV[7 + 2 * i], bid)
end
local held = 0
if ARGV[3] == '1' then held = redis.call('HDEL', KEYS[m + 4], bid) end
return {got[1], got[2], got[3], held}
""")

# KEYS: block.  ARGV: gen ('' = any), live statuses (comma list), target, target version (the
# stream sequence of the target event), JSON of extra fields (reason, source...).
# The block's desired instance count: set only if the block is live, of that generation, and the
# version is not older than the one it holds (the latest target wins; a redelivery of the same one
# is accepted again). Returns {1, 'ok'} or {0, current status | 'absent' | 'stale-gen:G' |
# 'superseded:V'}.
SET_DESIRED = r"""
local cur = redis.call('HMGET', KEYS[1], 'gen', 'status', 'desired_seq')
if not cur[1] then return {0, 'absent'} end
if ARGV[1] ~= '' and cur[1] ~= ARGV[1] then return {0, 'stale-gen:' .. cur[1]} end
local ok = false
for s in string.gmatch(ARGV[2], '([^,]+)') do if s == cur[2] then ok = true end end
if not ok then return {0, cur[2]} end
if tonumber(cur[3] or '0') > tonumber(ARGV[4]) then return {0, 'superseded:' .. cur[3]} end
redis.call('HSET', KEYS[1], 'desired', ARGV[3], 'desired_seq', ARGV[4])
local extra = cjson.decode(ARGV[5])
for k, val in pairs(extra) do redis.call('HSET', KEYS[1], k, val) end
return {1, 'ok'}
"""

# KEYS: the block's instances hash.  ARGV: instance id, floor, request id.
# Marks one instance ``removing`` for a scale-down, only while the block keeps more than ``floor``
# instances that are not already on their way out (starting or running): two scale-downs racing
# can never take the block below its floor (minInstances, or the target). The record gets
# ``"drain":"<request id>"`` (who removed it). Returns 'ok', 'absent', 'removing' (already going)
# or 'floor'.
DRAIN_INSTANCE = r"""
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 'absent' end
if string.find(raw, '"status":"removing"', 1, true) then return 'removing' end
local all = redis.call('HVALS', KEYS[1])
local live = 0
local mine = 0
local mark = '{"drain":' .. cjson.encode(ARGV[3])
for _, v in ipairs(all) do
  if not string.find(v, '"status":"removing"', 1, true) then live = live + 1 end
  if string.sub(v, 1, string.len(mark)) == mark then mine = mine + 1 end
end
if mine >= tonumber(ARGV[4] or '1000000') then return 'done' end
if live <= tonumber(ARGV[2]) then return 'floor' end
local new = string.gsub(raw, '"status":"[^"]*"', function() return '"status":"removing"' end, 1)
new = '{"drain":' .. cjson.encode(ARGV[3]) .. (string.sub(new, 2, 2) == '}' and '' or ',') .. string.sub(new, 2)
redis.call('HSET', KEYS[1], ARGV[1], new)
return 'ok'
"""

#: Record a scale step's new instances within the block's bound, atomically over its instance
#: hash (``Store.start_instances`` with a ``limit``): KEYS[1] = the block's instances; ARGV[1] =
#: the most records it may hold (``maxInstances``); ARGV[2..] = instance id, record pairs. An id
#: already recorded keeps its record (a redelivered step); a new one is recorded only while the
#: hash holds fewer records than the bound, so concurrent scale steps (several in one batch, or on
#: several controller copies) can never take a block past ``maxInstances``. Returns the refused ids.
ADD_INSTANCES = r"""
local most = tonumber(ARGV[1])
local refused = {}
for i = 2, #ARGV, 2 do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 0 then
    if redis.call('HLEN', KEYS[1]) >= most then
      table.insert(refused, ARGV[i])
    else
      redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
    end
  end
end
return refused
"""


# -- leases (one holder at a time, lapsing on their own: the metrics collector's per scope, the
# health checker's and the autoscaler's per block, a reassignment's claim on the instance it replaces)
#: take or keep a lease: KEYS[1] lease key; ARGV holder, ttl ms -> 1 if held by ``holder`` now
LEASE = """
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not cur then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
#: a ready block's short mark (``schemas.condition``): KEYS[1] the block; ARGV gen, the mark's JSON
#: ('': clear it). Set only on a ``ready`` block of that generation, cleared on one of that
#: generation whatever its status -> 1 if written
SHORT_MARK = """
local cur = redis.call('HMGET', KEYS[1], 'gen', 'status')
if cur[1] ~= ARGV[1] then return 0 end
if ARGV[2] == '' then return redis.call('HDEL', KEYS[1], 'short') end
if cur[2] ~= 'ready' then return 0 end
redis.call('HSET', KEYS[1], 'short', ARGV[2])
return 1
"""
#: give a lease back: KEYS[1] lease key; ARGV holder -> 1 if it was ours and is gone
LEASE_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
