#!/usr/bin/env bash
# Everything a GPU session carries, prepared on the CPU machine before the first device call (about 20 min on
# 2 cores, the JIT build being the long pole): SGLang 0.5.17 (.gpu/sglang1), its JIT kernels built for sm_90a
# (.gpu/sglang_jit), vLLM 0.26.0 in three parts (.gpu/vllm1..3) and the trainer's megatron-core wheel
# (.gpu/megatron). Run in the project root:
#   bash tools/gpu/prepare_session.sh          # logs in .gpu/prepare_*.log; exits non-zero if a part failed
# Then the calls of tools/gpu/session.sh (its header lists which folder each phase carries).
set -u
mkdir -p .gpu .git/info
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >> .git/info/exclude
# STAGE: the folder holding the hosts' staging scripts (stage_sglang.sh, stage_vllm.sh)
STAGE=${STAGE:-tools/gpu}
pids=()
[ -d .gpu/sglang1 ] || { bash "$STAGE/stage_sglang.sh" > .gpu/prepare_sglang.log 2>&1 & pids+=($!); }
[ -f .gpu/sglang_jit/tvm_ffi_cache.tar.xz ] || { bash tools/gpu/sglang_jit_prebuild.sh > .gpu/prepare_jit.log 2>&1 & pids+=($!); }
[ -d .gpu/vllm3 ] || { bash "$STAGE/stage_vllm.sh" > .gpu/prepare_vllm.log 2>&1 & pids+=($!); }
if ! ls .gpu/megatron/fla_core-*.whl > /dev/null 2>&1; then  # the trainer's KDA kernels (fla) too
  python3 -m pip download -q --no-deps --python-version 3.12 --only-binary=:all: \
    --platform manylinux_2_28_x86_64 megatron-core==0.19.2 fla-core==0.6.0 einops==0.8.2 -d .gpu/megatron > .gpu/prepare_megatron.log 2>&1 & pids+=($!)
fi
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
du -sh .gpu/* 2>/dev/null
[ -f .gpu/sglang_jit/tvm_ffi_cache.tar.xz ] && echo "JIT modules: $(tar -tJf .gpu/sglang_jit/tvm_ffi_cache.tar.xz | grep -c '\.so$')"
exit $rc
