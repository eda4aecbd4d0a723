-- KEYS: the rollouts stream, then one `published` marker key per rollout.
-- ARGV: marker ttl (s), then for each rollout: field count, fields...
-- Puts recorded rollouts back on a namespace with their ids unchanged, under the same marker as a
-- worker's publish (`publish.lua`): a rollout id whose marker is set is skipped, so replaying
-- into a namespace that already has these rollouts adds nothing. Returns how many were added.
local at = 2
local added = 0
for k = 2, #KEYS do
  local count = tonumber(ARGV[at])
  if redis.call('SET', KEYS[k], '1', 'NX', 'EX', ARGV[1]) then
    redis.call('XADD', KEYS[1], '*', unpack(ARGV, at + 1, at + count))
    added = added + 1
  end
  at = at + count + 1
end
return added
