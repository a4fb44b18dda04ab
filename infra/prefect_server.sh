#!/usr/bin/env bash
# Start / stop a local Prefect server for deployments and the UI (state in $PREFECT_HOME, default ./.prefect).
#   infra/prefect_server.sh start|stop|status
# `start` waits up to PREFECT_START_TIMEOUT_S seconds (default 180) for the server to answer, with a line every 15 s.
# `start` also installs the automation that marks flow runs Crashed when their heartbeats stop (the host or the
# flow-run process died): infra/zombie_automation.py, ZOMBIE_WITHIN_S seconds without a heartbeat (default 90;
# `dapo deploy` makes flow runs beat every 30 s).
# PREFECT_PORT (default 4200) and PREFECT_HOST (default 127.0.0.1) choose where it listens; its UI talks to this
# server's own API (PREFECT_UI_API_URL, set here unless given: the UI otherwise takes PREFECT_API_URL or port 4200).
# Its address opens the UI the README and tests/integration/test_browser_ui.py describe (Prefect's classic UI:
# run form, Artifacts tab, Retry); Prefect 3.9 would otherwise redirect `/` to its new UI at /v2
# (PREFECT_SERVER_UI_V2_ENABLED=true restores that; either UI offers a switch to the other).
# At scale, point PREFECT_API_DATABASE_CONNECTION_URL at PostgreSQL (see infra/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
export PREFECT_HOME="${PREFECT_HOME:-$PWD/.prefect}"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
PIDFILE="$PREFECT_HOME/server.pid"
PORT="${PREFECT_PORT:-4200}"
HOST="${PREFECT_HOST:-127.0.0.1}"
ASK="$HOST"; [ "$HOST" = "0.0.0.0" ] && ASK=127.0.0.1  # where this script checks health
SEEN="$HOST"; [ "$HOST" = "0.0.0.0" ] && SEEN="$(hostname -f 2>/dev/null || hostname)"  # where a browser finds it
export PREFECT_UI_API_URL="${PREFECT_UI_API_URL:-${PREFECT_SERVER_UI_API_URL:-http://$SEEN:$PORT/api}}"
export PREFECT_SERVER_UI_V2_ENABLED="${PREFECT_SERVER_UI_V2_ENABLED:-false}"
PREFECT_BIN=.venv/bin/prefect; [ -x "$PREFECT_BIN" ] || PREFECT_BIN="$(command -v prefect)"
PYTHON_BIN=.venv/bin/python; [ -x "$PYTHON_BIN" ] || PYTHON_BIN="$(command -v python)"
alive() { kill -0 "$1" 2>/dev/null && ! grep -qs '^State:.*Z' "/proc/$1/status"; }  # a zombie is not alive
case "${1:-start}" in
  start)
    mkdir -p "$PREFECT_HOME"
    if [ -f "$PIDFILE" ] && alive "$(cat "$PIDFILE")"; then echo "already running (pid $(cat "$PIDFILE"))"; exit 0; fi
    if curl -sf "http://$ASK:$PORT/api/health" >/dev/null; then
      echo "another Prefect server already answers on port $PORT (not the one of PREFECT_HOME=$PREFECT_HOME): stop it or pick PREFECT_PORT" >&2; exit 1; fi
    PREFECT_API_URL="http://$ASK:$PORT/api" nohup "$PREFECT_BIN" server start --host "$HOST" --port "$PORT" >"$PREFECT_HOME/server.log" 2>&1 &
    echo $! >"$PIDFILE"
    WAIT_S="${PREFECT_START_TIMEOUT_S:-180}"  # a loaded machine has been seen to need > 2 minutes
    for i in $(seq 1 "$WAIT_S"); do
      if ! alive "$(cat "$PIDFILE")"; then
        rm -f "$PIDFILE"; echo "the Prefect server exited; see $PREFECT_HOME/server.log" >&2; exit 1; fi
      if curl -sf "http://$ASK:$PORT/api/health" >/dev/null; then
        echo "Prefect server up: UI http://$SEEN:$PORT  API http://$SEEN:$PORT/api (pid $(cat "$PIDFILE"))"
        PREFECT_API_URL="http://$ASK:$PORT/api" "$PYTHON_BIN" infra/zombie_automation.py --within "${ZOMBIE_WITHIN_S:-90}"
        echo "export PREFECT_API_URL=http://$SEEN:$PORT/api"; exit 0; fi
      if [ $((i % 15)) -eq 0 ]; then echo "waiting for the Prefect server to answer on port $PORT ($i s of $WAIT_S s)"; fi
      sleep 1
    done
    echo "the Prefect server did not become healthy within $WAIT_S s; see $PREFECT_HOME/server.log (on a loaded machine raise PREFECT_START_TIMEOUT_S)" >&2; exit 1 ;;
  stop)
    # SIGTERM: a server started in the background of a script ignores SIGINT
    if [ -f "$PIDFILE" ] && PID="$(cat "$PIDFILE")" && kill -TERM "$PID" 2>/dev/null; then
      for _ in $(seq 1 30); do alive "$PID" || break; sleep 1; done
      kill -KILL "$PID" 2>/dev/null || true
      rm -f "$PIDFILE"; echo stopped
    else rm -f "$PIDFILE"; echo "not running"; fi ;;
  status)
    curl -sf "http://$ASK:$PORT/api/health" && echo " healthy" || echo "not running" ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
