-- Extend a compute lock: reset its TTL only if it still holds the owner's token.
-- KEYS[1] = lock key, KEYS[2] = its holder key (the holder's trace context, when one was
-- stored; same hash slot; it lives as long as the lock), ARGV[1] = owner token,
-- ARGV[2] = new TTL in milliseconds.
-- Returns 1 when extended, 0 when the lock had expired or belongs to another owner
-- (an expired lock is never revived: its owner must learn that it was lost).
if redis.call('GET', KEYS[1]) == ARGV[1] then
    if KEYS[2] then
        redis.call('PEXPIRE', KEYS[2], ARGV[2])
    end
    return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
