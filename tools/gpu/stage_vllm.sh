#!/usr/bin/env bash
# Stage a GPU vLLM for the H200 test machine (torch 2.11.0+cu130, Python 3.12, no network; each command
# there receives at most 64 MiB of files). vLLM 0.26.0 is the newest release that pins torch==2.11.0, and
# the one SkyRL's lock file pins, so it is the GPU vLLM we test on.
#
# Run in the project root, on the CPU machine (needs pip and the package index):
#   bash tools/gpu/stage_vllm.sh           # writes .gpu/vllm1 .gpu/vllm2 .gpu/vllm3 (each < 60 MB)
# and keep '.gpu/' out of git (echo /.gpu/ >> .git/info/exclude).
#
# On the GPU machine, three commands in a row, each sent with one part folder. A folder sent with one
# command is gone at the next, but /tmp stays while the machine is kept (30 s after a command ends), so
# each part is copied to /tmp/stash at once:
#   1. with .gpu/vllm1:  mkdir -p /tmp/stash && cp .gpu/vllm1/* /tmp/stash/
#   2. with .gpu/vllm2:  cp .gpu/vllm2/* /tmp/stash/
#   3. with .gpu/vllm3:  bash .gpu/vllm3/unstage.sh && <your tests>
# unstage.sh unpacks vLLM and its packages into /tmp/site, writes this project's entry points there,
# and prints the environment to export in every later command on the same machine:
#   export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0
# (vLLM's sampler imports flashinfer unless that variable is 0; flashinfer is not staged.)
# If a command finds /tmp/site missing, the machine is a new one: start again at 1.
set -euo pipefail
VLLM=${VLLM:-0.26.0}
OUTDIR=${1:-.gpu}
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp"
for n in 17 24 27 28 31 34 35; do PLAT="$PLAT --platform manylinux_2_${n}_x86_64"; done
PLAT="$PLAT --platform manylinux2014_x86_64"
pip() { python3 -m pip --disable-pip-version-check "$@"; }

echo "downloading vllm==$VLLM (~300 MB)"
pip download -q --no-deps $PLAT -d "$W/whl" "vllm==$VLLM"
# What the offline engine imports at module level on an H200 (checked on the machine for 0.26.0), pinned to
# versions that work there. Not staged: flashinfer, FA2 (FA3 serves SM90), structured-output extras' kernels.
DEPS="pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
 fastapi==0.136.3 starlette==1.10.0 openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 jiter==0.19.0 sniffio==1.3.1
 truststore==0.10.5 openai-harmony==0.0.8 msgspec==0.23.0 pyzmq==27.3.0 cbor2==6.3.0 cachetools==8.0.2
 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 blake3==1.0.11 compressed-tensors==0.17.0 loguru==0.7.3
 frozendict==2.5.1 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 llguidance==1.7.6 outlines-core==0.2.14 lark==1.2.2
 depyf==0.20.0 astor==0.8.1 dill==0.4.1 setproctitle==1.3.8 python-json-logger==4.2.0 gguf==0.19.0 ijson==3.6.0"
pip download -q --no-deps $PLAT -d "$W/deps" $DEPS

echo "stripping and packing"
mkdir -p "$W/site"
(cd "$W/site" && python3 -m zipfile -e "$W"/whl/vllm-*.whl .)
rm -f "$W"/site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so "$W"/site/vllm/vllm-rs
find "$W/site/vllm/third_party" -name '_C.cpython-3*-x86_64-linux-gnu.so' ! -name '*cpython-312*' -delete 2>/dev/null || true
(cd "$W/site" && tar cf - . | xz -T0 -6 > "$W/vllm.tar.xz")
rm -rf "$OUTDIR"/vllm1 "$OUTDIR"/vllm2 "$OUTDIR"/vllm3
mkdir -p "$OUTDIR"/vllm1 "$OUTDIR"/vllm2 "$OUTDIR"/vllm3
split -b 59000000 -d "$W/vllm.tar.xz" "$W/part"
n=$(ls "$W"/part* | wc -l)
[ "$n" -le 2 ] || { echo "vLLM packed to $n parts; this script handles 2"; exit 1; }
mv "$W/part00" "$OUTDIR/vllm1/"
[ -f "$W/part01" ] && mv "$W/part01" "$OUTDIR/vllm2/" || touch "$OUTDIR/vllm2/empty"
cp "$W"/deps/*.whl "$OUTDIR/vllm3/"
sha256sum "$W/vllm.tar.xz" | cut -d' ' -f1 > "$OUTDIR/vllm3/vllm.tar.xz.sha256"
cat > "$OUTDIR/vllm3/unstage.sh" <<'UNSTAGE'
#!/usr/bin/env bash
# On the GPU machine, in the project root, after /tmp/stash holds the vLLM parts (see stage_vllm.sh).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
cat /tmp/stash/part0* > /tmp/vllm.tar.xz
[ "$(sha256sum /tmp/vllm.tar.xz | cut -d' ' -f1)" = "$(cat "$HERE/vllm.tar.xz.sha256")" ] || { echo "vLLM parts do not match: restage"; exit 1; }
mkdir -p /tmp/site
python3 -c "import tarfile; tarfile.open('/tmp/vllm.tar.xz').extractall('/tmp/site')"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$HERE"/*.whl 2>&1 | grep -v "already exists" || true
# this project's entry points, read from its pyproject.toml (the code itself is used from the working tree)
python3 - <<'PY'
import os, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
d = f"/tmp/site/{p['name'].replace('-', '_')}-{p['version']}.dist-info"
os.makedirs(d, exist_ok=True)
open(f"{d}/METADATA", "w").write(f"Metadata-Version: 2.1\nName: {p['name']}\nVersion: {p['version']}\n")
eps = p.get("entry-points", {})
open(f"{d}/entry_points.txt", "w").write("".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in m.items()) for g, m in eps.items()))
print("entry points:", {g: list(m) for g, m in eps.items()})
PY
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0
python3 -c "import torch, vllm; print('vllm', vllm.__version__, '| torch', torch.__version__, '|', torch.cuda.get_device_name())"
echo "in every later command: export PYTHONPATH=/tmp/site:\$PWD VLLM_USE_FLASHINFER_SAMPLER=0"
UNSTAGE
chmod +x "$OUTDIR/vllm3/unstage.sh"
du -sh "$OUTDIR"/vllm1 "$OUTDIR"/vllm2 "$OUTDIR"/vllm3
