-- KEYS: the stream to forward to (rollouts), the stream read from (scoring).
-- ARGV: group, id count, the entry ids read, then for each rollout: field count, fields...
-- The scoring stage forwards a scored group: it acks the entries it read and adds the scored
-- rollouts in one step, so that a group is never both acked and unpublished, nor published twice
-- by one scorer. If none of the ids was still pending (a predecessor forwarded them), nothing is
-- written and -1 is returned; otherwise the number of rollouts added.
local ids = tonumber(ARGV[2])
if redis.call('XACK', KEYS[2], ARGV[1], unpack(ARGV, 3, 2 + ids)) == 0 then
  return -1
end
local at = 3 + ids
local added = 0
while at <= #ARGV do
  local count = tonumber(ARGV[at])
  redis.call('XADD', KEYS[1], '*', unpack(ARGV, at + 1, at + count))
  added = added + 1
  at = at + count + 1
end
return added
