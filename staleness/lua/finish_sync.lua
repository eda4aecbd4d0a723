-- KEYS: state, control. ARGV: version, uri, then the `resume` command's fields (name, value, ...). Also ends a sleep.
redis.call('HSET', KEYS[1], 'version', ARGV[1], 'weights_uri', ARGV[2], 'paused', '0', 'pending_version', '',
  'asleep', '0')
redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
return 1
