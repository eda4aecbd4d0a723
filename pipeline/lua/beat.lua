-- KEYS: the beats set `{ns}:beats` (worker -> the moment, in Redis's clock ms, after which its silence makes it dead),
-- the ready set `{ns}:ready` and `{ns}:ready:held` (as in `share.lua`).
-- ARGV: worker name, dead after ms (the silence it declares), room (entries it could take now; 0: none), held (the
-- entries it holds).
-- Part of a worker's heartbeat: moves its deadline to now + dead after, in Redis's clock (so no host's clock
-- matters); a claimer finds the dead in one range read (`claim.lua`). It also keeps the worker on the ready set
-- while it has room, and off it while it has none, so that a worker waiting for work is counted in every other
-- worker's share without asking for one itself (`share.lua`). Returns the deadline.
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local deadline = now + tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], deadline, ARGV[1])
if tonumber(ARGV[3]) > 0 then
  redis.call('ZADD', KEYS[2], now, ARGV[1])
  redis.call('ZADD', KEYS[3], tonumber(ARGV[4]), ARGV[1])
else
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('ZREM', KEYS[3], ARGV[1])
end
return deadline
