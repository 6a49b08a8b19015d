#!/usr/bin/env bash
# Everything CUDA in one GPU-machine call (run inside bench/gpu_session.sh):
# the CUDA tests with the fuzzers at full size, the main job, the CUDA-graph
# benchmark and its kernel profile, and the end-to-end encoder benchmark. Results land in
# $OUT/results.tgz (logs, JUnit XML, JSON and markdown), each step under its own
# time limit so one slow step cannot take the others down. STEPS="cuda-tests
# main-job" runs a subset; TEST_BACKEND=fa2 runs the tests on fa2 only where a
# test does not pick its backend itself (fa3 kernels JIT-compile for ~72 s each).
set -u
R=${OUT:-/tmp/out}/results
mkdir -p "$R"
export HYPOTHESIS_PROFILE=ci RAGGED_FUZZ_CUDA_EXAMPLES=${RAGGED_FUZZ_CUDA_EXAMPLES:-1000} \
  RAGGED_GRAPH_STEPS=${RAGGED_GRAPH_STEPS:-1000}
step() {  # step NAME SECONDS CMD...; STEPS="name ..." picks which run (default: all)
  local name=$1 secs=$2; shift 2
  case " ${STEPS:-$name} " in *" $name "*) ;; *) return ;; esac
  local t0=$SECONDS
  timeout "$secs" "$@" > "$R/$name.log" 2>&1
  echo "$name: exit $? in $((SECONDS - t0)) s" | tee -a "$R/summary.txt"
  tail -n 25 "$R/$name.log"
}
python3 -c "import json, sys; sys.path.insert(0, 'bench'); from env import environment; print(json.dumps(environment()))" > "$R/environment.json"
step cuda-tests "${T_TESTS:-270}" env RAGGED_COMPILE_BACKEND="${TEST_BACKEND:-auto}" python3 -m pytest -q -rs -m cuda -p no:cacheprovider tests fuzz --junitxml="$R/cuda-tests.xml"
step main-job "${T_MAIN:-70}" python3 -m ragged_compile
step bench-cudagraph "${T_GRAPH:-400}" python3 bench/bench_cudagraph.py --out "$R" --steps 100
step profile-cudagraph "${T_PROFILE:-120}" python3 bench/profile_cudagraph.py --out "$R"
cp bench/results/attention.json "$R/" 2>/dev/null  # keep the committed per-op section; e2e is re-run
step bench-e2e "${T_E2E:-110}" python3 bench/bench_attention.py --only e2e --out "$R"
tar czf "${OUT:-/tmp/out}/results.tgz" -C "$R/.." results && rm -rf "$R"
