-- KEYS: the streams to claim from, in the order to serve them (partials, prompts), then the ready sets `{ns}:ready`
-- and `{ns}:ready:held` (as `share.lua`'s), then the beats set `{ns}:beats` (worker -> the moment its silence makes it
-- dead: `beat.lua`).
-- ARGV: group, consumer, min idle ms, count (in all), quick idle ms, horizon ms (as `share.lua`'s), held (entries the
-- claimer holds).
-- Takes over work whose owner stopped: the entries of a worker past its deadline on the beats set (its heartbeat
-- silent longer than the silence it declared) once idle for quick idle ms, and any entry idle for min idle ms (an
-- owner that lives but stopped touching it, or one that never beat). Oldest first, and at most `count` and the
-- claimer's share, as `share.lua` counts it: the entries found over the workers on the ready set (itself included),
-- rounded up, less what it holds beyond the one of them that holds least (one at least for that one). Each goes to
-- the consumer by XCLAIM (which counts a delivery; its min idle keeps two claimers from both taking one). Entries
-- deleted while pending are acked instead: Redis 6.2 keeps them in the PEL for ever (7.0 drops them), where they
-- would hold back trimming. Same result on both versions, which XAUTOCLAIM does not give (6.2 replies with a nil in
-- their place and keeps them pending).
-- Returns, per stream, the claimed entries ({id, {field, value, ...}}, ...), then 1 if work was found that is another
-- worker's turn to take over (this one claimed none: it holds its share), else 0.
local group, consumer, min_idle, left = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local quick, horizon, held = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local ready, holdings, beats = KEYS[#KEYS - 2], KEYS[#KEYS - 1], KEYS[#KEYS]
local streams = #KEYS - 3
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local silent = redis.call('ZRANGEBYSCORE', beats, '-inf', now, 'LIMIT', 0, 100)

local function id_less(a, b)
  local am, as = string.match(a, '(%d+)-(%d+)')
  local bm, bs = string.match(b, '(%d+)-(%d+)')
  if #am ~= #bm then return #am < #bm end
  if am ~= bm then return am < bm end
  return tonumber(as) < tonumber(bs)
end

local found, total = {}, 0
for k = 1, streams do
  local stream, ids, seen = KEYS[k], {}, {}
  for _, owner in ipairs(silent) do
    if owner ~= consumer then
      for _, p in ipairs(redis.call('XPENDING', stream, group, 'IDLE', quick, '-', '+', left, owner)) do
        if not seen[p[1]] then seen[p[1]] = true; ids[#ids + 1] = p[1] end
      end
    end
  end
  for _, p in ipairs(redis.call('XPENDING', stream, group, 'IDLE', min_idle, '-', '+', left)) do
    if not seen[p[1]] then seen[p[1]] = true; ids[#ids + 1] = p[1] end
  end
  table.sort(ids, id_less)
  found[k] = ids
  total = total + #ids
end

if total > 0 then
  for _, gone in ipairs(redis.call('ZRANGEBYSCORE', ready, '-inf', '(' .. (now - horizon), 'LIMIT', 0, 100)) do
    redis.call('ZREM', ready, gone)  -- as `share.lua` does: both sets together
    redis.call('ZREM', holdings, gone)
  end
  local fleet = redis.call('ZCARD', ready)
  if not redis.call('ZSCORE', ready, consumer) then fleet = fleet + 1 end
  local least = held
  local low = redis.call('ZRANGE', holdings, 0, 1, 'WITHSCORES')
  for i = 1, #low, 2 do
    if low[i] ~= consumer then least = math.min(least, tonumber(low[i + 1])); break end
  end
  local share = math.ceil(total / fleet) - (held - least)
  if held <= least then share = math.max(share, 1) end
  left = math.max(0, math.min(left, share))
end

local result = {}
for k = 1, streams do
  local stream, live, gone = KEYS[k], {}, {}
  for _, id in ipairs(found[k]) do
    if #live >= left then break end
    if #redis.call('XRANGE', stream, id, id) == 0 then gone[#gone + 1] = id else live[#live + 1] = id end
  end
  if #gone > 0 then redis.call('XACK', stream, group, unpack(gone)) end
  local claimed = {}
  if #live > 0 then claimed = redis.call('XCLAIM', stream, group, consumer, math.min(quick, min_idle), unpack(live)) end
  left = left - #claimed
  result[k] = claimed
end
result[streams + 1] = (total > 0 and left == 0 and #result[1] + #result[streams] == 0) and 1 or 0
return result
