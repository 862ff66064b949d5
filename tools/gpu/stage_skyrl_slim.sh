#!/usr/bin/env bash
# The SkyRL staging without TransformerEngine: from the part folders of tools/gpu/stage_skyrl.sh (.gpu/skyrl1..N),
# writes .gpu/slim1..M with the same wheels minus TransformerEngine's core and the cuBLAS it needs (6 parts
# instead of 20). Enough for our Kimi model, which uses the local (non-TE) Megatron spec: kimi_megatron_plugin's
# te_stub lets megatron-bridge import without TE. Unstage on the GPU machine with
#   BUILD_TE=0 bash tools/gpu/stage_skyrl_unstage.sh .gpu/slimM
# and run tools/gpu/skyrl_loop.sh as usual. Run in the project root on the CPU machine.
set -euo pipefail
SRC=${SRC:-.gpu}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
last=$(ls -d "$SRC"/skyrl* | sort -V | tail -1)
for f in $(cat "$last/skyrl.parts"); do cat "$SRC"/skyrl*/"$f"; done > "$WORK/full.tar"
[ "$(sha256sum "$WORK/full.tar" | cut -d' ' -f1)" = "$(cat "$last/skyrl.tar.sha256")" ] || { echo "parts do not match their sha256"; exit 1; }
tar xf "$WORK/full.tar" -C "$WORK" && rm "$WORK/full.tar"
rm -f "$WORK"/whl/nvidia_cublas-*.whl "$WORK"/whl/transformer_engine_cu13-*.whl "$WORK"/whl/transformer_engine-[0-9]*.whl
(cd "$WORK" && tar cf slim.tar whl && split -b "${PART_BYTES:-47000000}" -d -a 2 slim.tar skyrl.part \
  && sha256sum slim.tar | cut -d' ' -f1 > skyrl.tar.sha256 && ls skyrl.part* > skyrl.parts)
rm -rf "$SRC"/slim*
i=1
for p in $(cat "$WORK/skyrl.parts"); do mkdir -p "$SRC/slim$i" && mv "$WORK/$p" "$SRC/slim$i/"; i=$((i + 1)); done
cp "$WORK/skyrl.parts" "$WORK/skyrl.tar.sha256" "$SRC/slim$((i - 1))/"
echo "$((i - 1)) parts in $SRC/slim1..$((i - 1)) ($(du -sh "$SRC"/slim* | awk '{s+=$1} END {print s}') MB)"
