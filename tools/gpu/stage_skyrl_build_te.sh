#!/usr/bin/env bash
# Build transformer-engine-torch from its PyPI sdist on the GPU machine (it is a torch CppExtension: host
# g++ over csrc/*.cpp against torch's and CUDA's headers plus cudnn.h from the cuDNN pip package that the
# machine's torch uses). tools/gpu/stage_skyrl.sh puts the sdist in the first part folder so the build can
# run in the background while the other parts travel:
#   setsid bash tools/gpu/stage_skyrl_build_te.sh /tmp/stash > /dev/null 2>&1 < /dev/null &
# Writes into TE_BUILD_DIR (default /tmp/te-build): build.log, whl/transformer_engine_torch-*.whl,
# status (running, then ok or failed) and seconds (wall time of the build). stage_skyrl_unstage.sh waits
# for it and installs the wheel.
set -uo pipefail
SRC=$(cd "${1:?usage: stage_skyrl_build_te.sh <folder holding transformer_engine_torch-*.tar.gz>}" && pwd)
B=${TE_BUILD_DIR:-/tmp/te-build}
rm -rf "$B" && mkdir -p "$B/src"
echo running > "$B/status"
t0=$(date +%s)
build() {
  set -e
  tar xzf "$SRC"/transformer_engine_torch-*.tar.gz -C "$B/src"
  NVCC=$(command -v nvcc || true)
  for c in /usr/local/cuda/bin/nvcc /usr/local/cuda-13*/bin/nvcc; do [ -n "$NVCC" ] || { [ ! -x "$c" ] || NVCC=$c; }; done
  CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "${NVCC:-/usr/local/cuda/bin/nvcc}")")")}
  CUDNN_INC=$(python3 -c "import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], 'include'))")
  [ -f "$CUDNN_INC/cudnn.h" ] || { echo "no cudnn.h under $CUDNN_INC"; return 1; }
  echo "CUDA_HOME=$CUDA_HOME nvcc=$NVCC cudnn headers=$CUDNN_INC jobs=${MAX_JOBS:-$(nproc)} $(g++ --version | head -1)"
  cd "$B"/src/transformer_engine_torch-*
  # FORCE_BUILD: do not try to download a prebuilt wheel from GitHub (no network there)
  CUDA_HOME=$CUDA_HOME NVTE_PYTORCH_FORCE_BUILD=TRUE MAX_JOBS=${MAX_JOBS:-$(nproc)} \
    CPLUS_INCLUDE_PATH="$CUDNN_INC${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}" \
    python3 -m pip wheel -v --no-deps --no-build-isolation --no-index -w "$B/whl" .
}
if (build) > "$B/build.log" 2>&1; then s=ok; else s=failed; fi
echo $(($(date +%s) - t0)) > "$B/seconds"
echo $s > "$B/status"
