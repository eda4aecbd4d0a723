-- KEYS: rollouts stream, source stream, partials stream, then one `published` marker key per rollout.
-- ARGV: group, source entry id, marker ttl, partial count, then for each partial: field count, fields...,
-- then for each rollout: field count, fields...
-- The source entry is acked first: if it was no longer pending (another worker finished it),
-- nothing is written. A rollout id already published (a resubmitted prompt) is skipped.
if redis.call('XACK', KEYS[2], ARGV[1], ARGV[2]) == 0 then
  return -1
end
local at = 5
for p = 1, tonumber(ARGV[4]) do
  local count = tonumber(ARGV[at])
  redis.call('XADD', KEYS[3], '*', unpack(ARGV, at + 1, at + count))
  at = at + count + 1
end
local published = 0
for k = 4, #KEYS do
  local count = tonumber(ARGV[at])
  if redis.call('SET', KEYS[k], '1', 'NX', 'EX', ARGV[3]) then
    redis.call('XADD', KEYS[1], '*', unpack(ARGV, at + 1, at + count))
    published = published + 1
  end
  at = at + count + 1
end
return published
