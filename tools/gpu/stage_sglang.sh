#!/usr/bin/env bash
# Stage a GPU SGLang for the H200 test machine (torch 2.11.0+cu130, Python 3.12, transformers 5.17.0,
# nvcc 13.0, no network; each command there receives at most 64 MiB of files). SGLang 0.5.17 pins
# torch==2.11.0, the machine's torch (0.5.23, the release kimi_sglang_plugin targets, pins torch 2.14.1),
# so it is the GPU SGLang we can test on.
#
# Run in the project root, on the CPU machine (needs pip and the package index):
#   bash tools/gpu/stage_sglang.sh         # writes .gpu/sglang1 (37 MB today; .gpu/sglang2 ... if it grows)
# and keep '.gpu/' out of git (echo /.gpu/ >> .git/info/exclude). WHEEL_CACHE=<dir> makes pip take wheels
# found there first (sglang-kernel alone is a 383 MB download). Each part folder is < 60 MB: the packed
# engine is split over as many as it needs, and the small wheels, unstage.sh and the sha256 go with the
# last one (into a folder of their own if they do not fit). The script prints the command sequence.
#
# On the GPU machine, today one command, sent with .gpu/sglang1 (it and the repo are under 64 MiB):
#   1. with .gpu/sglang1:  bash .gpu/sglang1/unstage.sh && <your tests>
# With N part folders, N commands in a row, each sent with one part folder. A folder sent with one command
# is gone at the next, but /tmp stays while the machine is kept (30 s after a command ends), so each part
# but the last is copied to /tmp/stash at once:
#   k < N. with .gpu/sglangk:  mkdir -p /tmp/stash && cp .gpu/sglangk/* /tmp/stash/
#   N.     with .gpu/sglangN:  bash .gpu/sglangN/unstage.sh && <your tests>
# unstage.sh unpacks SGLang and its packages into /tmp/site (SITE=<dir> for another one, e.g. to keep a
# staged vLLM's different pydantic/openai/xgrammar/tvm-ffi pins intact), patches sglang 0.5.17 for
# transformers 5.17 (its qwen3_asr AutoConfig.register calls get exist_ok=True), writes this project's
# entry points there, and prints the environment to export in every later command on the same machine:
#   export PYTHONPATH=/tmp/site:$PWD CUDA_HOME=<the CUDA 13.0 of nvcc>
# Engine flags that need nothing unstaged (no FA3/FA4, no sgl_kernel flash_ops, no sm100 kernels):
#   attention_backend="triton" (or "flashinfer"), mm_attention_backend="triton_attn",
#   grammar_backend="none", sampling_backend="pytorch", disable_cuda_graph=True,
#   moe_runner_backend="marlin" for quantized experts; enable_multimodal=False for text-only checkpoints.
# SGLang loads every installed sglang.srt.plugins entry point when SGLANG_PLUGINS is unset or empty,
# so stock runs need SGLANG_PLUGINS=<a name that is not installed>, e.g. SGLANG_PLUGINS=none.
# If a command finds /tmp/site missing, the machine is a new one: start again at 1.
set -euo pipefail
SGLANG=${SGLANG:-0.5.17}
OUTDIR=${1:-.gpu}
LIMIT=${PART_BYTES:-59000000}  # bytes per part (smaller only to test the split)
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp"
for n in 17 24 27 28 31 34 35; do PLAT="$PLAT --platform manylinux_2_${n}_x86_64"; done
PLAT="$PLAT --platform manylinux2014_x86_64"
pip() { python3 -m pip --disable-pip-version-check "$@"; }
# fetch DIR SPEC...: each SPEC from $WHEEL_CACHE if it is there, the rest from the registries
fetch() {
  local d=$1 s miss=(); shift
  if [ -n "${WHEEL_CACHE:-}" ]; then
    for s in "$@"; do
      pip download -q --no-deps $PLAT --no-index --find-links "$WHEEL_CACHE" -d "$d" "$s" >/dev/null 2>&1 || miss+=("$s")
    done
    set -- ${miss[@]+"${miss[@]}"}
  fi
  [ $# -eq 0 ] || pip download -q --no-deps $PLAT -d "$d" "$@"
}

# The engine and its kernels (the versions 0.5.17 pins), unpacked and stripped into one xz.
BIG="sglang==$SGLANG sglang-kernel==0.4.5 flashinfer-python==0.6.15.post1 sgl-deep-gemm==0.1.5.post1"
# What the offline engine imports at module level (import traces of 0.5.17 with transformers 5.17, each
# package dropped in turn), less what the machine has. openai is 0.5.17's pin; xgrammar 0.2.7 (1.3 MB)
# instead of the pinned 0.2.1 (45 MB) has every name 0.5.17 imports. Not staged: flashinfer's declared
# cutlass-dsl, cuda-tile, nccl4py, cudnn-frontend (not needed to import it; JIT goes through nvcc),
# IPython's own dependencies (sglang only imports IPython.display), the grammar backends' kernels.
DEPS="pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 opentelemetry-api==1.45.2
 orjson==3.13.0 pybase64==1.5.1 msgspec==0.23.0 setproctitle==1.3.8 pyzmq==27.3.0
 ipython==9.18.1 traitlets==5.16.1 dill==0.4.1
 openai==2.6.1 distro==1.9.0 sniffio==1.3.1 jiter==0.19.0 partial-json-parser==0.2.1.1.post7
 compressed-tensors==0.18.0 loguru==0.7.3 gguf==0.19.0 apache-tvm-ffi==0.1.11 xgrammar==0.2.7"
echo "downloading sglang==$SGLANG and its kernels (~420 MB, sglang-kernel is 383 MB of it)"
fetch "$W/whl" $BIG
fetch "$W/deps" $DEPS

echo "stripping and packing"
mkdir -p "$W/site"
for f in "$W"/whl/*.whl; do (cd "$W/site" && python3 -m zipfile -e "$f" .); done
S="$W/site"
# Rust extensions: the embedded Rust server (SGLANG_RUST_SERVER), the gRPC server, the Inkling image
# preprocessor (SGLANG_INKLING_RS_MM_PREPROCESS); multimodal_gen: the diffusion runtime (sglang.cli only).
# None is imported on the offline-engine path (checked by import trace and by grep of 0.5.17).
rm -f "$S"/sglang/srt/server/_core.*.so "$S"/sglang/srt/grpc/_core.*.so "$S"/sglang/srt/multimodal/_core.*.so
rm -rf "$S/sglang/multimodal_gen"
# build-time leftovers the wheels put at top level (a 'tools' package first on PYTHONPATH could shadow one)
rm -rf "$S/tools" "$S/build_backend.py" "$S/build_utils.py"
# sglang-kernel: keep sm90/common_ops (what its __init__ loads on compute capability 9.0), flashmla_ops,
# spatial_ops, the Python files and triton_kernels. Dropped: flash_ops (FA3, 1.1 GB unpacked; only the fa3
# backends import sgl_kernel.flash_attn), sm100/ (Blackwell), infllm_ops (a cpython-310 build).
rm -f "$S"/sgl_kernel/flash_ops.*.so "$S"/sgl_kernel/infllm_ops.*.so
rm -rf "$S/sgl_kernel/sm100"
for f in "$S"/sglang/srt/server/_core.*.so "$S"/sgl_kernel/flash_ops.*.so; do [ ! -e "$f" ] || { echo "strip failed: $f"; exit 1; }; done
[ -f "$S"/sgl_kernel/sm90/common_ops.abi3.so ] || { echo "sgl_kernel/sm90/common_ops.abi3.so missing"; exit 1; }
(cd "$S" && tar cf - --sort=name . | xz -T0 -9 > "$W/sglang.tar.xz")
rm -rf "$OUTDIR"/sglang[0-9]*
(cd "$W" && split -b $LIMIT -d sglang.tar.xz sgl.part)
parts=("$W"/sgl.part*)
n=${#parts[@]}
wheels=$(cat "$W"/deps/*.whl | wc -c)
last=$(wc -c < "${parts[$((n - 1))]}")
# the wheels and unstage.sh ride with the last xz part when they fit, else in a part of their own
if [ $((last + wheels + 100000)) -le $LIMIT ]; then m=$n; else m=$((n + 1)); fi
for i in $(seq 1 $m); do mkdir -p "$OUTDIR/sglang$i"; done
for i in $(seq 1 $n); do mv "${parts[$((i - 1))]}" "$OUTDIR/sglang$i/"; done
cp "$W"/deps/*.whl "$OUTDIR/sglang$m/"
sha256sum "$W/sglang.tar.xz" | cut -d' ' -f1 > "$OUTDIR/sglang$m/sglang.tar.xz.sha256"
for p in "${parts[@]}"; do basename "$p"; done > "$OUTDIR/sglang$m/sglang.parts"
cat > "$OUTDIR/sglang$m/unstage.sh" <<'UNSTAGE'
#!/usr/bin/env bash
# On the GPU machine, in the project root, after /tmp/stash holds the earlier SGLang parts, if any (see
# stage_sglang.sh). SITE=<dir> unpacks elsewhere than /tmp/site, STASH=<dir> reads parts from elsewhere.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SITE=${SITE:-/tmp/site}
STASH=${STASH:-/tmp/stash}
mkdir -p "$STASH" "$SITE"
XZ="$STASH/sglang.tar.xz"
: > "$XZ"
for f in $(cat "$HERE/sglang.parts"); do
  if [ -f "$HERE/$f" ]; then cat "$HERE/$f" >> "$XZ"; elif [ -f "$STASH/$f" ]; then cat "$STASH/$f" >> "$XZ"
  else echo "$f is neither here nor in $STASH: run the earlier commands again"; exit 1; fi
done
[ "$(sha256sum "$XZ" | cut -d' ' -f1)" = "$(cat "$HERE/sglang.tar.xz.sha256")" ] || { echo "SGLang parts do not match: restage"; exit 1; }
python3 -c "import sys, tarfile; t = tarfile.open(sys.argv[1]); t.extractall(sys.argv[2], **({'filter': 'tar'} if hasattr(tarfile, 'tar_filter') else {}))" "$XZ" "$SITE"
rm -f "$XZ"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$HERE"/*.whl > "$STASH/pip.log" 2>&1 \
  || { cat "$STASH/pip.log"; echo "pip install of the staged wheels failed"; exit 1; }
grep -v "already exists" "$STASH/pip.log" || true
# sglang 0.5.17 registers "qwen3_asr" with AutoConfig without exist_ok; transformers 5.17 already has that
# model type, so `import sglang.srt.configs` (every engine process) raises "'qwen3_asr' is already used".
F="$SITE/sglang/srt/configs/qwen3_asr.py"
sed -i -E 's/^AutoConfig\.register\(("qwen3_asr[a-z_]*"), ([A-Za-z0-9_]+)\)$/AutoConfig.register(\1, \2, exist_ok=True)/' "$F"
grep -q '^AutoConfig.register("qwen3_asr", Qwen3ASRConfig, exist_ok=True)$' "$F" || { echo "qwen3_asr patch did not apply to $F"; exit 1; }
echo "patched $F: AutoConfig.register(\"qwen3_asr\"...) now passes exist_ok=True (transformers 5.17 has qwen3_asr)"
# this project's entry points, read from its pyproject.toml (the code itself is used from the working tree)
python3 - "$SITE" <<'PY'
import os, sys, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
d = f"{sys.argv[1]}/{p['name'].replace('-', '_')}-{p['version']}.dist-info"
os.makedirs(d, exist_ok=True)
open(f"{d}/METADATA", "w").write(f"Metadata-Version: 2.1\nName: {p['name']}\nVersion: {p['version']}\n")
eps = p.get("entry-points", {})
open(f"{d}/entry_points.txt", "w").write("".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in m.items()) for g, m in eps.items()))
print("entry points:", {g: list(m) for g, m in eps.items()})
PY
# CUDA_HOME: the CUDA 13.0 that nvcc belongs to (flashinfer's and sglang's JIT kernels build with it)
NVCC=$(command -v nvcc || true)
for c in /usr/local/cuda/bin/nvcc /usr/local/cuda-13*/bin/nvcc; do [ -n "$NVCC" ] || { [ ! -x "$c" ] || NVCC=$c; }; done
if [ -n "$NVCC" ]; then CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$NVCC")")")}; else CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}; echo "warning: no nvcc found; JIT kernels will not build"; fi
export PYTHONPATH=$SITE:$PWD CUDA_HOME
python3 - <<'PY'
import torch
print("torch", torch.__version__, "|", torch.cuda.get_device_name(), "| capability", torch.cuda.get_device_capability())
import sgl_kernel, flashinfer, sglang, xgrammar, transformers
import sglang.srt.configs  # the qwen3_asr registration
from importlib.metadata import version
print("sglang", version("sglang"), "| sglang-kernel", version("sglang-kernel"), "| flashinfer", flashinfer.__version__,
      "| xgrammar", xgrammar.__version__, "| transformers", transformers.__version__)
PY
echo "in every later command: export PYTHONPATH=$SITE:\$PWD CUDA_HOME=$CUDA_HOME"
UNSTAGE
chmod +x "$OUTDIR/sglang$m/unstage.sh"
du -b "$OUTDIR"/sglang[0-9]* | sed 's/^/bytes /'
for i in $(seq 1 $m); do [ "$(du -cb "$OUTDIR/sglang$i" | tail -1 | cut -f1)" -lt 60000000 ] || { echo "$OUTDIR/sglang$i is 60 MB or more"; exit 1; }; done
echo "on the GPU machine, $m command(s) in a row:"
for i in $(seq 1 $((m - 1))); do echo "  $i. with $OUTDIR/sglang$i:  mkdir -p /tmp/stash && cp $OUTDIR/sglang$i/* /tmp/stash/"; done
echo "  $m. with $OUTDIR/sglang$m:  bash $OUTDIR/sglang$m/unstage.sh && <your tests>"
