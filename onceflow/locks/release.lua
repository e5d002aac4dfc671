-- Release a compute lock: delete it only if it still holds the owner's token.
-- KEYS[1] = lock key, KEYS[2] = its release mark, KEYS[3] = its holder key (the holder's
-- trace context, when one was stored; all three in one hash slot), ARGV[1] = owner token,
-- ARGV[2] = the mark's lifetime in milliseconds.
-- Returns 1 when this owner's lock was deleted now, 0 when it had expired or belongs to
-- another owner (whose lock is left alone: never delete someone else's lock), and 2 when
-- this owner's release already deleted it: the mark (the owner's token, kept briefly)
-- tells a resent release (its reply lost, the command sent again) from a lock lost.
if redis.call('GET', KEYS[1]) == ARGV[1] then
    redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
    if KEYS[3] then
        redis.call('DEL', KEYS[3])
    end
    return redis.call('DEL', KEYS[1])
end
if redis.call('GET', KEYS[2]) == ARGV[1] then
    return 2
end
return 0
