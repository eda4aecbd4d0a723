-- KEYS: state, control. ARGV: version, uri, then the `resume` command's fields (name, value, ...).
redis.call('HSET', KEYS[1], 'version', ARGV[1], 'weights_uri', ARGV[2], 'paused', '0', 'pending_version', '')
redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
return 1
