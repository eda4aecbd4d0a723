-- What `begin_sync.lua` and `begin_sleep.lua` share: each begins a pause of the fleet under a new epoch, and each is
-- run again with the same token when redis-py retries after a lost reply. Spliced in by `pipeline/lua.py` where a
-- script has the line `-- include: _begin.lua`; not a script itself.

-- Whether the state (`HMGET` of version, paused, epoch, sync_token) is paused under `token` already: this call again.
-- It writes the token once more all the same, so that a durability wait on this connection covers the first call's.
local function replayed(key, state, token)
  if state[2] == '1' and state[4] == token then
    redis.call('HSET', key, 'sync_token', token)
    return true
  end
  return false
end

-- Add the command whose fields (name, value, ...) are ARGV[first], ARGV[first + 1], ... to the stream `key`, with
-- `epoch` as the value of its `epoch` field.
local function announce(key, first, epoch)
  local command = {}
  for i = first, #ARGV, 2 do
    command[#command + 1] = ARGV[i]
    command[#command + 1] = (ARGV[i] == 'epoch') and tostring(epoch) or ARGV[i + 1]
  end
  redis.call('XADD', key, '*', unpack(command))
end
