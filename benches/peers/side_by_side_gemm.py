#!/usr/bin/env python3
"""The products alone, side by side: `examples/bench_gemm.rs` (the crate's
kernel and candle's matmul) and `bench_gemm.py` (PyTorch's `mm`, NumPy's
OpenBLAS), each in its own process, at each thread count, alternating
within a round; prints each shape's median GFLOP/s over the rounds.

    cargo build --release --example bench_gemm
    PY="$HOME/peers/bin/python" python3 benches/peers/side_by_side_gemm.py [ROUNDS] [THREADS ...]
"""
import collections
import os
import statistics
import sys

from rounds import PY, ROOT, output

IMPLS = ["ours", "candle", "torch", "numpy"]


def rates(cmd, threads):
    """The `RATE` lines of one process of `cmd` (`bench_gemm.py` takes its
    OpenBLAS thread count from `PEER_THREADS`)."""
    for line in output(cmd, threads).splitlines():
        if line.startswith("RATE "):
            _, impl, shape, layout, rate = line.split()
            yield (shape, layout), impl, float(rate)


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    threads = [int(t) for t in sys.argv[2:]] or [1, 2]
    ours = [os.path.join(ROOT, "target", "release", "examples", "bench_gemm")]
    peer = [PY, os.path.join(ROOT, "benches", "peers", "bench_gemm.py")]
    cmds = [ours, peer + ["torch"], peer + ["numpy"]]
    got = collections.defaultdict(list)
    order = []
    for _ in range(rounds):
        for t in threads:
            for cmd in cmds:
                for key, impl, rate in rates(cmd, t):
                    if (t, key) not in order:
                        order.append((t, key))
                    got[(t, key, impl)].append(rate)
    print("| threads | product | layout | " + " | ".join(IMPLS) + " | ours / best peer's rate |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in IMPLS) + " | --- |")
    for t, (shape, layout) in order:
        med = {i: statistics.median(got[(t, (shape, layout), i)]) for i in IMPLS}
        best = max(med["torch"], med["numpy"])
        cells = " | ".join(f"{med[i]:.0f}" for i in IMPLS)
        print(f"| {t} | {shape} | {layout} | {cells} | {med['ours'] / best:.2f} |")


if __name__ == "__main__":
    main()
