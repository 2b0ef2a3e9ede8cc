#!/usr/bin/env bash
# One call on the GPU machine (the device tool): build libdejavu_kernels from this tree, run the GPU tests,
# then the benchmark steps named as arguments. Each step's full log goes to $OUT/logs/<step>.log, packed
# into $OUT/logs.tgz at the end (the device tool returns at most 8 files); one summary line per step and the
# benchmarks' result lines are printed, so the call's reply ends with a short table.
#
#   bash benchmarks/device_run.sh tests tests-portable kernels e2e
#
# Steps: tests (pytest tests/gpu), tests-portable (DJV_NO_BULK=1 DJV_TOPK_R8=1: the sm_80 kernels on the
# H200), tests-nopdl, kernels (bench_kernels --focus), attn / mlp (bench_kernels, OPT-13B attention / all
# MLP shapes), e2e (bench_e2e --opt13b, all batches + HF eager), e2e-pdl (bench_e2e --core at B=1/4
# with and without programmatic dependent launch), e2e-core (bench_e2e --core at B=1/4: dense, sparse, and the
# mlp_norm fold A/B), sweep (bench_e2e --sweep: B=1 step time from ~0 to 100% kept, and the fitted fixed
# cost per step), smollm2 (bench_e2e --engine on the package carried under engines/), profile (bench_e2e
# --profile-step), profile-floor (the same with one neuron and one head kept, with and without PDL), ncu
# (Nsight Compute counters of one attention and one MLP call, benchmarks/probes/ncu_ops.py), ncu-pred (the same
# for one predictor call, with DJV_TOPK_HIST=0 and =1, benchmarks/probes/ncu_pred.py). A/B steps with
# environment settings (comma-separated): e2e-core:ENV=VAL,..., tests:ENV=VAL,... (the attention, chain and
# executor GPU tests), attn:ENV=VAL,... (bench_kernels --quick --only attn: OPT-13B attention at batch 1/4/16),
# e2e:ENV=VAL,... (the whole e2e step), mlp:ENV=VAL,... (the mlp step), pred:ENV=VAL,... (the predictor
# kernel benchmark), tests-mlp:ENV=VAL,... / tests-pred:ENV=VAL,... (the MLP / predictor, chain and
# executor GPU tests). pred: the predictor kernel benchmark alone. sync-cost: a grid barrier against a kernel boundary (probes/sync_cost.cu).
# fold-shapes: batch 1's mlp_norm fold A/B at OPT shapes of other hidden sizes (FOLD_DS="1024 2048 ...",
# FOLD_ENV=ENV=VAL for an A/B setting, e.g. DJV_MLP_PER_SM=2).
# profile-fold: per-kernel times with mlp_norm folded and not, at FOLD_DS (PROFILE_ENV=DJV_NO_PDL=1 for own times).
# e2e-bN[:ENV=VAL,...]: bench_e2e --core at batch N only.
# timeline: the CUDA-graph step's kernel timeline under torch.profiler, each kernel's share of the step
# (TIMELINE_DS="5120 ...", TIMELINE_ENV=ENV=VAL).
# mlp-l2[:ENV=VAL]: the fused MLP with its rows L2-resident against rotating row sets from HBM.
# first-step: wall time of batch 1's first decode step, the timed choice (auto) vs an executor pinned to it.
# mlp-trace[:ENV=VAL,...]: per-CTA timeline stamps of batch 1's fused MLP and its reduction, from a -DDJV_TRACE build
# (probes/mlp_trace.py): where each call's fixed cost goes. attn-trace[:ENV=VAL,...]: the same for the attention
# op's four kernels (OPT-13B, 20% of heads, 2k context).
# partial-sums: the partial-sum reduction kernel against fp32 atomics into the norm's input (probes/partial_sums.cu).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device-out}
LOGS=$OUT/logs
mkdir -p "$LOGS"
trap 'tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$LOGS"' EXIT
export PYTHONPATH=. PYTHONUNBUFFERED=1
# Benchmarks time batch 1's step choice afresh in every process (not from the machine's choice cache), so
# A/B steps never inherit another step's choice; the first-step probe sets its own cache file.
export DEJAVU_STEP_CHOICE_CACHE=${DEJAVU_STEP_CHOICE_CACHE:-0}
PY=${PY:-python3}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee "$OUT/gpu.txt"
# The device's copy of the tree carries no current git metadata: fingerprint the sources instead (run the
# same line here to match a commit).
sources_hash() {
    find plugins dejavu_trt benchmarks -type f \( -name '*.cu' -o -name '*.cuh' -o -name '*.h' -o -name '*.cpp' \
        -o -name '*.py' -o -name '*.sh' -o -name CMakeLists.txt \) -not -path '*/build/*' | LC_ALL=C sort |
        xargs sha256sum | sha256sum | cut -c1-12
}
echo "sources $(sources_hash)"
t0=$(date +%s)
# SKIP_BUILD=1: the trace steps only (they build their own library in plugins/build-trace)
if [ -z "${SKIP_BUILD:-}" ]; then
    if ! $PY -m dejavu_trt.kernels.build > "$LOGS/build.log" 2>&1; then tail -30 "$LOGS/build.log"; exit 1; fi
    echo "build $(( $(date +%s) - t0 ))s"
fi

failed=0
run() {  # run NAME ENV... -- CMD...: log to $LOGS/NAME.log, print rc, time and the last line
    local name=$1; shift
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    local t=$(date +%s)
    # STEP_TIMEOUT (seconds, default 420): a hung step (e.g. a kernel that never finishes) cannot eat the
    # device call's whole time limit; rc 124 then says so
    timeout "${STEP_TIMEOUT:-420}" env "${envs[@]}" "$@" > "$LOGS/$name.log" 2>&1
    local rc=$?
    [ $rc -eq 0 ] || failed=1
    printf '%-22s rc=%d %4ds  %s\n' "$name" "$rc" "$(( $(date +%s) - t ))" "$(tail -1 "$LOGS/$name.log" | cut -c1-150)"
    # result lines: kernel-benchmark rows, end-to-end rows (compacted)
    grep -E '^(mlp|attn|predictor) ' "$LOGS/$name.log" | cut -c1-200
    grep -E '"config"' "$LOGS/$name.log" | sed -E 's/.*"config": "([^"]*)", "batch": ([0-9]+).*"tbt_ms_p50": ([0-9.]+).*/  \1 B=\2 p50 \3 ms/' | cut -c1-150
}

E2E_CORE=(benchmarks/bench_e2e.py --opt13b --core --batches 1 4)
E2E_ALL=(benchmarks/bench_e2e.py --opt13b --batches 1 4 16 --hf-batches 1)
MLP_FOCUS=(benchmarks/bench_kernels.py --focus --only mlp)
PRED_FOCUS=(benchmarks/bench_kernels.py --focus --only pred)
GPU_TESTS=(-m pytest -q -x -p no:cacheprovider tests/gpu)
for step in "$@"; do
    case $step in
    tests) run tests -- $PY "${GPU_TESTS[@]}" ;;
    tests-portable) run tests-portable DJV_NO_BULK=1 DJV_TOPK_R8=1 -- $PY "${GPU_TESTS[@]}" ;;
    tests-nopdl) run tests-nopdl DJV_NO_PDL=1 -- $PY "${GPU_TESTS[@]}" -k kernel ;;
    kernels) run kernels -- $PY benchmarks/bench_kernels.py --focus --only mlp,attn,pred --json "$LOGS/kernels.json" ;;
    mlp) run mlp -- $PY "${MLP_FOCUS[@]}" --json "$LOGS/mlp.json" ;;
    pred) run pred -- $PY "${PRED_FOCUS[@]}" --json "$LOGS/pred.json" ;;
    attn) run attn -- $PY benchmarks/bench_kernels.py --focus --quick --only attn --json "$LOGS/attn.json" ;;
    e2e) run e2e -- $PY "${E2E_ALL[@]}" --json-out "$LOGS/e2e.json" ;;
    e2e-core) run e2e-core -- $PY "${E2E_CORE[@]}" ;;  # dense, sparse, and sparse with mlp_norm unfolded, B=1/4
    e2e-b[0-9]*)  # bench_e2e --core at one batch size, with optional settings: e2e-b1, e2e-b2:DJV_MLP_SLACK=2
        IFS=, read -ra kv <<< "$( [[ $step == *:* ]] && echo "${step#*:}" )"
        b=${step%%:*}; b=${b#e2e-b}
        run "$step" "${kv[@]}" -- $PY benchmarks/bench_e2e.py --opt13b --core --batches "$b" ;;
    e2e-core:*|e2e:*|tests:*|tests-mlp:*|tests-pred:*|attn:*|mlp:*|pred:*)  # with environment settings, e.g. e2e-core:DEJAVU_FOLD_NORMS=all,DJV_FOLD_IN_MLP=0
        IFS=, read -ra kv <<< "${step#*:}"
        case ${step%%:*} in
        e2e-core) cmd=($PY "${E2E_CORE[@]}") ;;
        e2e) cmd=($PY "${E2E_ALL[@]}") ;;
        tests) cmd=($PY "${GPU_TESTS[@]}" -k "attention or chain or executor") ;;
        tests-mlp) cmd=($PY "${GPU_TESTS[@]}" -k "mlp or chain or executor") ;;
        tests-pred) cmd=($PY "${GPU_TESTS[@]}" -k "predictor or chain or executor") ;;
        pred) cmd=($PY "${PRED_FOCUS[@]}") ;;
        attn) cmd=($PY benchmarks/bench_kernels.py --quick --only attn) ;;
        mlp) cmd=($PY "${MLP_FOCUS[@]}") ;;
        esac
        run "$step" "${kv[@]}" -- "${cmd[@]}" ;;
    mlp-ready)  # the MLP kernels with and without the indices-ready promise, at grid slack 0 and 2
        for r in $(seq "${REPEAT:-2}"); do for slack in 0 2; do for ready in 0 1; do
            run "mlp-r${ready}s${slack}-$r" -- $PY "${MLP_FOCUS[@]}" --indices-ready $ready --mlp-grid-slack $slack \
                --json "$LOGS/mlp-r${ready}s${slack}-$r.json"
        done; done; done ;;
    attn-ready)  # OPT-13B attention (batch 1/4/16) with and without the indices-ready promise
        for r in $(seq "${REPEAT:-2}"); do for ready in 0 1; do
            run "attn-r${ready}-$r" -- $PY benchmarks/bench_kernels.py --quick --only attn --indices-ready $ready \
                --json "$LOGS/attn-r${ready}-$r.json"
        done; done ;;
    e2e-core-applynorm)  # the same, the folded norm done by its own kernel (DJV_FOLD_IN_MLP=0), B=1/4/16
        run e2e-core-applynorm DJV_FOLD_IN_MLP=0 -- $PY "${E2E_CORE[@]}" 16 ;;
    e2e-prio)  # the whole end-to-end benchmark (ablations included) with the high-priority predictor stream
        run e2e-prio DEJAVU_PREDICTOR_PRIORITY=high -- $PY benchmarks/bench_e2e.py --opt13b --batches 1 4 16 --hf-batches ;;
    tests-applynorm) run tests-applynorm DJV_FOLD_IN_MLP=0 -- $PY -m pytest -q -x -p no:cacheprovider tests/gpu \
        -k "fold or chain or executor" ;;
    e2e-pdl)  # the launch chain on and off (DJV_NO_PDL=1), B=1/4
        run e2e-pdl -- $PY "${E2E_CORE[@]}"
        run e2e-nopdl DJV_NO_PDL=1 -- $PY "${E2E_CORE[@]}" ;;
    ncu)  # Nsight Compute counters of one attention + one MLP call, each kernel replayed alone (probes/ncu_ops.py)
        NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
        # skip 18 = ncu_ops.py's WARM (3) rounds x 6 matching kernels (attention 4, MLP 2): profile the last round
        run ncu -- "$NCU" --clock-control none -k "regex:qkv_rows|attn_kernel|rows_down|rows_reduce|mlp_bulk" \
            --launch-skip 18 --launch-count 6 --section SpeedOfLight --section MemoryWorkloadAnalysis \
            --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats \
            $PY benchmarks/probes/ncu_ops.py
        grep -E '^  [a-z_]+.*\(|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Waves Per|Stall Long|One or More|No Eligible' \
            "$LOGS/ncu.log" | cut -c1-140 ;;
    ncu-pred)  # Nsight Compute counters of one predictor call's three kernels, bisection and histogram top-k
        NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
        for hist in 0 1; do
            run ncu-pred-hist$hist DJV_TOPK_HIST=$hist -- "$NCU" --clock-control none \
                -k "regex:u_kernel|scores_kernel|topk_kernel" --launch-skip 9 --launch-count 3 \
                --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
                --section SchedulerStats --section InstructionStats $PY benchmarks/probes/ncu_pred.py
            grep -E '^  [a-z_]+.*\(|Duration|Registers Per|Stall|Executed Instructions  |Issue Slots Busy|No Eligible' \
                "$LOGS/ncu-pred-hist$hist.log" | cut -c1-140
        done ;;
    sweep)  # B=1 step time from ~0 to 100% kept (with and without predictor / side stream) and the fitted fixed cost
        run sweep -- $PY benchmarks/bench_e2e.py --sweep --json-out "$LOGS/sweep.json"
        grep -E '"sweep fit' "$LOGS/sweep.log" | cut -c1-220 ;;
    smollm2)  # the real engine package carried under engines/ (see RESULTS.md, session 5), dense vs sparse
        pkg=$(dirname "$(ls engines/*/manifest.json 2>/dev/null | head -1)")
        run smollm2 -- $PY benchmarks/bench_e2e.py --engine "$pkg" --steps 48 --json-out "$LOGS/smollm2.json"
        grep -E '"(tbt_ms_p50|mode|achieved_gb_s)"' "$LOGS/smollm2.log" | tr -d ' \n'; echo ;;
    profile-floor)  # per-kernel times with one neuron and one head kept per layer: each kernel's fixed cost
        run profile-floor -- $PY benchmarks/bench_e2e.py --profile-step --profile-kept 0 0
        run profile-floor-nopdl DJV_NO_PDL=1 -- $PY benchmarks/bench_e2e.py --profile-step --profile-kept 0 0
        grep -E ' us/step ' "$LOGS/profile-floor.log" "$LOGS/profile-floor-nopdl.log" | cut -c1-170 ;;
    sync-cost)  # one grid barrier vs one kernel boundary (PDL / plain) in a CUDA graph (probes/sync_cost.cu)
        nvcc -O3 -gencode=arch=compute_90,code=sm_90 benchmarks/probes/sync_cost.cu -o "$OUT/sync_cost" &&
            run sync-cost -- "$OUT/sync_cost" && cat "$LOGS/sync-cost.log"; rm -f "$OUT/sync_cost" ;;
    partial-sums)  # the partial-sum hand-off to the norm: reduction kernel vs fp32 atomics (probes/partial_sums.cu)
        nvcc -O3 -gencode=arch=compute_90,code=sm_90 benchmarks/probes/partial_sums.cu -o "$OUT/partial_sums" &&
            run partial-sums -- "$OUT/partial_sums" && cat "$LOGS/partial-sums.log"; rm -f "$OUT/partial_sums" ;;
    fold-shapes)  # batch 1's mlp_norm fold A/B (bench_e2e --core) at OPT shapes of d = $FOLD_DS (default 1024..4096)
        for d in ${FOLD_DS:-1024 2048 3072 4096}; do
            run fold-d$d ${FOLD_ENV:-} -- $PY benchmarks/bench_e2e.py --opt13b --core --batches 1 --hidden $d --json-out "$LOGS/fold-d$d.json"
        done ;;
    profile-fold)  # per-kernel device times with mlp_norm folded and not, at d = $FOLD_DS (default 5120 4608)
        for d in ${FOLD_DS:-5120 4608}; do
            for fold in none mlp; do
                run profile-d$d-$fold DEJAVU_FOLD_NORMS=$fold ${PROFILE_ENV:-} -- $PY benchmarks/bench_e2e.py --profile-step --hidden $d
                grep -E ' us/step ' "$LOGS/profile-d$d-$fold.log" | head -14 | cut -c1-120
            done
        done ;;
    first-step)  # wall time of batch 1's first decode step: auto (the timed choice) vs pinned to its choice
        run first-step -- $PY benchmarks/probes/first_step.py --hidden 5120 2048
        grep -E '^\{"hidden"' "$LOGS/first-step.log" | cut -c1-200 ;;
    timeline)  # the graph step's kernel timeline (probes/graph_timeline.py): each kernel's share of the step
        for d in ${TIMELINE_DS:-5120}; do
            run timeline-d$d ${TIMELINE_ENV:-} -- $PY benchmarks/probes/graph_timeline.py --hidden $d --json-out "$LOGS/timeline-d$d.json"
            grep -E '^timeline' "$LOGS/timeline-d$d.log" | cut -c1-170
        done ;;
    mlp-trace|mlp-trace:*|attn-trace|attn-trace:*)  # a timeline from inside the kernels (probes/mlp_trace.py, a -DDJV_TRACE build)
        IFS=, read -ra kv <<< "$( [[ $step == *:* ]] && echo "${step#*:}" )"
        op=${step%%-trace*}
        if [ -f plugins/build-trace/libdejavu_kernels.so ] && [ "$(cat plugins/build-trace/.sources 2>/dev/null)" = "$(sources_hash)" ] ||
            { cmake -S plugins -B plugins/build-trace -DDJV_TRACE=ON -DCMAKE_BUILD_TYPE=Release > "$LOGS/build-trace.log" 2>&1 &&
              cmake --build plugins/build-trace -j >> "$LOGS/build-trace.log" 2>&1 && sources_hash > plugins/build-trace/.sources; }; then
            run "$step" "${kv[@]}" -- $PY benchmarks/probes/mlp_trace.py --op "$op" --json "$LOGS/$step.json"
            grep -E '^trace ' "$LOGS/$step.log" | cut -c1-400
        else
            failed=1; echo "$step: the traced build failed"; tail -20 "$LOGS/build-trace.log"
        fi ;;
    mlp-l2)  # the fused MLP with its rows L2-resident vs from HBM (probes/mlp_l2.py): bytes or latency?
        run mlp-l2 -- $PY benchmarks/probes/mlp_l2.py
        run mlp-l2-bf16 -- $PY benchmarks/probes/mlp_l2.py --dtype bf16
        grep -hE '^\{"(dtype|copy_GB_s)"' "$LOGS/mlp-l2.log" "$LOGS/mlp-l2-bf16.log" ;;
    mlp-l2:*)
        IFS=, read -ra kv <<< "${step#*:}"
        run "$step" "${kv[@]}" -- $PY benchmarks/probes/mlp_l2.py
        grep -E '^\{"(dtype|copy_GB_s)"' "$LOGS/$step.log" ;;
    profile) run profile -- $PY benchmarks/bench_e2e.py --opt13b --profile-step ;;
    profile-unfolded) run profile-unfolded DEJAVU_FOLD_NORMS=0 -- $PY benchmarks/bench_e2e.py --opt13b --profile-step ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
    esac
done
echo "total $(( $(date +%s) - t0 ))s"
exit $failed
