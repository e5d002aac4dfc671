-- Acquire a compute lock: take it if it is free. Safe to send twice: when the client resends
-- an acquire whose reply was lost (a socket timeout after the server ran it; redis-py retries
-- once), the resend finds this owner's own token and answers as the first one did. A plain
-- SET NX would answer "taken" there, and leave a lock that nobody holds until its TTL.
-- KEYS[1] = lock key, ARGV[1] = owner token, ARGV[2] = TTL in milliseconds.
-- Returns 1 when the lock is this owner's, 0 when another owner holds it.
local held = redis.call('GET', KEYS[1])
if not held then
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
    return 1
end
if held == ARGV[1] then
    return 1
end
return 0
