#!/usr/bin/env bash
# Stage flash-attn-4 (and FlashInfer) for the offline GPU machine, whose calls
# carry at most 64 MiB: the CuTe DSL's MLIR library alone is ~50 MB packed, so
# it travels in its own call (.stage/a, unpacked into /tmp/site by the first
# command of a warm machine) and everything else in the next (.stage/b, which
# bench/gpu_session.sh unpacks).
#
#   bash bench/stage_fa4.sh            # -> .stage/a/ir.tar.xz, .stage/b/{site,fi}.tar.xz
#   run: mkdir -p /tmp/site && xz -dc .stage/a/ir.tar.xz | tar xf - -C /tmp/site   (carry .stage/a)
#   run: bash bench/gpu_session.sh ...   (carry .stage/b and .fiaot, soon after)
set -euo pipefail
fa4_version=${FA4_VERSION:-4.0.0b36}
dsl_version=${CUTLASS_DSL_VERSION:-4.8.1}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pip_dl() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$tmp/whl" "$@"
}
pip_dl --pre "flash-attn-4==$fa4_version"
pip_dl "nvidia-cutlass-dsl==$dsl_version" "nvidia-cutlass-dsl-libs-base==$dsl_version" \
  "nvidia-cutlass-dsl-libs-core==$dsl_version" "nvidia-cutlass-dsl-libs-cu13==$dsl_version" \
  quack-kernels torch-c-dlpack-ext cuda-python cuda-bindings cuda-pathfinder "protobuf<7"
cp .whl/apache_tvm_ffi-*.whl "$tmp/whl/"  # the version FlashInfer was staged with
mkdir -p "$tmp/site" .stage/a .stage/b
for w in "$tmp"/whl/*.whl; do python3 -m zipfile -e "$w" "$tmp/site"; done
ir=nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so
(cd "$tmp/site" && tar cf - "$ir" | xz -T0 -9e > "$OLDPWD/.stage/a/ir.tar.xz")
(cd "$tmp/site" && tar cf - --exclude="./$ir" . | xz -T0 -9 > "$OLDPWD/.stage/b/site.tar.xz")
mkdir -p "$tmp/fi"
python3 -m zipfile -e .whl/flashinfer_python-*.whl "$tmp/fi"
(cd "$tmp/fi" && tar cf - . | xz -T0 -9 > "$OLDPWD/.stage/b/fi.tar.xz")
du -sh .stage/a .stage/b
