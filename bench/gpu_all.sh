#!/usr/bin/env bash
# Everything CUDA of a release in two device calls on a 2-GPU H200 host, run
# inside bench/gpu_session.sh. Independent steps run in two lanes at once, one
# per GPU (CUDA_VISIBLE_DEVICES), so one call does twice the work; two-GPU steps
# run after both lanes. Results land in $OUT/results-$PHASE.tgz.
#
#   PHASE=tests bash bench/gpu_session.sh bash bench/gpu_all.sh   # correctness
#   PHASE=bench bash bench/gpu_session.sh bash bench/gpu_all.sh   # measurements
#
# Each step has its own time limit (SIGINT first, so pytest still writes its
# summary and JUnit XML) (T_<STEP> overrides), so one slow step never
# takes the others down; per-step logs and a summary.txt come back.
set -u
R=${OUT:-/tmp/out}/results
mkdir -p "$R"
export HYPOTHESIS_PROFILE=ci PYTHONPATH=${PYTHONPATH:-}:$PWD
step() {  # step NAME SECONDS CMD...; STEPS="name ..." runs a subset of the phase
  local name=$1 secs=$2; shift 2
  case " ${STEPS:-$name} " in *" $name "*) ;; *) return ;; esac
  local t0=$SECONDS
  timeout -s INT -k 15 "$secs" "$@" > "$R/$name.log" 2>&1
  echo "$name: exit $? in $((SECONDS - t0)) s (GPU ${CUDA_VISIBLE_DEVICES:-all})" | tee -a "$R/summary.txt"
  tail -n 12 "$R/$name.log"
}
python3 -c "import json, sys; sys.path.insert(0, 'bench'); from env import environment; print(json.dumps(environment()))" > "$R/environment.json"
nvidia-smi --query-gpu=name,memory.total --format=csv >> "$R/summary.txt" 2>&1
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
gpu1=$(( ngpu > 1 ? 1 : 0 ))

case "${PHASE:-tests}" in
tests)
  # Kernels the tests need beyond the bf16 64/128 ones in .fiaot: fp16 and
  # head dim 256 (the CUDA fuzzers run fa2; two parametrised tests run fa3 fp16 256).
  step warm "${T_WARM:-150}" python3 bench/warm_kernels.py \
    fa2:256:bf16 fa2:64:fp16 fa2:128:fp16 fa2:256:fp16 fa3:256:fp16
  (
    export CUDA_VISIBLE_DEVICES=0
    step cuda-tests "${T_TESTS:-300}" env RAGGED_COMPILE_BACKEND=fa2 RAGGED_FUZZ_CUDA_EXAMPLES="${FUZZ_N:-500}" \
      RAGGED_GRAPH_STEPS="${GRAPH_N:-500}" python3 -m pytest -q -rs -m cuda -p no:cacheprovider tests fuzz \
      --ignore fuzz/test_fuzz_grad_cuda.py --ignore tests/test_distributed.py --ignore tests/test_hf.py \
      --junitxml="$R/cuda-tests.xml"
    step main-job 40 python3 -m ragged_compile
  ) &
  (
    export CUDA_VISIBLE_DEVICES=$gpu1
    step grad-fuzz "${T_FUZZ:-230}" env RAGGED_COMPILE_BACKEND=fa2 RAGGED_FUZZ_GRAD_EXAMPLES="${GRAD_N:-1000}" \
      python3 -m pytest -q -s -p no:cacheprovider fuzz/test_fuzz_grad_cuda.py --junitxml="$R/grad-fuzz.xml"
    step hf-tests "${T_HF:-100}" python3 -m pytest -q -rs -m cuda -p no:cacheprovider tests/test_hf.py \
      --junitxml="$R/hf-tests.xml"
  ) &
  wait
  step dist-tests "${T_DIST:-80}" python3 -m pytest -q -rs -p no:cacheprovider tests/test_distributed.py \
    --junitxml="$R/dist-tests.xml"
  ;;
bench)
  # Timings must not share a GPU: with one GPU the lanes run in turn.
  lane0() (
    export CUDA_VISIBLE_DEVICES=0
    step bench-ops "${T_OPS:-200}" python3 bench/bench_attention.py --only ops \
      --impls ours_eager,flashinfer_fa2,flashinfer_fa3 --time-budget-s "${OPS_BUDGET:-160}" --out "$R"
    step bench-hf "${T_HFB:-260}" python3 bench/bench_hf.py --out "$R/hf.json"
  )
  lane1() (
    export CUDA_VISIBLE_DEVICES=$gpu1
    step bench-train-attn "${T_TA:-90}" python3 bench/bench_train.py --only attn --out "$R"
    step bench-train-e2e "${T_TE:-200}" python3 bench/bench_train.py --only e2e --out "$R"
    step bench-eager-reuse "${T_ER:-90}" python3 bench/bench_eager_reuse.py --out "$R/eager_reuse.json"
  )
  if [ "$ngpu" -gt 1 ]; then lane0 & lane1 & wait; else lane0; lane1; fi
  if [ "$ngpu" -gt 1 ]; then
    BENCH_ARGS="--mode fsdp --bench --layers 8 --dim 2048 --heads 16 --kv-heads 16 --segments 16 --min-len 64 --max-len 4096 --steps ${FSDP_STEPS:-6}"
    step fsdp-1gpu "${T_DB1:-90}" torchrun --standalone --nproc-per-node 1 examples/train_fsdp.py $BENCH_ARGS --json "$R/fsdp-1gpu.json"
    step fsdp-2gpu "${T_DB2:-100}" torchrun --standalone --nproc-per-node 2 examples/train_fsdp.py $BENCH_ARGS --json "$R/fsdp-2gpu.json"
  fi
  ;;
esac
tar czf "${OUT:-/tmp/out}/results-${PHASE:-tests}.tgz" -C "$R/.." results && rm -rf "$R"
