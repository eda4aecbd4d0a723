-- KEYS: rollouts, stale, state. ARGV: group, trainer version, then per rollout: entry id, staleness.
-- Each entry is acked first; only one that was still pending is copied and counted, so a second
-- attempt (another consumer, a retry) neither duplicates nor double-counts it. Returns how many were parked.
local parked = 0
for i = 3, #ARGV, 2 do
  if redis.call('XACK', KEYS[1], ARGV[1], ARGV[i]) == 1 then
    local fields = {}
    local found = redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i])
    if found[1] then fields = found[1][2] end
    fields[#fields + 1] = 'staleness'
    fields[#fields + 1] = ARGV[i + 1]
    fields[#fields + 1] = 'trainer_version'
    fields[#fields + 1] = ARGV[2]
    redis.call('XADD', KEYS[2], '*', unpack(fields))
    parked = parked + 1
  end
end
if parked > 0 then redis.call('HINCRBY', KEYS[3], 'stale', parked) end
return parked
