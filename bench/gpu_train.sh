#!/usr/bin/env bash
# Training on two GPUs in one device call, inside bench/gpu_session.sh (with
# flash-attn-4 staged: bench/stage_fa4.sh): GPU 0 runs the gradient fuzz (on
# flash-attn-4's backward for every layout, FUZZ_BACKWARD=auto to let short
# segments go to FA2), GPU 1
# the CUDA training tests and the training benchmarks, then, if time is left,
# the two-GPU tests. Results land in $OUT/results-train.tgz.
set -u
R=${OUT:-/tmp/out}/results
mkdir -p "$R"
export HYPOTHESIS_PROFILE=ci
t0=$SECONDS
python3 -c "import json, sys; sys.path.insert(0, 'bench'); from env import environment; print(json.dumps(environment()))" > "$R/environment.json"
cat "$R/environment.json"
(
  export CUDA_VISIBLE_DEVICES=0
  timeout -s INT -k 15 "${T_FUZZ:-400}" env RAGGED_COMPILE_BACKEND=fa2 RAGGED_COMPILE_BACKWARD="${FUZZ_BACKWARD:-fa4}" RAGGED_FUZZ_GRAD_EXAMPLES="${GRAD_N:-1000}" python3 -m pytest -q -s \
    -p no:cacheprovider fuzz/test_fuzz_grad_cuda.py --junitxml="$R/grad-fuzz.xml" > "$R/grad-fuzz.log" 2>&1
  echo "grad-fuzz: exit $? at $((SECONDS - t0)) s"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout -s INT -k 15 "${T_TESTS:-170}" python3 -m pytest -q -rs -p no:cacheprovider tests/test_train_cuda.py \
    --junitxml="$R/train-tests.xml" > "$R/train-tests.log" 2>&1
  echo "train-tests: exit $? at $((SECONDS - t0)) s"
  [ -n "${SKIP_BENCH:-}" ] && exit 0
  timeout -k 15 "${T_TA:-110}" python3 bench/bench_train.py --only attn --out "$R" > "$R/bench-train-attn.log" 2>&1
  echo "bench-train-attn: exit $? at $((SECONDS - t0)) s"
  timeout -k 15 "${T_TE:-230}" python3 bench/bench_train.py --only e2e --out "$R" > "$R/bench-train-e2e.log" 2>&1
  echo "bench-train-e2e: exit $? at $((SECONDS - t0)) s"
) &
wait
left=$(( ${BUDGET_S:-560} - SECONDS ))
if [ -z "${SKIP_DIST:-}" ] && [ "$left" -gt 60 ] && [ "$(nvidia-smi -L | wc -l)" -gt 1 ]; then
  timeout -s INT -k 10 $((left - 10)) python3 -m pytest -q -rs -p no:cacheprovider tests/test_distributed.py \
    --junitxml="$R/dist-tests.xml" > "$R/dist-tests.log" 2>&1
  echo "dist-tests: exit $? at $((SECONDS - t0)) s"
fi
for f in "$R"/*.log; do echo "== $f"; tail -n 4 "$f"; done
tar czf "${OUT:-/tmp/out}/results-train.tgz" -C "$R/.." results
