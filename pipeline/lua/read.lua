-- KEYS: the streams to read, in the order to serve them. ARGV: group, consumer, count (in all, not per stream).
-- New entries (">") for the consumer: the first stream's, then the next's, until count are taken. One
-- XREADGROUP over several streams applies its COUNT to each, so a read with room for one entry took one
-- from each stream that had some (a partial and a prompt: five samples where four fit).
-- A stream without the group (deleted under its readers, or an inbox whose worker never joined) is skipped and
-- named, not an error: an error would not undo the reads before it, and their entries would be handed out unseen.
-- Returns, per stream, the entries read ({id, {field, value, ...}}, ...), then the list of streams skipped.
local result, skipped, left = {}, {}, tonumber(ARGV[3])
for k, stream in ipairs(KEYS) do
  result[k] = {}
  if left > 0 then
    local reply = redis.pcall('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', left, 'STREAMS', stream, '>')
    if type(reply) == 'table' and reply.err then
      local err = tostring(reply.err)  -- a string; fakeredis's is a Python object
      if not (string.find(err, 'NOGROUP') or string.find(err, 'requires the key to exist')) then
        return reply
      end
      skipped[#skipped + 1] = stream
    elseif reply and reply[1] then
      -- Redis answers {{stream, entries}} or nil; fakeredis hands a script {stream, entries} or {}.
      result[k] = reply[1][2] or reply[2]
      left = left - #result[k]
    end
  end
end
result[#KEYS + 1] = skipped
return result
