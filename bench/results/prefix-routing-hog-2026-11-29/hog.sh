#!/bin/bash
# The replica bench beside a noisy neighbour: two CPU-bound Python processes at niceness 0 in a
# session of its own each (an autogroup each), as other tenants' busy jobs would be, for the whole run.
#   bash bench/results/prefix-routing-hog-2026-11-29/hog.sh OUTDIR [prefix_routing args...]
out=$1; shift
pids=()
for i in 1 2; do setsid .venv/bin/python -c 'while True: pass' --hog & pids+=($!); done
trap 'kill ${pids[@]}; sleep 1; ps -o pid,stat,cmd -p ${pids[@]} | tail -n +2' EXIT
ps -o pid,ni,sid,cmd -p ${pids[@]}
.venv/bin/python -m bench.prefix_routing --out "$out" "$@"
