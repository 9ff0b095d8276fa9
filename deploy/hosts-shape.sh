#!/usr/bin/env bash
# Rate-limit both ends of deploy/hosts-check.sh's veth pair to RATE (tc tbf; a burst of 10 ms at that rate, at
# least 64 KiB). Run by hosts-check.sh, and by its probe between phases (it publishes at one rate, restores at
# others). Needs root.
#
#   bash deploy/hosts-shape.sh 100mbit
set -euo pipefail
STORE_NS=${STORE_NS:-kvh-store} WORKER_NS=${WORKER_NS:-kvh-worker}
rate=$1
n=${rate%bit}
bits=$(numfmt --from=si "${n^^}")
burst=$((bits / 8 / 100 > 65536 ? bits / 8 / 100 : 65536))
tc -n "$STORE_NS" qdisc replace dev kvh-s root tbf rate "$rate" burst "$burst" latency 50ms
tc -n "$WORKER_NS" qdisc replace dev kvh-w root tbf rate "$rate" burst "$burst" latency 50ms
