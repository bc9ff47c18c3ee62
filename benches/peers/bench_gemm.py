"""The products of `examples/bench_gemm.rs` through PyTorch's `mm` (oneDNN /
MKL: `bench_gemm.py torch`) or NumPy's `@` (the OpenBLAS NumPy's wheel
bundles: `bench_gemm.py numpy`), one library per process (each one's
threads spin for a while after a call and would slow the other's), at
`PEER_THREADS` threads: `RATE <impl> <m>x<k>x<n> <layout> <GFLOP/s>`."""
import os
import statistics
import sys
import time

THREADS = os.environ.get("PEER_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", THREADS)
os.environ.setdefault("OMP_NUM_THREADS", THREADS)
import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(THREADS))

# the Rust example's list: (m, k, n, layout)
SHAPES = [
    (2048, 384, 384, "nt"), (2048, 384, 1536, "nt"), (2048, 1536, 384, "nt"), (384, 2048, 1536, "tn"),
    (512, 896, 896, "nt"), (512, 896, 128, "nt"), (512, 896, 4864, "nt"), (512, 4864, 896, "nt"),
    (896, 512, 4864, "tn"), (512, 896, 4864, "nn"), (512, 896, 151936, "nt"),
]


def median(flops, f):
    f()
    reps = max(3, int(2e9 / flops))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main():
    which = sys.argv[1] if len(sys.argv) > 1 else "torch"
    if which not in ("torch", "numpy"):
        raise SystemExit(f"bench_gemm.py: torch or numpy, got {which}")
    rng = np.random.default_rng(0)
    for m, k, n, layout in SHAPES:
        a = rng.standard_normal((k, m) if layout[0] == "t" else (m, k), dtype=np.float32)
        b = rng.standard_normal((n, k) if layout[1] == "t" else (k, n), dtype=np.float32)
        a = a.T if layout[0] == "t" else a
        b = b.T if layout[1] == "t" else b
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        flops = 2.0 * m * k * n
        f = (lambda: torch.mm(ta, tb)) if which == "torch" else (lambda: a @ b)
        print(f"RATE {which} {m}x{k}x{n} {layout} {flops / median(flops, f) / 1e9:.1f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
