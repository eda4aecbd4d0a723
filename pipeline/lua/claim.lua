-- KEYS: the streams to claim from, in the order to serve them. ARGV: group, consumer, min idle ms, count (in all).
-- Entries idle for at least min idle ms go to the consumer (XCLAIM, which counts a delivery).
-- Entries deleted while pending are acked instead: Redis 6.2 keeps them in the PEL for ever
-- (7.0 drops them), where they would hold back trimming. Same result on both versions, which
-- XAUTOCLAIM does not give (6.2 replies with a nil in their place and keeps them pending).
-- Returns, per stream, the claimed entries ({id, {field, value, ...}}, ...).
local result, left = {}, tonumber(ARGV[4])
for k, stream in ipairs(KEYS) do
  local pending = {}
  if left > 0 then pending = redis.call('XPENDING', stream, ARGV[1], 'IDLE', ARGV[3], '-', '+', left) end
  local live, gone = {}, {}
  for _, p in ipairs(pending) do
    if #redis.call('XRANGE', stream, p[1], p[1]) == 0 then gone[#gone + 1] = p[1] else live[#live + 1] = p[1] end
  end
  if #gone > 0 then redis.call('XACK', stream, ARGV[1], unpack(gone)) end
  local claimed = {}
  if #live > 0 then claimed = redis.call('XCLAIM', stream, ARGV[1], ARGV[2], ARGV[3], unpack(live)) end
  left = left - #claimed
  result[k] = claimed
end
return result
