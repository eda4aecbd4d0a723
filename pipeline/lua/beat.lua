-- KEYS: the beats set `{ns}:beats` (worker -> the moment, in Redis's clock ms, after which its silence makes it dead).
-- ARGV: worker name, dead after ms (the silence it declares).
-- Part of a worker's heartbeat: moves its deadline to now + dead after, in Redis's clock (so no host's clock
-- matters). A claimer finds the dead in one range read (`claim.lua`). Returns the deadline.
local clock = redis.call('TIME')
local deadline = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000) + tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], deadline, ARGV[1])
return deadline
