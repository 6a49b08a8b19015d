#!/usr/bin/env bash
# Wraps one command on the offline GPU machine (the `device` tool of this
# workplace): installs the FlashInfer wheels staged by
# ../shared/gpu/flashinfer-wheels.sh (carried in .whl), unpacks any
# .stage/*/*.tar.xz site archives (bench/stage_fa4.sh: flash-attn-4, and
# FlashInfer packed small enough to travel with it), restores compiled
# FlashInfer kernels (carried in .fiaot, as FlashInfer's AOT directory, so no
# JIT rebuild is attempted) and flash-attn-4 kernels (.fa4cache), runs "$@",
# and hands every kernel compiled so far back as $OUT/fiaot.tgz.part-* (unpack
# into .fiaot/ here) and $OUT/fa4cache.tgz (into .fa4cache/).
#
#   bash bench/gpu_session.sh python3 -m pytest -q -m cuda tests
set -u
mkdir -p /tmp/site
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
for archive in .stage/*/*.tar.xz; do
  [ -f "$archive" ] && { xz -dc "$archive" | tar xf - -C /tmp/site || exit 1; }
done
export PYTHONPATH=/tmp/site:$PWD
# flash-attn-4's CuTe DSL finds its packages through a .pth file, which
# PYTHONPATH entries do not run.
[ -d /tmp/site/nvidia_cutlass_dsl/dsl_packages ] && PYTHONPATH=$PYTHONPATH:/tmp/site/nvidia_cutlass_dsl/dsl_packages
aot=/tmp/site/flashinfer/data/aot
mkdir -p "$aot" /tmp/fiws /tmp/fa4cache
cat .fiaot/*.part-* 2>/dev/null | tar xzf - -C "$aot"
for cache in .fa4cache/*.tgz; do [ -f "$cache" ] && tar xzf "$cache" -C /tmp/fa4cache; done
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws MAX_JOBS=16 FLASHINFER_CUDA_ARCH_LIST=9.0a PYTHONUNBUFFERED=1
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4cache
"$@"
status=$?
for so in $(find /tmp/fiws/.cache -name '*.so' 2>/dev/null); do
  name=$(basename "$so" .so)
  mkdir -p "$aot/$name" && cp -n "$so" "$aot/$name/"
done
if [ -n "${OUT:-}" ]; then
  (cd "$aot" && tar czf - .) | split -b 15m - "$OUT/fiaot.tgz.part-"
  [ -n "$(ls -A /tmp/fa4cache)" ] && (cd /tmp/fa4cache && tar czf "$OUT/fa4cache.tgz" .)
fi
exit $status
