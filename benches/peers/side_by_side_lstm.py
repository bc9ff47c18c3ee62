#!/usr/bin/env python3
"""Per-sample gradients of a one-layer LSTM classifier (embedding 64,
hidden 128, T=64, B=64) beside Opacus 1.6's DPLSTM and torch.func, in
paired rounds: each round runs `bench_lstm.py` and then
`examples/bench_lstm.rs`, each in a fresh process (the peak resident
memory each prints is that process's), at one thread each and at two.

    PY="$HOME/peers/bin/python" python3 benches/peers/side_by_side_lstm.py [ROUNDS] [REPS]

from the repository root (build first: cargo build --release --example
bench_lstm). Prints each ratio's median, min and max over the rounds and
the last round's figures. Below 1 favours this crate.
"""
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = os.environ.get("PY", "python3")
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
REPS = sys.argv[2] if len(sys.argv) > 2 else "5"


def parse(out):
    if "unsupported" in out:
        return None
    m = re.search(r"RESULT (\S+) median(?:_ms)? ([0-9.]+)(?: ms)? first_ms ([0-9.]+) peak_rss_mib ([0-9.]+)", out)
    if not m:
        raise SystemExit(f"no RESULT line in:\n{out}")
    return float(m.group(2)), float(m.group(3)), float(m.group(4))


def run(cmd, threads):
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), PEER_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT, env=env).stdout
    if "unsupported" in out:
        print(out.strip(), flush=True)
    return parse(out)


def main():
    ours_bin = os.path.join(ROOT, "target", "release", "examples", "bench_lstm")
    peer = os.path.join(ROOT, "benches", "peers", "bench_lstm.py")
    ratios, last = {}, {}
    for r in range(ROUNDS):
        for threads in (1, 2):
            got = {
                ("peer", "psg_dplstm"): run([PY, peer, "psg_dplstm", REPS], threads),
                ("peer", "torch_func"): run([PY, peer, "torch_func", REPS], threads),
                ("ours", "psg"): run([ours_bin, "--variant", "psg", "--reps", REPS], threads),
                ("ours", "dp"): run([ours_bin, "--variant", "dp", "--reps", REPS], threads),
                ("ours", "step"): run([ours_bin, "--variant", "step", "--reps", REPS], threads),
            }
            t = lambda side, v: got[(side, v)][0]
            m = lambda side, v: got[(side, v)][2]
            out = {
                "per-sample gradients: ours / Opacus DPLSTM, time": t("ours", "psg") / t("peer", "psg_dplstm"),
                "per-sample gradients: ours / Opacus DPLSTM, peak RSS": m("ours", "psg") / m("peer", "psg_dplstm"),
                "clipped sum (ghost) / Opacus DPLSTM per-sample, time": t("ours", "dp") / t("peer", "psg_dplstm"),
                "per-sample gradients / our training step, time": t("ours", "psg") / t("ours", "step"),
            }
            if got[("peer", "torch_func")] is not None:
                out["per-sample gradients: ours / torch.func, time"] = t("ours", "psg") / t("peer", "torch_func")
                out["per-sample gradients: ours / torch.func, peak RSS"] = m("ours", "psg") / m("peer", "torch_func")
            for k, v in out.items():
                ratios.setdefault((threads, k), []).append(v)
            last[threads] = got
            print(f"round {r + 1}, {threads} thread(s): " + ", ".join(f"{k} {v:.2f}" for k, v in out.items()), flush=True)
    print("\n| threads | ratio | median | min | max |\n| --- | --- | --- | --- | --- |")
    for (threads, k), v in ratios.items():
        print(f"| {threads} | {k} | {statistics.median(v):.2f} | {min(v):.2f} | {max(v):.2f} |")
    print("\nlast round (ms median / first call ms / peak RSS MiB):")
    for threads, got in last.items():
        for (side, v), res in got.items():
            if res is not None:
                print(f"  {threads} thread(s) {side} {v}: {res[0]:.1f} / {res[1]:.0f} / {res[2]:.0f}")


if __name__ == "__main__":
    main()
