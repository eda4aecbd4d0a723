-- KEYS: state, control. ARGV: expected current version, new version, the sync's token (unique per call), the
-- highest epoch any live worker has acked (a failover may have lost the state's last epochs: the new one is above it),
-- then the `weights` command's fields (name, value, ...) with the epoch left to this script to fill in.
-- Run again with the same token (redis-py retrying after a lost reply), it returns the epoch it began. A fleet asleep
-- (`begin_sleep.lua`) is paused already: its sync begins all the same, and wakes it.
-- include: _begin.lua
local state = redis.call('HMGET', KEYS[1], 'version', 'paused', 'epoch', 'sync_token', 'asleep')
local version = tonumber(state[1] or '0')
if replayed(KEYS[1], state, ARGV[3]) then return tonumber(state[3]) end
if state[2] == '1' and (state[5] or '0') == '0' then return redis.error_reply('a weight sync is already under way') end
if version ~= tonumber(ARGV[1]) then
  return redis.error_reply('version conflict: the state is at version ' .. version .. ', not ' .. ARGV[1])
end
local epoch = math.max(tonumber(state[3] or '0'), tonumber(ARGV[4])) + 1
redis.call('HSET', KEYS[1], 'paused', '1', 'epoch', epoch, 'pending_version', ARGV[2], 'version', version,
  'sync_token', ARGV[3], 'asleep', '0')
announce(KEYS[2], 5, epoch)
return epoch
