#!/usr/bin/env bash
# Build SGLang 0.5.17's JIT kernels that the tiny K3 engine needs (Marlin MoE, ...) once on the H200 and
# pack the built modules, so later GPU calls start from a warm TVM-FFI cache instead of compiling them in
# the first forward (measured 2026-12-02: the first prefill sat > 150 s in nvcc for moe_wna16_marlin, so
# every engine of the GPU lane timed out; SGLang prints nothing while it compiles).
#
# On the GPU machine, after stage_sglang.sh's unstage step (PYTHONPATH and CUDA_HOME exported):
#   bash tests/gpu/sglang_jit_cache.sh pack $OUT      # runs one stock engine (<= 520 s), writes $OUT/tvm_ffi_cache.tar
# Bring the tar back into .gpu/sglang_jit/ (git-ignored) and in later calls, carried with it:
#   bash tests/gpu/sglang_jit_cache.sh unpack .gpu/sglang_jit/tvm_ffi_cache.tar   # sets up /tmp/tvm-ffi-cache
#   export TVM_FFI_CACHE_DIR=/tmp/tvm-ffi-cache
# The cache key holds the arch and the tvm-ffi version (sglang/kernels/jit/utils/compile.py), so a tar
# built on one H200 with this bundle is valid on another.
set -euo pipefail
mode=$1; where=$2
case "$mode" in
  pack)
    export TVM_FFI_CACHE_DIR=/tmp/tvm-ffi-cache MAX_JOBS=${MAX_JOBS:-16}
    mkdir -p "$TVM_FFI_CACHE_DIR" /tmp/jit_engine
    start=$(date +%s)
    timeout 520 python3 tests/gpu/sglang_one_engine.py /tmp/jit_engine none 500 || echo "engine rc=$? (the cache is packed anyway)"
    echo "engine + JIT: $(( $(date +%s) - start )) s"
    # only the built modules: each build directory's .so (the sources and objects are not needed to reuse it)
    (cd "$TVM_FFI_CACHE_DIR" && find . -name '*.so' -print0 | tar --null -cf "$where/tvm_ffi_cache.tar" -T -)
    tar -tvf "$where/tvm_ffi_cache.tar" ;;
  unpack)
    mkdir -p /tmp/tvm-ffi-cache && tar -xf "$where" -C /tmp/tvm-ffi-cache && ls /tmp/tvm-ffi-cache ;;
  *) echo "usage: $0 pack OUT_DIR | unpack TAR" >&2; exit 2 ;;
esac
