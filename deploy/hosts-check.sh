#!/usr/bin/env bash
# Hosts, simulated: the store (Redis and an S3 server) and a worker in network namespaces of their own,
# joined by a veth pair whose two ends are rate-limited with tc tbf (deploy/hosts-shape.sh). On the worker
# host, `python -m gateway.pool.bench.hosts` evaluates each prompt cold and publishes it across the link at
# PUBLISH_RATE, then, at each rate in RATES, measures the time to first token of the prompt restored from
# the other host and as the worker chooses by its own estimates; one JSON line per length and rate goes to
# OUT. Needs root (ip netns, tc) and the set-up's venv (its weed binary, redis-server).
#
#   sudo bash deploy/hosts-check.sh                        # SmolLM2, 100 Mbit/s, 1 and 10 Gbit/s, 2k and 8k tokens
#   RATES="100mbit 1gbit" LENGTHS=2048 bash deploy/hosts-check.sh
#   MODEL=.kvpool/models/kvpool-bench-s0.gguf bash deploy/hosts-check.sh   # the bench model (kvpool model make --size bench)
#   PUBLISH_RATE=1gbit RATES="1gbit 4mbit" ...             # published at 1 Gbit/s, restored at 1 Gbit/s and 4 Mbit/s
#
# Only the namespaces' own addresses (10.77.0.1 and 10.77.0.2, made here and removed on exit) carry traffic.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.kvpool/venv}
MODEL=${MODEL:-.kvpool/models/SmolLM2-135M-Instruct.Q4_1.gguf}
RATES=${RATES:-"100mbit 1gbit 10gbit"}
PUBLISH_RATE=${PUBLISH_RATE:-10gbit}
LENGTHS=${LENGTHS:-2048,8192}
OUT=${OUT:-/tmp/kvpool-hosts.jsonl}
STORE_NS=kvh-store WORKER_NS=kvh-worker
STORE_IP=10.77.0.1 WORKER_IP=10.77.0.2
WORK=$(mktemp -d /tmp/kvpool-hosts.XXXXXX)
PIDS=()

cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    ip netns del "$STORE_NS" 2>/dev/null || true
    ip netns del "$WORKER_NS" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

[ -f "$MODEL" ] || { echo "no model at $MODEL (kvpool model fetch, or kvpool model make --size bench)" >&2; exit 1; }
ip netns add "$STORE_NS"
ip netns add "$WORKER_NS"
ip link add kvh-s type veth peer name kvh-w
ip link set kvh-s netns "$STORE_NS"
ip link set kvh-w netns "$WORKER_NS"
ip -n "$STORE_NS" addr add "$STORE_IP/24" dev kvh-s
ip -n "$WORKER_NS" addr add "$WORKER_IP/24" dev kvh-w
for ns in "$STORE_NS" "$WORKER_NS"; do ip -n "$ns" link set lo up; done
ip -n "$STORE_NS" link set kvh-s up
ip -n "$WORKER_NS" link set kvh-w up

# The store host: Redis and SeaweedFS's S3 server (its own ports: nothing else listens in this namespace).
ip netns exec "$STORE_NS" redis-server --bind "$STORE_IP" --port 6379 --protected-mode no --save "" --appendonly no >"$WORK/redis.log" 2>&1 &
PIDS+=($!)
cat >"$WORK/s3.json" <<'JSON'
{"identities": [{"name": "kvpool", "credentials": [{"accessKey": "kvpool-hosts", "secretKey": "kvpool-hosts-secret"}],
                 "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
JSON
printf '[master.volume_growth]\ncopy_1 = 1\n' >"$WORK/master.toml"
mkdir -p "$WORK/s3"
(cd "$WORK" && exec ip netns exec "$STORE_NS" "$OLDPWD/$VENV/bin/weed" server -dir="$WORK/s3" -ip="$STORE_IP" -ip.bind="$STORE_IP" \
    -s3 -s3.port=8333 -s3.config="$WORK/s3.json" -s3.port.iceberg=0 -s3.port.lance=0 -master.telemetry=false \
    -master.electionTimeout=1s -volume.max=100 >"$WORK/weed.log" 2>&1) &
PIDS+=($!)
for _ in $(seq 1 600); do
    ip netns exec "$WORKER_NS" curl -sf -o /dev/null "http://$STORE_IP:8333/healthz" && break
    sleep 0.1
done
ip netns exec "$WORKER_NS" curl -sf -o /dev/null "http://$STORE_IP:8333/healthz" || { tail -20 "$WORK/weed.log"; exit 1; }

export KVPOOL_REDIS_URL="redis://$STORE_IP:6379/0"
export KVPOOL_STORE_URL=s3://kvpool-hosts/chunks KVPOOL_S3_ENDPOINT_URL="http://$STORE_IP:8333"
export KVPOOL_S3_ACCESS_KEY_ID=kvpool-hosts KVPOOL_S3_SECRET_ACCESS_KEY=kvpool-hosts-secret
export KVPOOL_READ_TIMEOUT_S=120 KVPOOL_LOG_LEVEL=WARNING
: >"$OUT"
echo "== $(basename "$MODEL"): published at $PUBLISH_RATE, restored at $RATES, lengths $LENGTHS" >&2
# shellcheck disable=SC2086
ip netns exec "$WORKER_NS" "$VENV/bin/python" -m gateway.pool.bench.hosts --model "$MODEL" --lengths "$LENGTHS" \
    --shape deploy/hosts-shape.sh --publish-rate "$PUBLISH_RATE" $(printf -- '--rate %s ' $RATES) --salt "$(date +%s)" |
    while read -r line; do echo "{\"model\": \"$(basename "$MODEL")\", \"result\": $line}"; done | tee -a "$OUT"
echo "wrote $OUT" >&2
