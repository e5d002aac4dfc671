-- Take one permit of a provider, or say why not and how long to wait (milliseconds).
-- Every key is in the provider's hash tag (one Redis Cluster slot); the time is Redis's.
--
-- KEYS: 1 log (zset permit -> grant ms), 2 meta (hash permit -> "requests|tokens|workspace"),
--       3 sums (hash req, tok), 4 ws_req (hash workspace -> requests in the window),
--       5 ws_tok (hash workspace -> tokens in the window), 6 holders (zset permit -> expiry ms),
--       7 cool (string, PX), 8 epoch (string), 9 blackout (string, PX),
--       10 waiters (zset permit -> last attempt ms), 11 waiter_ws (hash permit -> workspace),
--       12 ws_waiting (hash workspace -> waiters), 13 stats (hash)
-- ARGV: 1 permit id, 2 workspace, 3 tokens, 4 rpm (-1: none), 5 tpm (-1: none),
--       6 concurrency (-1: none), 7 window ms, 8 permit ttl ms, 9 cold start (full, known,
--       empty), 10 waiter stale ms, 11 poll ms (the wait hint when only a release can free
--       room), 12 the epoch this client saw ('' if none), 13 keep ms (every key but the
--       epoch expires this long after the provider's last acquire or settle)
-- Reply: {1, grant ms, epoch} or {0, wait ms, reason, epoch}

local id, ws = ARGV[1], ARGV[2]
local tokens = tonumber(ARGV[3])
local rpm, tpm, conc = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local window, ttl = tonumber(ARGV[7]), tonumber(ARGV[8])
local mode, stale, poll, seen = ARGV[9], tonumber(ARGV[10]), tonumber(ARGV[11]), ARGV[12]
local keep = tonumber(ARGV[13])

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- A resent acquire (its reply lost) answers as the first did.
local held = redis.call('ZSCORE', KEYS[6], id)
local granted = redis.call('ZSCORE', KEYS[1], id)
if held and granted then
    return {1, tonumber(granted), redis.call('GET', KEYS[8]) or ''}
end

-- The epoch (the Redis time the provider's state began, in µs) marks that this server holds it.
-- Its absence is a new provider or a server that lost its state (a restart without
-- persistence); an epoch other than the one the client saw is a state begun again after a
-- loss. The calls of the window before are then unknown, so it counts as full: with mode
-- 'full' always, with 'known' when the client had seen the state before, never with 'empty'.
local epoch = redis.call('GET', KEYS[8])
if not epoch then
    epoch = t[1] .. string.format('%06d', tonumber(t[2]))  -- microseconds, as digits
    redis.call('SET', KEYS[8], epoch)
    if mode == 'full' or (mode == 'known' and seen ~= '') then
        redis.call('SET', KEYS[9], now, 'PX', window)
        redis.call('HINCRBY', KEYS[13], 'state_lost', 1)
    end
elseif mode ~= 'empty' and seen ~= '' and seen ~= epoch then
    local left = tonumber(string.sub(epoch, 1, -4)) + window - now
    if left > 0 and redis.call('EXISTS', KEYS[9]) == 0 then
        redis.call('SET', KEYS[9], now, 'PX', left)
        redis.call('HINCRBY', KEYS[13], 'state_lost', 1)
    end
end

local function split(meta)
    local a = string.find(meta, '|', 1, true)
    local b = string.find(meta, '|', a + 1, true)
    return tonumber(string.sub(meta, 1, a - 1)), tonumber(string.sub(meta, a + 1, b - 1)),
        string.sub(meta, b + 1)
end

local function add(hash, field, delta)
    if delta ~= 0 and redis.call('HINCRBY', hash, field, delta) <= 0 then
        redis.call('HDEL', hash, field)
    end
end

-- Waiters: a workspace waits while one of its callers asked within the last `stale` ms.
local gone = redis.call('ZRANGEBYSCORE', KEYS[10], '-inf', now - stale)
for _, w in ipairs(gone) do
    local wws = redis.call('HGET', KEYS[11], w)
    if wws then add(KEYS[12], wws, -1) end
    redis.call('HDEL', KEYS[11], w)
end
if #gone > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[10], '-inf', now - stale) end
if redis.call('ZADD', KEYS[10], now, id) == 1 then
    redis.call('HSET', KEYS[11], id, ws)
    redis.call('HINCRBY', KEYS[12], ws, 1)
end

-- Every key but the epoch lives `keep` (a window and a permit's TTL, and a margin) past the
-- last call that wrote it: by then each entry it held has left its window or expired, so an
-- idle provider loses nothing, and a retired one leaves only its epoch. The epoch stays: its
-- absence means a lost state, and an idle provider has lost none.
local function kept()
    for _, i in ipairs({1, 2, 3, 4, 5, 6, 10, 11, 12, 13}) do
        redis.call('PEXPIRE', KEYS[i], keep)
    end
end

local function deny(wait, reason)
    redis.call('HINCRBY', KEYS[13], 'denied_' .. reason, 1)
    kept()
    return {0, math.max(wait, 1), reason, epoch}
end

local pttl = redis.call('PTTL', KEYS[7])
if pttl > 0 then return deny(pttl, 'cooling') end
pttl = redis.call('PTTL', KEYS[9])
if pttl > 0 then return deny(pttl, 'state_lost') end

-- Permits whose holders never settled: their concurrency slots come back, counted.
local expired = redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', now)
if expired > 0 then redis.call('HINCRBY', KEYS[13], 'expired', expired) end

-- The sliding log: calls granted within the last window, with their tokens.
local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - window)
for _, p in ipairs(old) do
    local meta = redis.call('HGET', KEYS[2], p)
    if meta then
        local r, k, w = split(meta)
        add(KEYS[3], 'req', -r)
        add(KEYS[3], 'tok', -k)
        if w ~= '' then
            add(KEYS[4], w, -r)
            add(KEYS[5], w, -k)
        end
        redis.call('HDEL', KEYS[2], p)
    end
end
if #old > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window) end
-- An empty window holds nothing: its sums start again from zero, whatever they had drifted to.
if redis.call('ZCARD', KEYS[1]) == 0 then redis.call('DEL', KEYS[2], KEYS[3], KEYS[4], KEYS[5]) end

if conc >= 0 and redis.call('ZCARD', KEYS[6]) >= conc then
    local first = redis.call('ZRANGE', KEYS[6], 0, 0, 'WITHSCORES')
    local until_expiry = first[2] and (tonumber(first[2]) - now) or poll
    return deny(math.min(until_expiry, poll), 'concurrency')
end

local sums = redis.call('HMGET', KEYS[3], 'req', 'tok')
local req, tok = tonumber(sums[1] or '0'), tonumber(sums[2] or '0')

-- When the oldest entries slide out; the wait until `need` of `what` (1: requests,
-- 2: tokens) has left the window. Only the oldest `scan` entries are looked at (one HGET
-- each): a wait that needs more answers the whole window (the waiter asks again sooner).
local scan = 200
local function wait_for(need, what)
    local freed, start = 0, 0
    while start < scan do
        local batch = redis.call('ZRANGE', KEYS[1], start, start + 99, 'WITHSCORES')
        if #batch == 0 then break end
        for i = 1, #batch, 2 do
            local meta = redis.call('HGET', KEYS[2], batch[i])
            if meta then
                local r, k = split(meta)
                freed = freed + (what == 1 and r or k)
            end
            if freed >= need then return tonumber(batch[i + 1]) + window - now end
        end
        start = start + 100
    end
    return window
end

if rpm >= 0 and req + 1 > rpm then return deny(wait_for(req + 1 - rpm, 1), 'rpm') end
if tpm >= 0 and tok + tokens > tpm then return deny(wait_for(tok + tokens - tpm, 2), 'tpm') end

-- Fairness: while several workspaces wait, each may hold at most its share of the
-- window (the limit over the waiting workspaces, at least one call).
local active = redis.call('HLEN', KEYS[12])
if active > 1 then
    local mine = redis.call('HMGET', KEYS[4], ws)[1]
    local ws_req = tonumber(mine or '0')
    if ws_req > 0 and rpm >= 0 and ws_req + 1 > math.max(math.floor(rpm / active), 1) then
        return deny(poll, 'share')
    end
    local ws_tok = tonumber(redis.call('HMGET', KEYS[5], ws)[1] or '0')
    if ws_req > 0 and tpm >= 0 and ws_tok + tokens > math.floor(tpm / active) then
        return deny(poll, 'share')
    end
end

redis.call('ZADD', KEYS[1], now, id)
redis.call('HSET', KEYS[2], id, '1|' .. tokens .. '|' .. ws)
add(KEYS[3], 'req', 1)
add(KEYS[3], 'tok', tokens)
add(KEYS[4], ws, 1)
add(KEYS[5], ws, tokens)
redis.call('ZADD', KEYS[6], now + ttl, id)
if redis.call('ZREM', KEYS[10], id) == 1 then
    add(KEYS[12], ws, -1)
    redis.call('HDEL', KEYS[11], id)
end
redis.call('HINCRBY', KEYS[13], 'granted', 1)
kept()
return {1, now, epoch}
