#!/usr/bin/env bash
# A local stack for ringtrain on one machine, all on loopback: a Ray head exporting metrics on
# port 8080, Prometheus scraping it (infra/prometheus.yml) and an S3-compatible server (moto,
# infra/s3_server.py) with a bucket for checkpoints.
#
#   infra/local-stack.sh start    start the three; their PIDs go to $RINGTRAIN_STACK_DIR/pids
#   infra/local-stack.sh env      print the exports that point ringtrain at them
#   infra/local-stack.sh status   show which of them are running
#   infra/local-stack.sh stop     stop exactly the processes `start` started, by PID
#
#   eval "$(infra/local-stack.sh env)" && ringtrain run jobs/quickstart.yaml
#
# Needs: PYTHON with ringtrain's dependencies (make venv) and moto's server (moto[s3,server],
# flask, flask-cors: make venv-test installs them), and Debian's prometheus (make tools); `start`
# names whatever is missing, and how to get it, before it starts anything.
#
# Every port listens on 127.0.0.1 only, the Ray head's own ones included (GCS, raylet, object
# manager, agents, dashboard, client server, metrics): Ray is told the node is a cluster of one
# (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0), else it would swap 127.0.0.1 for the machine's routable
# address and listen on every interface.
#
# The Ray head authenticates with a token (RAY_AUTH_MODE=token): `start` generates one and keeps
# it in $RINGTRAIN_STACK_DIR/auth_token (mode 0600), never printing it; `env` exports that file's
# path as RAY_AUTH_TOKEN_PATH, which ringtrain, Ray's CLI and Ray's clients read. Every other
# local user reaches the loopback ports too; without the token they cannot run code on the head.
#
# The S3 server answers only the stack's own credentials: a random access key of an IAM user it
# makes at its start, kept in $RINGTRAIN_STACK_DIR/s3_credentials (mode 0600, an AWS shared
# credentials file) and never printed; moto's control API, which could turn that check off, is
# refused. `env` exports the file's path (AWS_SHARED_CREDENTIALS_FILE) with the endpoint, and the
# Ray head runs with the same settings, so a job submitted to the stack reads and writes the
# stack's S3 with no --env.
#
# The head runs on PYTHON (the repo's .venv by default), and `env` exports that interpreter as
# RINGTRAIN_CLUSTER_PYTHON: `ringtrain submit` runs jobs with it, so a job finds ringtrain's
# dependencies whatever `python` the PATH of the shell that ran `start` holds.
#
# Ray's temp folder must be this user's own: one that is a link, not a folder, or another
# user's (made first by someone else in /tmp, say) is refused with exit 2; an open one of ours
# is made 0700. Ray itself runs in its `ray` subfolder: Ray makes every folder it uses
# world-writable (0777), which behind a 0700 parent nobody else can reach.
#
# It never runs `ray stop`, which would kill every Ray process on the machine: the Ray head is
# started with --block, and stopping that one process stops the processes it started.
#
# Settings (environment), each port with its default; `start` names the variable of each port
# it finds taken (another Ray head or an embedded `ringtrain run` on the machine, say):
#   RAY_PORT (6379: the GCS), RAY_DASHBOARD_PORT (8265: the dashboard and job API),
#   RAY_AGENT_PORT (52365: the job agent), RAY_CLIENT_PORT (10001: the Ray client server),
#   METRICS_PORT (8080), PROMETHEUS_PORT (9090), S3_PORT (9000),
#   S3_BUCKET (ringtrain), RINGTRAIN_STACK_DIR (state, logs; default .ringtrain-cache/local-stack),
#   RAY_TEMP_DIR (default /tmp/ringtrain-ray-<uid>: Ray's socket paths must stay short; Ray
#   unpacks every job's files there), PYTHON. Prometheus reads infra/prometheus.yml with the
#   metrics and Prometheus ports put in.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STATE_DIR=${RINGTRAIN_STACK_DIR:-$REPO/.ringtrain-cache/local-stack}
# Absolute: `env` hands out paths inside it.
[[ $STATE_DIR == /* ]] || STATE_DIR=$PWD/$STATE_DIR
PID_FILE=$STATE_DIR/pids
LOG_DIR=$STATE_DIR/logs
TOKEN_FILE=$STATE_DIR/auth_token
# The interpreter the head runs, as `start` found it (`env` exports it).
PYTHON_FILE=$STATE_DIR/cluster_python
# The S3 server's credentials (infra/s3_server.py writes them; they die with the stack).
CREDENTIALS_FILE=$STATE_DIR/s3_credentials
PROMETHEUS_CONFIG=$STATE_DIR/prometheus.yml
RAY_TEMP_DIR=${RAY_TEMP_DIR:-/tmp/ringtrain-ray-$(id -u)}
RAY_PORT=${RAY_PORT:-6379}
RAY_DASHBOARD_PORT=${RAY_DASHBOARD_PORT:-8265}
RAY_AGENT_PORT=${RAY_AGENT_PORT:-52365}
RAY_CLIENT_PORT=${RAY_CLIENT_PORT:-10001}
METRICS_PORT=${METRICS_PORT:-8080}
PROMETHEUS_PORT=${PROMETHEUS_PORT:-9090}
S3_PORT=${S3_PORT:-9000}
S3_BUCKET=${S3_BUCKET:-ringtrain}
S3_REGION=us-east-1
START_TIMEOUT_S=60
STOP_TIMEOUT_S=30

if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON=$REPO/.venv/bin/python; else PYTHON=python3; fi
fi

# What each service's command line contains; `stop` kills a PID only when its command line
# still matches, so a PID reused by an unrelated process after a reboot is left alone.
marker() {
    case "$1" in
        ray) echo "start --head --block" ;;
        prometheus) echo "--config.file=$PROMETHEUS_CONFIG" ;;
        s3) echo "infra/s3_server.py --port" ;;
        *) return 1 ;;
    esac
}

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
}

log() { echo "local-stack: $*" >&2; }

cmdline() {
    if [[ -r /proc/$1/cmdline ]]; then
        tr '\0' ' ' <"/proc/$1/cmdline"
    else
        ps -p "$1" -o command= 2>/dev/null || true
    fi
}

# Running and still the process we started?
ours() {
    local name=$1 pid=$2
    kill -0 "$pid" 2>/dev/null && [[ "$(cmdline "$pid")" == *"$(marker "$name")"* ]]
}

port_open() {
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# Every port the stack listens on, free on 127.0.0.1, else one line naming each taken port and
# the variable that moves it (exit 1; nothing started).
check_ports() {
    local taken=() names=() name
    for name in RAY_PORT RAY_DASHBOARD_PORT RAY_AGENT_PORT RAY_CLIENT_PORT METRICS_PORT PROMETHEUS_PORT S3_PORT; do
        if port_open "${!name}"; then
            taken+=("${!name} ($name)")
            names+=("$name=<free port>")
        fi
    done
    if ((${#taken[@]})); then
        local list
        list=$(printf ', %s' "${taken[@]}")
        log "ports in use on 127.0.0.1: ${list:2} (another Ray head, or an embedded ringtrain run, holds them): move each with its variable, e.g. ${names[*]} $0 start"
        exit 1
    fi
}

wait_for_port() {
    local name=$1 pid=$2 port=$3 waited=0
    until port_open "$port"; do
        if ! kill -0 "$pid" 2>/dev/null; then
            log "$name exited while starting; the end of $LOG_DIR/$name.log:"
            tail -n 20 "$LOG_DIR/$name.log" >&2 || true
            return 1
        fi
        if ((waited >= START_TIMEOUT_S * 10)); then
            log "$name did not open port $port within ${START_TIMEOUT_S}s (see $LOG_DIR/$name.log)"
            return 1
        fi
        sleep 0.1
        waited=$((waited + 1))
    done
}

require() {
    local what=$1 hint=$2
    shift 2
    if ! "$@" >/dev/null 2>&1; then
        log "$what is missing: $hint"
        exit 1
    fi
}

record() {
    echo "$1 $2" >>"$PID_FILE"
}

# Bad input (a temp folder we must not use): one line naming it, exit 2, nothing started.
refuse() {
    log "$*"
    exit 2
}

# $1 as a folder only this user can enter: made 0700 when missing; refused when it is a link,
# not a folder, or another user's. In a sticky /tmp nobody else can rename or replace a folder
# of ours once checked.
private_dir() {
    local dir=$1
    if [[ ! -e $dir && ! -L $dir ]]; then
        mkdir -p -- "$(dirname -- "$dir")"
        # Fails when someone made it meanwhile: that one is checked below like any other.
        mkdir -m 700 -- "$dir" 2>/dev/null || true
    fi
    if [[ -L $dir || ! -d $dir ]]; then
        refuse "RAY_TEMP_DIR $dir is a link or not a folder; remove it, or set RAY_TEMP_DIR to a folder of your own"
    fi
    if [[ ! -O $dir ]]; then
        local owner
        owner=$("$PYTHON" -c "import os, sys; print(os.lstat(sys.argv[1]).st_uid)" "$dir" 2>/dev/null) || owner="?"
        refuse "RAY_TEMP_DIR $dir belongs to another user (uid $owner), who could plant code in it; remove it, or set RAY_TEMP_DIR to a folder of your own"
    fi
    chmod 700 -- "$dir"
}

cmd_start() {
    if [[ -s "$PID_FILE" ]]; then
        while read -r name pid; do
            if ours "$name" "$pid"; then
                log "already running ($name, PID $pid); run '$0 stop' first"
                exit 1
            fi
        done <"$PID_FILE"
        rm -f "$PID_FILE"
    fi
    private_dir "$RAY_TEMP_DIR"
    require "ray" "install the project (make venv) or set PYTHON" "$PYTHON" -c "import ray"
    require "prometheus" "apt-get install --no-install-recommends prometheus (make tools does it)" command -v prometheus
    require "moto, the S3 server," "$PYTHON -m pip install 'moto[s3,server]' flask flask-cors (make venv-test installs them)" \
        "$PYTHON" -c "import moto.server, moto.iam, flask, flask_cors"
    check_ports
    mkdir -p "$LOG_DIR"
    chmod 700 "$STATE_DIR"
    # Made before anything starts: a token that only exists after `start` could be lost with it.
    new_token
    # The path Python reports for itself: a venv's interpreter stays the venv's (a resolved
    # symlink would be the base Python, without the venv's packages).
    "$PYTHON" -c "import sys; print(sys.executable)" >"$PYTHON_FILE"
    sed -e "s/127\.0\.0\.1:8080/127.0.0.1:$METRICS_PORT/" -e "s/127\.0\.0\.1:9090/127.0.0.1:$PROMETHEUS_PORT/" \
        "$REPO/infra/prometheus.yml" >"$PROMETHEUS_CONFIG"
    trap 'log "start failed; stopping what was started"; cmd_stop' ERR
    # Job control on: each service runs in a process group of its own, whose id is its PID, so
    # `stop` can also reach what a service started and left behind.
    set -m

    # Token authentication on: loopback ports are open to every user of this machine. The token
    # goes in through the environment (readable by this user only), never the command line.
    # Ray runs on PYTHON itself (its workers too), whatever `ray` the PATH holds.
    # A cluster of one (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0): every Ray port on 127.0.0.1. The
    # stack's S3 settings go to every job through the head's environment, the user's own AWS
    # credentials left out (they would win over the stack's file).
    env -u AWS_ACCESS_KEY_ID -u AWS_SECRET_ACCESS_KEY -u AWS_SESSION_TOKEN -u AWS_PROFILE -u AWS_ENDPOINT_URL_S3 \
        AWS_ENDPOINT_URL="http://127.0.0.1:$S3_PORT" AWS_SHARED_CREDENTIALS_FILE="$CREDENTIALS_FILE" \
        AWS_DEFAULT_REGION="$S3_REGION" RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 \
        RAY_AUTH_MODE=token RAY_AUTH_TOKEN="$(cat "$TOKEN_FILE")" RAY_USAGE_STATS_ENABLED=0 "$PYTHON" -m ray.scripts.scripts start --head --block \
        --node-ip-address=127.0.0.1 --port="$RAY_PORT" --ray-client-server-port="$RAY_CLIENT_PORT" \
        --dashboard-host=127.0.0.1 --dashboard-port="$RAY_DASHBOARD_PORT" --dashboard-agent-listen-port="$RAY_AGENT_PORT" \
        --metrics-export-port="$METRICS_PORT" --temp-dir="$RAY_TEMP_DIR/ray" \
        </dev/null >"$LOG_DIR/ray.log" 2>&1 &
    local ray_pid=$!
    record ray "$ray_pid"
    wait_for_port ray "$ray_pid" "$RAY_PORT"

    prometheus --config.file="$PROMETHEUS_CONFIG" \
        --web.listen-address="127.0.0.1:$PROMETHEUS_PORT" \
        --storage.tsdb.path="$STATE_DIR/prometheus-data" \
        </dev/null >"$LOG_DIR/prometheus.log" 2>&1 &
    record prometheus $!
    wait_for_port prometheus $! "$PROMETHEUS_PORT"

    "$PYTHON" "$REPO/infra/s3_server.py" --port "$S3_PORT" --bucket "$S3_BUCKET" --credentials "$CREDENTIALS_FILE" \
        </dev/null >"$LOG_DIR/s3.log" 2>&1 &
    record s3 $!
    wait_for_port s3 $! "$S3_PORT"
    set +m
    # The metrics agent comes up a few seconds after the head's GCS port; wait for it too, so
    # Prometheus' first scrapes succeed.
    wait_for_port ray "$ray_pid" "$METRICS_PORT"
    trap - ERR

    log "started; PIDs in $PID_FILE, logs in $LOG_DIR"
    log "Ray dashboard http://127.0.0.1:$RAY_DASHBOARD_PORT, Prometheus http://127.0.0.1:$PROMETHEUS_PORT, S3 http://127.0.0.1:$S3_PORT (bucket $S3_BUCKET)"
    log "Ray runs on $(cat "$PYTHON_FILE"); its auth token is in $TOKEN_FILE, the S3 credentials in $CREDENTIALS_FILE (mode 0600, never printed)"
    log "point ringtrain at it with: eval \"\$($0 env)\""
}

# A fresh random token in $TOKEN_FILE, readable by this user only (a file left from an earlier
# stack is replaced, not reused: a redirection into it would keep its old mode).
new_token() {
    rm -f "$TOKEN_FILE"
    (umask 077 && "$PYTHON" -c "import secrets; print(secrets.token_hex(32))" >"$TOKEN_FILE")
}

cmd_env() {
    if [[ ! -s "$TOKEN_FILE" ]]; then
        log "no token in $TOKEN_FILE: run '$0 start' first"
        exit 1
    fi
    local python
    python=$(cat "$PYTHON_FILE" 2>/dev/null) || python=$("$PYTHON" -c "import sys; print(sys.executable)")
    # %q: paths with spaces survive `eval`.
    cat <<EOF
export RAY_ADDRESS=127.0.0.1:$RAY_PORT
export RAY_API_SERVER_ADDRESS=http://127.0.0.1:$RAY_DASHBOARD_PORT
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH=$(printf %q "$TOKEN_FILE")
unset RAY_AUTH_TOKEN
export RINGTRAIN_CLUSTER_PYTHON=$(printf %q "$python")
export AWS_ENDPOINT_URL=http://127.0.0.1:$S3_PORT
export AWS_SHARED_CREDENTIALS_FILE=$(printf %q "$CREDENTIALS_FILE")
export AWS_DEFAULT_REGION=$S3_REGION
unset AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_SESSION_TOKEN AWS_PROFILE AWS_ENDPOINT_URL_S3
# checkpoint.uri=s3://$S3_BUCKET/<prefix>; metrics: http://127.0.0.1:$PROMETHEUS_PORT
EOF
}

cmd_status() {
    if [[ ! -s "$PID_FILE" ]]; then
        echo "not running"
        return 0
    fi
    while read -r name pid; do
        if ours "$name" "$pid"; then echo "$name: running (PID $pid)"; else echo "$name: stopped (PID $pid)"; fi
    done <"$PID_FILE"
}

cmd_stop() {
    # The token and the S3 credentials die with the stack: the next `start` makes new ones.
    rm -f "$TOKEN_FILE" "$PYTHON_FILE" "$CREDENTIALS_FILE"
    if [[ ! -s "$PID_FILE" ]]; then
        log "nothing to stop ($PID_FILE is absent)"
        rm -f "$PID_FILE"
        return 0
    fi
    local -a names=() pids=()
    while read -r name pid; do
        names+=("$name")
        pids+=("$pid")
    done <"$PID_FILE"
    # Newest first: the S3 server and Prometheus, then Ray.
    local i
    for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
        stop_one "${names[i]}" "${pids[i]}"
    done
    rm -f "$PID_FILE"
}

# Is the process (target PID) or a member of the process group (target -PID) alive? Zombies,
# which only wait for their parent to reap them, do not count.
alive() {
    local target=$1
    if [[ $target == -* ]]; then
        ps -A -o pgid= -o stat= | awk -v pgid="${target#-}" '$1 == pgid && $2 !~ /^Z/ {found = 1} END {exit !found}'
    else
        ps -p "$target" -o stat= | awk '$1 !~ /^Z/ {found = 1} END {exit !found}'
    fi
}

# SIGTERM a process (target PID) or a process group (target -PID), wait until it is gone, and
# SIGKILL it if it outlives the timeout.
terminate() {
    local target=$1 timeout_s=$2 waited=0
    kill -TERM -- "$target" 2>/dev/null || return 0
    while alive "$target" && ((waited < timeout_s * 10)); do
        sleep 0.1
        waited=$((waited + 1))
    done
    if alive "$target"; then
        log "$target ignored SIGTERM for ${timeout_s}s; sending SIGKILL"
        kill -KILL -- "$target" 2>/dev/null || true
    fi
}

stop_one() {
    local name=$1 pid=$2
    if alive "$pid"; then
        if ! ours "$name" "$pid"; then
            log "PID $pid is no longer $name; leaving it alone"
            return 0
        fi
        # The service first, alone, so that it shuts down its own children in order (the Ray
        # head stops its GCS, raylet and dashboard).
        terminate "$pid" "$STOP_TIMEOUT_S"
        log "stopped $name (PID $pid)"
    else
        log "$name (PID $pid) is not running"
    fi
    # Then whatever is left in its process group. Linux never hands out a PID that is still a
    # process group's id, so a group with this id is the one `start` created.
    if alive "-$pid"; then
        log "stopping what $name left in its process group $pid"
        terminate "-$pid" 5
    fi
}

case "${1:-}" in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    env) cmd_env ;;
    -h | --help | help) usage ;;
    *)
        usage >&2
        exit 2
        ;;
esac
