"""Lua scripts the Redis state store runs atomically on the server.

Rate-limit windows are hashes `sits:{deployment}:rl:{tenant}:{window}` with one field per replica
and kind (`r:{replica}` requests, `t:{replica}` tokens). Each replica only ever raises its own
fields to its own local counts (max-merge), so writes are idempotent: a retried or replayed write,
or a replica writing its counts back into a Redis that restarted empty, never double counts.
"""

ADMIT = """
-- KEYS[1]: current window hash, KEYS[2]: previous window hash
-- ARGV: 1 my request field, 2 my token field, 3 my current requests, 4 my current tokens,
--       5 my previous requests, 6 my previous tokens, 7 weight of the previous window,
--       8 request limit (-1: none), 9 token limit (-1: none), 10 tokens of this request, 11 TTL (s)
local function others(key)
  local flat = redis.call('HGETALL', key)
  local requests, tokens = 0, 0
  for i = 1, #flat, 2 do
    local field = flat[i]
    if field ~= ARGV[1] and field ~= ARGV[2] then
      if string.sub(field, 1, 2) == 'r:' then
        requests = requests + tonumber(flat[i + 1])
      else
        tokens = tokens + tonumber(flat[i + 1])
      end
    end
  end
  return requests, tokens
end
local function mine(key, field, local_count)
  return math.max(tonumber(redis.call('HGET', key, field) or '0'), tonumber(local_count))
end
local cur_r, cur_t = others(KEYS[1])
local prev_r, prev_t = others(KEYS[2])
local my_r, my_t = mine(KEYS[1], ARGV[1], ARGV[3]), mine(KEYS[1], ARGV[2], ARGV[4])
local my_pr, my_pt = mine(KEYS[2], ARGV[1], ARGV[5]), mine(KEYS[2], ARGV[2], ARGV[6])
local keep = tonumber(ARGV[7])
local request_limit, token_limit, tokens = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
local allowed = 1
if request_limit >= 0 and (prev_r + my_pr) * keep + cur_r + my_r + 1 > request_limit then allowed = 0 end
if token_limit >= 0 and (prev_t + my_pt) * keep + cur_t + my_t + tokens > token_limit then allowed = 0 end
if allowed == 1 then
  redis.call('HSET', KEYS[1], ARGV[1], my_r + 1, ARGV[2], my_t + tokens)
  redis.call('EXPIRE', KEYS[1], ARGV[11])
end
return {allowed, cur_r, cur_t, prev_r, prev_t}
"""

RAISE_FIELDS = """
-- KEYS[1]: a hash; ARGV: 1 TTL (s, 0: none), then field, value pairs. Each field becomes
-- max(stored, value): counts only grow, so replaying a write is harmless.
for i = 2, #ARGV, 2 do
  local stored = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0')
  if tonumber(ARGV[i + 1]) > stored then redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
end
if tonumber(ARGV[1]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[1]) end
return 1
"""

PUT_TENANTS = """
-- KEYS[1]: the tenant table hash {version, document}
-- ARGV: 1 document (JSON), 2 mode ('put': new version | 'restore': only if absent, keep version ARGV[3])
if ARGV[2] == 'restore' then
  if redis.call('EXISTS', KEYS[1]) == 1 then return tonumber(redis.call('HGET', KEYS[1], 'version')) end
  redis.call('HSET', KEYS[1], 'version', ARGV[3], 'document', ARGV[1])
  return tonumber(ARGV[3])
end
local version = redis.call('HINCRBY', KEYS[1], 'version', 1)
redis.call('HSET', KEYS[1], 'document', ARGV[1])
return version
"""
