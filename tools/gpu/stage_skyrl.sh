#!/usr/bin/env bash
# Stage SkyRL's own training loop (Ray, RayPPOTrainer, the vLLM generator, the Megatron policy worker) for
# the GPU test machine: Python 3.12, torch 2.11.0+cu130, nvcc 13.0, no network, each command there
# receiving at most 64 MiB of files (the working tree plus what `carry` names).
#
# Which SkyRL: no SkyRL release runs on torch 2.11 with vLLM 0.26. skyrl 0.4.0 pins torch 2.13.0 and
# vLLM 0.30.0; skyrl 0.3.0 pins torch 2.11.0 but vLLM 0.23.0, TransformerEngine 2.11 for CUDA 12, and
# has no Kimi pieces beyond fake-INT4 QAT. So this stages NovaSky-AI/SkyRL main at its August lock
# (SKYRL_REF below, `skyrl/__init__.py` there says 0.3.0; uv.lock: vLLM 0.26.0, torch 2.11.0+cu130,
# TE 2.16.0, megatron-core 0.19.0, megatron-bridge 0.6.0, ray 2.57.0, transformers 5.8.0), with skyrl and
# skyrl-gym built as wheels from that commit's source. That commit does NOT contain the Kimi series
# (KimiK25TextBridge, normalize_moe_lora, the vLLM Kimi LoRA patch, adapter-only sync: SkyRL PRs
# #2026/#2027/#2062/#2064, whose heads pin the same vLLM/torch/TE); SKYRL_REF=<commit> stages another.
#
# Versions and where they differ from SkyRL's lock (the lock takes some wheels from indexes this
# machine cannot reach, wheels.astral.sh and github.com; only PyPI is used here):
#   transformer-engine 2.16.0 + transformer-engine-cu13 2.16.0 (PyPI wheels) + transformer-engine-torch
#     2.16.0 as its PyPI sdist, built on the GPU machine by stage_skyrl_unstage.sh (the lock's Astral
#     prebuilt wheel is not reachable);
#   megatron-core 0.19.0+71e418ea7 built here from the lock's git revision (MCORE_REF, from MCORE_GIT):
#     SkyRL's Megatron strategy imports megatron.core.dist_checkpointing.strategies.base, which the
#     PyPI 0.19.0 wheel does not have; megatron-bridge 0.6.0 from PyPI (the lock's 0.6.0+91a15142 imports
#     nvidia-modelopt at module level, which nothing on the loop's path needs);
#   vllm-router 0.1.15 (the lock's 0.1.14.post1 is a fork wheel whose fix 0.1.15 carries);
#   flash-attn: not staged (no wheel for torch 2.11 on PyPI, its CUDA build takes hours). SkyRL imports
#     only flash_attn.bert_padding {pad_input, unpad_input} at module level; tools/gpu/
#     stage_skyrl_flash_attn/ is a small package written from those functions' definitions, installed
#     without a flash-attn dist-info so TransformerEngine does not mistake it for FlashAttention 2 (TE
#     then uses cuDNN fused attention);
#   vLLM's module-level deps: the versions verified on this machine with vLLM 0.26.0 (xgrammar 0.2.9,
#     apache-tvm-ffi 0.1.15.post2 where the lock has 0.2.3 / 0.1.10); flashinfer, wandb, nixl, mamba,
#     causal-conv1d, fla, modelopt are not staged (none is imported on the path the smoke test covers);
#   nvidia-cublas 13.2.0.9 (below) because TE 2.16's PyPI core library needs a newer cuBLAS than the
#     machine's 13.1.0.3.
#
# Run in the project root, on the CPU machine (needs git, pip and the package index):
#   SKYRL_GIT=<a clone or mirror of NovaSky-AI/SkyRL> tools/gpu/stage_skyrl.sh [OUTDIR]
# It writes OUTDIR/skyrl1 ... OUTDIR/skyrlN (default OUTDIR .gpu; keep it out of git with
# `echo /.gpu/ >> .git/info/exclude`). PART_BYTES (default 48000000) is the size of one part: a part
# travels with the working tree, and both must stay under 64 MiB together. WHEEL_CACHE=<dir> takes the
# wheels found there first. The script prints the GPU command sequence at the end:
#   1.     carry .gpu/skyrl1:  copy it to /tmp/stash and start stage_skyrl_build_te.sh in the background
#   1<k<N. carry .gpu/skyrlk:  cp .gpu/skyrlk/* /tmp/stash/
#   N.     carry .gpu/skyrlN:  bash tools/gpu/stage_skyrl_unstage.sh .gpu/skyrlN  (then export what it prints)
# tools/gpu/README-skyrl.md has the exact commands, sizes and what was measured.
# A folder sent with one command is gone at the next, but /tmp stays while the machine is kept (about
# 30 s after a command ends), so the commands must follow each other at once.
set -euo pipefail
SKYRL_GIT=${SKYRL_GIT:-/work/.mirror/NovaSky-AI+SkyRL/repo}
SKYRL_REF=${SKYRL_REF:-a9564572eb8e91076be43c1bd5e4615e3de17265}
MCORE_GIT=${MCORE_GIT:-/work/.mirror/NVIDIA+Megatron-LM/repo}
MCORE_REF=${MCORE_REF:-71e418ea7d7b3a6c9a53238c543c3e0b43e11026}
PY312=${PY312:-python3.12}  # builds megatron-core's optional C++ dataset helper for the GPU machine's Python
OUTDIR=${1:-.gpu}
LIMIT=${PART_BYTES:-48000000}
ROOT=$(pwd)
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp"
for n in 17 24 27 28 31 34 35; do PLAT="$PLAT --platform manylinux_2_${n}_x86_64"; done
PLAT="$PLAT --platform manylinux2014_x86_64"
pip() { python3 -m pip --disable-pip-version-check "$@"; }
# fetch DIR NAME==VERSION...: each wheel from $WHEEL_CACHE if a file of that name and version is there,
# the rest from the package index
fetch() {
  local d=$1 s f miss=()
  shift
  mkdir -p "$d"
  if [ -n "${WHEEL_CACHE:-}" ]; then
    for s in "$@"; do
      f=$(find "$WHEEL_CACHE" -maxdepth 1 -iname "$(echo "${s%%==*}" | tr -- '-.' '__')-${s#*==}-*.whl" | head -1)
      if [ -n "$f" ]; then cp "$f" "$d/"; else miss+=("$s"); fi
    done
    set -- ${miss[@]+"${miss[@]}"}
  fi
  [ $# -eq 0 ] || pip download -q --no-deps $PLAT -d "$d" "$@"
}

# The engines and libraries. Large: vllm (304 MB), transformer-engine-cu13 (190 MB), ray (78 MB).
ENGINES="vllm==0.26.0 ray==2.57.0 transformer-engine==2.16.0 transformer-engine-cu13==2.16.0
 megatron-bridge==0.6.0 transformers==5.8.0 vllm-router==0.1.15"
# vLLM 0.26.0's module-level imports (list verified on this machine for the offline engine) plus what
# its OpenAI server module imports (SkyRL's vLLM server actor imports vllm.entrypoints.openai.api_server).
VLLM_DEPS="pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
 fastapi==0.136.3 starlette==1.10.0 openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 jiter==0.19.0 sniffio==1.3.1
 truststore==0.10.5 openai-harmony==0.0.8 msgspec==0.23.0 pyzmq==27.3.0 cbor2==6.3.0 cachetools==8.0.2
 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 blake3==1.0.11 compressed-tensors==0.17.0 loguru==0.7.3
 frozendict==2.5.1 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 llguidance==1.7.6 outlines-core==0.2.14 lark==1.2.2
 depyf==0.20.0 astor==0.8.1 dill==0.4.1 setproctitle==1.3.8 python-json-logger==4.2.0 gguf==0.19.0 ijson==3.6.0
 prometheus-fastapi-instrumentator==8.1.0 model-hosting-container-standards==0.1.16 watchfiles==1.2.0
 python-multipart==0.0.32 uvicorn==0.52.1 mistral-common==1.11.7 pydantic-extra-types==2.11.0"
# SkyRL (base + skyrl-train extra, module-level imports on the trainer / worker / server paths), Ray,
# TransformerEngine's torch side and Megatron-Bridge: the lock's versions. tokenizers 0.22.2: transformers
# 5.8 checks tokenizers<=0.23.0 at import (the machine has 0.23.2). jmespath, supervisor: vLLM's SageMaker
# router (model-hosting-container-standards), imported by its OpenAI server module. pycountry:
# mistral-common (transformers' MistralCommonBackend, imported by vLLM's structured-output module) needs
# pydantic-extra-types' language codes. nvidia-cublas 13.2.0.9: the PyPI TransformerEngine 2.16 core
# library needs cublasLtGroupedMatrixLayoutInit_internal, which the machine's cuBLAS 13.1.0.3 lacks
# (13.2.0.9 has it); stage_skyrl_unstage.sh puts its two libraries aside for LD_PRELOAD.
LOOP_DEPS="datasets==5.0.1 multiprocess==0.70.19 fsspec==2026.6.0 torchdata==0.11.0 tensordict==0.13.0 pyvers==0.2.3
 omegaconf==2.3.1 hydra-core==1.3.2 peft==0.18.1
 cloudpathlib==0.24.0 zstandard==0.25.0 orjson==3.11.9 importlib-metadata==8.9.0
 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.6.3
 nvdlfw-inspect==0.2.2 diffusers==0.39.0 tokenizers==0.22.2 jmespath==1.0.1 supervisor==4.3.0
 pycountry==26.2.16 nvidia-cublas==13.2.0.9
 jaxtyping==0.3.11 wadler-lindig==0.1.8 accelerate==1.16.0 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2
 pygments==2.21.0"
echo "downloading the engines (~600 MB) and $(echo $VLLM_DEPS $LOOP_DEPS | wc -w) small packages"
fetch "$W/whl" $ENGINES $VLLM_DEPS $LOOP_DEPS
# sdist OUTDIR NAME VERSION: the sdist of NAME==VERSION, taken from the index's simple page (`pip download`
# would prepare its metadata, which for transformer-engine-torch needs torch) and checked against the
# sha256 the page gives.
sdist() {
  python3 - "$@" << 'PY'
import hashlib, os, re, sys, urllib.request
out, name, ver = sys.argv[1:4]
page = urllib.request.urlopen(f"https://pypi.org/simple/{name}/").read().decode()
stem = re.escape(re.sub(r"[-_.]+", "_", name)) + "|" + re.escape(name)
m = re.search(r'href="([^"#]*/(?:' + stem + r')-' + re.escape(ver) + r'\.tar\.gz)#sha256=([0-9a-f]{64})"', page, re.I)
if not m:
    sys.exit(f"{name}=={ver}: no sdist on the index page")
data = urllib.request.urlopen(m.group(1)).read()
if hashlib.sha256(data).hexdigest() != m.group(2):
    sys.exit(f"{name}=={ver}: sha256 of the download does not match the index")
os.makedirs(out, exist_ok=True)
open(os.path.join(out, os.path.basename(m.group(1))), "wb").write(data)
print(f"{name}=={ver} sdist: {len(data)} bytes")
PY
}
# built on the GPU machine (a torch extension)
sdist "$W/sdist" transformer-engine-torch 2.16.0
# pure Python and sdist only, built into wheels here: antlr4 (hydra-core and omegaconf need 4.9.*) and
# func-timeout (skyrl-gym's code-execution environments)
sdist "$W/pure" antlr4-python3-runtime 4.9.3
sdist "$W/pure" func-timeout 4.3.5
pip wheel -q --no-deps -w "$W/whl" "$W"/pure/*.tar.gz

echo "building skyrl and skyrl-gym wheels from $SKYRL_GIT at $SKYRL_REF"
mkdir -p "$W/src"
# a throwaway index, so a mirror with missing blobs elsewhere in the tree still yields these paths
GIT_INDEX_FILE="$W/git-index" git --git-dir="$SKYRL_GIT" read-tree "$SKYRL_REF"
GIT_INDEX_FILE="$W/git-index" git --git-dir="$SKYRL_GIT" ls-files -- pyproject.toml README.md LICENSE skyrl skyrl-gym \
  | GIT_INDEX_FILE="$W/git-index" git --git-dir="$SKYRL_GIT" --work-tree="$W/src" checkout-index -f --stdin
pip wheel -q --no-deps -w "$W/whl" "$W/src" "$W/src/skyrl-gym"

echo "building megatron-core from $MCORE_GIT at $MCORE_REF"
mkdir -p "$W/mcore"
GIT_INDEX_FILE="$W/git-index-mcore" git --git-dir="$MCORE_GIT" read-tree "$MCORE_REF"
GIT_INDEX_FILE="$W/git-index-mcore" git --git-dir="$MCORE_GIT" ls-files -- megatron setup.py pyproject.toml MANIFEST.in \
  README.md LICENSE | GIT_INDEX_FILE="$W/git-index-mcore" git --git-dir="$MCORE_GIT" --work-tree="$W/mcore" checkout-index -f --stdin
"$PY312" -m pip --disable-pip-version-check wheel -q --no-deps -w "$W/whl" "$W/mcore"

# Members no step of SkyRL's loop loads, deleted from the wheels without recompressing the rest (the wheels
# are deflate-compressed already; xz over the 1.4 GB they unpack to saves about two parts but takes far
# longer on a 2-core machine than the two extra GPU commands):
# vLLM's FA2 library (SM90 runs FA3) and Rust server, deep_gemm builds for other Pythons; Ray's Java jar
# and the dashboard's web client (the loop starts Ray without the dashboard).
zip -q -d "$W"/whl/vllm-*.whl 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' 'vllm/vllm-rs' \
  'vllm/third_party/deep_gemm/_C.cpython-313-*' 'vllm/third_party/deep_gemm/_C.cpython-314-*'
zip -q -d "$W"/whl/ray-*.whl 'ray/jars/*' 'ray/dashboard/client/build/*'
zip -q -d "$W"/whl/nvidia_cublas-*.whl 'nvidia/cu13/lib/libnvblas.so.13'
printf '%s\n' "$SKYRL_REF" > "$W/whl/SKYRL_REF"
(cd "$W" && tar cf skyrl.tar whl)
echo "bundle: $(wc -c < "$W/skyrl.tar") bytes, $(ls "$W"/whl/*.whl | wc -l) wheels"

rm -rf "$OUTDIR"/skyrl[0-9]*
# 1 MB under the limit per piece leaves room for the sdist (in the first folder, so the GPU machine
# can build it while the other parts travel) and the manifest (in the last)
(cd "$W" && split -b $((LIMIT - 1000000)) -d -a 2 skyrl.tar skyrl.part)
parts=("$W"/skyrl.part*)
m=${#parts[@]}
for i in $(seq 1 $m); do mkdir -p "$OUTDIR/skyrl$i" && mv "${parts[$((i - 1))]}" "$OUTDIR/skyrl$i/"; done
cp "$W"/sdist/* "$OUTDIR/skyrl1/"
sha256sum "$W/skyrl.tar" | cut -d' ' -f1 > "$OUTDIR/skyrl$m/skyrl.tar.sha256"
for p in "${parts[@]}"; do basename "$p"; done > "$OUTDIR/skyrl$m/skyrl.parts"
printf '%s\n' "$SKYRL_REF" > "$OUTDIR/skyrl$m/SKYRL_REF"
du -cb "$OUTDIR"/skyrl[0-9]* | sed 's/^/bytes /'
for i in $(seq 1 $m); do
  [ "$(du -cb "$OUTDIR/skyrl$i" | tail -1 | cut -f1)" -le "$LIMIT" ] || { echo "$OUTDIR/skyrl$i is over $LIMIT bytes"; exit 1; }
done
tree=$(cd "$ROOT" && git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2> /dev/null | tail -1 | cut -f1)
echo "the working tree that travels with each part: $tree bytes (a part plus the tree must stay under 67108864)"
[ $((tree + LIMIT)) -lt 67108864 ] || echo "warning: tree + PART_BYTES is over 64 MiB; stage again with a smaller PART_BYTES"
echo "on the GPU machine, $m commands in a row (each within 30 s of the last):"
echo "  1. carry $OUTDIR/skyrl1:  mkdir -p /tmp/stash && cp $OUTDIR/skyrl1/* /tmp/stash/ && setsid bash tools/gpu/stage_skyrl_build_te.sh /tmp/stash > /dev/null 2>&1 < /dev/null &"
for i in $(seq 2 $((m - 1))); do echo "  $i. carry $OUTDIR/skyrl$i:  cp $OUTDIR/skyrl$i/* /tmp/stash/"; done
echo "  $m. carry $OUTDIR/skyrl$m:  bash tools/gpu/stage_skyrl_unstage.sh $OUTDIR/skyrl$m"
