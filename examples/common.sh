# shellcheck shell=bash
# Shared pieces of the launch scripts in examples/. Source it; do not run it.
#
#   kimi_knob NAME DEFAULT      a scale knob: keeps $NAME from the environment, else DEFAULT; DRY_RUN lists it
#   kimi_env NAME VALUE         an environment variable the host processes need (exported, and listed)
#   kimi_runtime_env_json       the kimi_env variables as Ray's --runtime-env-json ({"env_vars": {...}})
#   kimi_divides A B WHAT       fail early, naming the knobs, unless A divides B
#   kimi_pp_split LAYERS PP     sets KIMI_PP_SPLIT_ARGS: Megatron first/last-stage layer counts for an uneven split
#   kimi_launch CMD...          run CMD, or with DRY_RUN=1 print the env and the exact command instead
#   kimi_miles_require FLAG...  fail first, naming the flag and the miles commit to use, unless miles has FLAG
#
# Our entry points are named here and nowhere else, so a rename is one edit
# (docs/recipes/*.md and ARCHITECTURE.md "How a user switches it on" describe them).

set -euo pipefail

KIMI_EXAMPLES_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
KIMI_REPO_DIR="$(cd "$KIMI_EXAMPLES_DIR/.." && pwd)"

# --- entry points of kimi-rl-plugins, by name --------------------------------------------------
KIMI_VLLM_PLUGIN_NAME=kimi                                   # vllm.general_plugins: kimi -> VLLM_PLUGINS
KIMI_SGLANG_PLUGIN_NAME=kimi                                 # sglang.srt.plugins: kimi -> SGLANG_PLUGINS
KIMI_MEGATRON_SPEC=(kimi_megatron_plugin.spec get_spec)      # miles/Megatron --spec MODULE FUNCTION
KIMI_MILES_INIT=kimi_rl_glue.miles.init                      # --custom-megatron-init-path (function init(args))
KIMI_MILES_LORA_PROVIDER=kimi_rl_glue.miles.lora_provider    # --lora-provider-path (a module)
KIMI_MILES_REWARD=kimi_rl_glue.miles.reward.math_rm          # --custom-rm-path: deepscaler-style 0/1 math reward
KIMI_MILES_LOSS_SCORE_CENTERING=kimi_rl_glue.miles.losses.score_centering_loss  # --custom-loss-function-path
KIMI_MILES_TOPK_GENERATE=kimi_rl_glue.miles.topk_rollout.generate  # --custom-generate-function-path: SGLang top-K per token
KIMI_MILES_TOPK_TRAIN_DATA=kimi_rl_glue.miles.topk_transport.convert_samples_to_train_data  # --custom-convert-samples-to-train-data-path
KIMI_SKYRL_ENTRYPOINT=kimi_rl_glue.skyrl.main                # SkyRL trainer.override_entrypoint (module with main())

KIMI_KNOBS=()
KIMI_ENVS=()

kimi_knob() {
  local name=$1 default=$2
  if [[ -z "${!name:-}" ]]; then
    printf -v "$name" '%s' "$default"
  fi
  KIMI_KNOBS+=("$name")
}

kimi_env() {
  local name=$1 value=$2
  printf -v "$name" '%s' "$value"
  export "${name?}"
  KIMI_ENVS+=("$name")
}

_kimi_json_str() {
  local s=$1
  s=${s//\\/\\\\}
  s=${s//\"/\\\"}
  printf '"%s"' "$s"
}

kimi_runtime_env_json() {
  local out='{"env_vars": {' sep='' name
  for name in "${KIMI_ENVS[@]}"; do
    out+="$sep$(_kimi_json_str "$name"): $(_kimi_json_str "${!name}")"
    sep=', '
  done
  printf '%s}}' "$out"
}

kimi_divides() {
  local a=$1 b=$2 what=$3
  if (( a <= 0 || b % a != 0 )); then
    echo "error: $what: $a must be positive and divide $b" >&2
    exit 2
  fi
}

kimi_pp_split() {
  # Every stage but the last takes ceil(LAYERS / PP) layers and the last takes the rest
  # (93 layers: PP8 -> 12/9, PP4 -> 24/21, PP2 -> 47/46). Empty when the split is even.
  local layers=$1 pp=$2 first last
  KIMI_PP_SPLIT_ARGS=()
  (( pp > 1 )) || return 0
  first=$(( (layers + pp - 1) / pp ))
  last=$(( layers - first * (pp - 1) ))
  if (( last < 1 )); then
    echo "error: cannot split $layers layers over PP=$pp (last stage would get $last)" >&2
    exit 2
  fi
  if (( first != last )); then
    KIMI_PP_SPLIT_ARGS=(--decoder-first-pipeline-num-layers "$first" --decoder-last-pipeline-num-layers "$last")
  fi
}

kimi_launch() {
  if [[ "${DRY_RUN:-0}" == 1 ]]; then
    local name
    echo "# DRY_RUN=1: ${KIMI_SCRIPT_NAME:-$0} would run the command below (nothing was started)."
    echo "# knobs (set any of them in the environment to override):"
    for name in "${KIMI_KNOBS[@]}"; do
      printf '#   %s=%q\n' "$name" "${!name}"
    done
    echo "# env:"
    for name in "${KIMI_ENVS[@]}"; do
      printf 'export %s=%q\n' "$name" "${!name}"
    done
    echo "# command:"
    printf '%q' "$1"
    shift
    printf ' %q' "$@"
    printf '\n'
    return 0
  fi
  exec "$@"
}

# --- miles (seeds 000 and 001) ---------------------------------------------------------------------

# The miles the recipes need (docs/miles.md): native LoRA's --lora-provider-path is only on radixark/miles
# PR #1792 (branch zhichen/lora-native); main up to 31f1ca961 lacks it and then silently trains full weights.
KIMI_MILES_DIR_DEFAULT=/root/miles
KIMI_MILES_COMMIT=0aceece44be760beee8b7088d922105c39e80cf0   # radixark/miles PR #1792 head
KIMI_MEGATRON_COMMIT=2e64d788b67fe8155774200c87606e1e449c494b  # radixark/Megatron-LM miles-main

_kimi_miles_flag_source() {
  case $1 in
    --lora-provider-path)
      echo "radixark/miles@$KIMI_MILES_COMMIT (PR #1792, branch zhichen/lora-native)" ;;
    --rollout-top-logprobs-num)
      echo "--custom-generate-function-path $KIMI_MILES_TOPK_GENERATE, which defines it" ;;
    *) echo "a radixark/miles that defines it" ;;
  esac
}

kimi_miles_require() {
  # Checks, before anything else, that the miles train.py will run defines each FLAG (a grep of its
  # sources: no import). miles is $MILES_DIR/miles, else the importable package. Missing miles or flag:
  # exit 2 with one message; under DRY_RUN=1 only a warning on stderr, and the command is still printed.
  local dir=${MILES_DIR:-$KIMI_MILES_DIR_DEFAULT} src flag
  if [[ -d "$dir/miles" ]]; then
    src="$dir/miles"
  else
    src=$(python3 -c 'import importlib.util as u; s = u.find_spec("miles"); print(s.submodule_search_locations[0])' \
      2>/dev/null) || src=""
  fi
  if [[ -z "$src" ]]; then
    if [[ "${DRY_RUN:-0}" == 1 ]]; then
      echo "warning: no miles at MILES_DIR=$dir nor importable; not checked for: $*" >&2
      return 0
    fi
    echo "error: no miles at MILES_DIR=$dir and none importable; check out radixark/miles@$KIMI_MILES_COMMIT" \
      "there (docs/miles.md)" >&2
    exit 2
  fi
  for flag in "$@"; do
    if ! grep -rqF --include='*.py' -- "\"$flag\"" "$src"; then
      if [[ "${DRY_RUN:-0}" == 1 ]]; then
        echo "warning: the miles in $src lacks $flag; use $(_kimi_miles_flag_source "$flag") (docs/miles.md)" >&2
        continue
      fi
      echo "error: the miles in $src lacks $flag; use $(_kimi_miles_flag_source "$flag") (docs/miles.md)" >&2
      exit 2
    fi
  done
}

kimi_miles_knobs() {
  # Paths and cluster address shared by the miles recipes (the seeds' image layout as defaults).
  kimi_knob MILES_DIR "$KIMI_MILES_DIR_DEFAULT"    # radixark/miles checkout at $KIMI_MILES_COMMIT (docs/miles.md)
  kimi_knob MEGATRON_DIR /root/Megatron-LM         # radixark/Megatron-LM miles-main at $KIMI_MEGATRON_COMMIT, no Kimi patch
  kimi_knob RAY_ADDRESS http://127.0.0.1:8265      # the Ray cluster's job server (bring the cluster up first)
  kimi_knob TRITON_CACHE_DIR /root/.cache/kimi-triton   # persistent: the first KDA backward autotunes ~30 min
  kimi_knob RUN_ID "kimi-$(date +%Y%m%d-%H%M%S)"
  kimi_knob EXTRA_ARGS ""                          # appended to train.py's flags, word-split
}

kimi_miles_env() {
  # Environment of every Ray worker (trainer and SGLang engines): Ray's runtime_env replaces theirs.
  kimi_env SGLANG_PLUGINS "$KIMI_SGLANG_PLUGIN_NAME"   # loads kimi_sglang_plugin in every SGLang process
  kimi_env PYTHONPATH "$MEGATRON_DIR"
  kimi_env PYTHONUNBUFFERED 1
  kimi_env CUDA_DEVICE_MAX_CONNECTIONS 1
  kimi_env NCCL_TIMEOUT 3600
  kimi_env SGLANG_NUMA_BIND_V2 0          # the default membind puts the whole host weight backup on one NUMA node
  kimi_env TRITON_CACHE_DIR "$TRITON_CACHE_DIR"
  local name
  for name in MASTER_ADDR NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME NCCL_IB_HCA NCCL_DEBUG SGLANG_K3_ATTN_RES_MODE; do
    if [[ -n "${!name:-}" ]]; then kimi_env "$name" "${!name}"; fi
  done
}

kimi_miles_plugin_args() {
  # Sets KIMI_MILES_PLUGIN_ARGS: our entry points in miles, replacing the seeds' Kimi branches.
  # $1: --model-name, the key of our raw-mode converter (kimi_k3 or kimi_k31).
  KIMI_MILES_PLUGIN_ARGS=(
    --custom-megatron-init-path "$KIMI_MILES_INIT"        # every train actor: megatron-core check, Megatron-Bridge registration if installed
    --lora-provider-path "$KIMI_MILES_LORA_PROVIDER"      # native Kimi LoRA (shared-outer expert factors), HF export
    --megatron-to-hf-mode raw
    --model-name "$1"
  )
}

kimi_miles_launch() {
  # Submits miles' train.py to the running Ray cluster with MODEL_ARGS and the given flags.
  # shellcheck disable=SC2206  # EXTRA_ARGS is word-split on purpose
  local extra=($EXTRA_ARGS)
  kimi_launch ray job submit --address="$RAY_ADDRESS" --runtime-env-json="$(kimi_runtime_env_json)" \
    -- python3 "$MILES_DIR/train.py" "${MODEL_ARGS[@]}" "$@" "${extra[@]}"
}

# --- examples/local: tiny CPU versions of the recipes ----------------------------------------------

kimi_local_knobs() {
  # $1: the recipe's output folder name under runs/local.
  kimi_knob OUT "$KIMI_REPO_DIR/runs/local/$1"
  kimi_knob LAYERS 2                      # decoder layers of the tiny checkpoint (make-tiny --layers)
  kimi_knob TOKENS 4                      # sampled tokens per sequence in check-numerics
  kimi_knob NUMERICS_DTYPE fp32
  if command -v kimi-rl >/dev/null 2>&1; then
    kimi_knob KIMI_RL kimi-rl
  elif [[ -x "$KIMI_REPO_DIR/.venv/bin/kimi-rl" ]]; then    # the venv `make test` builds
    kimi_knob KIMI_RL "$KIMI_REPO_DIR/.venv/bin/kimi-rl"
  else
    kimi_knob KIMI_RL "python3 -m kimi_rl_glue.cli"
  fi
  mkdir -p "$OUT"
}

kimi_local_step() {
  # Prints a numbered step and the command, then runs it (a failure stops the script).
  KIMI_LOCAL_STEP=$(( ${KIMI_LOCAL_STEP:-0} + 1 ))
  echo
  echo "== [$KIMI_LOCAL_STEP] $1"
  shift
  echo "\$ $*"
  "$@"
}

kimi_local_make_tiny() {
  # $1 model, $2 folder, then extra make-tiny flags. Reuses a finished checkpoint (config.json written last).
  local model=$1 dir=$2
  shift 2
  if [[ -f "$dir/config.json" && -f "$dir/model.safetensors.index.json" ]]; then
    echo "(reusing $dir)"
    return 0
  fi
  # shellcheck disable=SC2086  # KIMI_RL may be "python3 -m kimi_rl_glue.cli"
  $KIMI_RL make-tiny --model "$model" --out "$dir" --layers "$LAYERS" "$@"
}

kimi_local_k3_sizes() {
  # Presets the K3_* / K31_* sizes of examples/miles/models/kimi_k3.sh from a checkpoint's config.json.
  local assignments
  assignments=$(python3 - "$1/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
t = c.get("text_config", c)
pairs = {
    "K3_NUM_LAYERS": t["num_hidden_layers"], "K3_HIDDEN": t["hidden_size"], "K3_FFN_HIDDEN": t["intermediate_size"],
    "K3_HEADS": t["num_attention_heads"], "K3_VOCAB": t["vocab_size"], "K3_Q_LORA_RANK": t["q_lora_rank"],
    "K3_KV_LORA_RANK": t["kv_lora_rank"], "K3_QK_HEAD_DIM": t["qk_nope_head_dim"],
    "K3_QK_POS_HEAD_DIM": t["qk_rope_head_dim"], "K3_V_HEAD_DIM": t["v_head_dim"], "K3_EXPERTS": t["num_experts"],
    "K3_TOPK": t["num_experts_per_token"], "K3_MOE_FFN_HIDDEN": t["moe_intermediate_size"],
    "K3_MOE_LATENT": t["routed_expert_hidden_size"],
    "K3_SHARED_FFN_HIDDEN": t["num_shared_experts"] * t["moe_intermediate_size"],
    "K3_FIRST_DENSE": t["first_k_dense_replace"],
}
if "index_topk" in t:
    pairs.update(K31_INDEX_HEADS=t["index_n_heads"], K31_INDEX_HEAD_DIM=t["index_head_dim"], K31_INDEX_TOPK=t["index_topk"])
print(" ".join(f"{k}={int(v)}" for k, v in pairs.items()))
PY
)
  local kv
  for kv in $assignments; do export "${kv?}"; done
}

kimi_local_prepare_data() {
  # Converts the sample prompts shipped in examples/data to miles' format, where the launch scripts'
  # DATA_DIR layout expects them: $1/dapo-math-17k/dapo-math-17k.jsonl and $1/aime-2024/aime-2024.jsonl.
  $KIMI_RL prepare-data --task dapo-math --input "$KIMI_EXAMPLES_DIR/data/dapo-math-sample.jsonl" \
    --output "$1/dapo-math-17k/dapo-math-17k.jsonl"
  $KIMI_RL prepare-data --task aime --input "$KIMI_EXAMPLES_DIR/data/aime-sample.jsonl" \
    --output "$1/aime-2024/aime-2024.jsonl"
}

kimi_local_show_cluster_command() {
  # $1: a launch script under examples/; the rest: KEY=VALUE knobs. Prints its DRY_RUN output.
  local script=$1
  shift
  echo
  echo "== what a GPU cluster would run (printed, not run): DRY_RUN=1 $* bash $script"
  env DRY_RUN=1 "$@" bash "$KIMI_REPO_DIR/$script"
}
