-- Release a compute lock: delete it only if it still holds the owner's token.
-- KEYS[1] = lock key, ARGV[1] = owner token.
-- Returns 1 when this owner's lock was deleted, 0 when it had expired or belongs to
-- another owner (whose lock is left alone: never delete someone else's lock).
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
