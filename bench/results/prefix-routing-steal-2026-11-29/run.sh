#!/bin/bash
# The replica bench on a host whose cores are taken away ON ms in every ON+OFF ms (steal.py).
#   bash bench/results/prefix-routing-steal-2026-11-29/run.sh ON_MS OFF_MS OUTDIR [prefix_routing args...]
on=$1 off=$2 out=$3; shift 3
.venv/bin/python bench/results/prefix-routing-steal-2026-11-29/steal.py "$on" "$off" & steal=$!
trap 'kill $steal; wait $steal' EXIT
.venv/bin/python -m bench.prefix_routing --out "$out" "$@"
