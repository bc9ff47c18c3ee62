#!/usr/bin/env python3
"""The table of scripts/cpu_scaling.sh: reads its RESULT lines (ours and
PyTorch's, one process each, at several thread counts) and prints, per
variant and thread count, both medians, their ratio (below 1 favours this
crate), each side's speed-up over its own one-thread time, and both peak
resident memories.

    python3 scripts/scaling_table.py results.txt
"""
import re
import sys

NAMES = {"forward": "forward", "step": "training step (gradient)", "psg": "per-sample gradients",
         "dp": "DP step (ghost clipping)"}


def main():
    got = {}
    head = []
    for line in open(sys.argv[1]):
        if not line.startswith("RESULT "):
            head.append(line.strip())
            continue
        m = re.match(r"RESULT (ours|peer)_(\S+) (.*) threads (\d+)", line)
        if not m:
            continue
        side, v, rest, threads = m.group(1), m.group(2), m.group(3), int(m.group(4))
        t = re.search(r"median(?:_ms)? ([0-9.]+)", rest)
        rss = re.search(r"peak_rss_mib ([0-9.]+)", rest)
        got[(side, v, threads)] = (float(t.group(1)), float(rss.group(1))) if t and rss else None
    print("\n".join(f"{h}  " for h in head if h))
    print("\n| workload | threads | ours ms | PyTorch ms | ours / PyTorch | ours: 1 thread / n | PyTorch: 1 thread / n "
          "| ours peak RSS MiB | PyTorch peak RSS MiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    variants = list(dict.fromkeys(v for (_, v, _) in got))
    threads = sorted({n for (_, _, n) in got})
    fmt = lambda x, f: "—" if x is None else f.format(x)
    for v in variants:
        for n in threads:
            ours, peer = got.get(("ours", v, n)), got.get(("peer", v, n))
            o1, p1 = got.get(("ours", v, threads[0])), got.get(("peer", v, threads[0]))
            ratio = ours[0] / peer[0] if ours and peer else None
            so = o1[0] / ours[0] if ours and o1 else None
            sp = p1[0] / peer[0] if peer and p1 else None
            print(f"| {NAMES.get(v, v)} | {n} | {fmt(ours and ours[0], '{:.1f}')} | {fmt(peer and peer[0], '{:.1f}')} "
                  f"| {fmt(ratio, '{:.2f}')} | {fmt(so, '{:.2f}x')} | {fmt(sp, '{:.2f}x')} "
                  f"| {fmt(ours and ours[1], '{:.0f}')} | {fmt(peer and peer[1], '{:.0f}')} |")


if __name__ == "__main__":
    main()
