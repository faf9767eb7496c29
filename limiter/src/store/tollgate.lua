#!lua name=tollgate_v2
--
-- tollgate's atomic bucket transitions, as one Redis Function library (Redis >= 7.0).
--
-- The arithmetic mirrors tollgate-core's `assign.rs` (`current`, `allot`, `give_back`,
-- `Allotment::taken`) and `bucket.rs` (`millis_to_refill`, EPSILON) line by line, and the
-- limiter's `store::bucket_ttl_ms` for expiry; the in-memory store runs the Rust originals,
-- and a property test replays random operation sequences on both and demands identical
-- answers. Change one side, change the other.
--
-- State, all keys named by tollgate-core's `key.rs` (one hash tag per call, so one slot):
--   bucket        hash { t = tokens (%.17g; below zero while assignments run ahead of the
--                        refill), u = updated_ms,
--                        h:<holder> = "share|ends|demand" per holding (share and demand per
--                        ms, %.17g; ends in ms, exclusive) }
--                 at most 2 + MAX_HOLDERS (64) fields, read with one HGETALL; holdings that
--                 ended are deleted when read.
--   lease record  hash { g = taken (what returns may give back at most: the grant plus the
--                        whole tokens of the assignment), n = granted, r = returned so far,
--                        rem = remaining at grant (%.17g), ra = retry_after_ms (%.17g),
--                        s = share per ms (%.17g), p = period ms, b = bucket key it was
--                        drawn from }
-- Time is this server's `TIME`; a clock that moved backwards refills nothing.
-- Work per call is bounded by the number of keys passed and MAX_HOLDERS per bucket (no
-- scans, no unbounded structures).
-- The library name carries the contract version: a changed contract is a new library, so
-- the functions of both versions can be loaded in one Redis side by side. v2 changed the
-- bucket itself: its content may be negative (debt of running assignments), which
-- `tollgate_v1` clamps to zero, creating tokens out of debt; so a v1 limiter must not run
-- against buckets a v2 limiter has put in debt (replace every limiter of a store). A v2
-- limiter reads v1 lease records (no `n`: `g` is the grant) and v1 buckets (no holdings) as
-- they are.

local EPSILON = 1e-9
local U64_MAX_F = 18446744073709551616.0 -- u64::MAX as f64 (2^64)
-- core assign::MAX_HOLDERS
local MAX_HOLDERS = 64
-- limiter store::BUCKET_TTL_MARGIN_MS and store::MAX_BUCKET_TTL_MS
local BUCKET_TTL_MARGIN_MS = 1000
local MAX_BUCKET_TTL_MS = 315360000000

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function fmt(x)
  return string.format('%.17g', x)
end

-- core: Limits::millis_to_refill, as a number; U64_MAX_F stands for u64::MAX.
local function millis_to_refill(rate, deficit)
  if deficit <= EPSILON then
    return 0
  end
  local ms = math.ceil(deficit / rate)
  if ms >= U64_MAX_F then
    return U64_MAX_F
  end
  if ms < 1 then
    ms = 1
  end
  return ms
end

-- A millisecond count as reply text (it may exceed Lua's integer replies).
local function millis_text(ms)
  if ms >= U64_MAX_F then
    return '18446744073709551615'
  end
  return fmt(ms)
end

-- core: assign::current (a missing bucket is full; never clamped at zero).
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
  if tokens > cap then
    tokens = cap
  end
  if now > updated then
    updated = now
  end
  return tokens, updated
end

-- Byte order of two holder ids, like Rust's `str::cmp` (Lua's `<` on strings follows the
-- server's locale).
local function holder_less(a, b)
  local n = math.min(#a, #b)
  for i = 1, n do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then
      return x < y
    end
  end
  return #a < #b
end

-- core: assign::allot on bucket `s` = { tokens, updated, holdings } (holdings mutated in
-- place like the Rust `Vec`: ended ones dropped, the rest sorted by holder id, the asker's
-- moved to the end with its new terms, marked `dirty` to be written).
-- Returns granted, retry_after (number), share, period_ms.
local function allot(cap, rate, s, now, min, want, holder, demand, period, lease_ttl)
  s.tokens, s.updated = current(cap, rate, s.tokens, s.updated, now)
  local live = {}
  for _, h in ipairs(s.holdings) do
    if h.ends > now then
      live[#live + 1] = h
    end
  end
  s.holdings = live
  -- One order for every store (sums of floats depend on it): by holder id.
  table.sort(s.holdings, function(a, b)
    return holder_less(a.holder, b.holder)
  end)

  -- The asker's running assignment ends now: its undripped rest goes back to the bucket.
  local had_holding = false
  if holder ~= nil then
    for pos, h in ipairs(s.holdings) do
      if h.holder == holder then
        local own = table.remove(s.holdings, pos)
        had_holding = true
        if own.share > 0 then
          local rest = own.share * (own.ends - now)
          s.tokens = math.min(s.tokens + rest, cap)
        end
        break
      end
    end
  end

  if min < 1 then
    min = 1
  end
  if want < min then
    want = min
  end
  local tokens = s.tokens
  local available = math.floor(tokens + EPSILON)
  local granted = 0
  local retry = 0
  if available < min then
    retry = millis_to_refill(rate, min - tokens)
  else
    local fill = tokens / cap
    if fill < 0 then
      fill = 0
    elseif fill > 1 then
      fill = 1
    end
    local scaled = math.floor(available * fill)
    granted = math.min(math.max(scaled, min), want, available)
    s.tokens = tokens - granted
    if s.tokens < 0 then
      s.tokens = 0
    end
  end

  if holder == nil then
    return granted, retry, 0, 0
  end
  local room = had_holding or #s.holdings < MAX_HOLDERS
  if available >= want or not room then
    -- The bucket holds what the demand asks for: below the limit, a lease (sized by the
    -- fill ratio) is the answer (also when there is no room to assign). Remember the
    -- holder while its tokens may still come back, so others' denials know budget is
    -- parked here.
    if room and granted > 0 then
      s.holdings[#s.holdings + 1] =
        { holder = holder, share = 0, ends = now + lease_ttl, demand = demand, dirty = true }
    end
    return granted, retry, 0, 0
  end

  -- An assignment. The bucket cannot give what the demand asks, so its whole content goes
  -- out now (fill scaling keeps leases small below the limit; over it, what stayed in the
  -- bucket while shares run would go unused)...
  if available >= min then
    granted = available
    s.tokens = tokens - granted
    if s.tokens < 0 then
      s.tokens = 0
    end
  end
  -- ...and a share of the rate by demand, within what other holders leave free.
  local others_share = 0
  local total_demand = demand
  local first_end = nil
  for _, h in ipairs(s.holdings) do
    others_share = others_share + h.share
    total_demand = total_demand + h.demand
    if first_end == nil or h.ends < first_end then
      first_end = h.ends
    end
  end
  local target
  if total_demand <= rate then
    target = demand
  else
    target = rate * demand / total_demand
  end
  local share = math.min(target, rate - others_share)
  if share ~= share or share <= rate * 1e-6 then
    share = 0
  end
  local period_ms = 0
  if share > 0 then
    period_ms = period
  end
  s.tokens = s.tokens - share * period_ms
  s.holdings[#s.holdings + 1] =
    { holder = holder, share = share, ends = now + period, demand = demand, dirty = true }
  if granted == 0 and share == 0 and first_end ~= nil then
    -- Budget is held elsewhere: ask again when the first other holding ends, if that is
    -- sooner than the refill.
    retry = math.min(retry, math.max(first_end - now, 1))
  end
  if granted > 0 or share > 0 then
    retry = 0
  end
  return granted, retry, share, period_ms
end

-- core: Allotment::taken.
local function taken(granted, share, period_ms)
  local drip = math.floor(share * period_ms + EPSILON)
  if drip ~= drip or drip == math.huge or drip <= 0 then
    drip = 0
  end
  return granted + drip
end

-- limiter: store::bucket_ttl_ms (0 = no expiry).
local function bucket_ttl(cap, rate, tokens, holdings, now)
  local need = math.max(millis_to_refill(rate, cap), millis_to_refill(rate, cap - tokens))
  for _, h in ipairs(holdings) do
    if h.ends > now then
      need = math.max(need, h.ends - now)
    end
  end
  local ttl = need + math.max(BUCKET_TTL_MARGIN_MS, math.floor(need / 10))
  if ttl > MAX_BUCKET_TTL_MS then
    return 0
  end
  return ttl
end

-- One bucket hash: tokens, updated (nil when absent), live holdings (unsorted). Holdings that
-- ended are deleted from the hash.
local function read_bucket(key, now)
  local flat = redis.call('HGETALL', key)
  local tokens, updated
  local holdings = {}
  local ended = {}
  for j = 1, #flat, 2 do
    local field, value = flat[j], flat[j + 1]
    if field == 't' then
      tokens = tonumber(value)
    elseif field == 'u' then
      updated = tonumber(value)
    elseif string.sub(field, 1, 2) == 'h:' then
      local share, ends, demand = string.match(value, '^([^|]+)|([^|]+)|([^|]+)$')
      share, ends, demand = tonumber(share), tonumber(ends), tonumber(demand)
      if share ~= nil and ends ~= nil and demand ~= nil and ends > now then
        holdings[#holdings + 1] =
          { holder = string.sub(field, 3), share = share, ends = ends, demand = demand }
      else
        ended[#ended + 1] = field
      end
    end
  end
  if #ended > 0 then
    redis.call('HDEL', key, unpack(ended))
  end
  return tokens, updated, holdings
end

local function expire(key, ttl)
  if ttl > 0 then
    redis.call('PEXPIRE', key, ttl)
  else
    redis.call('PERSIST', key)
  end
end

-- tollgate_v2_lease: decide N lease items, all-or-nothing, once per lease id.
--   KEYS  2 per item i: KEYS[2i-1] = bucket key, KEYS[2i] = lease record key (one slot).
--   ARGV  [1] = lease record TTL in ms (> 0), [2] = assignment period in ms (> 0),
--         [3] = lease TTL in ms (> 0: how long a lease-only holder stays known);
--         then 6 per item i, from ARGV[4 + 6(i-1)]: capacity, refill per ms (%.17g),
--         min, want, holder ('' = none: leases only), demand per ms (%.17g, >= 0).
--   An item whose record exists is a replay: it answers from the record and takes nothing.
--   The other items are decided in order by `allot` (a later item sees the earlier ones'
--   takings and holdings). All or nothing: if some of them got something (a grant or a
--   share) and others nothing, none of them takes anything and no holding changes (their
--   buckets are only refilled); if all got nothing, what they leave is kept (a waiting
--   holder's demand, the rest of a running assignment a renewal gave back), as a single
--   item's is.
--   Returns { now_ms, then 6 per item: granted (integer), remaining (text),
--             retry_after_ms (text), replayed (0|1), share_per_ms (text),
--             period_ms (integer) }.
local function lease_fn(keys, args)
  local n = #keys / 2
  if n < 1 or n ~= math.floor(n) or #args ~= 3 + 6 * n then
    return redis.error_reply('ERR tollgate_v2_lease: bad KEYS/ARGV count')
  end
  local record_ttl = tonumber(args[1])
  local period = tonumber(args[2])
  local lease_ttl = tonumber(args[3])
  local now = now_ms()

  local results = {}
  local fresh = {}
  for i = 1, n do
    local rec = redis.call('HMGET', keys[2 * i], 'g', 'n', 'rem', 'ra', 's', 'p')
    if rec[1] then
      local granted = tonumber(rec[2] or rec[1])
      results[i] = { granted, rec[3], rec[4], 1, rec[5] or '0', tonumber(rec[6] or '0') }
    else
      fresh[#fresh + 1] = i
    end
  end

  -- Every bucket the fresh items touch, in first-use order: its state and holdings before
  -- any item (`start_*`), and as the items decided so far leave it.
  local state = {}
  local order = {}
  local decided = {}
  for _, i in ipairs(fresh) do
    local b = 4 + 6 * (i - 1)
    local cap, rate = tonumber(args[b]), tonumber(args[b + 1])
    local holder = args[b + 4]
    if holder == '' then
      holder = nil
    end
    local key = keys[2 * i - 1]
    local s = state[key]
    if s == nil then
      local tokens, updated, holdings = read_bucket(key, now)
      tokens, updated = current(cap, rate, tokens, updated, now)
      local copy = {}
      for j, h in ipairs(holdings) do
        copy[j] = h
      end
      s = { cap = cap, rate = rate, start_tokens = tokens, start_holdings = holdings,
            tokens = tokens, updated = updated, holdings = copy }
      state[key] = s
      order[#order + 1] = key
    end
    local granted, retry, share, period_ms = allot(cap, rate, s, now, tonumber(args[b + 2]),
      tonumber(args[b + 3]), holder, tonumber(args[b + 5]), period, lease_ttl)
    decided[i] = { granted, s.tokens, retry, key, share, period_ms }
  end

  -- All or nothing: mixed outcomes are undone (see `lease_fn` above); items that all got
  -- nothing keep what they leave.
  local given = 0
  for _, i in ipairs(fresh) do
    if decided[i][1] > 0 or decided[i][5] > 0 then
      given = given + 1
    end
  end
  local apply = given == #fresh or given == 0

  for _, key in ipairs(order) do
    local s = state[key]
    if apply then
      local kept = {}
      for _, h in ipairs(s.holdings) do
        kept[h.holder] = true
      end
      local gone = {}
      for _, h in ipairs(s.start_holdings) do
        if not kept[h.holder] then
          gone[#gone + 1] = 'h:' .. h.holder
        end
      end
      if #gone > 0 then
        redis.call('HDEL', key, unpack(gone))
      end
      local fields = { 't', fmt(s.tokens), 'u', fmt(s.updated) }
      for _, h in ipairs(s.holdings) do
        if h.dirty then
          fields[#fields + 1] = 'h:' .. h.holder
          fields[#fields + 1] = fmt(h.share) .. '|' .. fmt(h.ends) .. '|' .. fmt(h.demand)
        end
      end
      redis.call('HSET', key, unpack(fields))
      expire(key, bucket_ttl(s.cap, s.rate, s.tokens, s.holdings, now))
    else
      redis.call('HSET', key, 't', fmt(s.start_tokens), 'u', fmt(s.updated))
      expire(key, bucket_ttl(s.cap, s.rate, s.start_tokens, s.start_holdings, now))
    end
  end

  for _, i in ipairs(fresh) do
    local d = decided[i]
    local granted, remaining, share, period_ms = d[1], d[2], d[5], d[6]
    if not apply then
      granted, remaining, share, period_ms = 0, state[d[4]].start_tokens, 0, 0
    end
    local rem, ra, sh = fmt(remaining), millis_text(d[3]), fmt(share)
    redis.call('HSET', keys[2 * i], 'g', fmt(taken(granted, share, period_ms)),
      'n', fmt(granted), 'r', 0, 'rem', rem, 'ra', ra, 's', sh, 'p', fmt(period_ms), 'b', d[4])
    redis.call('PEXPIRE', keys[2 * i], record_ttl)
    results[i] = { granted, rem, ra, 0, sh, period_ms }
  end

  local reply = { now }
  for i = 1, n do
    local r = results[i]
    for j = 1, 6 do
      reply[#reply + 1] = r[j]
    end
  end
  return reply
end

-- tollgate_v2_return: give back unused tokens of one lease, at most once per token.
--   KEYS  [1] = bucket key, [2] = lease record key (one slot).
--   ARGV  [1] = capacity, [2] = refill per ms (%.17g), [3] = unused (integer >= 0).
--   Gives back min(unused, taken - returned so far), added to the content even below zero
--   (core: assign::give_back), never above capacity; an unknown or expired lease id, or one
--   drawn from another bucket, gives back nothing.
--   Returns { now_ms, returned (integer) }.
local function return_fn(keys, args)
  if #keys ~= 2 or #args ~= 3 then
    return redis.error_reply('ERR tollgate_v2_return: bad KEYS/ARGV count')
  end
  local now = now_ms()
  local rec = redis.call('HMGET', keys[2], 'g', 'r', 'b')
  local took, returned = tonumber(rec[1]), tonumber(rec[2])
  if took == nil or returned == nil or rec[3] ~= keys[1] then
    return { now, 0 }
  end
  local amount = math.min(tonumber(args[3]), took - returned)
  if amount <= 0 then
    return { now, 0 }
  end
  local cap, rate = tonumber(args[1]), tonumber(args[2])
  local tokens, updated, holdings = read_bucket(keys[1], now)
  tokens, updated = current(cap, rate, tokens, updated, now)
  tokens = math.min(tokens + amount, cap)
  redis.call('HSET', keys[1], 't', fmt(tokens), 'u', fmt(updated))
  expire(keys[1], bucket_ttl(cap, rate, tokens, holdings, now))
  redis.call('HSET', keys[2], 'r', fmt(returned + amount))
  return { now, amount }
end

-- tollgate_v2_ping: KEYS none, ARGV none. Returns the library name; proves it is loaded.
local function ping_fn()
  return 'tollgate_v2'
end

redis.register_function('tollgate_v2_lease', lease_fn)
redis.register_function('tollgate_v2_return', return_fn)
redis.register_function {
  function_name = 'tollgate_v2_ping',
  callback = ping_fn,
  flags = { 'no-writes' },
}
