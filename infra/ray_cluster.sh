#!/usr/bin/env bash
# Start a Ray head on this machine, or join one, for multi-node runs (docs/SCALE.md "Several machines").
#   infra/ray_cluster.sh head [RAY START ARGS]           # on the head node (port 6379 unless --port=...)
#   infra/ray_cluster.sh join HEAD:PORT [RAY START ARGS]  # on every other node
#   infra/ray_cluster.sh status [HEAD:PORT]               # nodes and their resources (`ray status`)
#   infra/ray_cluster.sh stop                             # `ray stop`: stops EVERY Ray process of this user here
# Placement: give each node a custom resource naming its job and point the roles at it, e.g.
#   infra/ray_cluster.sh head --resources='{"gen_node": 1}'
#   infra/ray_cluster.sh join 10.0.0.1:6379 --resources='{"train_node": 1}'
#   RAY_ADDRESS=10.0.0.1:6379 dapo train trainer.ray_resources.rollout='{gen_node: 1}' \
#       trainer.ray_resources.actor='{train_node: 1}'
# Other useful args: --num-cpus=N / --num-gpus=N (what the node offers), --temp-dir=DIR.
# The head runs the dashboard's job server for `dapo submit` on 127.0.0.1:8265; add --dashboard-host=0.0.0.0
# to take submissions from other machines (with token auth on).
# Token auth is on by default in Ray 2.60: set RAY_AUTH_MODE=token and the same RAY_AUTH_TOKEN (or
# ~/.ray/auth_token) on every node and on the driver (or RAY_AUTH_MODE=disabled everywhere, trusted networks
# only). Every node must see trainer.runs_dir, trainer.models_dir and the data at the same paths.
set -euo pipefail
cd "$(dirname "$0")/.."
RAY=.venv/bin/ray
case "${1:-}" in
  head) "$RAY" start --head --include-dashboard=true --disable-usage-stats "${@:2}" ;;
  join)
    [[ -n "${2:-}" ]] || { echo "usage: $0 join HEAD:PORT [ray start args]" >&2; exit 2; }
    "$RAY" start --address "$2" "${@:3}" ;;
  status) "$RAY" status ${2:+--address "$2"} ;;
  stop) "$RAY" stop ;;
  *) echo "usage: $0 head [args] | join HEAD:PORT [args] | status [HEAD:PORT] | stop" >&2; exit 2 ;;
esac
