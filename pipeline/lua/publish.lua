-- KEYS: the target stream (rollouts, scoring, or a gateway's replies), the source stream, the partials stream,
-- then the dedupe buckets `{ns}:published:{size}:{bucket}`, oldest first; the last is the current one.
-- ARGV: group, source entry id ('' for none: a replay, a gateway's finished session), bucket expiry (s),
-- partial count, then for each partial: field count, fields...; then for each rollout: prompt id, sample,
-- field count, fields...
-- The source entry is acked first: if it was no longer pending (another worker finished it first), nothing is
-- written and -1 comes back. A rollout is skipped when its sample's bit is set under its prompt id in any
-- bucket (the same id published within the dedupe TTL: a prompt submitted twice, a replay); otherwise it is
-- added and its bit set in the current bucket, a hash of prompt id -> bitmap of samples.
-- Each prompt's bitmaps are read once (one HGET a bucket, however many of its samples come) and its bits in the
-- current bucket written once, at the end.
-- Returns how many rollouts were added.
if ARGV[2] ~= '' and redis.call('XACK', KEYS[2], ARGV[1], ARGV[2]) == 0 then
  return -1
end
local at = 5
for p = 1, tonumber(ARGV[4]) do
  local count = tonumber(ARGV[at])
  redis.call('XADD', KEYS[3], '*', unpack(ARGV, at + 1, at + count))
  at = at + count + 1
end

-- Bits with arithmetic, not the `bit` library: the same script runs on fakeredis.
local function has(bits, sample)
  local byte = string.byte(bits, math.floor(sample / 8) + 1)
  return byte ~= nil and math.floor(byte / 2 ^ (sample % 8)) % 2 == 1
end

local function with(bits, sample)
  if has(bits, sample) then return bits end
  local i = math.floor(sample / 8) + 1
  if #bits < i then bits = bits .. string.rep('\0', i - #bits) end
  local byte = string.byte(bits, i) + 2 ^ (sample % 8)
  return string.sub(bits, 1, i - 1) .. string.char(byte) .. string.sub(bits, i + 1)
end

local current = KEYS[#KEYS]
local older = {}    -- prompt id -> its bitmaps in the buckets before the current one
local now = {}      -- prompt id -> its bitmap in the current bucket, with what this call added
local changed = {}  -- prompt ids whose current bitmap this call changed ...
local order = {}    -- ... in the order they came
local function seen(prompt, sample)
  if now[prompt] == nil then
    local found = {}
    for k = 4, #KEYS - 1 do
      local bits = redis.call('HGET', KEYS[k], prompt)
      if bits then found[#found + 1] = bits end
    end
    older[prompt] = found
    now[prompt] = redis.call('HGET', current, prompt) or ''
  end
  if has(now[prompt], sample) then return true end
  for _, bits in ipairs(older[prompt]) do
    if has(bits, sample) then return true end
  end
  return false
end

local added = 0
while at <= #ARGV do
  local prompt, sample, count = ARGV[at], tonumber(ARGV[at + 1]), tonumber(ARGV[at + 2])
  if not seen(prompt, sample) then
    if not changed[prompt] then
      changed[prompt] = true
      order[#order + 1] = prompt
    end
    now[prompt] = with(now[prompt], sample)
    redis.call('XADD', KEYS[1], '*', unpack(ARGV, at + 3, at + 2 + count))
    added = added + 1
  end
  at = at + 3 + count
end
for _, prompt in ipairs(order) do
  redis.call('HSET', current, prompt, now[prompt])
end
if added > 0 then redis.call('EXPIRE', current, ARGV[3]) end
return added
