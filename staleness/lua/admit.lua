-- KEYS: state, prompts, control, admitted (the submission's marker).
-- ARGV: samples, max_staleness ('' = no limit), batch_size, prompt count, then per prompt: field count, fields...,
-- then the marker's ttl in seconds.
-- Returns {admitted (0|1|2), submitted, stale, capacity (-1 = no limit), version, last control id, entry ids...}.
-- `submitted_version` in each prompt becomes the version the prompt was admitted under.
-- A submission already admitted (its marker exists: the same call retried after a lost reply, or the same
-- prompts submitted again by a restarted producer) returns its first reply with admitted = 2, queuing nothing. It
-- renews the marker's ttl all the same: a write, so that a durability wait on the caller's connection (`WAIT` counts
-- that connection's writes) covers the first call's prompts. Writing nothing, a retry of a call whose prompts no
-- replica had yet would be done at once, and a failover then lost prompts the caller was told were queued.
local done = redis.call('GET', KEYS[4])
if done then
  redis.call('EXPIRE', KEYS[4], ARGV[#ARGV])
  local first = cjson.decode(done)
  first[1] = 2
  return first
end
local state = redis.call('HMGET', KEYS[1], 'version', 'submitted', 'stale')
local version = tonumber(state[1] or '0')
local submitted = tonumber(state[2] or '0')
local stale = tonumber(state[3] or '0')
local samples = tonumber(ARGV[1])
local capacity = -1
if ARGV[2] ~= '' then
  capacity = (tonumber(ARGV[2]) + version + 1) * tonumber(ARGV[3])
  redis.call('HSET', KEYS[1], 'max_staleness', ARGV[2], 'batch_size', ARGV[3])
  if submitted - stale + samples > capacity then
    local last = redis.call('XREVRANGE', KEYS[3], '+', '-', 'COUNT', 1)
    local last_id = '0-0'
    if last[1] then last_id = last[1][1] end
    return {0, submitted, stale, capacity, version, last_id}
  end
end
submitted = redis.call('HINCRBY', KEYS[1], 'submitted', samples)
local reply = {1, submitted, stale, capacity, version, ''}
local at = 5
for p = 1, tonumber(ARGV[4]) do
  local count = tonumber(ARGV[at])
  local fields = {}
  for i = at + 1, at + count, 2 do
    fields[#fields + 1] = ARGV[i]
    if ARGV[i] == 'submitted_version' then
      fields[#fields + 1] = tostring(version)
    else
      fields[#fields + 1] = ARGV[i + 1]
    end
  end
  reply[#reply + 1] = redis.call('XADD', KEYS[2], '*', unpack(fields))
  at = at + count + 1
end
redis.call('SET', KEYS[4], cjson.encode(reply), 'EX', ARGV[at])
return reply
