-- KEYS: the stream the entry came from, the dead-letter stream `{ns}:dead`.
-- ARGV: the consumer group, the entry id, then the dead letter's fields (name, value, ...).
-- Acks the entry and adds its dead letter only if the entry was still pending: one that another reader
-- already finished or dead-lettered (a claim that raced with it, a call retried after its reply was lost)
-- adds nothing. Returns 1 if the dead letter was added, 0 if not.
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then
  return 0
end
redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
return 1
