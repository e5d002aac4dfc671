-- Settle (or give back) a granted permit: its concurrency slot is freed and the tokens
-- reserved at acquire are corrected to the call's actual usage. Idempotent: a resent
-- settle corrects nothing twice.
--
-- KEYS: 1 log, 2 meta, 3 sums, 4 ws_req, 5 ws_tok, 6 holders, 7 stats (see acquire.lua)
-- ARGV: 1 permit id, 2 workspace, 3 estimate tokens, 4 actual tokens (-1: keep the estimate),
--       5 outcome, 6 keep ms (see acquire.lua)
-- Reply: {1 if the permit still held its slot (0: expired, or settled before), Redis ms}
--
-- The workspace whose count is corrected is the one the permit was granted to (its meta);
-- ARGV[2] only names it once that entry has left the window.

local id, ws = ARGV[1], ARGV[2]
local estimate, actual = tonumber(ARGV[3]), tonumber(ARGV[4])
local keep = tonumber(ARGV[6])

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function add(hash, field, delta)
    if delta ~= 0 and redis.call('HINCRBY', hash, field, delta) <= 0 then
        redis.call('HDEL', hash, field)
    end
end

local held = redis.call('ZREM', KEYS[6], id)
if actual >= 0 then
    local meta = redis.call('HGET', KEYS[2], id)
    if meta then
        local a = string.find(meta, '|', 1, true)
        local b = string.find(meta, '|', a + 1, true)
        local reserved = tonumber(string.sub(meta, a + 1, b - 1))
        local granted_to = string.sub(meta, b + 1)
        local delta = actual - reserved
        if delta ~= 0 then
            redis.call('HSET', KEYS[2], id, string.sub(meta, 1, a) .. actual .. string.sub(meta, b))
            add(KEYS[3], 'tok', delta)
            if granted_to ~= '' then add(KEYS[5], granted_to, delta) end
        end
    elseif actual > estimate and redis.call('HEXISTS', KEYS[2], id .. ':over') == 0 then
        -- The permit's entry has left the window: what the call used above its estimate
        -- is counted now, in full.
        local over = id .. ':over'
        redis.call('ZADD', KEYS[1], now, over)
        redis.call('HSET', KEYS[2], over, '0|' .. (actual - estimate) .. '|' .. ws)
        add(KEYS[3], 'tok', actual - estimate)
        add(KEYS[5], ws, actual - estimate)
    end
end
if held == 1 then redis.call('HINCRBY', KEYS[7], 'settled_' .. ARGV[5], 1) end
for i = 1, 7 do redis.call('PEXPIRE', KEYS[i], keep) end
return {held, now}
