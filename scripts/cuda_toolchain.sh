#!/usr/bin/env bash
# Installs a CUDA compiler for `cargo build --features cuda` on a machine
# without the CUDA toolkit (nor a GPU): NVIDIA's nvcc, runtime headers and
# CCCL headers come from the package registry as Python wheels, into a
# folder outside the repository (once; later runs reuse it). It prints the
# environment to export:
#
#   eval "$(scripts/cuda_toolchain.sh)" && cargo check --features cuda
#
# CUDA_COMPUTE_CAP=90 (the H200's) is set because there is no GPU to ask.
# The folder is $CANDLE_FUNC_CUDA, by default ~/.cache/candle-func/cuda.
#
# The version is the newest that candle 0.11's cudarc (0.19) knows, 13.4:
# its build refuses an nvcc it has no bindings for (13.5 is on the
# registry too).
#
# CANDLE_FUNC_CUDA_VERSION picks another version, in a folder of its own
# (scripts/gpu_check.sh builds with 13.0.88: binaries for a GPU machine
# whose driver is CUDA 13.0 need PTX that driver can compile).
set -euo pipefail
version="${CANDLE_FUNC_CUDA_VERSION:-13.4.92}"
dir="${CANDLE_FUNC_CUDA:-$HOME/.cache/candle-func/cuda}"
if [ "$version" != 13.4.92 ]; then
  dir="$dir-$version"
fi
if [ ! -x "$dir/venv/bin/pip" ]; then
  python3 -m venv "$dir/venv" >&2
fi
# every compiler part of one version (nvvm, nvcc's dependency, too: a
# newer one writes PTX that this ptxas refuses)
wheels="nvidia-cuda-nvcc==$version nvidia-cuda-runtime==$version nvidia-cuda-crt==$version nvidia-nvvm==$version"
if [ "$(cat "$dir/done" 2>/dev/null)" != "$wheels" ]; then
  # shellcheck disable=SC2086
  "$dir/venv/bin/pip" install -q --disable-pip-version-check $wheels nvidia-cuda-cccl >&2
  echo "$wheels" > "$dir/done"
fi
root="$(ls -d "$dir"/venv/lib/python3*/site-packages/nvidia/cu1* | sort | tail -1)"
if [ ! -x "$root/bin/nvcc" ]; then
  echo "no nvcc under $root" >&2
  exit 1
fi
# nvcc finds its own headers beside it; the CCCL ones (cuda_fp16.h needs
# nv/target) are in include/cccl too
echo "export CUDA_ROOT='$root' CUDA_PATH='$root' CUDA_HOME='$root' PATH='$root/bin':\"\$PATH\""
echo "export NVCC_PREPEND_FLAGS='-I$root/include -I$root/include/cccl' CUDA_COMPUTE_CAP=90"
