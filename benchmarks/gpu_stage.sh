#!/bin/bash
# Runs on the GPU machine, from the repository root; benchmarks/gpu_kit.sh copies it to .device/stage.sh.
# Each call copies the kit parts it carried under .device/ to /tmp/parts (kept for the machine's life).
# `install`, once every part is there, unpacks the kit: the packages into /tmp/site, the wheels
# installed there too, the embedded GGUF (if the kit has it) at /tmp/models/smollm2.Q4_1.gguf, and
# writes /tmp/kit.env (PYTHONPATH, the NCCL stand-in's LD_PRELOAD, ESAMP_TEST_GGUF) for `. /tmp/kit.env`.
# Prints the seconds each stage took.
case "${1:-}" in
  ""|install) ;;
  *) echo "usage: bash .device/stage.sh [install]" >&2; exit 2;;
esac
t0=$(date +%s.%N)
mkdir -p /tmp/parts
for f in .device/kit.part* .device/kit.count; do
  [ -f "$f" ] && [ ! -f "/tmp/parts/$(basename "$f")" ] && cp "$f" /tmp/parts/
done
want=$(cat /tmp/parts/kit.count 2>/dev/null || echo "?")
have=$(ls /tmp/parts/kit.part* 2>/dev/null | wc -l)
echo "kit parts here: $have of $want"
[ "${1:-}" = install ] || exit 0
if [ ! -f /tmp/site/.done ]; then
  [ "$have" = "$want" ] || { echo "missing kit parts: carry the rest first" >&2; exit 1; }
  set -e
  rm -rf /tmp/kit && mkdir -p /tmp/kit /tmp/site /tmp/models
  cat /tmp/parts/kit.part* | tar x -C /tmp/kit
  xz -d -T0 < /tmp/kit/site.tar.xz | tar x -C /tmp/site
  echo "unpacked in $(awk "BEGIN{printf \"%.0f\", $(date +%s.%N) - $t0}") s"
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site /tmp/kit/wheels/*.whl 2>&1 \
    | grep -v "^WARNING: Target directory" || true
  [ -f /tmp/kit/smollm2.Q4_1.gguf ] && cp /tmp/kit/smollm2.Q4_1.gguf /tmp/models/
  [ -f /tmp/kit/nccl_compat.so ] && cp /tmp/kit/nccl_compat.so /tmp/site/
  cp /tmp/kit/vllm.version /tmp/site/.vllm.version
  rm -rf /tmp/kit
  set +e
  {
    echo "export PYTHONPATH=/tmp/site:$PWD\${PYTHONPATH:+:\$PYTHONPATH}"
    [ -f /tmp/site/nccl_compat.so ] && echo "export LD_PRELOAD=/tmp/site/nccl_compat.so"
    [ -f /tmp/models/smollm2.Q4_1.gguf ] && echo "export ESAMP_TEST_GGUF=/tmp/models/smollm2.Q4_1.gguf"
    echo "export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1"
  } > /tmp/kit.env
  touch /tmp/site/.done
  echo "installed in $(awk "BEGIN{printf \"%.0f\", $(date +%s.%N) - $t0}") s"
fi
. /tmp/kit.env
python3 -c "import torch, vllm, triton, vllm.entrypoints.openai.api_server; print('vllm', vllm.__version__, 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0), '(server imports ok)')"
ls /tmp/models 2>/dev/null
exit 0
