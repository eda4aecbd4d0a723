#!/usr/bin/env bash
# Runs the two load-sensitive tests many times with CPU hogs beside them (issue 64 item 3).
cd /work/main
hogs=()
for i in 1 2 3; do python -c "while True: pass" & hogs+=($!); done
trap 'kill ${hogs[@]}' EXIT
for i in $(seq 1 10); do
  s=$SECONDS
  r=$(timeout 400 python -m pytest tests/pipeline/test_sentinel.py -q -n 0 -p no:randomly -k "stale_primary or made_a_replica" --basetemp=/tmp/ul-s$i 2>&1 | tail -1)
  echo "stale-primary run $i: $r ($((SECONDS-s)) s, load $(cut -d' ' -f1 /proc/loadavg))"
done
for i in $(seq 1 6); do
  s=$SECONDS
  r=$(timeout 400 python -m pytest benchmarks/tests/test_failover_chaos.py -q -n 0 -p no:randomly -k sigterm --basetemp=/tmp/ul-t$i 2>&1 | tail -1)

  echo "sigterm run $i: $r ($((SECONDS-s)) s, load $(cut -d' ' -f1 /proc/loadavg))"
done
