#!lua name=tollgate_v4
--
-- tollgate's atomic bucket and window transitions, as one Redis Function library
-- (Redis >= 7.0).
--
-- The arithmetic mirrors tollgate-core's `assign.rs` (`current`, `allot`, `give_back`,
-- `Allotment::taken`), `bucket.rs` (`millis_to_refill`, EPSILON) and `window.rs`
-- (`Counters::at`, `counted`, `wait_ms`, `fraction_ms`, `lease`, `Log::trim`, `Log::lease`)
-- line by line, and the limiter's `store::bucket_ttl_ms` and `store::window_ttl_ms` for
-- expiry; the in-memory store runs the Rust originals, and property tests replay random
-- operation sequences on both and demand identical answers. Change one side, change the
-- other.
--
-- State, all keys named by the limiter's `store/keys.rs` (one hash tag per call, so one
-- slot):
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
--                 a window's lease: g = 0 (nothing of it ever comes back), n = granted,
--                 b = the window's state key, e = when the lease ends (ms, this server's
--                 clock); s = 0, p = 0.
--   fixed window  <state> = string: the newest window index seen (a calendar window's: its
--                 week or month number on its grid, see `grid_index`);
--                 <state>:w<index> = string: units counted in that window (INCRBY);
--                 both expire WINDOW_TTL_MARGIN_MS after that window's end.
--   sliding       <state> = hash { w = newest window index seen, c = its count,
--   window          p = the count of the window before it }; expires the margin after the
--                 end of the window after w (two windows).
--   sliding log   <state> = sorted set of the units counted in the last window: score =
--                 the time (ms) they count from (a leased unit: when its lease expires, the
--                 end of the window-grid slot it was granted in, so it counts until a window
--                 after the instance may last spend it), member = "<time>:l<n>", n = 1, 2, ...
--                 among the units of that time (unique: units of one time leave together);
--                 <state>:seen = string: the newest time the log has seen (it counts on
--                 that clock: a clock that went back neither drops units early nor logs one
--                 before a unit it holds); both expire the margin after the newest unit
--                 leaves the log; an empty log is deleted.
--   The `:w<index>` and `:seen` keys are derived from the state key passed in KEYS (the
--   window index comes from this server's clock), so they share its hash tag and slot.
-- Time is this server's `TIME`; a clock that moved backwards refills nothing and creates no
-- window capacity (it counts in the newest window, on the newest time, seen).
-- Work per call is bounded by the number of keys passed, MAX_HOLDERS per bucket and a
-- window's limit (at most 256 units for a sliding log): no scans.
-- The library name carries the contract version: a changed contract is a new library, so
-- the functions of both versions can be loaded in one Redis side by side. v4 added calendar
-- windows (a fixed window's window argument `<n>w` or `<n>mo`, which a v3 library cannot
-- read); its state and lease records are v3's, and v3 and v4 read each other's as they are
-- (a calendar window's state key is its own: `store::keys::state_key`). v3 added the
-- windows (a per-item algorithm, the window's expiry in the reply) and reads v2 buckets and
-- lease records as they are; a v2 limiter reads v3 buckets and records as they are too
-- (a window's lease record answers its grant and returns nothing). v2 changed the
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
-- limiter store::WINDOW_TTL_MARGIN_MS
local WINDOW_TTL_MARGIN_MS = 1000
-- limiter store::keys::FIXED_COUNT_SUFFIX and store::keys::LOG_SEEN_SUFFIX
local FIXED_COUNT_SUFFIX = ':w'
local LOG_SEEN_SUFFIX = ':seen'

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
  if tokens + EPSILON >= cap then
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

-- Windows (core: window.rs). Window indexes, ends and times are integers below 2^53, so
-- these doubles hold them exactly, and `math.floor(a / b)` is the integer division.
-- A window's grid `g` is { ms = window length } or a calendar period (core: calendar.rs):
-- { weeks = n } (n weeks from Monday 00:00 UTC, on the grid from Monday 1969-12-29) or
-- { months = n } (n months from the first of a month 00:00 UTC, n dividing 12, from January:
-- a year is 12 months), with the real lengths of the months.

local DAY_MS = 86400000

-- core: calendar::days_from_civil (days since 1970-01-01 of a date from the epoch on).
local function days_from_civil(year, month, day)
  local y = year
  if month <= 2 then
    y = y - 1
  end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = month + 9
  if month > 2 then
    mp = month - 3
  end
  local doy = math.floor((153 * mp + 2) / 5) + day - 1
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end

-- core: calendar::civil_from_days (the year and month of a day since 1970-01-01).
local function civil_from_days(days)
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
    - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local month = mp - 9
  if mp < 10 then
    month = mp + 3
  end
  local year = yoe + era * 400
  if month <= 2 then
    year = year + 1
  end
  return year, month
end

-- The grid of an item's window argument: milliseconds (> 0), `<n>w` (1 <= n <= 52) or
-- `<n>mo` (n dividing 12); nil if it is none of them.
local function parse_grid(text)
  local n, unit = string.match(text, '^(%d+)(%a+)$')
  n = tonumber(n)
  if unit == 'w' and n ~= nil and n >= 1 and n <= 52 then
    return { weeks = n }
  end
  if unit == 'mo' and n ~= nil and n >= 1 and 12 % n == 0 then
    return { months = n }
  end
  local ms = tonumber(text)
  if unit == nil and ms ~= nil and ms >= 1 and ms == math.floor(ms) then
    return { ms = ms }
  end
  return nil
end

-- core: Window::index (Calendar::index)
local function grid_index(g, now)
  if g.ms then
    return math.floor(now / g.ms)
  end
  local days = math.floor(now / DAY_MS)
  if g.weeks then
    return math.floor((days + 3) / (7 * g.weeks))
  end
  local year, month = civil_from_days(days)
  return math.floor(((year - 1970) * 12 + month - 1) / g.months)
end

-- core: Window::start_ms (Calendar::start_ms; the week grid's first window reads as 0)
local function grid_start(g, index)
  if g.ms then
    return index * g.ms
  end
  if g.weeks then
    local days = index * 7 * g.weeks - 3
    if days < 0 then
      days = 0
    end
    return days * DAY_MS
  end
  local months = index * g.months
  return days_from_civil(1970 + math.floor(months / 12), months % 12 + 1, 1) * DAY_MS
end

-- core: Window::end_ms (where the next window starts)
local function grid_end(g, index)
  return grid_start(g, index + 1)
end

-- core: Counters::at (a clock that went back counts in the newest window seen).
local function counters_at(g, c, now)
  local index = grid_index(g, now)
  if index <= c.window then
    return { window = c.window, count = c.count, previous = c.previous }
  end
  local previous = 0
  if index == c.window + 1 then
    previous = c.count
  end
  return { window = index, count = 0, previous = previous }
end

-- core: window::counted
local function counted(kind, g, c, now)
  if kind == 'fixed_window' then
    return c.count
  end
  local wms = g.ms
  local start = grid_start(g, c.window)
  local elapsed = now - start
  if elapsed < 0 then
    elapsed = 0
  end
  if elapsed > wms then
    elapsed = wms
  end
  local weight = 1.0 - elapsed / wms
  return c.count + c.previous * weight
end

-- core: window::fraction_ms
local function fraction_ms(x, wm)
  if x < 0 then
    x = 0
  elseif x > 1 then
    x = 1
  end
  local ms = math.ceil(x * wm - 1e-6)
  if ms < 0 then
    ms = 0
  end
  return ms
end

-- core: window::wait_ms (milliseconds from `now` until `cost` more units fit, at least 1).
local function counter_wait(kind, limit, g, c, now, cost)
  local wms = g.ms
  local window_start = grid_start(g, c.window)
  local next_start = grid_end(g, c.window)
  local at
  if kind == 'fixed_window' then
    at = next_start
  else
    local room = limit - cost
    if c.count + cost <= limit and c.previous > 0 then
      -- This window: the previous one's weight must fall to `room - count`.
      local x = 1.0 - (room - c.count) / c.previous
      at = window_start + fraction_ms(x, wms)
    elseif c.count == 0 then
      at = next_start
    else
      -- The next window, where this window's count is the weighted one.
      local x = 1.0 - room / c.count
      at = next_start + fraction_ms(x, wms)
    end
  end
  local ms = at - now
  if ms < 1 then
    ms = 1
  end
  return ms
end

-- core: the `room` of window::lease.
local function counter_room(kind, limit, g, c, now)
  local room = math.floor(limit - counted(kind, g, c, now) + 1e-9)
  if room < 0 then
    room = 0
  end
  return room
end

-- core: Log::wait_ms on log `w` (its stored units, then the ones this call added at `ends`).
local function log_wait(w, cost)
  local keep = w.limit - cost
  if keep < 0 then
    keep = 0
  end
  local must_leave = w.stored + w.added - keep
  if must_leave < 1 then
    return 1
  end
  local t = w.ends
  if must_leave <= w.stored then
    -- The must_leave-th oldest unit (0-based index must_leave - 1).
    local r = redis.call('ZRANGE', w.key, must_leave - 1, must_leave - 1, 'WITHSCORES')
    t = tonumber(r[2])
  end
  local ms = t + w.wms - w.seen
  if ms < 1 then
    ms = 1
  end
  return ms
end

-- A window's state, moved to `now`: counters (`start`, and `c` as the call's items leave
-- them) or a log (trimmed here: `stored` units, `seen`, and `added` units to record).
local function read_window(kind, key, limit, g, now)
  local w = { kind = kind, key = key, limit = limit, grid = g, wms = g.ms }
  local wms = g.ms
  if kind == 'sliding_log' then
    -- core: Log::trim (the log's clock never goes back; a unit counts for one window from
    -- its time).
    local seen = tonumber(redis.call('GET', key .. LOG_SEEN_SUFFIX)) or 0
    if now > seen then
      seen = now
    end
    redis.call('ZREMRANGEBYSCORE', key, '-inf', fmt(seen - wms))
    w.seen = seen
    -- core: Log::lease_end_ms (a lease granted now ends, and its units are entered, at the
    -- end of the window-grid slot of the log's clock: later than every stored unit).
    w.ends = grid_end(g, grid_index(g, seen))
    w.stored = redis.call('ZCARD', key)
    w.added = 0
    return w
  end
  local c
  if kind == 'fixed_window' then
    local index = tonumber(redis.call('GET', key))
    w.stored_window = index
    if index == nil then
      c = { window = 0, count = 0, previous = 0 }
    else
      local count = redis.call('GET', key .. FIXED_COUNT_SUFFIX .. fmt(index))
      c = { window = index, count = tonumber(count) or 0, previous = 0 }
    end
  else
    local f = redis.call('HMGET', key, 'w', 'c', 'p')
    c = { window = tonumber(f[1]) or 0, count = tonumber(f[2]) or 0,
          previous = tonumber(f[3]) or 0 }
  end
  w.start = counters_at(g, c, now)
  w.c = { window = w.start.window, count = w.start.count, previous = w.start.previous }
  return w
end

-- core: window::lease / Log::lease on window `w` as the call's items left it.
-- Returns granted, remaining, retry_after_ms, expires_ms.
local function window_lease(w, now, min, want)
  if min < 1 then
    min = 1
  end
  if w.kind == 'sliding_log' then
    local room = w.limit - (w.stored + w.added)
    if room < 0 then
      room = 0
    end
    -- `ends` is past `seen` >= `now`: at least 1.
    local expires = w.ends - now
    if expires < 1 then
      expires = 1
    end
    if room < min then
      return 0, room, log_wait(w, min), expires
    end
    local granted = math.min(math.max(want, min), room)
    w.added = w.added + granted
    return granted, room - granted, 0, expires
  end
  local c = w.c
  local room = counter_room(w.kind, w.limit, w.grid, c, now)
  local expires = grid_end(w.grid, c.window) - now
  if expires < 1 then
    expires = 1
  end
  if room < min then
    return 0, room, counter_wait(w.kind, w.limit, w.grid, c, now, min), expires
  end
  local granted = math.min(math.max(want, min), room)
  c.count = c.count + granted
  return granted, room - granted, 0, expires
end

-- Units that fit window `w` before the call took any (a denied group's `remaining`).
local function window_start_room(w, now)
  if w.kind == 'sliding_log' then
    local room = w.limit - w.stored
    if room < 0 then
      room = 0
    end
    return room
  end
  return counter_room(w.kind, w.limit, w.grid, w.start, now)
end

-- limiter: store::window_ttl_ms, as the absolute time (ms, this server's clock) the state
-- expires at: every key of a window expires at the very same millisecond whichever command
-- or call set it (a relative PX would add the time the Function took until it ran).
local function window_expires_at(idle_at, now)
  local ttl = idle_at - now
  if ttl < 0 then
    ttl = 0
  end
  return now + ttl + WINDOW_TTL_MARGIN_MS
end

-- Writes window `w`: with `apply`, as the call's items left it; otherwise as time alone left
-- it (a new window, units that left the log), like a bucket's refill.
local function write_window(w, now, apply)
  local key = w.key
  if w.kind == 'sliding_log' then
    local added = 0
    if apply then
      added = w.added
    end
    if w.stored + added == 0 then
      redis.call('DEL', key, key .. LOG_SEEN_SUFFIX)
      return
    end
    local last = w.ends
    if added > 0 then
      -- Members "<time>:l<n>": every unit at `ends`, which no stored unit is newer than, and
      -- n past the units already at `ends` (they are trimmed all at once, never some of
      -- them, so theirs are 1..count).
      local at = fmt(w.ends)
      local before = redis.call('ZCOUNT', key, at, at)
      local args = {}
      for j = 1, added do
        args[#args + 1] = at
        args[#args + 1] = at .. ':l' .. fmt(before + j)
      end
      redis.call('ZADD', key, unpack(args))
    else
      last = tonumber(redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')[2])
    end
    -- core: Log::idle_at_ms (the newest unit leaves a window after it).
    local at = fmt(window_expires_at(last + w.wms, now))
    redis.call('PEXPIREAT', key, at)
    redis.call('SET', key .. LOG_SEEN_SUFFIX, fmt(w.seen), 'PXAT', at)
    return
  end
  local c = w.start
  if apply then
    c = w.c
  end
  if w.kind == 'fixed_window' then
    -- core: Counters::idle_at_ms (fixed): the end of its window.
    local at = fmt(window_expires_at(grid_end(w.grid, c.window), now))
    if w.stored_window ~= c.window then
      redis.call('SET', key, fmt(c.window), 'PXAT', at)
    end
    local delta = c.count - w.start.count
    if delta > 0 then
      -- The count and its expiry in this one atomic call.
      local count_key = key .. FIXED_COUNT_SUFFIX .. fmt(c.window)
      redis.call('INCRBY', count_key, delta)
      redis.call('PEXPIREAT', count_key, at)
    end
    return
  end
  redis.call('HSET', key, 'w', fmt(c.window), 'c', fmt(c.count), 'p', fmt(c.previous))
  -- core: Counters::idle_at_ms (sliding): the end of the window after its own.
  redis.call('PEXPIREAT', key, fmt(window_expires_at(grid_end(w.grid, c.window + 1), now)))
end

local function expire(key, ttl)
  if ttl > 0 then
    redis.call('PEXPIRE', key, ttl)
  else
    redis.call('PERSIST', key)
  end
end

-- tollgate_v4_lease: decide N lease items, all-or-nothing, once per lease id.
--   KEYS  2 per item i: KEYS[2i-1] = the item's state key (its bucket, or its window's state
--         key: `store::keys::state_key`), KEYS[2i] = lease record key (one slot).
--   ARGV  [1] = lease record TTL in ms (> 0), [2] = assignment period in ms (> 0),
--         [3] = lease TTL in ms (> 0: how long a lease-only holder stays known);
--         then 8 per item i, from ARGV[4 + 8(i-1)]: algorithm ('token_bucket',
--         'fixed_window', 'sliding_window' or 'sliding_log'), capacity (a bucket's, %.17g;
--         a window's limit), refill per ms (a bucket's, %.17g; 0 for a window), min, want,
--         holder ('' = none: leases only; a window ignores it), demand per ms (%.17g, >= 0;
--         a window ignores it), window (a window's: its length in ms, > 0, or for a
--         fixed window a calendar period, `<n>w` (n weeks, 1 to 52, from Monday 00:00 UTC)
--         or `<n>mo` (n months, n dividing 12, from January; a year is `12mo`); 0 for a
--         bucket; anything else is refused as a bad window).
--   An item whose record exists is a replay: it answers from the record and takes nothing.
--   The other items are decided in order, a bucket's by `allot`, a window's by the window
--   lease of its algorithm (a later item sees the earlier ones' takings and holdings). All or
--   nothing: if some of them got something (a grant or a share) and others nothing, none of
--   them takes anything and no holding changes (their buckets are only refilled, their
--   windows only moved to the call's time); if all got nothing, what they leave is kept (a
--   waiting holder's demand, the rest of a running assignment a renewal gave back), as a
--   single item's is.
--   Returns { now_ms, then 7 per item: granted (integer), remaining (text),
--             retry_after_ms (text), replayed (0|1), share_per_ms (text),
--             period_ms (integer), expires_ms (integer: a window's lease, how long from
--             now it may be spent, 0 once it ended: a fixed or sliding window's at the end of
--             its window, a sliding log's at the end of the window-grid slot it was granted
--             in, when its units were entered in the log; -1 for a bucket's) }.
--   The limiter's RateLimitService (Envoy's gRPC rate-limit protocol, `rls.rs`) counts with
--   tollgate_v4_count instead (no lease records), in the same count keys as a 'fixed_window'
--   item of its window's state key.
local function lease_fn(keys, args)
  local n = #keys / 2
  if n < 1 or n ~= math.floor(n) or #args ~= 3 + 8 * n then
    return redis.error_reply('ERR tollgate_v4_lease: bad KEYS/ARGV count')
  end
  local record_ttl = tonumber(args[1])
  local period = tonumber(args[2])
  local lease_ttl = tonumber(args[3])
  local now = now_ms()

  local results = {}
  local fresh = {}
  for i = 1, n do
    local rec = redis.call('HMGET', keys[2 * i], 'g', 'n', 'rem', 'ra', 's', 'p', 'e')
    if rec[1] then
      local granted = tonumber(rec[2] or rec[1])
      local expires = -1
      if rec[7] then
        expires = math.max(tonumber(rec[7]) - now, 0)
      end
      results[i] = { granted, rec[3], rec[4], 1, rec[5] or '0', tonumber(rec[6] or '0'), expires }
    else
      fresh[#fresh + 1] = i
    end
  end

  -- Every bucket and window the fresh items touch, in first-use order: a bucket's state and
  -- holdings before any item (`start_*`) and as the items decided so far leave it; a
  -- window's (see `read_window`).
  local state = {}
  local order = {}
  local windows = {}
  local window_order = {}
  local decided = {}
  for _, i in ipairs(fresh) do
    local b = 4 + 8 * (i - 1)
    local kind = args[b]
    local cap, rate = tonumber(args[b + 1]), tonumber(args[b + 2])
    local key = keys[2 * i - 1]
    if kind == 'token_bucket' then
      local holder = args[b + 5]
      if holder == '' then
        holder = nil
      end
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
      local granted, retry, share, period_ms = allot(cap, rate, s, now, tonumber(args[b + 3]),
        tonumber(args[b + 4]), holder, tonumber(args[b + 6]), period, lease_ttl)
      decided[i] = { granted, s.tokens, retry, key, share, period_ms, -1 }
    elseif kind == 'fixed_window' or kind == 'sliding_window' or kind == 'sliding_log' then
      local w = windows[key]
      if w == nil then
        local grid = parse_grid(args[b + 7])
        if grid == nil or (grid.ms == nil and kind ~= 'fixed_window') then
          return redis.error_reply('ERR tollgate_v4_lease: bad window')
        end
        w = read_window(kind, key, cap, grid, now)
        windows[key] = w
        window_order[#window_order + 1] = key
      end
      local granted, remaining, retry, expires =
        window_lease(w, now, tonumber(args[b + 3]), tonumber(args[b + 4]))
      decided[i] = { granted, remaining, retry, key, 0, 0, expires }
    else
      return redis.error_reply('ERR tollgate_v4_lease: unknown algorithm')
    end
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
  for _, key in ipairs(window_order) do
    write_window(windows[key], now, apply)
  end

  for _, i in ipairs(fresh) do
    local d = decided[i]
    local granted, remaining, share, period_ms, expires = d[1], d[2], d[5], d[6], d[7]
    local w = windows[d[4]]
    if not apply then
      granted, share, period_ms = 0, 0, 0
      if w then
        remaining = window_start_room(w, now)
      else
        remaining = state[d[4]].start_tokens
      end
    end
    local rem, ra, sh = fmt(remaining), millis_text(d[3]), fmt(share)
    if w then
      -- A window's lease: nothing of it comes back (g = 0); it ends with its window.
      redis.call('HSET', keys[2 * i], 'g', 0, 'n', fmt(granted), 'r', 0, 'rem', rem,
        'ra', ra, 's', '0', 'p', '0', 'b', d[4], 'e', fmt(now + expires))
    else
      redis.call('HSET', keys[2 * i], 'g', fmt(taken(granted, share, period_ms)),
        'n', fmt(granted), 'r', 0, 'rem', rem, 'ra', ra, 's', sh, 'p', fmt(period_ms),
        'b', d[4])
    end
    redis.call('PEXPIRE', keys[2 * i], record_ttl)
    results[i] = { granted, rem, ra, 0, sh, period_ms, expires }
  end

  local reply = { now }
  for i = 1, n do
    local r = results[i]
    for j = 1, 7 do
      reply[#reply + 1] = r[j]
    end
  end
  return reply
end

-- tollgate_v4_count: count N hits in fixed windows aligned to the epoch, all or nothing, with
-- no lease record (the limiter's RateLimitService, `rls.rs`: nothing is ever replayed or
-- given back, so it needs none).
--   KEYS  1 per item i: KEYS[i] = the window's state key (`store::keys::rls_window_key`, all
--         in one slot). The count of the window that holds now (this server's `TIME`) is
--         kept under KEYS[i] .. ':w' .. index, index = floor(now / window_ms): the count key
--         of a 'fixed_window' lease item of the same state key (so a limiter still leasing
--         during an upgrade counts in the same keys).
--   ARGV  3 per item i, from ARGV[3(i-1) + 1]: limit (>= 1), window length in ms (> 0),
--         cost (>= 1).
--   If every item's count plus its cost (plus the costs of the call's earlier items of the
--   same count key) is within its limit, every count is raised by its cost (INCRBY) and a
--   count the call created expires WINDOW_TTL_MARGIN_MS after its window's end
--   (PEXPIREAT, this server's clock); otherwise nothing is written at all.
--   Returns { now_ms, admitted (1|0), then per item: remaining (integer >= 0: the limit less
--             the count after the item, or for a refused call, less the count before it) }.
--   Commands: TIME, one MGET, and when admitted one INCRBY per item (plus a PEXPIREAT once
--   per window and key).
local function count_fn(keys, args)
  local n = #keys
  if n < 1 or #args ~= 3 * n then
    return redis.error_reply('ERR tollgate_v4_count: bad KEYS/ARGV count')
  end
  local now = now_ms()
  local counts = {}
  local limits, windows, costs = {}, {}, {}
  for i = 1, n do
    local limit, wms, cost = tonumber(args[3 * i - 2]), tonumber(args[3 * i - 1]),
      tonumber(args[3 * i])
    if limit == nil or wms == nil or cost == nil or wms < 1 or wms ~= math.floor(wms)
        or cost < 1 or limit < 0 then
      return redis.error_reply('ERR tollgate_v4_count: bad item')
    end
    limits[i], windows[i], costs[i] = limit, wms, cost
    counts[i] = keys[i] .. FIXED_COUNT_SUFFIX .. fmt(math.floor(now / wms))
  end
  local stored = redis.call('MGET', unpack(counts))
  -- The count of each count key before the call, and after the items decided so far.
  local before, after = {}, {}
  local admitted = true
  local remaining = {}
  for i = 1, n do
    local key = counts[i]
    if before[key] == nil then
      before[key] = tonumber(stored[i]) or 0
      after[key] = before[key]
    end
    after[key] = after[key] + costs[i]
    if after[key] > limits[i] then
      admitted = false
    end
    remaining[i] = limits[i] - after[key]
  end
  if admitted then
    for i = 1, n do
      local key = counts[i]
      if redis.call('INCRBY', key, costs[i]) == costs[i] then
        -- A new count: it lives until its window's end plus the margin
        -- (`store::window_ttl_ms` of the window's end).
        local ends = (math.floor(now / windows[i]) + 1) * windows[i]
        redis.call('PEXPIREAT', key, fmt(window_expires_at(ends, now)))
      end
    end
  else
    for i = 1, n do
      remaining[i] = math.max(limits[i] - before[counts[i]], 0)
    end
  end
  local reply = { now, 0 }
  if admitted then
    reply[2] = 1
  end
  for i = 1, n do
    reply[2 + i] = remaining[i]
  end
  return reply
end

-- tollgate_v4_return: give back unused tokens of one lease, at most once per token.
--   KEYS  [1] = bucket key, [2] = lease record key (one slot).
--   ARGV  [1] = the policy's algorithm (as in tollgate_v4_lease), [2] = capacity,
--         [3] = refill per ms (%.17g), [4] = unused (integer >= 0).
--   Gives back min(unused, taken - returned so far), added to the content even below zero
--   (core: assign::give_back), never above capacity; an unknown or expired lease id, one
--   drawn from another bucket or from a window (taken 0), or a return to a windowed policy
--   gives back nothing (a window's leased units count as used in their window) and writes
--   nothing.
--   Returns { now_ms, returned (integer) }.
local function return_fn(keys, args)
  if #keys ~= 2 or #args ~= 4 then
    return redis.error_reply('ERR tollgate_v4_return: bad KEYS/ARGV count')
  end
  local now = now_ms()
  if args[1] ~= 'token_bucket' then
    return { now, 0 }
  end
  local rec = redis.call('HMGET', keys[2], 'g', 'r', 'b')
  local took, returned = tonumber(rec[1]), tonumber(rec[2])
  if took == nil or returned == nil or rec[3] ~= keys[1] then
    return { now, 0 }
  end
  local amount = math.min(tonumber(args[4]), took - returned)
  if amount <= 0 then
    return { now, 0 }
  end
  local cap, rate = tonumber(args[2]), tonumber(args[3])
  local tokens, updated, holdings = read_bucket(keys[1], now)
  tokens, updated = current(cap, rate, tokens, updated, now)
  tokens = math.min(tokens + amount, cap)
  redis.call('HSET', keys[1], 't', fmt(tokens), 'u', fmt(updated))
  expire(keys[1], bucket_ttl(cap, rate, tokens, holdings, now))
  redis.call('HSET', keys[2], 'r', fmt(returned + amount))
  return { now, amount }
end

-- tollgate_v4_ping: KEYS none, ARGV none. Returns the library name; proves it is loaded.
local function ping_fn()
  return 'tollgate_v4'
end

redis.register_function('tollgate_v4_lease', lease_fn)
redis.register_function('tollgate_v4_return', return_fn)
redis.register_function('tollgate_v4_count', count_fn)
redis.register_function {
  function_name = 'tollgate_v4_ping',
  callback = ping_fn,
  flags = { 'no-writes' },
}
