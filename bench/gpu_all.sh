#!/usr/bin/env bash
# The CUDA tests and every benchmark behind the README's numbers, one step at a
# time (timings never share a GPU), on a machine with flashinfer-python
# installed (and flash-attn-4 for its backward: pip install 'ragged-compile[fa4]').
# From the repository root:
#
#   bash bench/gpu_all.sh                          # tests, then benchmarks
#   bash bench/gpu_all.sh bench profile            # any of: tests bench profile
#   STEPS="bench-ops bench-e2e" bash bench/gpu_all.sh bench   # some steps only
#
# Results (the JSON / markdown files of bench/results/) land in $OUT (default
# bench/results-new), a log per step in $OUT/logs, each step's exit status in
# $OUT/summary.txt. Two-GPU steps run where there are two GPUs.
set -u
OUT=${OUT:-bench/results-new}
mkdir -p "$OUT/logs"
export HYPOTHESIS_PROFILE=ci PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
step() {  # step NAME CMD...
  local name=$1 t0=$SECONDS
  shift
  case " ${STEPS:-$name} " in *" $name "*) ;; *) return 0 ;; esac
  "$@" > "$OUT/logs/$name.log" 2>&1
  echo "$name: exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
}
python3 -c "import json, sys; sys.path.insert(0, 'bench'); from env import environment; print(json.dumps(environment(), indent=1))" \
  > "$OUT/environment.json"

tests() {
  # FlashInfer compiles a kernel per (backend, head dim, dtype) on first use: the tests' ones,
  # five at a time (a dozen at once on 16 cores had not finished after 330 s)
  step warm python3 bench/warm_kernels.py fa2:64:bf16 fa2:128:bf16 fa3:64:bf16 fa3:128:bf16 fa2:256:bf16
  step warm-2 python3 bench/warm_kernels.py fa2:64:fp16 fa2:128:fp16 fa2:256:fp16 fa3:256:fp16 fa3:128:fp16
  # soft-capped (and left-windowed) plans are modules of their own
  step warm-variants python3 bench/warm_kernels.py fa2:64:bf16:softcap fa3:64:bf16:softcap \
    fa2:64:bf16:softcap+window fa3:64:bf16:softcap+window
  step cuda-tests env RAGGED_COMPILE_BACKEND=fa2 RAGGED_FUZZ_CUDA_EXAMPLES="${FUZZ_N:-1000}" \
    RAGGED_GRAPH_STEPS="${GRAPH_N:-1000}" python3 -m pytest -q -rs -m cuda tests fuzz \
    --ignore fuzz/test_fuzz_grad_cuda.py --ignore tests/test_distributed.py
  # the gradient fuzz on flash-attn-4's backward where it is installed, else FA2's
  local bwd=fa2
  python3 -c "import flash_attn.cute" 2> /dev/null && bwd=fa4
  step grad-fuzz env RAGGED_COMPILE_BACKEND=fa2 RAGGED_COMPILE_BACKWARD="${FUZZ_BACKWARD:-$bwd}" \
    RAGGED_FUZZ_GRAD_EXAMPLES="${GRAD_N:-1000}" python3 -m pytest -q -s fuzz/test_fuzz_grad_cuda.py
  # flash-attn-4's padded isolation layouts (isolation by recompute is the default)
  if [ "$bwd" = fa4 ]; then
    step grad-fuzz-copies-pad env RAGGED_COMPILE_BACKEND=fa2 RAGGED_COMPILE_BACKWARD=fa4 RAGGED_COMPILE_FA4_PAD=copies \
      RAGGED_FUZZ_GRAD_EXAMPLES="${GRAD_N:-1000}" python3 -m pytest -q -s fuzz/test_fuzz_grad_cuda.py -k "not variant"
    step grad-fuzz-fused-pad env RAGGED_COMPILE_BACKEND=fa2 RAGGED_COMPILE_BACKWARD=fa4 RAGGED_COMPILE_FA4_PAD=fused \
      RAGGED_FUZZ_GRAD_EXAMPLES="${GRAD_N:-1000}" python3 -m pytest -q -s fuzz/test_fuzz_grad_cuda.py -k "not variant"
  fi
  step main-job python3 -m ragged_compile
  if [ "$ngpu" -gt 1 ]; then step dist-tests python3 -m pytest -q -rs tests/test_distributed.py; fi
}

bench() {
  step bench-ops python3 bench/bench_attention.py --only ops --impls ours_eager,flashinfer_fa2,flashinfer_fa3 --out "$OUT"
  step bench-e2e python3 bench/bench_attention.py --only e2e --out "$OUT"
  step bench-train-attn python3 bench/bench_train.py --only attn --out "$OUT"
  step bench-train-e2e python3 bench/bench_train.py --only e2e --out "$OUT"
  step bench-train-e2e-vit python3 bench/bench_train.py --only e2e --e2e-layout vit --out "$OUT"
  step bench-isolation python3 bench/bench_isolation.py --out "$OUT"
  step bench-train-bwd-sweep python3 bench/bench_train.py --only bwd-sweep --out "$OUT"
  step bench-hf python3 bench/bench_hf.py --out "$OUT/hf.json"
  step bench-host python3 bench/bench_host.py --out "$OUT"
  step bench-host-graphs python3 bench/bench_host.py --only graphs --out "$OUT/graphs"  # host.{json,md} of its own
  step bench-variants python3 bench/bench_variants.py --out "$OUT"
  step bench-unpad python3 bench/bench_unpad.py --out "$OUT"
  step bench-eager-reuse python3 bench/bench_eager_reuse.py --out "$OUT/eager_reuse.json"
  step bench-cudagraph python3 bench/bench_cudagraph.py --steps 100 --out "$OUT"
  step sweep-backends python3 bench/sweep_backends.py --out "$OUT"
  local fsdp="--mode fsdp --bench --layers 8 --dim 2048 --heads 16 --kv-heads 16 --segments 16 --min-len 64 --max-len 4096 --steps 6"
  step fsdp-1gpu torchrun --standalone --nproc-per-node 1 examples/train_fsdp.py $fsdp --json "$OUT/fsdp-1gpu.json"
  if [ "$ngpu" -gt 1 ]; then
    step fsdp-2gpu torchrun --standalone --nproc-per-node 2 examples/train_fsdp.py $fsdp --json "$OUT/fsdp-2gpu.json"
  fi
}

profile() {
  step profile-train python3 bench/profile/profile_train.py --out "$OUT"
  step profile-cudagraph python3 bench/profile/profile_cudagraph.py --out "$OUT"
  step profile-hf python3 bench/profile/profile_hf.py --out "$OUT"
  step profile-host python3 bench/profile/profile_host.py --out "$OUT"
  step profile-train-call python3 bench/profile/profile_train_call.py --out "$OUT"
}

for phase in "${@:-tests bench}"; do
  for p in $phase; do
    case $p in tests | bench | profile) "$p" ;; *) echo "unknown phase $p (tests, bench, profile)"; exit 2 ;; esac
  done
done
