#!/usr/bin/env bash
# ensure-system.sh install        install what is missing of Debian's redis-server and g++
#                                 (g++ builds the engine's kernels: replica/kernels)
# ensure-system.sh test          also Debian's prometheus (promtool) and chromium (headless),
#                                 which the observability tests drive
# ensure-system.sh start [PORT]   also start a local redis-server on PORT (default 6379)
#                                 unless one already answers there
set -euo pipefail
port="${2:-6379}"

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v g++ >/dev/null 2>&1 || missing+=(g++)
if [ "${1:-install}" = test ]; then
    command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
    command -v chromium >/dev/null 2>&1 || missing+=(chromium)
fi
if [ "${#missing[@]}" -gt 0 ]; then
    echo "missing: installing Debian's ${missing[*]}" >&2
    sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ "${1:-install}" = start ]; then
    if redis-cli -p "$port" ping >/dev/null 2>&1; then
        echo "redis-server already answers on port $port" >&2
    else
        mkdir -p .run
        redis-server --port "$port" --bind 127.0.0.1 --daemonize yes --save "" --appendonly no \
            --pidfile "$PWD/.run/redis-$port.pid" --logfile "$PWD/.run/redis-$port.log"
        for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
        echo "started redis-server on port $port (pid file .run/redis-$port.pid)" >&2
    fi
fi
