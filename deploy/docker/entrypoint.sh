#!/usr/bin/env bash
# tqserve launcher: TQSERVE_* environment variables -> `tqserve serve` arguments.
#
# One launcher for every way of running tqserve here: the container entrypoint
# (Dockerfile.cuda, Dockerfile.cpu, compose.yaml), the systemd units
# (ExecStart=/opt/tqserve/deploy/docker/entrypoint.sh leader|follower) and
# deploy/tqservectl's pid-file mode. The variables are documented in
# deploy/systemd/tqserve.env.
#
#   entrypoint.sh [leader|follower] [more `tqserve serve` arguments...]
#
# The role comes from the first argument, else from TQSERVE_ROLE, else it is
# "leader" on a single node (TQSERVE_NNODES unset or 1); with more than one node
# it must be given. Arguments after the role, then TQSERVE_EXTRA_ARGS, are
# appended to the ones built here.
#
# The API key is read from the file TQSERVE_API_KEY_FILE and handed to tqserve
# in its environment (TQSERVE_API_KEY), never on the command line, where any
# user could read it in `ps`.
#
# A bad or missing setting: one line on stderr, exit status 2 (systemd's
# RestartPreventExitStatus=2 then does not restart a unit that cannot work).
# Otherwise tqserve replaces this shell (exec): it gets the signals (SIGTERM
# drains), and its exit status is the container's / the unit's.
set -euo pipefail

die() {
    printf 'tqserve-entrypoint: %s\n' "$*" >&2
    exit 2
}

# is_int NAME VALUE MIN [MAX]: VALUE is a decimal integer in [MIN, MAX].
is_int() {
    local name=$1 value=$2 min=$3 max=${4:-}
    [[ $value =~ ^[0-9]+$ ]] || die "$name must be an integer, got '$value'"
    value=$((10#$value))
    ((value >= min)) || die "$name must be >= $min, got $value"
    if [[ -n $max ]]; then
        ((value <= max)) || die "$name must be <= $max, got $value"
    fi
}

# is_number NAME VALUE: a non-negative decimal number (30, 0.9, 1.5).
is_number() {
    [[ $2 =~ ^[0-9]+([.][0-9]+)?$|^[.][0-9]+$ ]] || die "$1 must be a non-negative number, got '$2'"
}

role=${TQSERVE_ROLE:-}
if [[ $# -gt 0 && ($1 == leader || $1 == follower) ]]; then
    role=$1
    shift
fi

nnodes=${TQSERVE_NNODES:-1}
is_int TQSERVE_NNODES "$nnodes" 1
nnodes=$((10#$nnodes))
if [[ -z $role ]]; then
    ((nnodes == 1)) || die "TQSERVE_ROLE (leader or follower) must be set when TQSERVE_NNODES is $nnodes"
    role=leader
fi
[[ $role == leader || $role == follower ]] || die "TQSERVE_ROLE must be leader or follower, got '$role'"

model=${TQSERVE_MODEL:-}
[[ -n $model ]] || die "TQSERVE_MODEL is not set (a model name, an HF directory or a .gguf path)"

bin=${TQSERVE_BIN:-}
if [[ -z $bin ]]; then
    bin=$(command -v tqserve || true)
    [[ -n $bin ]] || bin=/opt/tqserve/.venv/bin/tqserve
fi
[[ -x $bin ]] || die "tqserve executable not found: '$bin' (set TQSERVE_BIN)"

args=(serve --model "$model")

# --- tensor parallelism over nodes ---------------------------------------
tp=${TQSERVE_TENSOR_PARALLEL_SIZE:-}
if [[ -n $tp ]]; then
    is_int TQSERVE_TENSOR_PARALLEL_SIZE "$tp" 1
    tp=$((10#$tp))
    ((tp % nnodes == 0)) || die "TQSERVE_TENSOR_PARALLEL_SIZE ($tp) must be a multiple of TQSERVE_NNODES ($nnodes)"
    args+=(--tensor-parallel-size "$tp")
elif ((nnodes > 1)); then
    die "TQSERVE_TENSOR_PARALLEL_SIZE must be set when TQSERVE_NNODES is $nnodes"
fi

if ((nnodes > 1)); then
    # TQSERVE_NODE_RANK is the follower's: the env file is the same on both boxes.
    if [[ $role == leader ]]; then
        rank=0
    else
        rank=${TQSERVE_NODE_RANK:-1}
        is_int TQSERVE_NODE_RANK "$rank" 1 $((nnodes - 1))
        rank=$((10#$rank))
    fi
    master_addr=${TQSERVE_MASTER_ADDR:-}
    [[ -n $master_addr ]] || die "TQSERVE_MASTER_ADDR (the leader's address on the link between the nodes) is not set"
    master_port=${TQSERVE_MASTER_PORT:-29500}
    is_int TQSERVE_MASTER_PORT "$master_port" 1 65535
    args+=(--nnodes "$nnodes" --node-rank "$rank" --master-addr "$master_addr"
        --master-port "$((10#$master_port))")
    if [[ -n ${TQSERVE_DISTRIBUTED_TIMEOUT:-} ]]; then
        is_number TQSERVE_DISTRIBUTED_TIMEOUT "$TQSERVE_DISTRIBUTED_TIMEOUT"
        args+=(--distributed-timeout "$TQSERVE_DISTRIBUTED_TIMEOUT")
    fi
elif [[ $role == follower ]]; then
    die "a follower needs TQSERVE_NNODES > 1 (got $nnodes)"
fi

# --- HTTP: the leader only ------------------------------------------------
if [[ $role == leader ]]; then
    [[ -z ${TQSERVE_HOST:-} ]] || args+=(--host "$TQSERVE_HOST")
    if [[ -n ${TQSERVE_PORT:-} ]]; then
        is_int TQSERVE_PORT "$TQSERVE_PORT" 0 65535
        args+=(--port "$((10#$TQSERVE_PORT))")
    fi
    if [[ -n ${TQSERVE_SERVED_MODEL_NAME:-} ]]; then
        read -r -a names <<<"$TQSERVE_SERVED_MODEL_NAME"
        args+=(--served-model-name "${names[@]}")
    fi
    key_file=${TQSERVE_API_KEY_FILE:-}
    if [[ -n $key_file ]]; then
        [[ -f $key_file && -r $key_file ]] || die "TQSERVE_API_KEY_FILE '$key_file' is not a readable file"
        key=$(<"$key_file")
        key=${key%$'\r'}
        [[ -n $key ]] || die "TQSERVE_API_KEY_FILE '$key_file' is empty"
        [[ $key != *[[:space:]]* ]] || die "TQSERVE_API_KEY_FILE '$key_file' must hold one key on one line, without spaces"
        export TQSERVE_API_KEY=$key
        unset key
    fi
    if [[ -n ${TQSERVE_DRAIN_TIMEOUT:-} ]]; then
        is_number TQSERVE_DRAIN_TIMEOUT "$TQSERVE_DRAIN_TIMEOUT"
        args+=(--drain-timeout "$TQSERVE_DRAIN_TIMEOUT")
    fi
else
    args+=(--headless)
    # A follower serves no HTTP: a key in the environment would be unused.
    unset TQSERVE_API_KEY
fi

# --- engine settings: identical on every node -----------------------------
if [[ -n ${TQSERVE_DEVICE:-} ]]; then
    case $TQSERVE_DEVICE in
    auto | cuda | cpu) args+=(--device "$TQSERVE_DEVICE") ;;
    *) die "TQSERVE_DEVICE must be auto, cuda or cpu, got '$TQSERVE_DEVICE'" ;;
    esac
fi
[[ -z ${TQSERVE_DTYPE:-} ]] || args+=(--dtype "$TQSERVE_DTYPE")
[[ -z ${TQSERVE_QUANTIZATION:-} ]] || args+=(--quantization "$TQSERVE_QUANTIZATION")
[[ -z ${TQSERVE_KV_CACHE_DTYPE:-} ]] || args+=(--kv-cache-dtype "$TQSERVE_KV_CACHE_DTYPE")
[[ -z ${TQSERVE_KV_CACHE_MEMORY:-} ]] || args+=(--kv-cache-memory "$TQSERVE_KV_CACHE_MEMORY")
if [[ -n ${TQSERVE_MAX_MODEL_LEN:-} ]]; then
    is_int TQSERVE_MAX_MODEL_LEN "$TQSERVE_MAX_MODEL_LEN" 1
    args+=(--max-model-len "$((10#$TQSERVE_MAX_MODEL_LEN))")
fi
if [[ -n ${TQSERVE_GPU_MEMORY_UTILIZATION:-} ]]; then
    is_number TQSERVE_GPU_MEMORY_UTILIZATION "$TQSERVE_GPU_MEMORY_UTILIZATION"
    args+=(--gpu-memory-utilization "$TQSERVE_GPU_MEMORY_UTILIZATION")
fi
if [[ -n ${TQSERVE_LOG_LEVEL:-} ]]; then
    case $TQSERVE_LOG_LEVEL in
    debug | info | warning | error) args+=(--log-level "$TQSERVE_LOG_LEVEL") ;;
    *) die "TQSERVE_LOG_LEVEL must be debug, info, warning or error, got '$TQSERVE_LOG_LEVEL'" ;;
    esac
fi
if [[ -n ${TQSERVE_EXTRA_ARGS:-} ]]; then
    # Split on whitespace, no quoting: write JSON values without spaces.
    read -r -a extra <<<"$TQSERVE_EXTRA_ARGS"
    args+=("${extra[@]}")
fi
args+=("$@")

exec "$bin" "${args[@]}"
