-- KEYS: the session hash, then the pins sorted set of each candidate worker (in ARGV's order).
-- ARGV: session id, now (s), pin expiry (s), then per candidate: worker name, its heartbeat's in-flight count.
-- Sticky least-loaded placement: a session stays on its worker while that worker is a candidate (alive and
-- serving); otherwise it goes to the candidate with the fewest live pins, then the fewest samples in flight.
-- Pins expire by score (a session idle past its TTL no longer counts). Returns the worker.
local current = redis.call('HGET', KEYS[1], 'worker')
local best, best_pins, best_load
for i = 2, #KEYS do
  local name = ARGV[2 + 2 * (i - 1)]
  if name == current then
    redis.call('ZADD', KEYS[i], ARGV[3], ARGV[1])
    return current
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', ARGV[2])
  local pins = redis.call('ZCARD', KEYS[i])
  local load = tonumber(ARGV[3 + 2 * (i - 1)])
  if best == nil or pins < best_pins or (pins == best_pins and load < best_load) then
    best, best_pins, best_load = i, pins, load
  end
end
local name = ARGV[2 + 2 * (best - 1)]
redis.call('HSET', KEYS[1], 'worker', name)
redis.call('ZADD', KEYS[best], ARGV[3], ARGV[1])
return name
