-- KEYS: the worker's heartbeat hash, its inbox stream, the prompts stream, the workers set, the beats set.
-- ARGV: worker name, group, forget (1: the worker is leaving: drop its inbox too; 0: it may be dead).
-- Moves the work still in a departed worker's inbox (delivered or not) to the shared prompts stream,
-- where any worker takes it, and takes the worker off the registry and the beats set. Does nothing while the heartbeat
-- lives (returns -1). A worker that was only stalled and publishes later finds its entry gone: its
-- publish acks nothing and writes nothing (`publish.lua`), so the moved copy is the one delivered.
-- Returns how many entries were moved.
if redis.call('EXISTS', KEYS[1]) == 1 then
  return -1
end
local entries = redis.call('XRANGE', KEYS[2], '-', '+')
for _, entry in ipairs(entries) do
  redis.call('XADD', KEYS[3], '*', unpack(entry[2]))
  pcall(redis.call, 'XACK', KEYS[2], ARGV[2], entry[1])
  redis.call('XDEL', KEYS[2], entry[1])
end
redis.call('SREM', KEYS[4], ARGV[1])
redis.call('ZREM', KEYS[5], ARGV[1])
if ARGV[3] == '1' then
  redis.call('DEL', KEYS[2])
end
return #entries
