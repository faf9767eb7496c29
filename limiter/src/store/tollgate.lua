#!lua name=tollgate_v1
--
-- tollgate's atomic bucket transitions, as one Redis Function library (Redis >= 7.0).
--
-- The arithmetic mirrors tollgate-core's `bucket.rs` line by line (`refilled`, `lease`,
-- `give_back`, `millis_to_refill`, EPSILON); the in-memory store runs the Rust original, and
-- a property test replays random operation sequences on both and demands identical answers.
-- Change one side, change the other.
--
-- State, all keys named by tollgate-core's `key.rs` (one hash tag per call, so one slot):
--   bucket        hash { t = tokens (%.17g, fractions survive), u = updated_ms }
--   lease record  hash { g = granted, r = returned so far, rem = remaining at grant (%.17g),
--                        ra = retry_after_ms (%.17g), b = bucket key it was drawn from }
-- Time is this server's `TIME`; a clock that moved backwards refills nothing.
-- Work per call is bounded by the number of keys passed (no scans, no unbounded structures).
-- The library name carries the contract version: a changed contract is a new library
-- (`tollgate_v2`), so limiters of both versions can run against one Redis during a rollout.

local EPSILON = 1e-9
local U64_MAX_F = 18446744073709551616.0 -- u64::MAX as f64 (2^64)

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function fmt(x)
  return string.format('%.17g', x)
end

-- core: Limits::millis_to_refill. Returned as text (it may exceed Lua's integer replies).
local function millis_to_refill(rate, deficit)
  if deficit <= EPSILON then
    return '0'
  end
  local ms = math.ceil(deficit / rate)
  if ms >= U64_MAX_F then
    return '18446744073709551615'
  end
  if ms < 1 then
    ms = 1
  end
  return fmt(ms)
end

-- core: BucketState::refilled (or BucketState::full when the bucket does not exist).
local function current(cap, rate, tokens, updated, now)
  if tokens == nil or updated == nil then
    return cap, now
  end
  if tokens ~= tokens or tokens == math.huge or tokens == -math.huge then
    tokens = 0
  end
  local elapsed = now - updated
  if elapsed < 0 then
    elapsed = 0
  end
  tokens = tokens + elapsed * rate
  if tokens < 0 then
    tokens = 0
  elseif tokens > cap then
    tokens = cap
  end
  if now > updated then
    updated = now
  end
  return tokens, updated
end

-- core: bucket::lease on an already current state.
-- Returns next_tokens, granted, remaining, retry_after (text).
local function lease(cap, rate, tokens, min, want)
  if min < 1 then
    min = 1
  end
  if want < min then
    want = min
  end
  local available = math.floor(tokens + EPSILON)
  if available < min then
    return tokens, 0, tokens, millis_to_refill(rate, min - tokens)
  end
  local fill = tokens / cap
  if fill < 0 then
    fill = 0
  elseif fill > 1 then
    fill = 1
  end
  local scaled = math.floor(available * fill)
  local granted = math.min(math.max(scaled, min), want, available)
  local next_tokens = tokens - granted
  if next_tokens < 0 then
    next_tokens = 0
  end
  return next_tokens, granted, next_tokens, '0'
end

local function write_bucket(key, tokens, updated, ttl)
  redis.call('HSET', key, 't', fmt(tokens), 'u', fmt(updated))
  if ttl > 0 then
    redis.call('PEXPIRE', key, ttl)
  else
    redis.call('PERSIST', key)
  end
end

-- tollgate_v1_lease: take a lease from each of N buckets, all-or-nothing, once per lease id.
--   KEYS  2 per item i: KEYS[2i-1] = bucket key, KEYS[2i] = lease record key (one slot).
--   ARGV  [1] = lease record TTL in ms (> 0);
--         then 5 per item i, from ARGV[2 + 5(i-1)]: capacity, refill per ms (%.17g),
--         min, want, bucket TTL in ms (0 = no expiry).
--   An item whose record exists is a replay: it answers from the record and takes nothing.
--   The other items are decided in order (a later item sees the earlier ones' takings); if
--   any of them gets nothing, none of them takes anything (their buckets are only refilled).
--   Returns { now_ms, then 4 per item: granted (integer), remaining (text),
--             retry_after_ms (text), replayed (0|1) }.
local function lease_fn(keys, args)
  local n = #keys / 2
  if n < 1 or n ~= math.floor(n) or #args ~= 1 + 5 * n then
    return redis.error_reply('ERR tollgate_v1_lease: bad KEYS/ARGV count')
  end
  local record_ttl = tonumber(args[1])
  local now = now_ms()

  local results = {}
  local fresh = {}
  for i = 1, n do
    local rec = redis.call('HMGET', keys[2 * i], 'g', 'rem', 'ra')
    if rec[1] then
      results[i] = { tonumber(rec[1]), rec[2], rec[3], 1 }
    else
      fresh[#fresh + 1] = i
    end
  end

  -- Current state of every bucket the fresh items touch, in first-use order.
  local state = {}
  local order = {}
  local decided = {}
  for _, i in ipairs(fresh) do
    local b = 2 + 5 * (i - 1)
    local cap, rate = tonumber(args[b]), tonumber(args[b + 1])
    local key = keys[2 * i - 1]
    local s = state[key]
    if s == nil then
      local h = redis.call('HMGET', key, 't', 'u')
      local tokens, updated = current(cap, rate, tonumber(h[1]), tonumber(h[2]), now)
      s = { start = tokens, tokens = tokens, updated = updated, ttl = tonumber(args[b + 4]) }
      state[key] = s
      order[#order + 1] = key
    end
    local tokens = current(cap, rate, s.tokens, s.updated, now)
    local next_tokens, granted, remaining, retry =
      lease(cap, rate, tokens, tonumber(args[b + 2]), tonumber(args[b + 3]))
    s.tokens = next_tokens
    decided[i] = { granted, remaining, retry, key }
  end

  local all = true
  for _, i in ipairs(fresh) do
    if decided[i][1] == 0 then
      all = false
    end
  end

  for _, key in ipairs(order) do
    local s = state[key]
    if all then
      write_bucket(key, s.tokens, s.updated, s.ttl)
    else
      write_bucket(key, s.start, s.updated, s.ttl)
    end
  end

  for _, i in ipairs(fresh) do
    local d = decided[i]
    local granted, remaining = d[1], d[2]
    if not all then
      granted, remaining = 0, state[d[4]].start
    end
    local rem = fmt(remaining)
    redis.call('HSET', keys[2 * i], 'g', granted, 'r', 0, 'rem', rem, 'ra', d[3], 'b', d[4])
    redis.call('PEXPIRE', keys[2 * i], record_ttl)
    results[i] = { granted, rem, d[3], 0 }
  end

  local reply = { now }
  for i = 1, n do
    local r = results[i]
    reply[#reply + 1] = r[1]
    reply[#reply + 1] = r[2]
    reply[#reply + 1] = r[3]
    reply[#reply + 1] = r[4]
  end
  return reply
end

-- tollgate_v1_return: give back unused tokens of one lease, at most once per token.
--   KEYS  [1] = bucket key, [2] = lease record key (one slot).
--   ARGV  [1] = capacity, [2] = refill per ms (%.17g), [3] = unused (integer >= 0),
--         [4] = bucket TTL in ms (0 = no expiry).
--   Gives back min(unused, granted - returned so far), never above capacity; an unknown or
--   expired lease id, or one drawn from another bucket, gives back nothing.
--   Returns { now_ms, returned (integer) }.
local function return_fn(keys, args)
  if #keys ~= 2 or #args ~= 4 then
    return redis.error_reply('ERR tollgate_v1_return: bad KEYS/ARGV count')
  end
  local now = now_ms()
  local rec = redis.call('HMGET', keys[2], 'g', 'r', 'b')
  local granted, returned = tonumber(rec[1]), tonumber(rec[2])
  if granted == nil or returned == nil or rec[3] ~= keys[1] then
    return { now, 0 }
  end
  local amount = math.min(tonumber(args[3]), granted - returned)
  if amount <= 0 then
    return { now, 0 }
  end
  local cap, rate = tonumber(args[1]), tonumber(args[2])
  local h = redis.call('HMGET', keys[1], 't', 'u')
  local tokens, updated = current(cap, rate, tonumber(h[1]), tonumber(h[2]), now)
  tokens = math.min(tokens + amount, cap)
  write_bucket(keys[1], tokens, updated, tonumber(args[4]))
  redis.call('HSET', keys[2], 'r', returned + amount)
  return { now, amount }
end

-- tollgate_v1_ping: KEYS none, ARGV none. Returns the library name; proves it is loaded.
local function ping_fn()
  return 'tollgate_v1'
end

redis.register_function('tollgate_v1_lease', lease_fn)
redis.register_function('tollgate_v1_return', return_fn)
redis.register_function {
  function_name = 'tollgate_v1_ping',
  callback = ping_fn,
  flags = { 'no-writes' },
}
