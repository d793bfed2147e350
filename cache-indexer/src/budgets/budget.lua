-- One tenant's token budget in Redis, shared by every indexer replica:
-- reserve / settle / release / cancel / expire / abandon, each one atomic
-- EVALSHA.
--
-- A transcription of kvasir-budget's integer arithmetic (budget/src/
-- bucket.rs, ledger.rs, limits.rs); tests/budget_lua.rs runs random
-- operation sequences through both and asserts the same results. Credit is
-- kept in 1/60000 token units (one per ms of the window). Lua numbers are
-- doubles, exact below 2^53: limits are at most 10^9 per minute (6*10^13
-- units, the policy's validation and the caller's clamp), token counts at
-- most 10^8 per field (the caller's clamp), and debt is floored at -2^52,
-- so every figure here is an exact integer.
--
-- KEYS[1]  state hash: c<d> credit, t<d> last refill ms (d = 1 requests,
--          2 prompt, 3 completion, 4 total tokens; absent: not primed),
--          l<d> / mc / w the limits of the last reserve, px the last purge
--          of stale reservations
-- KEYS[2]  open reservations: request id -> "since held1..4 usage_p
--          usage_c usage_comp reserved_prompt reserved_cached token"
--          (token: the reserve attempt that opened it; absent before
--          attempts carried one)
-- KEYS[3]  abandoned attempts: token -> ms until which a reserve carrying
--          that token opens nothing
-- ARGV[1]  op: reserve | settle | release | cancel | expire | abandon
-- ARGV[2]  now ms; negative: Redis TIME (so replicas' clocks never disagree)
-- ARGV[3..6] per-minute limits of d = 1..4; negative: unlimited; ARGV[3]
--          empty: the limits the last reserve stored (a report carries
--          none)
-- ARGV[7]  max concurrent; negative: unlimited
-- ARGV[8]  cached-token weight, thousandths
-- ARGV[9]  idle ms: keys expire this long after the buckets are whole
-- ARGV[10] request id (expire: unused)
-- ARGV[11..13] reserve: prompt, cached, output tokens;
--          settle / release: usage prompt, cached, completion tokens
--          (release: negative prompt, the prompt as reserved and the
--          completion as last settled); expire: max age ms
-- ARGV[14] reserve: max age ms of an open reservation (stale ones are
--          dropped before counting concurrency, at most once a second);
--          negative: never. release: 1 to charge the usage on its own
--          (one request plus its tokens) when nothing is open under the id
--          (the end of a request a proxy admitted itself)
-- ARGV[15] reserve: the attempt's token (empty: none); abandon: the token
--          of the attempt its caller gave up on
--
-- abandon (ARGV[11]: how long, in ms, the token stays refused) undoes a
-- reserve whose answer its caller never saw: the reservation under the id
-- is cancelled only when that attempt opened it (a reservation opened by
-- another attempt, or none, is left alone), else the token is remembered
-- so that the reserve, should it run later (still on its way, or queued
-- in a connection Redis has not read yet), opens nothing.
--
-- Reply (integers): reserve {code, a, b, c, held1..4, hdr}; code 0
-- admitted, 1 limited (a dimension, b retry ms), 2 concurrency (a limit),
-- 3 too large (a dimension, b requested, c limit), 4 already open (held as
-- reserved before: a repeated pick is not charged twice).
-- settle {found, extra1..4, hdr}; release {found, refunded1..4,
-- charged1..4, final1..4, hdr} (found 2: nothing was open, the usage was
-- charged on its own); cancel {found, held1..4, hdr}; expire
-- {dropped}; abandon {found} (1: the attempt's reservation was cancelled,
-- 0: the token is remembered instead); reserve code 5: the attempt was
-- abandoned before it ran, nothing opened. hdr: per dimension the limit, remaining whole tokens and ms
-- until whole (-1 -1 -1 when unlimited).

local W = 60000
local FLOOR = -4503599627370496 -- -2^52: debt beyond it is not counted

local function num(s)
  return tonumber(s) or -1
end

local op = ARGV[1]
local now = num(ARGV[2])
if now < 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local IDLE = num(ARGV[9])
local ID = ARGV[10]
local TOKEN = ARGV[15] or ''
local L, MC, WEIGHT
if ARGV[3] == '' then
  local s = redis.call('HMGET', KEYS[1], 'l1', 'l2', 'l3', 'l4', 'mc', 'w')
  L = { num(s[1]), num(s[2]), num(s[3]), num(s[4]) }
  MC = num(s[5])
  WEIGHT = tonumber(s[6]) or 1000
else
  L = { num(ARGV[3]), num(ARGV[4]), num(ARGV[5]), num(ARGV[6]) }
  MC = num(ARGV[7])
  WEIGHT = num(ARGV[8])
end

-- floor(a / b) for integers, b > 0: exact where the float quotient rounds.
local function idiv(a, b)
  local q = math.floor(a / b)
  if q * b > a then
    q = q - 1
  elseif (q + 1) * b <= a then
    q = q + 1
  end
  return q
end

-- Rust's ceil_div, for a >= 0, b > 0.
local function ceil_div(a, b)
  return idiv(a + b - 1, b)
end

local C, T = {}, {}
local state = redis.call('HMGET', KEYS[1], 'c1', 't1', 'c2', 't2', 'c3', 't3', 'c4', 't4', 'px')
for d = 1, 4 do
  C[d] = tonumber(state[2 * d - 1])
  T[d] = tonumber(state[2 * d])
end
local PX = tonumber(state[9]) or 0

-- Bucket::refill
local function refill(d)
  local lim = L[d]
  if lim < 0 then
    return
  end
  local cap = lim * W
  if C[d] == nil or T[d] == nil then
    C[d], T[d] = cap, now
    return
  end
  local elapsed = now - T[d]
  if elapsed < 0 then
    elapsed = 0
  end
  local short = cap - C[d]
  -- elapsed * lim may pass 2^53, but then it is past short too.
  if short <= 0 or elapsed * lim >= short then
    C[d] = cap
  else
    C[d] = C[d] + elapsed * lim
  end
  if now > T[d] then
    T[d] = now
  end
end

local function refill_all()
  for d = 1, 4 do
    refill(d)
  end
end

-- Bucket::wait_ms: nil when it never fits.
local function wait_ms(d, tokens)
  local lim = L[d]
  local need = tokens * W
  if need > lim * W then
    return nil
  end
  local short = need - C[d]
  if short <= 0 then
    return 0
  end
  if lim == 0 then
    return nil
  end
  return ceil_div(short, lim)
end

local function take(cost)
  for d = 1, 4 do
    if L[d] >= 0 then
      C[d] = C[d] - cost[d] * W
      if C[d] < FLOOR then
        C[d] = FLOOR
      end
    end
  end
end

local function give(cost)
  for d = 1, 4 do
    if L[d] >= 0 then
      C[d] = math.min(C[d] + cost[d] * W, L[d] * W)
    end
  end
end

-- Usage::cost (requests 0); Request::cost sets requests to 1.
local function cost_of(p, c, comp)
  local cached = math.min(c, p)
  local weighted = ceil_div(cached * WEIGHT, 1000)
  local prompt = p - cached + weighted
  return { 0, prompt, comp, prompt + comp }
end

local function max4(a, b)
  return { math.max(a[1], b[1]), math.max(a[2], b[2]), math.max(a[3], b[3]), math.max(a[4], b[4]) }
end

local function sub4(a, b) -- saturating
  return { math.max(a[1] - b[1], 0), math.max(a[2] - b[2], 0), math.max(a[3] - b[3], 0), math.max(a[4] - b[4], 0) }
end

local function fmt(x)
  return string.format('%.0f', x)
end

-- An open reservation: since, held, usage so far, the prompt as reserved,
-- the token of the attempt that opened it.
local function encode(since, held, u, rp, token)
  local v = { fmt(since) }
  for _, x in ipairs(held) do
    v[#v + 1] = fmt(x)
  end
  for _, x in ipairs(u) do
    v[#v + 1] = fmt(x)
  end
  v[#v + 1] = fmt(rp[1])
  v[#v + 1] = fmt(rp[2])
  if token and token ~= '' then
    v[#v + 1] = token
  end
  return table.concat(v, ' ')
end

local function decode(s)
  local v = {}
  for w in string.gmatch(s, '%S+') do
    v[#v + 1] = w
  end
  local function at(i)
    return tonumber(v[i]) or 0
  end
  return at(1), { at(2), at(3), at(4), at(5) }, { at(6), at(7), at(8) }, { at(9), at(10) }, v[11]
end

local function reset_ms(d)
  local short = L[d] * W - C[d]
  if short <= 0 or L[d] == 0 then
    return 0
  end
  return ceil_div(short, L[d])
end

local function headers()
  local out = {}
  for d = 1, 4 do
    if L[d] >= 0 then
      local rem = 0
      if C[d] > 0 then
        rem = idiv(C[d], W)
      end
      out[#out + 1] = L[d]
      out[#out + 1] = rem
      out[#out + 1] = reset_ms(d)
    else
      out[#out + 1] = -1
      out[#out + 1] = -1
      out[#out + 1] = -1
    end
  end
  return out
end

-- Writes the buckets back; the keys live IDLE ms past the time every
-- bucket is whole again (a whole bucket is what a missing key means).
local function save()
  local args, whole = {}, 0
  for d = 1, 4 do
    if L[d] >= 0 then
      args[#args + 1] = 'c' .. d
      args[#args + 1] = fmt(C[d])
      args[#args + 1] = 't' .. d
      args[#args + 1] = fmt(T[d])
      whole = math.max(whole, reset_ms(d))
    end
  end
  args[#args + 1] = 'px'
  args[#args + 1] = fmt(PX)
  if op == 'reserve' then
    for d = 1, 4 do
      args[#args + 1] = 'l' .. d
      args[#args + 1] = fmt(L[d])
    end
    args[#args + 1] = 'mc'
    args[#args + 1] = fmt(MC)
    args[#args + 1] = 'w'
    args[#args + 1] = fmt(WEIGHT)
  end
  redis.call('HSET', KEYS[1], unpack(args))
  local ttl = math.max(IDLE, 1) + whole
  redis.call('PEXPIRE', KEYS[1], ttl)
  if redis.call('EXISTS', KEYS[2]) == 1 then
    redis.call('PEXPIRE', KEYS[2], ttl)
  end
end

local function reply(head, tail)
  for _, x in ipairs(tail) do
    head[#head + 1] = x
  end
  return head
end

-- TenantBudget::expire: drops reservations older than max_age.
local function expire(max_age)
  local all = redis.call('HGETALL', KEYS[2])
  local dropped = 0
  for i = 1, #all, 2 do
    local since = decode(all[i + 1])
    if now - since > max_age then
      redis.call('HDEL', KEYS[2], all[i])
      dropped = dropped + 1
    end
  end
  return dropped
end

if op == 'expire' then
  return { expire(num(ARGV[11])) }
end

refill_all()

if op == 'abandon' then
  if TOKEN == '' then
    return redis.error_reply('kvasir budget: abandon without a token')
  end
  local prior = redis.call('HGET', KEYS[2], ID)
  if prior then
    local _, held, _, _, token = decode(prior)
    if token == TOKEN then
      redis.call('HDEL', KEYS[2], ID)
      give(held)
      save()
      return { 1 }
    end
  end
  -- Not (yet) opened by that attempt: remember its token, dropping those
  -- past their time.
  local ttl = math.max(num(ARGV[11]), 1)
  local gone = redis.call('HGETALL', KEYS[3])
  for i = 1, #gone, 2 do
    if (tonumber(gone[i + 1]) or 0) < now then
      redis.call('HDEL', KEYS[3], gone[i])
    end
  end
  redis.call('HSET', KEYS[3], TOKEN, fmt(now + ttl))
  redis.call('PEXPIRE', KEYS[3], ttl)
  return { 0 }
end

if op == 'reserve' then
  local max_age = num(ARGV[14])
  if max_age >= 0 and now - PX >= 1000 then
    expire(max_age)
    PX = now
  end
  if TOKEN ~= '' then
    local until_ms = tonumber(redis.call('HGET', KEYS[3], TOKEN))
    if until_ms and until_ms >= now then
      save()
      return reply({ 5, 0, 0, 0, 0, 0, 0, 0 }, headers())
    end
  end
  local rp = { num(ARGV[11]), num(ARGV[12]) }
  local cost = cost_of(rp[1], rp[2], num(ARGV[13]))
  cost[1] = 1
  local prior = redis.call('HGET', KEYS[2], ID)
  if prior then
    local _, held = decode(prior)
    save()
    return reply({ 4, 0, 0, 0, held[1], held[2], held[3], held[4] }, headers())
  end
  local worst_d, worst_ms = nil, nil
  for d = 1, 4 do
    if L[d] >= 0 then
      local ms = wait_ms(d, cost[d])
      if ms == nil then
        save()
        return reply({ 3, d, cost[d], L[d], 0, 0, 0, 0 }, headers())
      end
      if ms > 0 and (worst_ms == nil or ms > worst_ms) then
        worst_d, worst_ms = d, ms
      end
    end
  end
  if MC >= 0 and redis.call('HLEN', KEYS[2]) >= MC then
    save()
    return reply({ 2, MC, 0, 0, 0, 0, 0, 0 }, headers())
  end
  if worst_d then
    save()
    return reply({ 1, worst_d, worst_ms, 0, 0, 0, 0, 0 }, headers())
  end
  take(cost)
  redis.call('HSET', KEYS[2], ID, encode(now, cost, { 0, 0, 0 }, rp, TOKEN))
  save()
  return reply({ 0, 0, 0, 0, cost[1], cost[2], cost[3], cost[4] }, headers())
end

local prior = redis.call('HGET', KEYS[2], ID)
if not prior then
  if op == 'release' and num(ARGV[14]) == 1 and num(ARGV[11]) >= 0 then
    -- TenantBudget::charge
    local c = cost_of(num(ARGV[11]), num(ARGV[12]), num(ARGV[13]))
    c[1] = 1
    take(c)
    save()
    return reply({ 2, 0, 0, 0, 0, c[1], c[2], c[3], c[4], c[1], c[2], c[3], c[4] }, headers())
  end
  save()
  if op == 'release' then
    return reply({ 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0 }, headers())
  end
  return reply({ 0, 0, 0, 0, 0 }, headers())
end
local since, held, usage, rp, token = decode(prior)

if op == 'settle' then
  usage = { math.max(usage[1], num(ARGV[11])), math.max(usage[2], num(ARGV[12])), math.max(usage[3], num(ARGV[13])) }
  local target = max4(held, cost_of(usage[1], usage[2], usage[3]))
  local extra = sub4(target, held)
  take(extra)
  redis.call('HSET', KEYS[2], ID, encode(since, target, usage, rp, token))
  save()
  return reply({ 1, extra[1], extra[2], extra[3], extra[4] }, headers())
end

if op == 'release' then
  local final = { num(ARGV[11]), num(ARGV[12]), num(ARGV[13]) }
  if final[1] < 0 then
    final = { rp[1], rp[2], 0 }
  end
  usage = { math.max(usage[1], final[1]), math.max(usage[2], final[2]), math.max(usage[3], final[3]) }
  local fin = cost_of(usage[1], usage[2], usage[3])
  fin[1] = held[1]
  local refunded, charged = sub4(held, fin), sub4(fin, held)
  redis.call('HDEL', KEYS[2], ID)
  take(charged)
  give(refunded)
  save()
  local r = { 1 }
  for _, c in ipairs({ refunded, charged, fin }) do
    for d = 1, 4 do
      r[#r + 1] = c[d]
    end
  end
  return reply(r, headers())
end

if op == 'cancel' then
  redis.call('HDEL', KEYS[2], ID)
  give(held)
  save()
  return reply({ 1, held[1], held[2], held[3], held[4] }, headers())
end

return redis.error_reply('kvasir budget: unknown op ' .. tostring(op))
