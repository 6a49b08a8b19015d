#!/usr/bin/env bash
# Issue 9 (training on the GPU) inside bench/gpu_session.sh on a 2-GPU H200 host.
# Each step runs under its own time limit; STEPS picks steps. Three calls, each
# under 9 minutes (limits add up to <= 540 s; typical runs are shorter):
#
#   STEPS="warm cuda-tests fuzz"       bash bench/gpu_session.sh bash bench/gpu_train.sh
#   STEPS="bench-attn bench-e2e dist-bench" bash bench/gpu_session.sh bash bench/gpu_train.sh
#   STEPS="dist-tests"                 bash bench/gpu_session.sh bash bench/gpu_train.sh
#
# (limits per call: 540, 540, 240 s; no STEPS: everything, ~12-20 min). Logs, JUnit XML, JSON and markdown land in
# $OUT/train/. Kernels come from .fiaot; "warm" compiles the missing ones in parallel.
set -u
R=${OUT:-/tmp/out}/train
mkdir -p "$R"
export HYPOTHESIS_PROFILE=ci PYTHONPATH=${PYTHONPATH:-}:$PWD
step() {  # step NAME SECONDS CMD...; STEPS="name ..." picks which run (default: all)
  local name=$1 secs=$2; shift 2
  case " ${STEPS:-$name} " in *" $name "*) ;; *) return ;; esac
  local t0=$SECONDS
  timeout "$secs" "$@" > "$R/$name.log" 2>&1
  echo "$name: exit $? in $((SECONDS - t0)) s" | tee -a "$R/summary.txt"
  tail -n 25 "$R/$name.log"
}
python3 -c "import json, sys; sys.path.insert(0, 'bench'); from env import environment; print(json.dumps(environment()))" > "$R/environment.json"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$R/gpus.txt" 2>&1
# Kernels these steps use, compiled in parallel (bf16 64/128 for fa2 and fa3 are
# usually in .fiaot already): the fuzz runs fa2 over padded dims 64/128/256 in
# bf16 and fp16; tests, benches and the two-GPU runs use bf16 64/128 (auto: fa2 or fa3).
step warm "${T_WARM:-150}" python3 bench/warm_kernels.py \
  fa2:64:bf16 fa2:128:bf16 fa3:64:bf16 fa3:128:bf16 fa2:256:bf16 fa2:64:fp16 fa2:128:fp16 fa2:256:fp16
step cuda-tests "${T_TESTS:-170}" python3 -m pytest -q -rs -m cuda -p no:cacheprovider \
  tests/test_train_cuda.py tests/test_runtime_cuda.py --junitxml="$R/cuda-tests.xml"
step fuzz "${T_FUZZ:-220}" env RAGGED_COMPILE_BACKEND=fa2 RAGGED_FUZZ_GRAD_EXAMPLES="${RAGGED_FUZZ_GRAD_EXAMPLES:-1000}" \
  python3 -m pytest -q -s -p no:cacheprovider fuzz/test_fuzz_grad_cuda.py --junitxml="$R/fuzz.xml"
step bench-attn "${T_ATTN:-80}" python3 bench/bench_train.py --only attn --out "$R"
step bench-e2e "${T_E2E:-180}" python3 bench/bench_train.py --only e2e --out "$R"
step dist-tests "${T_DIST:-240}" python3 -m pytest -q -rs -p no:cacheprovider tests/test_distributed.py --junitxml="$R/dist-tests.xml"
BENCH_ARGS="--mode fsdp --bench --layers 8 --dim 2048 --heads 16 --kv-heads 16 --segments 16 --min-len 64 --max-len 4096 --steps 6"
case " ${STEPS:-dist-bench} " in *" dist-bench "*) STEPS_DB=1 ;; *) STEPS_DB=0 ;; esac
[ "$STEPS_DB" = 1 ] && STEPS="${STEPS:+$STEPS }dist-bench-1gpu dist-bench-2gpu"
step dist-bench-1gpu "${T_DB1:-130}" torchrun --standalone --nproc-per-node 1 examples/train_fsdp.py $BENCH_ARGS --json "$R/fsdp-1gpu.json"
step dist-bench-2gpu "${T_DB2:-150}" torchrun --standalone --nproc-per-node 2 examples/train_fsdp.py $BENCH_ARGS --json "$R/fsdp-2gpu.json"
python3 - "$R" <<'PY'
import json, os, sys
r = sys.argv[1]
try:
    one, two = (json.load(open(os.path.join(r, f"fsdp-{n}gpu.json")))["bench"] for n in (1, 2))
    row = {"tokens_per_s_1gpu": one["tokens_per_s"], "tokens_per_s_2gpu": two["tokens_per_s"],
           "scaling": two["tokens_per_s"] / one["tokens_per_s"]}
    json.dump(row, open(os.path.join(r, "fsdp-scaling.json"), "w"), indent=1)
    print("FSDP2 tokens/s:", row)
except Exception as e:  # not run in this call, or failed: the logs say why
    print("no FSDP scaling row:", e)
PY
