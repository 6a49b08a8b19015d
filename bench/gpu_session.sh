#!/usr/bin/env bash
# Wraps one command on the offline GPU machine (the `device` tool of this
# workplace): installs the FlashInfer wheels staged by
# ../shared/gpu/flashinfer-wheels.sh (carried in .whl), restores compiled
# FlashInfer kernels (carried in .fiaot, as FlashInfer's AOT directory, so no
# JIT rebuild is attempted), runs "$@", and hands every kernel compiled so far
# back as $OUT/fiaot.tgz.part-* to unpack into .fiaot/ here.
#
#   bash bench/gpu_session.sh python3 -m pytest -q -m cuda tests
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
aot=/tmp/site/flashinfer/data/aot
mkdir -p "$aot" /tmp/fiws
cat .fiaot/*.part-* 2>/dev/null | tar xzf - -C "$aot"
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws MAX_JOBS=16 FLASHINFER_CUDA_ARCH_LIST=9.0a PYTHONUNBUFFERED=1
"$@"
status=$?
for so in $(find /tmp/fiws/.cache -name '*.so' 2>/dev/null); do
  name=$(basename "$so" .so)
  mkdir -p "$aot/$name" && cp -n "$so" "$aot/$name/"
done
if [ -n "${OUT:-}" ]; then
  (cd "$aot" && tar czf - .) | split -b 15m - "$OUT/fiaot.tgz.part-"
fi
exit $status
