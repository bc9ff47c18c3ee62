#!/usr/bin/env bash
# Thread scaling on a many-core machine (issue 36, item 5): the MiniLM-shaped
# encoder of examples/bench_attention.rs (random weights, B=32, T=64) beside
# the same encoder in PyTorch (benches/peers/bench_encoder.py), each variant
# its own process, at 1, 4 and 16 threads. Two halves, as for
# scripts/gpu_check.sh, because the 16-core machine (the GPU machine) has
# PyTorch but no Rust toolchain:
#
#   scripts/cpu_scaling.sh build   # here: the example into .scale/ (ignored)
#   scripts/cpu_scaling.sh run     # there: writes $OUT/cpu_scaling.md
#
# The device tool's call: command "bash scripts/cpu_scaling.sh run", carry
# [".scale"], timeout_s 400. Here, `SCALE_THREADS="1 2" bash
# scripts/cpu_scaling.sh run` after the build is the same run on this
# machine's cores. SCALE_REPS (default 3) and SCALE_VARIANTS (default
# "forward step psg dp") choose the work.
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-}"

build() {
  cargo build --release --example bench_attention
  rm -rf .scale && mkdir -p .scale
  cp target/release/examples/bench_attention .scale/
  strip .scale/bench_attention
  xz -T0 -9 .scale/bench_attention
  grep -qx '/.scale/' .git/info/exclude 2>/dev/null || echo '/.scale/' >> .git/info/exclude
  du -sh .scale
}

run() {
  local out="${OUT:-.scale/out}" py="${PY:-python3}"
  mkdir -p "$out"
  local exe="${TMPDIR:-/tmp}/scale_bin"
  mkdir -p "$exe"
  python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
    .scale/bench_attention.xz "$exe/bench_attention"
  chmod +x "$exe/bench_attention"
  local log="$out/results.txt"
  {
    echo "cpu: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores available"
    echo "torch: $("$py" -c 'import torch; print(torch.__version__, torch.backends.mkldnn.is_available())' 2>&1 | tail -1)"
    echo "opacus: $("$py" -c 'import opacus; print(opacus.__version__)' 2>&1 | tail -1)"
  } > "$log"
  local reps="${SCALE_REPS:-3}"
  for threads in ${SCALE_THREADS:-1 4 16}; do
    for v in ${SCALE_VARIANTS:-forward step psg dp}; do
      # ours, then PyTorch's, each in a fresh process
      RAYON_NUM_THREADS=$threads timeout 120 "$exe/bench_attention" --shape minilm --b 32 --t 64 \
        --variant "$v" --reps "$reps" 2>&1 | grep RESULT >> "$log" || echo "RESULT ours_$v failed threads $threads" >> "$log"
      (cd benches/peers && PEER_THREADS=$threads OMP_NUM_THREADS=$threads timeout 120 "$py" bench_encoder.py \
        "$v" "$reps" minilm 6 32 64 2>&1 | grep -E 'RESULT|unsupported' | sed "s/^unsupported.*/RESULT peer_$v unsupported threads $threads/") \
        >> "$log" || echo "RESULT peer_$v failed threads $threads" >> "$log"
    done
  done
  python3 scripts/scaling_table.py "$log" > "$out/cpu_scaling.md"
  cat "$log" "$out/cpu_scaling.md"
}

case "$mode" in
  build) build ;;
  run) run ;;
  *) echo "usage: scripts/cpu_scaling.sh build|run" >&2; exit 2 ;;
esac
