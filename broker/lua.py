"""The Lua scripts behind every atomic step of ``broker.store`` (Redis runs each one alone).

Keys are built from a prefix passed as ``ARGV[1]``; FleetBroker targets one Redis primary (with
Sentinel or a managed failover), not Redis Cluster, so scripts may touch keys they compute.
A job hash holds ``doc`` (the record as JSON), ``reason`` (JSON, apart so that a round saying
why a job waits rewrites no record) and plain copies of what scripts compare:
``state``, ``version``, ``attempt``, ``cancel_requested`` (plus ``id`` and ``team``).
"""

# Fencing: a write that carries a fence is refused unless the leader lease still holds that
# fence. The lease value is "<fence>|<owner>".
_FENCE_CHECK = """
local function check_fence(p, fence)
  if fence == '' then return nil end
  local lease = redis.call('GET', p .. 'leader')
  if (not lease) or string.match(lease, '^(%d+)|') ~= fence then
    return redis.error_reply('STALEFENCE fence ' .. fence .. ' no longer holds the leader lease')
  end
  return nil
end
local function event(p, now, etype, job, data)
  redis.call('XADD', p .. 'events', 'MAXLEN', '~', 100000, '*',
             'ts', now, 'type', etype, 'job', job or '', 'data', data or '{}')
  if job and job ~= '' then
    redis.call('XADD', p .. 'events:' .. job, 'MAXLEN', '~', 1000, '*',
               'ts', now, 'type', etype, 'job', job, 'data', data or '{}')
  end
end
local function wake(p)
  redis.call('LPUSH', p .. 'wake', '1')
  redis.call('LTRIM', p .. 'wake', 0, 0)
end
"""

# ARGV: prefix, team, name, now, request_key ('' = none), doc (JSON object without "id").
# Returns the job id (the existing one when request_key was seen before). The id is the name and
# a time-ordered number: microseconds of Redis's clock, or one above the last id's when the clock
# has not moved past it. A counter alone would start again after Redis lost data and hand out
# ids of jobs that existed (with checkpoints, logs and users who know them); the clock has moved
# on since any id it gave out, so an id is never given twice. In base 36, 10 digits: sortable.
SUBMIT = _FENCE_CHECK + """
local p, team, name, now, rkey, doc = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local dedupe = p .. 'request:' .. team .. ':' .. rkey
if rkey ~= '' then
  local seen = redis.call('GET', dedupe)
  if seen then return seen end
end
local t = redis.call('TIME')
local n = math.max(tonumber(t[1]) * 1000000 + tonumber(t[2]),
                   (tonumber(redis.call('GET', p .. 'seq:job')) or 0) + 1)
redis.call('SET', p .. 'seq:job', string.format('%d', n))
local digits, left, num = '0123456789abcdefghijklmnopqrstuvwxyz', n, ''
while left > 0 do
  local d = left % 36
  num = string.sub(digits, d + 1, d + 1) .. num
  left = (left - d) / 36
end
local id = name .. '-' .. string.rep('0', 10 - #num) .. num
local key = p .. 'job:' .. id
redis.call('HSET', key, 'id', id, 'team', team, 'state', 'queued', 'version', 1,
           'attempt', 0, 'cancel_requested', 'false',
           'doc', '{"id":"' .. id .. '",' .. string.sub(doc, 2))
redis.call('ZADD', p .. 'jobs', n, id)
redis.call('ZADD', p .. 'team:' .. team, n, id)
redis.call('SADD', p .. 'state:queued', id)
if rkey ~= '' then redis.call('SET', dedupe, id, 'EX', 86400) end
event(p, now, 'submitted', id, cjson.encode({team = team}))
wake(p)
return id
"""

# ARGV: prefix, fence ('' = none), now, ops (JSON). All checks run before any write, so a plan
# applies entirely or not at all. ops = {
#   checks: [{job, states?: [..], version?: n, attempt?: n}],
#   sets: [{job, state?: s, fields?: {name: text}}],   -- bumps version by one
#   intents_add: [{id, json}], intents_del: [id],
#   placement_open: [{job, json}], placement_close: [{job, json}],
#   events: [{type, job?, data?}], wake?: true,
#   kv: [{key, value, expect}],   -- a plain string key set only if it still holds `expect`
#                                    ('' = absent): leader state such as the blocklist
#   incr: [{key, field, by}] }    -- add `by` to a hash field: counters such as preemptions
#                                    per pool, counted once because the plan applies once
APPLY = _FENCE_CHECK + """
local p, fence, now = ARGV[1], ARGV[2], ARGV[3]
local err = check_fence(p, fence)
if err then return err end
local ops = cjson.decode(ARGV[4])
for _, c in ipairs(ops.checks or {}) do
  local key = p .. 'job:' .. c.job
  local st = redis.call('HGET', key, 'state')
  if not st then return redis.error_reply('NOTFOUND ' .. c.job) end
  if c.states then
    local ok = false
    for _, s in ipairs(c.states) do if s == st then ok = true end end
    if not ok then return redis.error_reply('CONFLICT ' .. c.job .. ' is ' .. st) end
  end
  if c.version and tonumber(redis.call('HGET', key, 'version')) ~= c.version then
    return redis.error_reply('CONFLICT ' .. c.job .. ' changed (version)')
  end
  if c.attempt and tonumber(redis.call('HGET', key, 'attempt')) ~= c.attempt then
    return redis.error_reply('CONFLICT ' .. c.job .. ' is on another attempt')
  end
end
for _, kv in ipairs(ops.kv or {}) do
  if (redis.call('GET', p .. kv.key) or '') ~= kv.expect then
    return redis.error_reply('CONFLICT ' .. kv.key .. ' changed')
  end
end
-- HINCRBYFLOAT refuses inf and nan only when it runs, after other writes: refuse them here
for _, c in ipairs(ops.incr or {}) do
  local by = tonumber(c.by)
  if not by or by ~= by or by == math.huge or by == -math.huge then
    return redis.error_reply('BADPLAN ' .. c.key .. ' ' .. c.field .. ': increment ' ..
                             tostring(c.by) .. ' is not a finite number')
  end
end
local versions = {}
for _, s in ipairs(ops.sets or {}) do
  local key = p .. 'job:' .. s.job
  if s.state then
    local old = redis.call('HGET', key, 'state')
    if old ~= s.state then
      redis.call('SREM', p .. 'state:' .. old, s.job)
      redis.call('SADD', p .. 'state:' .. s.state, s.job)
      redis.call('HSET', key, 'state', s.state)
    end
  end
  for f, v in pairs(s.fields or {}) do redis.call('HSET', key, f, v) end
  table.insert(versions, redis.call('HINCRBY', key, 'version', 1))
end
for _, it in ipairs(ops.intents_add or {}) do redis.call('HSET', p .. 'outbox', it.id, it.json) end
for _, id in ipairs(ops.intents_del or {}) do redis.call('HDEL', p .. 'outbox', id) end
for _, pl in ipairs(ops.placement_open or {}) do
  redis.call('RPUSH', p .. 'placements:' .. pl.job, pl.json)
end
for _, pl in ipairs(ops.placement_close or {}) do
  if redis.call('LLEN', p .. 'placements:' .. pl.job) > 0 then
    redis.call('LSET', p .. 'placements:' .. pl.job, -1, pl.json)
  end
end
for _, kv in ipairs(ops.kv or {}) do redis.call('SET', p .. kv.key, kv.value) end
for _, c in ipairs(ops.incr or {}) do redis.call('HINCRBYFLOAT', p .. c.key, c.field, c.by) end
for _, e in ipairs(ops.events or {}) do event(p, now, e.type, e.job, e.data) end
if ops.wake then wake(p) end
return versions
"""

# ARGV: prefix, owner, ttl_ms. Returns the fence held (new or renewed), or 0 when another
# owner holds the lease. The fence counter only ever grows.
ACQUIRE = """
local p, owner, ttl = ARGV[1], ARGV[2], ARGV[3]
local cur = redis.call('GET', p .. 'leader')
if cur then
  local f, o = string.match(cur, '^(%d+)|(.*)$')
  if o == owner then
    redis.call('PEXPIRE', p .. 'leader', ttl)
    return tonumber(f)
  end
  return 0
end
local f = redis.call('INCR', p .. 'fence')
redis.call('SET', p .. 'leader', f .. '|' .. owner, 'PX', ttl)
return f
"""

# ARGV: prefix, fence. Deletes the lease only if it still holds this fence.
RELEASE = """
local cur = redis.call('GET', ARGV[1] .. 'leader')
if cur and string.match(cur, '^(%d+)|') == ARGV[2] then
  redis.call('DEL', ARGV[1] .. 'leader')
  return 1
end
return 0
"""

# ARGV: prefix, states... Returns {{doc, state, version, reason}, ...}, {progress flat per
# job}, pools flat, outbox flat: one consistent view for a scheduling round.
SNAPSHOT = """
local p = ARGV[1]
local jobs, progress = {}, {}
for i = 2, #ARGV do
  for _, id in ipairs(redis.call('SMEMBERS', p .. 'state:' .. ARGV[i])) do
    table.insert(jobs, redis.call('HMGET', p .. 'job:' .. id, 'doc', 'state', 'version',
                                  'reason'))
    table.insert(progress, redis.call('HGETALL', p .. 'progress:' .. id))
  end
end
return {jobs, progress, redis.call('HGETALL', p .. 'pools'), redis.call('HGETALL', p .. 'outbox')}
"""

# The job's rendezvous round and node count, which only its record (``doc``) holds, and whether
# a visitor holds the idempotency key of rank ``rank``'s current node: that of the rank's
# stand-in (``providers.base.replacement_key``: "<launch_key>~r<rank>.<round>", stand_ins naming
# the round it was launched for; cjson keys the object with strings) or else the launch's own.
# A node the broker gave up on (a late stand-in, a partitioned node) still holds the attempt's
# token but not that key, and neither does a visitor without a key; a record without a launch
# key has nothing to check against.
_JOB_SHAPE = """
local function job_shape(key)
  local doc = cjson.decode(redis.call('HGET', key, 'doc'))
  return tonumber(doc['round']) or 0, math.max(tonumber(doc['nodes']) or 1, 1), doc
end
local function holds_rank(doc, rank, node_key)
  local launch = doc['launch_key']
  local stand_ins = type(doc['stand_ins']) == 'table' and doc['stand_ins'] or {}
  local since = stand_ins[string.format('%d', rank)]
  if type(launch) ~= 'string' then return true end
  if since then
    return node_key == launch .. '~r' .. string.format('%d', rank) .. '.' ..
                       string.format('%d', since)
  end
  return node_key == launch
end
"""

# ARGV: prefix, job, attempt, now, round, node_rank, node_key ('' = none), n_progress,
# rendezvous_ttl_s, field, value, ... Records an agent's report for the job's current attempt: the
# first n_progress pairs are progress, taken from node rank 0 of the job's current round only (a
# node of an older round, or another rank, must not reset it); the rest are the node's exit code
# and notice, taken for a round up to the job's and a rank below its node count (a report naming a
# later round or a rank the job lacks is dropped). A node that does not hold the rank's current
# key (``holds_rank``: the broker replaced it) records nothing, not even liveness. Returns the
# job's state, cancel flag and rendezvous round so the caller picks the action, with 'stale' for
# the state when the heartbeat comes from an attempt that is no longer current and 'superseded'
# for a replaced node. A heartbeat keeps the job's rendezvous record alive (rdzv:<job>): the
# reconciler reads who checked in for as long as the job runs, however long it trains.
# Progress of one (attempt, round) only moves forward (``progress_from`` names the one it came
# from): once rank 0's final report (its exit code) landed, or from a report with fewer samples
# or an older checkpoint than those taken, none is taken: a late heartbeat, delivered after
# the final one by another replica or a retry, must not wind the job back.
HEARTBEAT = _JOB_SHAPE + """
local p, job, attempt, now = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local rnd, rank, node_key, np = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7], tonumber(ARGV[8])
local key = p .. 'job:' .. job
local st = redis.call('HGET', key, 'state')
if not st then return {'missing', '0', 0} end
local round, nodes, doc = job_shape(key)
if redis.call('HGET', key, 'attempt') ~= attempt then return {'stale', '0', round} end
if not holds_rank(doc, rank, node_key) then return {'superseded', '0', round} end
local progress = p .. 'progress:' .. job
local leader = rank == 0 and rnd == round
local member = rnd <= round and rank < nodes
local from = attempt .. ':' .. rnd
if leader then
  local final = 'exit:' .. from .. ':0'
  if redis.call('HEXISTS', progress, final) == 1 then leader = false end
  if redis.call('HGET', progress, 'progress_from') == from then
    for i = 10, 8 + 2 * np, 2 do
      if ARGV[i] == 'samples_done' or ARGV[i] == 'checkpoint_step' then
        local had = tonumber(redis.call('HGET', progress, ARGV[i]) or '')
        local got = tonumber(ARGV[i + 1])
        if had and got and got < had then leader = false end
      end
    end
  end
end
for i = 10, #ARGV, 2 do
  local take = member
  if (i - 10) / 2 < np then take = leader end
  if take then redis.call('HSET', progress, ARGV[i], ARGV[i + 1]) end
end
if leader and np > 0 then redis.call('HSET', progress, 'progress_from', from) end
redis.call('EXPIRE', p .. 'rdzv:' .. job, ARGV[9])  -- no-op while there is none
redis.call('HSET', progress, 'heartbeat_at', now)
redis.call('HSETNX', progress, 'beat:' .. attempt, now)  -- the attempt's first
return {st, redis.call('HGET', key, 'cancel_requested') or 'false', round}
"""

# ARGV: prefix, job, attempt, round, node_rank, addr ('' = none), ttl_s, node_key ('' = none).
# A node's check-in for the job's current attempt and round, in the
# hash rdzv:<job> (field "<attempt>:<round>:<rank>"): rank 0's "host:port" (rank 0 without one
# has not checked in), another rank's address or '' (an address already there stays). A visit
# for another round or a rank the job lacks records nothing; so does one from a node that does
# not hold the rank's current key (``holds_rank``), which is told to stop ('superseded'). Once
# every rank 0..nodes-1 checked in for the current round (a barrier: no node starts before the
# whole group is up) rank 0's address is frozen, so the master handed out never changes.
# Returns the job's state ('stale' for another attempt, 'superseded', 'missing'), cancel flag,
# round, node count and, once the barrier released, the address rank 0 registered and every
# rank's, by rank ('' where a rank gave none) (else nil; always nil for a stale attempt or a
# superseded node).
RENDEZVOUS = _JOB_SHAPE + """
local p, job, attempt, rnd, rank, addr, ttl, node_key = ARGV[1], ARGV[2], ARGV[3],
  tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6], ARGV[7], ARGV[8]
local key = p .. 'job:' .. job
local st = redis.call('HGET', key, 'state')
if not st then return {'missing', '0', 0, 0, false} end
local round, nodes, doc = job_shape(key)
local cancel = redis.call('HGET', key, 'cancel_requested') or 'false'
if redis.call('HGET', key, 'attempt') ~= attempt then
  return {'stale', cancel, round, nodes, false}
end
if not holds_rank(doc, rank, node_key) then return {'superseded', cancel, round, nodes, false} end
local rdzv = p .. 'rdzv:' .. job
local base = attempt .. ':' .. string.format('%d', round) .. ':'
local fields = {}
for r = 0, nodes - 1 do fields[r + 1] = base .. string.format('%d', r) end
local function released()
  local seen = redis.call('HMGET', rdzv, unpack(fields))
  for r = 1, nodes do
    if not seen[r] then return false, false end
  end
  return seen[1], seen
end
if rnd == round and rank < nodes and (rank > 0 or addr ~= '') then
  local field = base .. string.format('%d', rank)
  if rank == 0 and released() then
    -- the master was handed out: a second registration must not change it
  elseif addr ~= '' then
    redis.call('HSET', rdzv, field, addr)
  else
    redis.call('HSETNX', rdzv, field, '')
  end
  redis.call('EXPIRE', rdzv, ttl)
end
local master, seen = released()
return {st, cancel, round, nodes, master, seen}
"""

# ARGV: prefix, job, max_lines, line... Appends log lines, trimming the oldest beyond
# max_lines; 'logbase' counts trimmed lines so offsets stay absolute.
APPEND_LOG = """
local p, job, cap = ARGV[1], ARGV[2], tonumber(ARGV[3])
local key = p .. 'logs:' .. job
for i = 4, #ARGV do redis.call('RPUSH', key, ARGV[i]) end
local n = redis.call('LLEN', key)
if n > cap then
  redis.call('LTRIM', key, n - cap, -1)
  redis.call('INCRBY', p .. 'logbase:' .. job, n - cap)
end
return n
"""
