-- KEYS: the finishing session's hash, its group's hash.
-- ARGV: group size n, group hash ttl (s).
-- Gives a finished session its sample index in its group, once: a retried finish gets the same index.
-- Errors (nothing changed): `GROUPSIZE` when the group was started with another n, `GROUPFULL` when it
-- has its n sessions already. Returns the sample index.
local taken = redis.call('HGET', KEYS[1], 'sample')
if taken then
  return tonumber(taken)
end
local n = redis.call('HGET', KEYS[2], 'n')
if n and n ~= ARGV[1] then
  return redis.error_reply('GROUPSIZE the group has group_size=' .. n)
end
local next = tonumber(redis.call('HGET', KEYS[2], 'next') or '0')
if next >= tonumber(ARGV[1]) then
  return redis.error_reply('GROUPFULL the group has its ' .. ARGV[1] .. ' sessions already')
end
redis.call('HSET', KEYS[2], 'n', ARGV[1], 'next', next + 1)
redis.call('EXPIRE', KEYS[2], ARGV[2])
redis.call('HSET', KEYS[1], 'sample', next)
return next
