#!/usr/bin/env bash
# GPU side of tools/gpu/stage_skyrl.sh. Run in the project root on the GPU machine, sent with the last part
# folder, after the earlier commands copied the other parts to /tmp/stash:
#   bash tools/gpu/stage_skyrl_unstage.sh .gpu/skyrlN
# It joins the parts, checks their sha256, installs the wheels into /tmp/site (no dependency resolution:
# the set is complete by construction), adds the flash_attn
# stand-in (tools/gpu/stage_skyrl_flash_attn), installs transformer-engine-torch built from its sdist by
# stage_skyrl_build_te.sh (waits for the background build the first command started, or runs it; BUILD_TE=0
# skips it), writes this project's entry points, and prints the
# environment every later command on the same machine exports. Wall times of each step are printed as
# "time <step> <seconds>". SITE=<dir> and STASH=<dir> change the two folders.
set -euo pipefail
HERE=$(cd "${1:?usage: stage_skyrl_unstage.sh <last part folder>}" && pwd)
SITE=${SITE:-/tmp/site}
STASH=${STASH:-/tmp/stash}
BUILD_TE=${BUILD_TE:-1}
ROOT=$(pwd)
mkdir -p "$STASH" "$SITE"
t0=$(date +%s)
step() { local t=$(date +%s); echo "time $1 $((t - t0))"; t0=$t; }

TAR="$STASH/skyrl.tar"
: > "$TAR"
for f in $(cat "$HERE/skyrl.parts"); do
  if [ -f "$HERE/$f" ]; then cat "$HERE/$f" >> "$TAR"; elif [ -f "$STASH/$f" ]; then cat "$STASH/$f" >> "$TAR"
  else echo "$f is neither in $HERE nor in $STASH: run the earlier commands again"; exit 1; fi
done
[ "$(sha256sum "$TAR" | cut -d' ' -f1)" = "$(cat "$HERE/skyrl.tar.sha256")" ] || { echo "SkyRL parts do not match their sha256: restage"; exit 1; }
rm -f "$STASH"/skyrl.part*
rm -rf "$STASH/whl" && tar xf "$TAR" -C "$STASH" && rm -f "$TAR"
step join
# The newer cuBLAS that TransformerEngine's core library needs goes to its own folder, not into the site:
# torch loads cuBLAS from its own nvidia/cu13/lib at import, so the newer pair must be preloaded
# (LD_PRELOAD, printed at the end) in every process, before torch.
CUBLAS_DIR=${CUBLAS_DIR:-/tmp/cublas}
PRELOAD=
for w in "$STASH"/whl/nvidia_cublas-*.whl; do
  [ -f "$w" ] || continue
  mkdir -p "$CUBLAS_DIR"
  python3 - "$w" "$CUBLAS_DIR" << 'PY'
import os, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
for lib in ("libcublasLt.so.13", "libcublas.so.13"):
    with z.open(f"nvidia/cu13/lib/{lib}") as src, open(os.path.join(sys.argv[2], lib), "wb") as dst:
        dst.write(src.read())
print("cuBLAS", os.path.basename(sys.argv[1]).split("-")[1], "->", sys.argv[2])
PY
  PRELOAD="$CUBLAS_DIR/libcublasLt.so.13:$CUBLAS_DIR/libcublas.so.13"
  rm -f "$w"
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$STASH"/whl/*.whl > "$STASH/pip.log" 2>&1 \
  || { cat "$STASH/pip.log"; echo "pip install of the staged wheels failed"; exit 1; }
grep -v "already exists" "$STASH/pip.log" || true
cp "$STASH/whl/SKYRL_REF" "$SITE/" && rm -rf "$STASH/whl"
step install
echo "SkyRL staged from NovaSky-AI/SkyRL at $(cat "$SITE/SKYRL_REF")"
# The flash_attn stand-in, with distribution metadata under its own name: transformers maps the import
# name to its distributions (a KeyError without any), and neither it nor TransformerEngine finds a
# "flash-attn" distribution, so both treat FlashAttention 2 as absent.
cp -r "$ROOT/tools/gpu/stage_skyrl_flash_attn/flash_attn" "$SITE/"
python3 - "$SITE" << 'PY'
import os, sys
site = sys.argv[1]
d = os.path.join(site, "stage_skyrl_flash_attn_padding-0.0.0.dist-info")
os.makedirs(d, exist_ok=True)
open(os.path.join(d, "METADATA"), "w").write("Metadata-Version: 2.1\nName: stage-skyrl-flash-attn-padding\nVersion: 0.0.0\n")
open(os.path.join(d, "top_level.txt"), "w").write("flash_attn\n")
files = [f"flash_attn/{f}" for f in sorted(os.listdir(os.path.join(site, "flash_attn"))) if f.endswith(".py")]
open(os.path.join(d, "RECORD"), "w").write("".join(f"{f},,\n" for f in files + [os.path.basename(d) + "/METADATA"]))
PY

NVCC=$(command -v nvcc || true)
for c in /usr/local/cuda/bin/nvcc /usr/local/cuda-13*/bin/nvcc; do [ -n "$NVCC" ] || { [ ! -x "$c" ] || NVCC=$c; }; done
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "${NVCC:-/usr/local/cuda/bin/nvcc}")")")}
export CUDA_HOME

if [ "$BUILD_TE" = 1 ]; then
  # stage_skyrl_build_te.sh, started in the background by the first command, or here if it was not
  B=${TE_BUILD_DIR:-/tmp/te-build}
  if [ ! -f "$B/status" ]; then
    src=$HERE
    [ -n "$(ls "$src"/transformer_engine_torch-*.tar.gz 2> /dev/null)" ] || src=$STASH
    bash "$ROOT/tools/gpu/stage_skyrl_build_te.sh" "$src"
  fi
  while [ "$(cat "$B/status")" = running ]; do sleep 5; done
  step te_build_wait
  echo "transformer-engine-torch build: $(cat "$B/status") in $(cat "$B/seconds") s"
  [ "$(cat "$B/status")" = ok ] || { tail -40 "$B/build.log"; echo "transformer-engine-torch build failed (log: $B/build.log)"; exit 1; }
  ls -la "$B"/whl/
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$B"/whl/*.whl 2>&1 | grep -v "already exists" || true
  # TransformerEngine finds its torch extension only as <site>/transformer_engine_torch*.so (or under
  # transformer_engine/ or transformer_engine/wheel_lib/): put it there wherever the build left it
  python3 -m zipfile -l "$B"/whl/*.whl | grep -E "\.so" || echo "the transformer-engine-torch wheel holds no .so"
  if ! compgen -G "$SITE/transformer_engine_torch*.so" > /dev/null; then
    so=$(find "$SITE" "$B" -name "transformer_engine_torch*.so" 2> /dev/null | head -1)
    if [ -n "$so" ]; then cp "$so" "$SITE/" && echo "TE torch extension: $so -> $SITE/"; else echo "no transformer_engine_torch*.so found"; fi
  fi
  step te_install
fi

# this project's entry points, read from its pyproject.toml (the code itself is used from the working tree)
python3 - "$SITE" << 'PY'
import os, sys, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
d = f"{sys.argv[1]}/{p['name'].replace('-', '_')}-{p['version']}.dist-info"
os.makedirs(d, exist_ok=True)
open(f"{d}/METADATA", "w").write(f"Metadata-Version: 2.1\nName: {p['name']}\nVersion: {p['version']}\n")
eps = p.get("entry-points", {})
open(f"{d}/entry_points.txt", "w").write("".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in m.items()) for g, m in eps.items()))
print("entry points:", {g: list(m) for g, m in eps.items()})
PY
du -sh "$SITE"
echo "in every later command: export PYTHONPATH=$SITE:\$PWD CUDA_HOME=$CUDA_HOME VLLM_USE_FLASHINFER_SAMPLER=0${PRELOAD:+ LD_PRELOAD=$PRELOAD}"
