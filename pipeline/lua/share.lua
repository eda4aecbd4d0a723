-- KEYS: the partials stream, the prompts stream, the ready set `{ns}:ready` (workers with room that asked for work,
-- scored by when: Redis's clock, ms) and `{ns}:ready:held` (the same workers, scored by the entries each holds).
-- ARGV: group, consumer, room (entries it may take now), held (entries it holds, those it just read included),
-- horizon ms (a worker that has not asked for work for this long is no longer on the ready set).
-- How many of the shared streams' entries (partials and prompts) one worker of a fleet may take now: what waits
-- there undelivered over the workers on the ready set (itself included), rounded up, less what it holds beyond the
-- worker on the set that holds least, and no more than its room. So holdings level out: the worker that holds least
-- gets one entry at least while any waits (work never waits on a worker that does not come), and a lone worker may
-- take all that fits. The worker stays on the ready set, holding what it may take, while it has room left after it,
-- and leaves the set once full. The caller then reads that many (XREADGROUP, outside the script: a read from Lua
-- costs Redis ~20 times a plain one, for the entries' copy through Lua tables).
-- Returns {share, waiting, partials, above}: what it may take, the entries that wait, those of them that are partials
-- (each counted up to room x fleet), so that the caller reads partials alone first while there are any, and 1 if it
-- holds more than the least-holding worker on the set (then it should not wait in a blocking read, where Redis hands
-- the next new entry to whoever waited longest, but leave new work to those that hold least).
local group, consumer = ARGV[1], ARGV[2]
local room, held, horizon = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local ready, holdings = KEYS[3], KEYS[4]
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
for _, gone in ipairs(redis.call('ZRANGEBYSCORE', ready, '-inf', '(' .. (now - horizon), 'LIMIT', 0, 100)) do
  redis.call('ZREM', ready, gone)
  redis.call('ZREM', holdings, gone)
end
redis.call('ZADD', ready, now, consumer)
local fleet = redis.call('ZCARD', ready)

-- The least any worker on the ready set holds, this one as it holds now (both sets change together, here and when
-- a worker leaves).
local least = held
local low = redis.call('ZRANGE', holdings, 0, 1, 'WITHSCORES')
for i = 1, #low, 2 do
  if low[i] ~= consumer then least = math.min(least, tonumber(low[i + 1])); break end
end

-- Entries of `stream` the group has not delivered yet, counted up to `cap`: Redis 7's `lag` where it knows it,
-- else the entries after the group's last delivered id (Redis 6.2 has no `lag`); 0 without the stream, -1 if the
-- stream has no group (deleted and made again by an XADD).
local function waiting(stream, cap)
  local groups = redis.pcall('XINFO', 'GROUPS', stream)
  if groups['err'] then return 0 end  -- no such stream
  for _, info in ipairs(groups) do
    local fields = {}
    for i = 1, #info, 2 do fields[info[i]] = info[i + 1] end
    if fields['name'] == group then
      if fields['lag'] then return tonumber(fields['lag']) end
      return #redis.call('XRANGE', stream, '(' .. fields['last-delivered-id'], '+', 'COUNT', cap)
    end
  end
  return -1
end

local cap = math.min(room * fleet, 10000)
local partials, prompts = waiting(KEYS[1], cap), waiting(KEYS[2], cap)
if partials < 0 or prompts < 0 then return redis.error_reply('NOGROUP a stream has no group ' .. group) end
local backlog = partials + prompts
local share = math.ceil(backlog / fleet) - (held - least)
if backlog > 0 and held <= least then share = math.max(share, 1) end
share = math.max(0, math.min(share, room, backlog))
if share >= room then
  redis.call('ZREM', ready, consumer)
  redis.call('ZREM', holdings, consumer)
else
  redis.call('ZADD', holdings, held + share, consumer)
end
return {share, backlog, partials, (held > least) and 1 or 0}
