#!/usr/bin/env bash
# Every GPU check in one run, within a time budget, ending with one results table:
#   1. the machine: nvidia-smi, and the torch, Triton and transformers versions;
#   2. benchmarks/plan_sweep.py --json: the planner's plan, then a worker started under it, for 12
#      geometries, context lengths and algorithms; planned against allocated, reserved and
#      driver-measured dynamic memory (a failed start or a view above plan fails the check);
#   3. benchmarks/gpu_serving.py --json: start-up, planned against measured dynamic peak, decode
#      against the roofline, step time by live length, the speculative rows, MTP and the
#      load-aware sweep (each phase saved as it ends, so a run cut short keeps what it measured);
#   4. every CUDA-only test (tests/gpu/test_triton_cuda.py, tests/gpu/test_engine_cuda.py), then the Triton
#      kernel tests compiled for the device instead of interpreted, with whatever time is left.
#
# On a GPU machine:  bash benchmarks/device_check.sh [OUT_DIR]   (default: $OUT, else /tmp/device_check)
# On CPU, to check the script itself:  bash benchmarks/device_check.sh --tiny [OUT_DIR]
#   (the benchmark's tiny geometry; the CUDA tests are collected and skip; .venv's python when present)
# Budget: DEVICE_CHECK_SECONDS (default 720) for the whole run; the plan sweep gets PLAN_SECONDS
# (default 240) of it, the benchmark BENCH_SECONDS (default 360, the transformers peer's two
# compiles included) and the tests the rest. A rerun of a part: PLAN_CASES (plan_sweep.py --only names, ';'-separated; "none" skips the sweep),
# BENCH_PHASES (gpu_serving.py --phases, default all) and CUDA_TESTS (pytest node ids).
set -uo pipefail
cd "$(dirname "$0")/.."

tiny=()
if [[ "${1:-}" == "--tiny" ]]; then
    tiny=(--tiny)
    shift
fi
out="${1:-${OUT:-/tmp/device_check}}"
mkdir -p "$out"
rm -f "$out"/{environment.txt,results.md,plan_sweep.*,gpu_serving.json,gpu_serving.log,cuda_tests.*,kernel_tests.*}
budget="${DEVICE_CHECK_SECONDS:-720}"
deadline=$((SECONDS + budget))
python="${PYTHON:-python3}"
[[ -z "${PYTHON:-}" && -x .venv/bin/python ]] && python=.venv/bin/python  # `make setup`'s, where there is one
export PYTHONPATH="worker:operator:.${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

left() { echo $((deadline - SECONDS)); }

echo "== the machine"
{
    date -u +"date: %Y-%m-%d %H:%M UTC"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv 2>&1 \
        || echo "nvidia-smi: not available"
    "$python" -c 'import platform, torch, triton, transformers
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| triton", triton.__version__, "| transformers", transformers.__version__)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device: {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, sm_{p.major}{p.minor}")'
} 2>&1 | tee "$out/environment.txt"

plan_rc=0
if [[ "${PLAN_CASES:-}" != "none" ]]; then
    echo "== benchmarks/plan_sweep.py (at most ${PLAN_SECONDS:-240} s)"
    only=()
    IFS=';' read -ra names <<< "${PLAN_CASES:-}"
    for name in "${names[@]}"; do only+=(--only "$name"); done
    timeout -k 10 "${PLAN_SECONDS:-240}" "$python" benchmarks/plan_sweep.py "${tiny[@]}" --json "$out/plan_sweep.json" \
        "${only[@]}" 2>&1 | tee "$out/plan_sweep.log"
    plan_rc=${PIPESTATUS[0]}
    echo "plan_sweep exit status: $plan_rc (1: a start failed or a view was above plan; 124: cut at its budget)"
fi

echo "== benchmarks/gpu_serving.py (at most ${BENCH_SECONDS:-360} s)"
timeout -k 10 "${BENCH_SECONDS:-360}" "$python" benchmarks/gpu_serving.py "${tiny[@]}" --json "$out/gpu_serving.json" \
    ${BENCH_PHASES:+--phases "$BENCH_PHASES"} 2>&1 | tee "$out/gpu_serving.log"
bench_rc=${PIPESTATUS[0]}
echo "gpu_serving exit status: $bench_rc (124: cut at its budget; the phases it finished are in the JSON)"

echo "== CUDA-only tests (at most $(left) s)"
timeout -k 10 "$(left)" "$python" -m pytest -q -rfEs -p no:cacheprovider --timeout 150 \
    --junitxml="$out/cuda_tests.xml" ${CUDA_TESTS:-tests/gpu/test_triton_cuda.py tests/gpu/test_engine_cuda.py} 2>&1 \
    | tee "$out/cuda_tests.log"
tests_rc=${PIPESTATUS[0]}

if (( ${#tiny[@]} == 0 && $(left) > 60 )); then  # on CPU these run interpreted in `make test`
    echo "== Triton kernel tests compiled for the device (at most $(left) s)"
    timeout -k 10 "$(left)" "$python" -m pytest -q -rfE -p no:cacheprovider --timeout 120 -m "not slow" \
        --junitxml="$out/kernel_tests.xml" tests/engine/test_triton_attention.py tests/engine/test_triton_mla.py \
        tests/engine/test_triton_moe.py 2>&1 | tee "$out/kernel_tests.log"
fi

echo "== results"
{
    cat "$out/environment.txt"
    echo
    if [[ -s "$out/plan_sweep.json" ]]; then
        "$python" benchmarks/plan_sweep.py --table "$out/plan_sweep.json"
        echo
    fi
    if [[ -s "$out/gpu_serving.json" ]]; then
        "$python" benchmarks/gpu_serving.py --table "$out/gpu_serving.json"
    else
        echo "gpu_serving.py saved no results (exit status $bench_rc)"
    fi
    echo
    for log in cuda_tests kernel_tests; do
        [[ -f "$out/$log.log" ]] && echo "$log: $(grep -E '(passed|failed|error|skipped|no tests ran)' "$out/$log.log" | tail -1)"
    done
} | tee "$out/results.md"
exit $(( plan_rc != 0 || bench_rc != 0 || tests_rc != 0 ))
