"""The limiter's Redis side: the Lua scripts every gateway runs, and the layout of a tenant's
keys. Each script runs atomically and reads Redis's own clock (`TIME`), so gateways with skewed
clocks agree; every key of a tenant carries one `{tag}` hash tag, so they share a Redis Cluster
slot (a script may only touch keys of one slot)."""

from __future__ import annotations

from kvfleet_gateway.limiter import BUDGET_SETTLE_RETRY_S

_COMMON = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local sec = tonumber(t[1])
"""

ADMIT = (
    _COMMON
    + """
local leases, resv, rtot, rq, tq, budget = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local genkey = KEYS[7]
local id, need, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local rpm, tpm, maxc = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local btok, bper = tonumber(ARGV[7]), tonumber(ARGV[8])
local known, fresh = ARGV[9], ARGV[10]
local bneed = tonumber(ARGV[11])
local gen = ''
if btok >= 0 then
  gen = redis.call('GET', genkey)
  if not gen then
    if known ~= '' then
      redis.call('SET', genkey, 'lost:' .. known)
      return {0, 'store_reset', '', 0, 0, 0, 0, '0', '0', -1, sec, ''}
    end
    redis.call('SET', genkey, fresh)
    gen = fresh
  elseif string.sub(gen, 1, 5) == 'lost:' then
    return {0, 'store_reset', '', 0, 0, 0, 0, '0', '0', -1, sec, ''}
  end
end
for _, old in ipairs(redis.call('ZRANGEBYSCORE', leases, '-inf', now)) do
  local r = redis.call('HGET', resv, old)
  if r then redis.call('DECRBY', rtot, r); redis.call('HDEL', resv, old) end
  redis.call('ZREM', leases, old)
end
local function window(key)
  local all, total, buckets = redis.call('HGETALL', key), 0, {}
  for i = 1, #all, 2 do
    local s, v = tonumber(all[i]), tonumber(all[i + 1])
    if s <= sec - 60 then redis.call('HDEL', key, all[i])
    else total = total + v; table.insert(buckets, {s, v}) end
  end
  table.sort(buckets, function(a, b) return a[1] < b[1] end)
  return total, buckets
end
local function wait(buckets, total, n, limit)
  for _, b in ipairs(buckets) do
    total = total - b[2]
    if total + n <= limit then return math.max(0, b[1] + 60 - now) end
  end
  return 60
end
local function reset(buckets)
  if #buckets == 0 then return 0 end
  return math.max(0, buckets[1][1] + 60 - now)
end
local nreq, rb = window(rq)
local ntok, tb = window(tq)
local reserved = tonumber(redis.call('GET', rtot) or '0')
local period, used = -1, 0
if btok >= 0 then
  period = math.floor(now / bper)
  used = tonumber(redis.call('HGET', budget, tostring(period)) or '0')
end
local function out(ok, reason, retry)
  return {ok, reason, tostring(retry), nreq, ntok, reserved, used, tostring(reset(rb)),
          tostring(reset(tb)), period, sec, gen}
end
if maxc >= 0 and redis.call('ZCARD', leases) >= maxc then return out(0, 'concurrency', 1) end
if rpm >= 0 and nreq + 1 > rpm then return out(0, 'requests', wait(rb, nreq, 1, rpm)) end
if tpm >= 0 and need > tpm then return out(0, 'tokens', '') end
if tpm >= 0 and ntok + need > tpm then return out(0, 'tokens', wait(tb, ntok, need, tpm)) end
if btok >= 0 then
  if bneed > btok then return out(0, 'budget', '') end
  if used + reserved + bneed > btok then
    -- fits once the requests in flight settle: soon; else only the next period
    if used + bneed <= btok then return out(0, 'budget', BUDGET_SETTLE_RETRY_S) end
    return out(0, 'budget', (period + 1) * bper - now)
  end
end
redis.call('ZADD', leases, now + ttl, id)
redis.call('HSET', resv, id, bneed)
redis.call('INCRBY', rtot, bneed)
redis.call('HINCRBY', rq, sec, 1)
redis.call('HINCRBY', tq, sec, need)
redis.call('EXPIRE', rq, 120)
redis.call('EXPIRE', tq, 120)
nreq, ntok, reserved = nreq + 1, ntok + need, reserved + bneed
table.insert(rb, {sec, 1})
table.insert(tb, {sec, need})
table.sort(rb, function(a, b) return a[1] < b[1] end)
table.sort(tb, function(a, b) return a[1] < b[1] end)
return out(1, '', '')
""".replace("BUDGET_SETTLE_RETRY_S", repr(BUDGET_SETTLE_RETRY_S))
)

SETTLE = """
local leases, resv, rtot, tq, budget, done = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local id, used, reserved = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local bucket, period = ARGV[4], tonumber(ARGV[5])
local remember, budget_ttl = tonumber(ARGV[6]), tonumber(ARGV[7])
local bused = tonumber(ARGV[8])
if not redis.call('SET', done, '1', 'NX', 'EX', remember) then return 0 end
local r = redis.call('HGET', resv, id)
if r then redis.call('DECRBY', rtot, r); redis.call('HDEL', resv, id) end
redis.call('ZREM', leases, id)
local spent = 0
if period >= 0 then
  spent = redis.call('HINCRBY', budget, tostring(period), bused)
  redis.call('EXPIRE', budget, budget_ttl)
end
if redis.call('HEXISTS', tq, bucket) == 1 then
  if redis.call('HINCRBY', tq, bucket, used - reserved) < 0 then
    redis.call('HSET', tq, bucket, 0)
  end
end
return {1, spent, tonumber(redis.call('GET', rtot) or '0')}
"""

HEARTBEAT = (
    _COMMON
    + """
redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[2]), ARGV[1])
return 1
"""
)


def budget_tag(scope: str, tenant: str) -> str:
    """The hash tag of a tenant's keys (`kvf:{<tag>}:...`, one Redis Cluster slot): the
    tenant within its scope, so gateways of different scopes sharing a Redis share nothing."""
    return f"{scope}/{tenant}" if scope else tenant


def tenant_keys(tag: str) -> dict[str, str]:
    p = f"kvf:{{{tag}}}"
    return {k: f"{p}:{k}" for k in ("leases", "resv", "rtot", "rq", "tq", "budget", "gen")}


LOST = "lost:"
"""A generation key's value once its budget data was lost (the tombstone's prefix)."""
STORE_RESET_MESSAGE = (
    "the budget store lost this tenant's data (Redis restarted empty); budgets fail closed"
    " until an administrator restores it or accepts the loss (kvfleet budgets reset)"
)
