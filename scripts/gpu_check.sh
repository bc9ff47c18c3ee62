#!/usr/bin/env bash
# The GPU check (issue 28): our convolution routes and fixtures on a CUDA
# GPU, beside PyTorch's torch.func and per-example loop on the same GPU.
# Two halves, because the GPU machine has no Rust toolchain and nothing
# to download:
#
#   scripts/gpu_check.sh build   # here: CUDA builds of the fixture tests
#                                # and examples/bench into .gpu/ (ignored)
#   scripts/gpu_check.sh run     # there: runs them, writes $OUT/gpu_check.md
#
# The device tool's call: command "bash scripts/gpu_check.sh run", carry
# [".gpu"], timeout_s 540 (the run takes about five minutes; a fresh
# machine adds its start). Set GPU_CHECK_CUDNN=1 to build with cuDNN too.
# A dry run of the second half here, on CPU builds: GPU_CHECK_DEVICE=cpu
# GPU_CHECK_BIN=<folder with bench, fixtures, models.py, features>.
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-}"

build() {
  # the CUDA 13.0 compiler: the GPU's driver is CUDA 13.0, and PTX from a
  # newer compiler is refused by an older driver
  eval "$(CANDLE_FUNC_CUDA_VERSION=13.0.88 scripts/cuda_toolchain.sh)"
  export CARGO_TARGET_DIR="$HOME/.cache/candle-func/gpu-target"
  local features=cuda
  if [ "${GPU_CHECK_CUDNN:-0}" = 1 ]; then features=cuda,cudnn; fi
  # the library first (cudarc compiled), then link stubs for the CUDA
  # libraries, then the binaries
  cargo build --release --features "$features" --lib
  link_stubs
  cargo build --release --features "$features" --example bench
  local tests
  tests="$(cargo test --release --features "$features" --test fixtures --no-run --message-format=json \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "fixtures":
        print(m["executable"])')"
  rm -rf .gpu && mkdir -p .gpu
  cp "$CARGO_TARGET_DIR/release/examples/bench" .gpu/bench
  cp "$tests" .gpu/fixtures
  strip .gpu/bench .gpu/fixtures
  # about 55 MB each, mostly candle's kernels as PTX text: xz makes them
  # 6 MB, inside the 64 MiB that travels
  xz -T0 -9 .gpu/bench .gpu/fixtures
  cp benches/peers/models.py .gpu/models.py
  echo "$features" > .gpu/features
  grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
  du -sh .gpu
  echo 'now hand the device tool: command "bash scripts/gpu_check.sh run", carry [".gpu"], timeout_s 540'
}

# Linking needs libcuda (the driver's, which only a GPU machine has) and
# cuBLAS, cuRAND and NVRTC (large wheels): stand-ins with the symbols
# cudarc calls and the real libraries' sonames are enough to link, and the
# GPU machine's own libraries (its driver, PyTorch's CUDA wheels) are the
# ones loaded there. Written beside the compiler, where cudarc's build
# looks ($CUDA_ROOT/lib).
link_stubs() {
  local rlib
  rlib="$(ls -t "$CARGO_TARGET_DIR"/release/deps/libcudarc-*.rlib | head -1)"
  nm -u --quiet "$rlib" 2>/dev/null | awk '{print $NF}' | grep -E '^(cu|nvrtc)[A-Za-z0-9_]*$' | sort -u > "$CUDA_ROOT/lib/cuda_symbols.txt"
  python3 - "$CUDA_ROOT/lib" <<'PY'
import os, subprocess, sys
lib = sys.argv[1]
# the runtime is in the compiler's wheel itself (candle's kernels for
# mixture-of-experts call it from C++): linked for real
if not os.path.exists(os.path.join(lib, "libcudart.so")):
    os.symlink("libcudart.so.13", os.path.join(lib, "libcudart.so"))
groups = {"cuda": "libcuda.so.1", "cublas": "libcublas.so.13", "cublasLt": "libcublasLt.so.13",
          "curand": "libcurand.so.10", "nvrtc": "libnvrtc.so.13", "cudnn": "libcudnn.so.9"}
syms = {g: [] for g in groups}
for s in open(os.path.join(lib, "cuda_symbols.txt")).read().split():
    for prefix, g in (("cublasLt", "cublasLt"), ("cublas", "cublas"), ("curand", "curand"), ("nvrtc", "nvrtc"),
                      ("cudnn", "cudnn"), ("cuda", None), ("cu", "cuda")):
        if s.startswith(prefix):
            if g is not None:
                syms[g].append(s)
            break
for g, soname in groups.items():
    c = os.path.join(lib, f"stub_{g}.c")
    with open(c, "w") as f:
        f.write("".join(f"void {s}(void) {{}}\n" for s in syms[g]) or "int candle_func_stub;\n")
    subprocess.run(["cc", "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", os.path.join(lib, f"lib{g}.so"), c],
                   check=True)
    print(f"stub lib{g}.so ({soname}): {len(syms[g])} symbols", file=sys.stderr)
PY
}

run() {
  local bin="${GPU_CHECK_BIN:-.gpu}"
  local out="${OUT:-$bin/out}"
  mkdir -p "$out"
  local md="$out/gpu_check.md"
  export CANDLE_FUNC_DEVICE="${GPU_CHECK_DEVICE:-cuda}" PEER_DEVICE="${GPU_CHECK_DEVICE:-cuda}"
  export CANDLE_FUNC_FIXTURES=tests/fixtures
  # the binaries unpacked; the CUDA libraries they were linked against
  # stand-ins for are the machine's own (its driver, PyTorch's wheels)
  local exe="${TMPDIR:-/tmp}/gpu_check_bin"
  mkdir -p "$exe"
  for b in bench fixtures; do
    if [ -f "$bin/$b.xz" ]; then
      python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
        "$bin/$b.xz" "$exe/$b"
    else
      cp "$bin/$b" "$exe/$b"
    fi
    chmod +x "$exe/$b"
  done
  local nv
  nv="$("${PY:-python3}" -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null || true)"
  if [ -n "$nv" ]; then
    LD_LIBRARY_PATH="$(find "$nv" -name 'lib*.so*' -printf '%h\n' | sort -u | tr '\n' ':')${LD_LIBRARY_PATH:-}"
  fi
  export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:/usr/local/nvidia/lib64:/usr/local/nvidia/lib"
  local gpu
  gpu="$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1 || true)"
  {
    echo "## On a GPU: ${gpu:-no nvidia-smi, device $CANDLE_FUNC_DEVICE}"
    echo
    echo "Built with features: $(cat "$bin/features"); $(date -u +%Y-%m-%d)."
    if ldd "$exe/bench" | grep -q 'not found'; then
      echo
      echo "Libraries not found: $(ldd "$exe/bench" | grep 'not found' | tr -s ' \t\n' ' ')"
    fi
  } > "$md"
  # 1. every fixture through every route and schedule, on the GPU
  set +e
  timeout 150 "$exe/fixtures" --test-threads 1 --nocapture > "$out/fixtures.log" 2>&1
  local rc=$?
  set -e
  python3 - "$out/fixtures.log" "$rc" >> "$md" <<'PY'
import re, sys
log, rc = open(sys.argv[1]).read(), sys.argv[2]
lines = [l for l in log.splitlines() if l.startswith("fixture ")]
worst = {}
for l in lines:
    route = re.search(r"\b(Grouped|Unfold|Loop|Auto)\b", l)
    diffs = [float(x) for x in re.findall(r"[0-9.]+e-?[0-9]+|[0-9]+\.[0-9]+", l.split(":", 1)[-1])]
    key = route.group(1) if route else "-"
    n, w = worst.get(key, (0, 0.0))
    worst[key] = (n + 1, max([w] + diffs))
print(f"\n### Fixtures\n\nThe fixture tests' runs on the device above (exit status {rc}): against PyTorch's numbers, "
      "the largest difference each route printed.\n")
print("| route | runs | largest difference |\n| --- | --- | --- |")
for k, (n, w) in sorted(worst.items()):
    print(f"| {k} | {n} | {w:.2e} |")
print("\n" + "\n".join(l for l in log.splitlines() if "test result" in l or "panicked" in l))
PY
  # 2. the routes timed, ours then PyTorch's, on the seed's workloads
  timeout 200 "$exe/bench" --only T,O,ENS_T,ENS_O --reps 11 --json > "$out/ours.jsonl" 2> "$out/ours.err" || true
  PEERS="$bin" timeout 150 "${PY:-python3}" benches/peers/bench_gpu.py 11 > "$out/torch.txt" 2>&1 || true
  {
    echo
    echo "### Routes against torch.func (medians of 11, ms)"
    echo
    python3 benches/peers/gpu_table.py "$out/ours.jsonl" "$out/torch.txt"
  } >> "$md"
  cat "$md"
}

case "$mode" in
  build) build ;;
  run) run ;;
  *) echo "usage: scripts/gpu_check.sh build|run" >&2; exit 2 ;;
esac
