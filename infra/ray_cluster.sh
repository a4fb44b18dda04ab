#!/usr/bin/env bash
# Start a Ray head on this machine (or join one) for multi-node runs; the flow joins it with RAY_ADDRESS=auto.
#   infra/ray_cluster.sh head            # on the head node
#   infra/ray_cluster.sh join HEAD:6379  # on every worker node
#   infra/ray_cluster.sh stop            # `ray stop`: stops EVERY Ray process of this user on the machine
# Token auth is on by default in Ray 2.60: joining by explicit address needs RAY_AUTH_MODE=token on every node
# (or `disabled` everywhere); `address="auto"` on the head works as is.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  head) .venv/bin/ray start --head --include-dashboard=false "${@:2}" ;;
  join) .venv/bin/ray start --address "$2" "${@:3}" ;;
  stop) .venv/bin/ray stop ;;
  *) echo "usage: $0 head|join ADDR|stop" >&2; exit 2 ;;
esac
