"""Paired rounds for the side-by-side scripts (`side_by_side.py` and the
others beside it): each round runs a peer's
script and then the crate's `examples/bench.rs --json` on the same
workloads, one after the other (never two at once on two cores), and takes
the ratios within the round, so load during one round falls on both sides
of its ratios. Prints each ratio's median, min and max over the rounds and
the last round's milliseconds; with `RATIOS_JSON=PATH` set, also writes
them to PATH (`scripts/readme_figures.py` reads it)."""
import json, os, re, statistics, subprocess, sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = os.environ.get("PY", "python3")


def results(out):
    """A peer script's `RESULT <name> median <ms> ms` lines, by name."""
    return {m.group(1).strip(): float(m.group(2)) for m in re.finditer(r"RESULT (.+?)\s+median\s+([0-9.]+) ms", out)}


def peer(script, *args):
    """The results of `benches/peers/SCRIPT ARGS`."""
    out = subprocess.run([PY, os.path.join(ROOT, "benches", "peers", script), *args], capture_output=True, text=True, check=True).stdout
    return results(out)


def our_rows(only, reps):
    """Our bench's JSON rows for `--only ONLY`, as printed."""
    cmd = ["cargo", "run", "--release", "-q", "--example", "bench", "--", "--only", only, "--json", "--reps", reps]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return [json.loads(l) for l in out.splitlines() if l.startswith("{")]


def ours(only, reps):
    """Our bench's JSON rows for `--only ONLY`: variant -> (ms, peak MiB)."""
    return {r["variant"]: (r["median_ms"], r["peak_mib"]) for r in our_rows(only, reps)}


def ms(o):
    """`ours()`'s rows as variant -> milliseconds."""
    return {k: v[0] for k, v in o.items()}


def print_last(t, o):
    """The peer's and our (`ours()`) milliseconds of one round."""
    for k, v in t.items():
        print(f"peer  {k}: {v:.3f}")
    for k, (v, peak) in o.items():
        print(f"ours  {k}: {v:.3f}" + (f"  (peak {peak:.1f} MiB)" if peak is not None else ""))


def rounds(n, run_peer, run_ours, ratios, show=print_last, heading="ratio"):
    """`n` paired rounds: `ratios(peer, ours)` of each round's results,
    their median, min and max as a table, then `show` of the last round."""
    table, last = {}, None
    for r in range(n):
        t, o = run_peer(), run_ours()
        for k, v in ratios(t, o).items():
            table.setdefault(k, []).append(v)
        last = (t, o)
        print(f"round {r + 1}/{n} done", file=sys.stderr, flush=True)
    print(f"| {heading} | median of {n} rounds | min | max |")
    print("| --- | --- | --- | --- |")
    for k, v in table.items():
        print(f"| {k} | {statistics.median(v):.2f} | {min(v):.2f} | {max(v):.2f} |")
    print("\nlast round, milliseconds:\n")
    show(*last)
    threads = int(os.environ.get("RAYON_NUM_THREADS") or os.cpu_count())
    save_ratios(n, {(threads, k): v for k, v in table.items()})


def save_ratios(n, table):
    """Writes `table` ({(threads, ratio name): [one value per round]}) as
    JSON to `$RATIOS_JSON`, when it is set: each ratio's thread count,
    median, min and max over the `n` rounds."""
    path = os.environ.get("RATIOS_JSON")
    if not path:
        return
    rows = [{"threads": t, "ratio": k, "rounds": n, "median": statistics.median(v), "min": min(v), "max": max(v)}
            for (t, k), v in table.items()]
    with open(path, "w") as f:
        json.dump({"script": os.path.basename(sys.argv[0]), "ratios": rows}, f, indent=1)
