#!/usr/bin/env bash
# Build SGLang 0.5.17's JIT kernels for Hopper (sm_90a) here, on the CPU (nvcc 13.0 at /usr/local/cuda), and pack them
# as .gpu/sglang_jit/tvm_ffi_cache.tar.xz, which tools/gpu/session.sh unpacks when it is carried: a fresh
# session's first SGLang call then starts its engines in ~40 s instead of ~9 min of nvcc on the device.
#   bash tools/gpu/sglang_jit_prebuild.sh        # ~12 min on 2 cores; venv in /tmp/sglang_jit_venv (~6 GB)
set -euo pipefail
V=${VENV:-/tmp/sglang_jit_venv}; SRC=${SRC:-/tmp/sglang_jit_src}; CACHE=${CACHE:-/tmp/sglang_jit_cache}
OUT=${OUT:-.gpu/sglang_jit}
pip() { "$V/bin/python" -m pip --disable-pip-version-check -q "$@"; }
if [ ! -x "$V/bin/python" ]; then
  python3 -m venv "$V"
  # what importing the kernels' modules pulls in; torch only for dtypes (the build is nvcc + tvm-ffi headers).
  # torchvision is imported on the way and needs its torch (2.14.1 + 0.29.1, the pair this disk holds)
  pip install torch==2.14.1 torchvision==0.29.1 apache-tvm-ffi==0.1.11 numpy orjson psutil pybase64 requests \
    triton packaging pillow starlette tqdm ipython pydantic aiohttp msgspec pyzmq
fi
if [ ! -d "$SRC/sglang" ]; then
  mkdir -p "$SRC" && python3 -m pip download -q --no-deps -d "$SRC" sglang==0.5.17
  (cd "$SRC" && python3 -m zipfile -e sglang-0.5.17-*.whl . && rm sglang-0.5.17-*.whl)
fi
mkdir -p "$CACHE" "$OUT"
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} MAX_JOBS=${MAX_JOBS:-2} PYTHONPATH="$SRC" \
  "$V/bin/python" tools/gpu/sglang_jit_prebuild.py "$CACHE" || echo "some kernels did not build (listed above)"
(cd "$CACHE" && find . -name '*.so' -print0 | tar --null -cJf - -T -) > "$OUT/tvm_ffi_cache.tar.xz.tmp"
mv "$OUT/tvm_ffi_cache.tar.xz.tmp" "$OUT/tvm_ffi_cache.tar.xz"
echo "$(tar -tJf "$OUT/tvm_ffi_cache.tar.xz" | grep -c '\.so$') modules in $OUT/tvm_ffi_cache.tar.xz"
