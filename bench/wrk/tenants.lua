-- wrk script for `just bench`: GET /items/<n> with an x-tenant-id header, tenants spread
-- uniformly or Zipf-like, requests prepared once per thread (so wrk spends no Lua time per
-- request), wrk's plain closed loop, and one JSON line of results for the driver to parse.
--
--   wrk ... -s bench/wrk/tenants.lua http://127.0.0.1:PORT -- TENANTS DIST SEED PREFIX
--
-- TENANTS: number of tenants (default 100); DIST: "zipf" (weight 1/rank, s = 1) or "uniform";
-- SEED: per-run seed; PREFIX: tenant name prefix (a fresh one gives fresh buckets).

local prepared = {}
local next_index = 1
local PREPARED = 8192

-- xorshift32: deterministic per thread, independent of LuaJIT's math.random.
local state = 1
local function rand()
  state = bit.bxor(state, bit.lshift(state, 13))
  state = bit.bxor(state, bit.rshift(state, 17))
  state = bit.bxor(state, bit.lshift(state, 5))
  return (state % 1000003) / 1000003
end

local thread_counter = 0
function setup(thread)
  thread_counter = thread_counter + 1
  thread:set("thread_id", thread_counter)
end

function init(args)
  local tenants = tonumber(args[1]) or 100
  local dist = args[2] or "zipf"
  local seed = tonumber(args[3]) or 1
  local prefix = args[4] or "t"
  state = (seed * 7919 + (thread_id or 1) * 104729) % 2147483647
  if state == 0 then state = 1 end
  -- Cumulative weights.
  local cumulative = {}
  local total = 0
  for rank = 1, tenants do
    local w = 1
    if dist == "zipf" then w = 1 / rank end
    total = total + w
    cumulative[rank] = total
  end
  for i = 1, PREPARED do
    local r = rand() * total
    local lo, hi = 1, tenants
    while lo < hi do
      local mid = math.floor((lo + hi) / 2)
      if cumulative[mid] < r then lo = mid + 1 else hi = mid end
    end
    local path = "/items/" .. tostring(math.floor(rand() * 100000))
    prepared[i] = wrk.format("GET", path, {
      ["Host"] = "api.example.com",
      ["x-tenant-id"] = prefix .. tostring(lo - 1),
    })
  end
end

function request()
  local r = prepared[next_index]
  next_index = next_index + 1
  if next_index > PREPARED then next_index = 1 end
  return r
end

function done(summary, latency, requests)
  io.write(string.format(
    'TOLLGATE_BENCH {"requests":%d,"duration_us":%d,"bytes":%d,' ..
    '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},' ..
    '"latency_us":{"p50":%d,"p90":%d,"p99":%d,"mean":%.1f,"max":%d}}\n',
    summary.requests, summary.duration, summary.bytes,
    summary.errors.connect, summary.errors.read, summary.errors.write,
    summary.errors.status, summary.errors.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency.mean, latency.max))
end
