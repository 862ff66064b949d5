#!/usr/bin/env bash
# One GPU lease, several calls in a row, each a phase of this script (the machine stays warm for 30 s
# after a call, and /tmp with it, so later phases reuse what earlier ones unpacked or built). Prepare what the
# calls carry on the CPU machine first: bash tools/gpu/prepare_session.sh (~20 min, no device time).
#
#   bash tools/gpu/session.sh sglang   # carry .gpu/sglang1 (+ .gpu/sglang_jit, .gpu/triton): SGLang 0.5.17 GPU lane
#   bash tools/gpu/session.sh sglang_bench  # benchmarks/serving.py sglang (K3 real-width slice), after sglang
#   bash tools/gpu/session.sh w4a16    # kernels GPU tests + benchmarks/w4a16.py table
#   bash tools/gpu/session.sh gluon    # the Gluon W4A16 kernels: their GPU tests, then w4a16.py gluon's configs
#   bash tools/gpu/session.sh w4a16_profile  # Nsight Compute of W4A16 vs BF16 GEMM calls (w4a16.py profile)
#   bash tools/gpu/session.sh w4a16_sweep    # the fused kernels' tile configs vs BF16 (w4a16.py sweep)
#   bash tools/gpu/session.sh w4a16_clocks   # SM clock and power, BF16 vs W4A16 (w4a16.py clocks)
#   bash tools/gpu/session.sh vllm1    # carry .gpu/vllm1: stash part 1
#   bash tools/gpu/session.sh vllm2    # carry .gpu/vllm2: stash part 2
#   bash tools/gpu/session.sh vllm3    # carry .gpu/vllm3 (+ .gpu/sglang1): unstage vLLM 0.26.0, the vLLM GPU lane
#   bash tools/gpu/session.sh vllm_bench  # benchmarks/serving.py vllm (K2 real-width slice), after vllm3
#   VLLM_TESTS=none bash tools/gpu/session.sh vllm3 skyrl_demo  # phases run in order in one call
#   bash tools/gpu/session.sh skyrl_demo  # carry .gpu/megatron (megatron-core 0.19.2 cp312 wheel), after vllm3:
#                                              # kimi-rl demo --recipe skyrl-k2 --device cuda --size small
#   bash tools/gpu/session.sh miles_demo  # carry .gpu/sglang1 .gpu/sglang_jit .gpu/megatron (+ .gpu/triton):
#                                              # kimi-rl demo --recipe miles-k3 --device cuda --size small
#   bash tools/gpu/session.sh megatron_bench  # carry .gpu/megatron: benchmarks/megatron_trainer.py single's real-width K3
#                                              # slice with MXFP4 (W4A16, auto and Gluon) and BF16 experts
#
# The SGLang lane runs in groups (base engines, MoE LoRA + hot load, K3.1, K2 INT4); a group that ran
# leaves /tmp/kimi_gpu_done/<group>, so a second `sglang` call goes on where the first stopped. Each
# call stops its work PHASE_LIMIT s (default 560) after it began (all its phases together), then packs what comes back:
# the pytest logs, the engines' logs (logs.tgz) and SGLang's built JIT modules (tvm_ffi_cache.tar.xz,
# bring it into .gpu/sglang_jit/ for the next session); a demo or sglang call also packs Triton's cache
# (triton_cache.tar.xz: compiled kernels and autotuning results, fla's KDA backward autotunes for minutes cold, the
# stock engine's first generate took 84 s; bring it into .gpu/triton/).
# SGLang is unpacked into /tmp/site_sgl and vLLM into /tmp/site, so both can be staged on one machine. A phase
# ends by killing whatever still holds the GPU (a timed-out engine's scheduler would hold its memory otherwise).
set -u
[ $# -ge 1 ] || { echo "usage: $0 PHASE [PHASE ...]" >&2; exit 2; }
start=$(date +%s)
LIMIT=${PHASE_LIMIT:-560}
left() { echo $(( LIMIT - ($(date +%s) - start) )); }
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/kimi_gpu_done /tmp/kimi_test_out
export PYTHONUNBUFFERED=1 KIMI_TEST_OUT=/tmp/kimi_test_out

# Triton's cache (/tmp/triton-cache), unpacked from .gpu/triton when carried, packed back after a demo
export TRITON_CACHE_DIR=/tmp/triton-cache
if [ -f .gpu/triton/triton_cache.tar.xz ] && [ ! -d "$TRITON_CACHE_DIR" ]; then
  mkdir -p "$TRITON_CACHE_DIR" && tar -xJf .gpu/triton/triton_cache.tar.xz -C "$TRITON_CACHE_DIR"
  echo "Triton cache unpacked: $(find "$TRITON_CACHE_DIR" -name '*.json' | wc -l) entries"
fi
pack_triton() { [ -d "$TRITON_CACHE_DIR" ] && XZ_OPT=-T0 tar -cJf "$OUT/triton_cache.tar.xz" -C "$TRITON_CACHE_DIR" .; }
free_gpu() {
  local pids; pids=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ')
  [ -n "$pids" ] && { echo "killing what still holds the GPU: $pids"; kill -9 $pids 2>/dev/null; sleep 2; }
  return 0
}

pack_logs() { tar -czf "$OUT/logs.tgz" -C /tmp/kimi_test_out . 2>/dev/null; ls -la "$OUT"; }
# SGLang's built JIT modules (only the .so of each build directory), to carry into .gpu/sglang_jit/
pack_jit() { (cd /tmp/tvm-ffi-cache && find . -name '*.so' -print0 | tar --null -cJf "$OUT/tvm_ffi_cache.tar.xz" -T -); }

sglang_env() {
  if [ ! -d /tmp/site_sgl/sglang ]; then
    [ -d .gpu/sglang1 ] || { echo "no /tmp/site_sgl and no .gpu/sglang1 carried: a new machine needs the bundle"; exit 3; }
    SITE=/tmp/site_sgl bash .gpu/sglang1/unstage.sh > /tmp/kimi_test_out/unstage_sglang.log 2>&1
    [ -d /tmp/site_sgl/sglang ] || { tail -40 /tmp/kimi_test_out/unstage_sglang.log; exit 3; }
    grep -o 'CUDA_HOME=[^ ]*' /tmp/kimi_test_out/unstage_sglang.log | tail -1 | cut -d= -f2 > /tmp/site_sgl.cuda_home
    python3 tools/gpu/write_entry_points.py /tmp/site_sgl
  fi
  # the JIT cache of an earlier call (or of tools/gpu/sglang_jit_prebuild.sh on a CPU host), whenever carried
  if [ -f .gpu/sglang_jit/tvm_ffi_cache.tar.xz ]; then
    mkdir -p /tmp/tvm-ffi-cache && tar -xJf .gpu/sglang_jit/tvm_ffi_cache.tar.xz -C /tmp/tvm-ffi-cache
    echo "JIT cache unpacked: $(find /tmp/tvm-ffi-cache -name '*.so' | wc -l) modules"
  fi
  export PYTHONPATH=/tmp/site_sgl:$PWD CUDA_HOME=$(cat /tmp/site_sgl.cuda_home) TVM_FFI_CACHE_DIR=/tmp/tvm-ffi-cache
  mkdir -p "$TVM_FFI_CACHE_DIR"
}

# group name, seconds it needs at least, pytest -k expression, engine timeout
SGL_GROUPS=(
  "base|300|stock or plugin_k3_matches or plugin_log_names or any_hidden_size|480"
  "lora|200|moe_lora_shared_outer or lora_log_names or hot_load|300"
  "k31|150|k31|240"
  "k2|120|k2_int4|${K2_ENGINE_TIMEOUT:-540}"
)

run_sglang() {
  sglang_env
  for g in "${SGL_GROUPS[@]}"; do
    IFS='|' read -r name need expr eto <<< "$g"
    [ -f /tmp/kimi_gpu_done/$name ] && continue
    if [ "$(left)" -lt "$need" ]; then echo "== $name: $(left) s left < $need s, left for the next call"; break; fi
    echo "== $name ($(left) s left)"
    # an engine must time out (and dump its stacks into its log) before the call's own limit kills pytest
    cap=$(( $(left) - 40 )); [ "$eto" -gt "$cap" ] && eto=$cap
    KIMI_SGLANG_ENGINE_TIMEOUT=$eto timeout "$(left)" python3 -m pytest -q -m gpu -s -rfE -p no:cacheprovider \
      tests/kimi_sglang_plugin/test_engine_gpu.py -k "$expr" > "$OUT/pytest_sglang_$name.log" 2>&1
    echo "   rc=$? $(tail -1 "$OUT/pytest_sglang_$name.log")"
    touch /tmp/kimi_gpu_done/$name
  done
  free_gpu
  pack_jit
  pack_triton  # the engines' Triton kernels (attention, KDA, LoRA): the stock engine's first generate took 84 s cold
  pack_logs
}

run_w4a16() {
  export PYTHONPATH=$PWD
  # the whole kernels GPU suite (fused, chunked and Gluon paths), then the W4A16 table
  # (W4A16_BENCH_ARGS: e.g. --quick for K3 fc1 only; W4A16_TESTS=0: the table alone, W4A16_BENCH=0: the tests alone,
  # so the two can go to different calls of one lease)
  if [ "${W4A16_TESTS:-1}" = 1 ]; then
    # cold (a fresh machine, no Triton cache) the suite compiles for several minutes (warm: under a minute), so on a
    # fresh machine the table goes to the next call (W4A16_TESTS=0)
    timeout "${KERNELS_TIMEOUT:-540}" python3 -m pytest -q -m gpu -rfE -p no:cacheprovider tests/kimi_core/kernels \
      > "$OUT/pytest_kernels.log" 2>&1
    echo "kernels rc=$? $(tail -1 "$OUT/pytest_kernels.log")"
  fi
  [ "${W4A16_BENCH:-1}" = 1 ] || return 0
  timeout "$(left)" python3 benchmarks/w4a16.py table --json "$OUT/w4a16.json" ${W4A16_BENCH_ARGS:-} \
    > "$OUT/w4a16_bench.log" 2>&1
  echo "bench rc=$?"; grep '^|' "$OUT/w4a16_bench.log" | head -80
}

# the fused kernels' tile configs next to BF16 (SWEEP_TOKENS, default 8; SWEEP_SHAPES, e.g. "K2 fc1,K2 fc2", default
# all; SWEEP_OPS, e.g. fwd, default fwd,dgrad; SWEEP_FUSED_OPTIONS, e.g. {"fold_scales": false}, default the shipped
# FUSED_OPTIONS; SWEEP_CONFIGS, e.g. "maxnreg,w8": only configs whose label contains one): w4a16_sweep.log
run_w4a16_sweep() {
  export PYTHONPATH=$PWD
  timeout "$(left)" python3 benchmarks/w4a16.py sweep --tokens "${SWEEP_TOKENS:-8}" --json "$OUT/w4a16_sweep.json" \
    ${SWEEP_SHAPES:+--shapes "$SWEEP_SHAPES"} ${SWEEP_OPS:+--ops "$SWEEP_OPS"} \
    ${SWEEP_CONFIGS:+--configs "$SWEEP_CONFIGS"} \
    ${SWEEP_FUSED_OPTIONS:+--fused-options "$SWEEP_FUSED_OPTIONS"} \
    > "$OUT/w4a16_sweep.log" 2>&1
  echo "sweep rc=$?"; grep '^|' "$OUT/w4a16_sweep.log"
}

# SM clock and power while BF16 and the W4A16 path run back to back (the 2048 tok/exp forwards: lost cycles or a
# lower clock?); CLOCK_SHAPES (default "K3 fc1,K2 fc1"), CLOCK_FORMATS (mxfp4,int4), CLOCK_TOKENS (2048), CLOCK_OPS
# (fwd), CLOCK_SECONDS (3) per phase, CLOCK_ROUNDS (2)
run_w4a16_clocks() {
  export PYTHONPATH=$PWD
  timeout "$(left)" python3 benchmarks/w4a16.py clocks --json "$OUT/w4a16_clocks.json" \
    --shapes "${CLOCK_SHAPES:-K3 fc1,K2 fc1}" --formats "${CLOCK_FORMATS:-mxfp4,int4}" \
    --tokens "${CLOCK_TOKENS:-2048}" --ops "${CLOCK_OPS:-fwd}" --seconds "${CLOCK_SECONDS:-3}" \
    --rounds "${CLOCK_ROUNDS:-2}" \
    > "$OUT/w4a16_clocks.log" 2>&1
  echo "clocks rc=$?"; tail -30 "$OUT/w4a16_clocks.log"
}

# Nsight Compute on one call of each case (benchmarks/w4a16.py profile run), W4A16 next to BF16;
# the CSVs come back and are summarized into one table (PROFILE_CASES: "shape;tokens;fmt;op;path,..." comma-separated)
run_w4a16_profile() {
  export PYTHONPATH=$PWD
  local ncu; ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null) || { echo "no ncu on this machine"; return; }
  mkdir -p "$OUT/ncu"
  local extra=()  # NCU_EXTRA_SECTIONS: more Nsight Compute sections, e.g. MemoryWorkloadAnalysis (shared / L1 / L2)
  local sec; for sec in ${NCU_EXTRA_SECTIONS:-}; do extra+=(--section "$sec"); done
  # the tensor pipe's busy share, under the name this ncu lists for the GPU
  local tensor; tensor=$("$ncu" --query-metrics 2>/dev/null | python3 benchmarks/w4a16.py profile tensor-metric)
  echo "tensor pipe metric: ${tensor:-none listed}"; [ -n "$tensor" ] && extra+=(--metrics "$tensor")
  local cases=${PROFILE_CASES:-"K3 fc1;2048;mxfp4;fwd;gluon,K3 fc1;2048;mxfp4;fwd;bf16,K3 fc1;2048;mxfp4;dgrad;gluon,K3 fc1;2048;mxfp4;dgrad;bf16,K3 fc1;8;mxfp4;fwd;fused,K3 fc1;8;mxfp4;fwd;bf16"}
  local IFS=','
  for c in $cases; do
    IFS=';' read -r shape tok fmt op path <<< "$c"
    local tag; tag=$(echo "${shape}_${tok}_${fmt}_${op}_${path}" | tr ' ' '_')
    [ "$(left)" -gt 30 ] || { echo "out of time before $tag"; break; }
    timeout $(( $(left) < 120 ? $(left) : 120 )) "$ncu" --nvtx --nvtx-include "profile/" --section SpeedOfLight \
      --section ComputeWorkloadAnalysis --section SchedulerStats --section WarpStateStats ${extra[@]+"${extra[@]}"} \
      --print-details all \
      --csv --page details python3 benchmarks/w4a16.py profile run --shape "$shape" --tokens "$tok" --fmt "$fmt" \
      --op "$op" --path "$path" > "$OUT/ncu/$tag.csv" 2> "$OUT/ncu/$tag.err"
    echo "$tag rc=$? $(grep -c '' "$OUT/ncu/$tag.csv") lines; $(grep -m1 -i 'err' "$OUT/ncu/$tag.err")"
  done
  python3 benchmarks/w4a16.py profile summarize "$OUT"/ncu/*.csv | tee "$OUT/ncu_summary.md"
}

# the Gluon kernels alone: their GPU tests (GLUON_TESTS=0 skips them), then their table next to BF16 in each config
# (every shape; GLUON_BENCH_ARGS=--quick: K3 fc1)
run_gluon() {
  export PYTHONPATH=$PWD
  if [ "${GLUON_TESTS:-1}" = 1 ]; then
    timeout 400 python3 -m pytest -q -m gpu -rfE -p no:cacheprovider tests/kimi_core/kernels/w4a16/test_gluon_gpu.py \
      > "$OUT/pytest_gluon.log" 2>&1
    local rc=$?; echo "gluon tests rc=$rc $(tail -1 "$OUT/pytest_gluon.log")"
    [ $rc -eq 0 ] || { tail -30 "$OUT/pytest_gluon.log"; return; }
  fi
  # every benchmark shape, BF16 and the Gluon kernel alone, in each tile config (GLUON_BENCH_ARGS: e.g. --quick)
  timeout "$(left)" python3 benchmarks/w4a16.py gluon ${GLUON_CONFIGS:+--configs "$GLUON_CONFIGS"} \
    ${GLUON_BENCH_ARGS:-} --json "$OUT/gluon.json" 2>&1 | tee "$OUT/gluon_bench.log" | grep '^|'
  echo "bench rc=${PIPESTATUS[0]}"
}

run_vllm3() {
  # SGLang carried too (it and vllm3 fit in one call): unpack it meanwhile, for a later phase
  if [ -d .gpu/sglang1 ] && [ ! -d /tmp/site_sgl/sglang ]; then
    setsid bash tools/gpu/session.sh sglang_unstage > /tmp/kimi_test_out/sglang_unstage_bg.log 2>&1 < /dev/null &
  fi
  bash .gpu/vllm3/unstage.sh > /tmp/kimi_test_out/unstage_vllm.log 2>&1
  [ -d /tmp/site/vllm ] || { tail -40 /tmp/kimi_test_out/unstage_vllm.log; exit 3; }
  vllm_env
  python3 tools/gpu/write_entry_points.py /tmp/site
  [ "${VLLM_TESTS:-}" = none ] && { echo "vLLM 0.26.0 unstaged into /tmp/site (VLLM_TESTS=none: no lane)"; return; }
  timeout "$(left)" python3 -m pytest -q -m gpu -s -rfE -p no:cacheprovider tests/kimi_vllm_plugin \
    -k "${VLLM_TESTS:-not k25 and not cuda_graphs}" > "$OUT/pytest_vllm.log" 2>&1
  echo "vllm lane rc=$? $(tail -1 "$OUT/pytest_vllm.log")"
  cp /tmp/kimi_test_out/vllm_gpu_numbers.json "$OUT/" 2>/dev/null
  pack_logs
}

vllm_env() { export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0; }

run_vllm_bench() {
  vllm_env
  timeout "$(left)" python3 benchmarks/serving.py vllm ${VLLM_SERVING_ARGS:-} \
    --budget-s $(( $(left) - 30 )) --stack-dump-after 150 --stack-file "$OUT/stacks.txt" --json "$OUT/vllm_serving.json" \
    > "$OUT/vllm_serving.log" 2>&1
  echo "serving rc=$?"; tail -30 "$OUT/vllm_serving.log"
}

mcore_env() {
  # the trainer's megatron-core next to the staged engine (pip download --no-deps --python-version 3.12
  # --only-binary=:all: megatron-core==0.19.2 -d .gpu/megatron on the CPU machine)
  if [ ! -d /tmp/site_mcore/megatron ] || [ ! -d /tmp/site_mcore/fla ]; then  # megatron-core, fla-core, einops
    python3 -m pip install -q --no-deps --no-index --target /tmp/site_mcore .gpu/megatron/*.whl || exit 3
  fi
  export PYTHONPATH=/tmp/site_mcore:$PYTHONPATH
}

# one GPU demo test of tests/kimi_rl_glue/test_demo_gpu.py: $1 = the engine's env function (vllm_env / sglang_env),
# $2 = tag (skyrl / miles)
run_demo() {
  $1
  mcore_env
  local up; up=$(echo "$2" | tr a-z A-Z)
  env "KIMI_${up}_TIMEOUT=$(( $(left) - 30 ))" timeout "$(left)" python3 -m pytest -q -m gpu -s -rfE -p no:cacheprovider \
    tests/kimi_rl_glue/test_demo_gpu.py -k "$2" > "$OUT/pytest_$2_demo.log" 2>&1
  echo "$2_demo rc=$? $(tail -1 "$OUT/pytest_$2_demo.log")"
  grep -E "^\[(setup|step 0|done)\]" "/tmp/kimi_test_out/$2_demo_gpu.log"
  cp /tmp/kimi_test_out/$2_demo_gpu_* "$OUT/" 2>/dev/null
  free_gpu
  [ "$1" = sglang_env ] && pack_jit
  pack_triton
  pack_logs
}

# benchmarks/megatron_trainer.py single's real-width K3 slice: MXFP4 (W4A16: auto, the Gluon kernel) and BF16 experts
run_megatron_bench() {
  export PYTHONPATH=$PWD
  mcore_env
  # MEGATRON_SKIP: the parts not run (default: all but slice, slice-bf16, slice-gluon); MEGATRON_PARTS: how many run
  timeout "$(left)" python3 benchmarks/megatron_trainer.py single --skip "${MEGATRON_SKIP:-tiny,tiny-fla,int4}" \
    --part-timeout $(( ($(left) - 20) / ${MEGATRON_PARTS:-3} )) --json "$OUT/megatron_slice.json" \
    > "$OUT/megatron_single.log" 2>&1
  echo "megatron single rc=$?"; tail -20 "$OUT/megatron_single.log"
  free_gpu
}

run_sglang_bench() {
  sglang_env
  SGLANG_PLUGINS=kimi timeout "$(left)" python3 benchmarks/serving.py sglang --json "$OUT/sglang_serving.json" \
    --budget-s $(( $(left) - 60 )) > "$OUT/sglang_serving.log" 2>&1
  echo "sglang_serving rc=$?"; tail -25 "$OUT/sglang_serving.log"
  free_gpu
  pack_jit
}

for phase in "$@"; do
case "$phase" in
  sglang) run_sglang ;;
  sglang_unstage) sglang_env ;;
  sglang_bench) run_sglang_bench ;;
  w4a16) run_w4a16 ;;
  gluon) run_gluon ;;
  w4a16_profile) run_w4a16_profile ;;
  w4a16_clocks) run_w4a16_clocks ;;
  w4a16_sweep) run_w4a16_sweep ;;
  vllm1) mkdir -p /tmp/stash && cp .gpu/vllm1/* /tmp/stash/ && ls /tmp/stash ;;
  vllm2) cp .gpu/vllm2/* /tmp/stash/ && ls /tmp/stash ;;
  vllm3) run_vllm3 ;;
  vllm_bench) run_vllm_bench ;;
  skyrl_demo) run_demo vllm_env skyrl ;;
  miles_demo) run_demo sglang_env miles ;;
  megatron_bench) run_megatron_bench ;;
  *) echo "usage: $0 sglang|sglang_unstage|sglang_bench|w4a16|w4a16_sweep|w4a16_profile|w4a16_clocks|gluon|vllm1|vllm2|vllm3|vllm_bench|skyrl_demo|miles_demo|megatron_bench" >&2; exit 2 ;;
esac
done
