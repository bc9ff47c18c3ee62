"""Paired rounds of one-variant-per-process benchmarks (the side-by-side
scripts for MiniLM and the LSTM): each variant runs in a fresh process, so
the peak resident memory it prints is its own, at one thread and at two,
and the ratios are taken within a round. `RATIOS_JSON=PATH` writes the
ratios to PATH too (`paired.save_ratios`)."""
import os
import re
import statistics
import subprocess

from paired import save_ratios

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = os.environ.get("PY", "python3")


def parse(out):
    """`(median ms, first call ms, peak RSS MiB)` of a RESULT line, or None
    for a peer that says it cannot run the workload (`unsupported`)."""
    if "unsupported" in out:
        return None
    m = re.search(r"RESULT (\S+) median(?:_ms)? ([0-9.]+)(?: ms)? first_ms ([0-9.]+) peak_rss_mib ([0-9.]+)", out)
    if not m:
        raise SystemExit(f"no RESULT line in:\n{out}")
    return float(m.group(2)), float(m.group(3)), float(m.group(4))


def output(cmd, threads):
    """The standard output of one process of `cmd` at `threads` threads
    (ours and PyTorch's alike)."""
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), PEER_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    return subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT, env=env).stdout


def run(cmd, threads):
    """One process of `cmd` at `threads` threads: its RESULT line, parsed."""
    out = output(cmd, threads)
    if "unsupported" in out:
        print(out.strip(), flush=True)
    return parse(out)


def paired(rounds, one_round):
    """Runs `one_round(threads)` (returning `(ratios, got)`) `rounds` times at
    one thread and at two, then prints each ratio's median, min and max and
    the last round's figures."""
    ratios, last = {}, {}
    for r in range(rounds):
        for threads in (1, 2):
            out, got = one_round(threads)
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
    save_ratios(rounds, ratios)
