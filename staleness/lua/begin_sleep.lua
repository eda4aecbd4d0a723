-- KEYS: state, control. ARGV: the sleep's level, the call's token (unique per call), then the `sleep` command's fields
-- (name, value, ...) with the epoch left to this script to fill in. The state must not be paused; it becomes paused,
-- `asleep` at the level, with a new epoch. Run again with the same token (redis-py retrying after a lost reply), it
-- returns the epoch it began.
local state = redis.call('HMGET', KEYS[1], 'version', 'paused', 'epoch', 'sync_token')
if state[2] == '1' and state[4] == ARGV[2] then
  -- A write all the same (the token again), so that a durability wait on this connection covers the first call's.
  redis.call('HSET', KEYS[1], 'sync_token', ARGV[2])
  return tonumber(state[3])
end
if state[2] == '1' then return redis.error_reply('a weight sync or a sleep is already under way') end
local epoch = tonumber(state[3] or '0') + 1
redis.call('HSET', KEYS[1], 'paused', '1', 'asleep', ARGV[1], 'epoch', epoch, 'version', state[1] or '0',
  'sync_token', ARGV[2])
local command = {}
for i = 3, #ARGV, 2 do
  command[#command + 1] = ARGV[i]
  command[#command + 1] = (ARGV[i] == 'epoch') and tostring(epoch) or ARGV[i + 1]
end
redis.call('XADD', KEYS[2], '*', unpack(command))
return epoch
