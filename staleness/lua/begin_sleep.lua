-- KEYS: state, control. ARGV: the sleep's level, the call's token (unique per call), then the `sleep` command's fields
-- (name, value, ...) with the epoch left to this script to fill in. The state must not be paused; it becomes paused,
-- `asleep` at the level, with a new epoch. Run again with the same token (redis-py retrying after a lost reply), it
-- returns the epoch it began.
-- include: _begin.lua
local state = redis.call('HMGET', KEYS[1], 'version', 'paused', 'epoch', 'sync_token')
if replayed(KEYS[1], state, ARGV[2]) then return tonumber(state[3]) end
if state[2] == '1' then return redis.error_reply('a weight sync or a sleep is already under way') end
local epoch = tonumber(state[3] or '0') + 1
redis.call('HSET', KEYS[1], 'paused', '1', 'asleep', ARGV[1], 'epoch', epoch, 'version', state[1] or '0',
  'sync_token', ARGV[2])
announce(KEYS[2], 3, epoch)
return epoch
