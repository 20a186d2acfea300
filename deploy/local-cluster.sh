#!/usr/bin/env bash
# A multi-node splitkey cluster on this machine: a Ray head and N Ray worker nodes
# (`ray start`, each its own ports, temp dir and resources), and `splitkey serve`
# joined to them; everything on loopback, Ray token auth on. `down` stops exactly the
# processes `up` started. Linux only. deploy/README.md "Local multi-node cluster".
set -euo pipefail

PROG=${0##*/}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
HELPER=$HERE/local_cluster.py
MARKER=SPLITKEY_LOCAL_CLUSTER  # set to the state dir in the environment of everything started
# Seconds from SIGTERM to SIGKILL: a worker node exits in a few; the head's GCS and
# `ray start` wait for a drain that nothing needs once the workers are gone.
WORKER_GRACE=10
HEAD_GRACE=5

if [[ -z ${PYTHON:-} ]]; then
  if [[ -n ${VIRTUAL_ENV:-} && -x $VIRTUAL_ENV/bin/python ]]; then
    PYTHON=$VIRTUAL_ENV/bin/python
  elif [[ -x $ROOT/.venv/bin/python ]]; then  # the README's install
    PYTHON=$ROOT/.venv/bin/python
  else
    PYTHON=python3
  fi
fi

usage() {
  cat <<EOF
usage: $PROG up N [--name NAME] [--port P] [--workers-per-node W] [--api-key-file PATH]
                   [--object-store-bytes B] [--shutdown-grace S] [--timeout S] [-- SERVE_ARGS...]
       $PROG status [--name NAME]
       $PROG down [--name NAME]
       $PROG --help

up      Start a Ray head (no CPUs: shard workers go to the worker nodes) and N Ray
        worker nodes with W CPUs each (default 1) on 127.0.0.1, Ray token auth on, then
        \`splitkey serve --ray-address\` joined to them with N*W shard workers, on
        --port (default: a free port). Waits for /readyz (--timeout, default 180 s;
        on failure it stops what it started), then prints URL=, RAY_ADDRESS= and
        STATE_DIR=. Arguments after -- go to \`splitkey serve\` as they are.
        --object-store-bytes: each node's Ray object store (default 1 GiB).
        --shutdown-grace: serve's drain on SIGTERM (default 5 s).
status  The processes of the cluster and /readyz; exit 0 when all run and it is ready.
down    SIGTERM what up started (serve first, then the Ray nodes), SIGKILL what is
        left after the grace, and remove the state dir. Exit 1 if no such cluster.

NAME    default "local"; letters, digits, - and _ (at most 20).
State   \${SPLITKEY_CLUSTER_DIR:-\${XDG_RUNTIME_DIR:-/tmp}}/splitkey-NAME: the Ray auth
        token (mode 600), PID files, logs/ (every node and serve), ray/ (each node's
        Ray temp dir, its sessions and logs).
PYTHON  the interpreter with Ray and splitkey (default \$VIRTUAL_ENV/bin/python if a
        virtual environment is active, else $ROOT/.venv/bin/python if it exists, the
        README's install, else python3). serve runs as
        "\$PYTHON -m service.cli serve" from $ROOT.
EOF
}

die() {
  echo "$PROG: $*" >&2
  exit 1
}

NAME=local
set_dir() {
  [[ $NAME =~ ^[A-Za-z0-9_-]{1,20}$ ]] || die "--name must be 1-20 letters, digits, - or _, got '$NAME'"
  BASE=${SPLITKEY_CLUSTER_DIR:-${XDG_RUNTIME_DIR:-/tmp}}
  DIR=$BASE/splitkey-$NAME
  if [[ -e $DIR && ! -O $DIR ]]; then die "$DIR belongs to another user: not touching it"; fi
}

# -- processes ---------------------------------------------------------------------------
# Every process up starts leads a new session (setsid) whose id, its PID, is in
# pids/ROLE.pid, and carries MARKER=DIR in its environment. Ray's processes (GCS,
# raylet, agents, workers) stay in their node's session, though not in its process
# group (the raylet gives each worker a group of its own), and the environment a
# process shows may be overwritten by its title (setproctitle): a session is what
# identifies them. Linux keeps a session id from being reused while any process is
# in the session, so the ids recorded cannot name someone else's processes unless
# the whole session ended and a new leader took its number: that one would lack
# the marker, and its session is left alone.
ours() {
  grep -qzxF "$MARKER=$DIR" "/proc/$1/environ" 2>/dev/null
}

roles() {
  local f
  for f in "$DIR"/pids/*.pid; do
    [[ -e $f ]] && basename "$f" .pid
  done
  return 0
}

# The PIDs in the sessions of the given roles.
session_pids() {
  local role sid stat leader_sid
  for role; do
    sid=$(cat "$DIR/pids/$role.pid" 2>/dev/null) || continue
    [[ $sid =~ ^[0-9]+$ ]] || continue
    stat="" leader_sid=""
    read -r stat leader_sid < <(ps -o stat=,sid= -p "$sid" 2>/dev/null) || true
    if [[ $leader_sid == "$sid" && $stat != Z* ]] && ! ours "$sid"; then
      continue  # a new session took the number
    fi
    ps -eo pid=,sid=,stat= | awk -v s="$sid" '$2 == s && $3 !~ /^Z/ {print $1}'  # zombies have ended
  done
}

# Any process that carries the marker (one that left its session, say).
marked_pids() {
  local p pid
  for p in /proc/[0-9]*; do
    pid=${p#/proc/}
    if ours "$pid"; then echo "$pid"; fi
  done
}

# stop GRACE_S ROLE...: SIGTERM the sessions of these roles, SIGKILL what is left after
# GRACE_S; false if something outlives that by 5 s.
stop() {
  local grace=$1 pids
  shift
  pids=$(session_pids "$@")
  [[ -z $pids ]] && return 0
  # shellcheck disable=SC2086 # one PID a word
  kill -TERM $pids 2>/dev/null || true
  if wait_gone "$grace" "$@"; then return 0; fi
  pids=$(session_pids "$@")
  # shellcheck disable=SC2086
  kill -KILL $pids 2>/dev/null || true
  wait_gone 5 "$@"
}

wait_gone() {  # SECONDS ROLE...
  local deadline=$((SECONDS + $1))
  shift
  while [[ -n $(session_pids "$@") ]]; do
    ((SECONDS < deadline)) || return 1
    sleep 0.5
  done
}

# Serve first (it drains), then the worker nodes (while the head's GCS still answers
# them), then the head; SIGKILL for whatever outlasts its grace. Then any process that
# left its session but carries the marker. The state dir goes once nothing is left.
teardown() {
  local grace left role workers=() ok=0 all_roles=()
  mapfile -t all_roles < <(roles)
  grace=$(sed -n 's/^SHUTDOWN_GRACE=//p' "$DIR/cluster.env" 2>/dev/null) || true
  [[ $grace =~ ^[0-9]+$ ]] || grace=30
  stop $((grace + 10)) serve || ok=1
  for role in ${all_roles[@]+"${all_roles[@]}"}; do
    [[ $role == worker-* ]] && workers+=("$role")
  done
  if ((${#workers[@]})); then stop "$WORKER_GRACE" "${workers[@]}" || ok=1; fi
  stop "$HEAD_GRACE" head || ok=1
  left=$(marked_pids)
  if [[ -n $left ]]; then
    # shellcheck disable=SC2086
    kill -KILL $left 2>/dev/null || true
    sleep 1
  fi
  left=$(marked_pids; session_pids ${all_roles[@]+"${all_roles[@]}"})
  if ((ok)) || [[ -n $left ]]; then
    echo "$PROG: still running after SIGKILL: $(echo "$left" | tr '\n' ' ')(state dir $DIR kept)" >&2
    return 1
  fi
  [[ $DIR == */splitkey-"$NAME" ]] && rm -rf -- "$DIR"
}

running_roles() {
  local role
  for role in $(roles); do
    [[ -n $(session_pids "$role") ]] && echo "$role"
  done
  return 0
}

# -- up ----------------------------------------------------------------------------------
STARTED=0
UP_DONE=0
on_up_exit() {
  local rc=$? role
  ((STARTED && !UP_DONE)) || return 0
  echo "$PROG: up failed; the last lines of each log:" >&2
  for role in $(roles); do
    echo "--- $role ($DIR/logs/$role.log)" >&2
    tail -n 15 "$DIR/logs/$role.log" >&2 2>/dev/null || true
  done
  echo "$PROG: stopping what was started" >&2
  teardown || true
  exit "$rc"
}

# start ROLE CMD...: CMD as the leader of a new session, logging to logs/ROLE.log.
start() {
  local role=$1 pid sid i
  shift
  env "$MARKER=$DIR" setsid "$@" </dev/null >"$DIR/logs/$role.log" 2>&1 &
  pid=$!
  disown "$pid"  # its end is down's business, not reported here
  echo "$pid" >"$DIR/pids/$role.pid"
  # setsid forks (and $! is not the leader) only if it already leads a process group,
  # which a background job of a script without job control does not.
  for ((i = 0; i < 100; i++)); do
    sid=$(ps -o sid= -p "$pid" | tr -d ' ') || true
    [[ -z $sid || $sid == "$pid" ]] && break  # gone (the wait that follows says so), or leading
    sleep 0.05
  done
  [[ -z $sid || $sid == "$pid" ]] || die "$role: setsid did not make $pid a session leader"
  LAST_PID=$pid
}

# Sets LEFT to the seconds left of --timeout.
time_left() {
  LEFT=$((DEADLINE - SECONDS))
  ((LEFT > 0)) || die "timed out after $TIMEOUT s"
}

int_arg() {  # FLAG VALUE MIN
  if [[ ! $2 =~ ^[0-9]+$ ]] || (($2 < $3)); then die "$1 must be an integer >= $3, got '$2'"; fi
}

cmd_up() {
  local nodes="" port="" per_node=1 api_key_file="" store=$((1 << 30)) grace=5
  local serve_args=()
  TIMEOUT=180
  while (($#)); do
    case $1 in
      --name) NAME=${2:?--name needs a value}; shift 2 ;;
      --port) port=${2:?--port needs a value}; shift 2 ;;
      --workers-per-node) per_node=${2:?--workers-per-node needs a value}; shift 2 ;;
      --api-key-file) api_key_file=${2:?--api-key-file needs a value}; shift 2 ;;
      --object-store-bytes) store=${2:?--object-store-bytes needs a value}; shift 2 ;;
      --shutdown-grace) grace=${2:?--shutdown-grace needs a value}; shift 2 ;;
      --timeout) TIMEOUT=${2:?--timeout needs a value}; shift 2 ;;
      --) shift; serve_args=("$@"); break ;;
      -h | --help) usage; exit 0 ;;
      -*) die "unknown option '$1' (see --help)" ;;
      *) [[ -z $nodes ]] || die "one N only, got '$nodes' and '$1'"; nodes=$1; shift ;;
    esac
  done
  [[ -n $nodes ]] || die "up needs N, the number of worker nodes (see --help)"
  int_arg N "$nodes" 1
  ((nodes <= 32)) || die "N must be at most 32, got $nodes"
  int_arg --workers-per-node "$per_node" 1
  int_arg --object-store-bytes "$store" $((80 << 20))
  int_arg --shutdown-grace "$grace" 0
  int_arg --timeout "$TIMEOUT" 1
  if [[ -n $port ]]; then int_arg --port "$port" 1; fi
  if [[ -n $api_key_file ]]; then
    [[ -r $api_key_file ]] || die "--api-key-file: cannot read '$api_key_file'"
    api_key_file=$(cd "$(dirname "$api_key_file")" && pwd)/$(basename "$api_key_file")
  fi
  set_dir
  # Unix socket paths are limited to 107 bytes; Ray's longest under a node's temp dir
  # is /session_<date>_<time>_<usec>_<pid>/sockets/plasma_store (64 bytes at most).
  local longest=$DIR/ray/$nodes
  ((${#longest} + 64 <= 107)) ||
    die "state dir '$DIR' is too long for Ray's socket paths: use a shorter --name or SPLITKEY_CLUSTER_DIR"
  command -v "$PYTHON" >/dev/null || die "no Python '$PYTHON' (set PYTHON to the interpreter with Ray)"
  (cd "$ROOT" && "$PYTHON" -c 'import ray, service.cli' 2>/dev/null) ||
    die "'$PYTHON' cannot import ray and service.cli (set PYTHON; see --help)"

  mkdir -p "$BASE"
  if [[ -e $DIR ]]; then
    if [[ -n $(running_roles) ]]; then
      die "cluster '$NAME' is already up ($(sed -n 's/^URL=//p' "$DIR/cluster.env" 2>/dev/null), state $DIR)"
    fi
    die "cluster '$NAME' is not running but its state dir $DIR is there: '$PROG down --name $NAME' removes it"
  fi
  mkdir -m 700 "$DIR" || die "cannot create $DIR"
  STARTED=1
  trap on_up_exit EXIT
  trap 'exit 130' INT TERM HUP
  mkdir "$DIR/pids" "$DIR/logs" "$DIR/ray"
  DEADLINE=$((SECONDS + TIMEOUT))

  (umask 077 && "$PYTHON" "$HELPER" token >"$DIR/ray-auth-token")
  local ports
  mapfile -t ports < <("$PYTHON" "$HELPER" ports $((nodes + 5)))
  local gcs_port=${ports[0]} client_port=${ports[1]} dashboard_port=${ports[2]}
  [[ -n $port ]] || port=${ports[3]}
  local url=http://127.0.0.1:$port address=127.0.0.1:$gcs_port
  cat >"$DIR/cluster.env" <<EOF
NAME=$NAME
NODES=$nodes
WORKERS_PER_NODE=$per_node
URL=$url
RAY_ADDRESS=$address
SHUTDOWN_GRACE=$grace
EOF

  # Every process started gets this environment (and MARKER, from start).
  export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$DIR/ray-auth-token
  export RAY_USAGE_STATS_ENABLED=0 PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
  unset RAY_AUTH_TOKEN RAY_ADDRESS
  cd "$ROOT"

  local common=(--block --node-ip-address=127.0.0.1 --disable-usage-stats --object-store-memory="$store"
    --min-worker-port=0 --max-worker-port=0)
  start head "$PYTHON" "$HELPER" start --head --port="$gcs_port" --num-cpus=0 --num-gpus=0 \
    --include-dashboard=false --dashboard-host=127.0.0.1 --dashboard-port="$dashboard_port" \
    --ray-client-server-port="$client_port" --dashboard-agent-listen-port="${ports[4]}" \
    --resources='{"splitkey-head": 1}' --temp-dir="$DIR/ray/0" "${common[@]}"
  local pids=("$LAST_PID") i
  time_left
  "$PYTHON" "$HELPER" wait-nodes "$address" 1 "$LEFT" "${pids[@]}" || die "the Ray head did not start"
  for ((i = 1; i <= nodes; i++)); do
    start "worker-$i" "$PYTHON" "$HELPER" start --address="$address" --num-cpus="$per_node" --num-gpus=0 \
      --dashboard-agent-listen-port="${ports[i + 4]}" --resources="{\"splitkey-worker-$i\": 1}" \
      --temp-dir="$DIR/ray/$i" "${common[@]}"
    pids+=("$LAST_PID")
  done
  time_left
  "$PYTHON" "$HELPER" wait-nodes "$address" $((nodes + 1)) "$LEFT" "${pids[@]}" ||
    die "the Ray worker nodes did not all join"

  local serve=("$PYTHON" -m service.cli serve --host 127.0.0.1 --port "$port" --ray-address "$address"
    --workers $((nodes * per_node)) --worker-cpus 1 --shutdown-grace "$grace")
  if [[ -n $api_key_file ]]; then serve+=(--api-key-file "$api_key_file"); fi
  start serve "${serve[@]}" ${serve_args[@]+"${serve_args[@]}"}
  pids+=("$LAST_PID")
  time_left
  "$PYTHON" "$HELPER" wait-ready "$url" "$LEFT" "${pids[@]}" || die "splitkey serve did not become ready"
  UP_DONE=1
  echo "URL=$url"
  echo "RAY_ADDRESS=$address"
  echo "STATE_DIR=$DIR"
  echo "# $nodes worker node(s) x $per_node worker(s); logs in $DIR/logs; stop with: $0 down --name $NAME"
}

# -- status, down ------------------------------------------------------------------------
name_only() {
  while (($#)); do
    case $1 in
      --name) NAME=${2:?--name needs a value}; shift 2 ;;
      -h | --help) usage; exit 0 ;;
      *) die "unknown argument '$1' (see --help)" ;;
    esac
  done
  set_dir
}

cmd_status() {
  name_only "$@"
  [[ -d $DIR ]] || die "no cluster '$NAME' is up (no state dir $DIR)"
  local role pids all=0 url code
  cat "$DIR/cluster.env" 2>/dev/null
  echo "STATE_DIR=$DIR"
  for role in $(roles); do
    pids=$(session_pids "$role" | wc -l)
    if ((pids)); then
      echo "$role: running, session $(cat "$DIR/pids/$role.pid"), $pids process(es)"
    else
      echo "$role: not running"
      all=1
    fi
  done
  url=$(sed -n 's/^URL=//p' "$DIR/cluster.env" 2>/dev/null)
  code=$("$PYTHON" - "$url" <<'EOF'
import sys, urllib.error, urllib.request
try:
    print(urllib.request.urlopen(sys.argv[1] + "/readyz", timeout=5).status)
except urllib.error.HTTPError as e:
    print(e.code)
except (OSError, ValueError):
    print("no answer")
EOF
  ) || code="no answer"
  echo "readyz: $code"
  [[ $code == 200 ]] || all=1
  return "$all"
}

cmd_down() {
  name_only "$@"
  [[ -d $DIR ]] || die "no cluster '$NAME' is up (no state dir $DIR)"
  local was
  was=$(running_roles | tr '\n' ' ')
  teardown || exit 1
  if [[ -n $was ]]; then
    echo "stopped cluster '$NAME' (${was% }); removed $DIR"
  else
    echo "cluster '$NAME' was not running; removed $DIR"
  fi
}

case ${1:-} in
  up) shift; cmd_up "$@" ;;
  status) shift; cmd_status "$@" ;;
  down) shift; cmd_down "$@" ;;
  -h | --help | help) usage ;;
  "") usage >&2; exit 2 ;;
  *) echo "$PROG: unknown command '$1'" >&2; usage >&2; exit 2 ;;
esac
