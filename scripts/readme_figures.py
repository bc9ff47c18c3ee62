#!/usr/bin/env python3
"""The README's speed figures, measured in one sitting and written from one
results file.

    PY="$HOME/peers/bin/python" python3 scripts/readme_figures.py measure [ROUNDS]
    python3 scripts/readme_figures.py write

`measure` runs the side-by-side scripts of `benches/peers/` behind the
README's figures, one after another (never two at once), at two threads
each and at one (`PEER_THREADS`, `RAYON_NUM_THREADS`), and writes every
ratio they print, with the date, the CPU, the commit and the peers'
versions, to `benches/results/readme.json`; then it does what `write`
does. `write` rewrites the README's table between its `figures` markers
from that file alone. `tests/readme.rs` fails when the README's table is
not the one the committed file gives, so a figure cannot be edited by hand.
ROUNDS (paired rounds per script) defaults to 3. Build first:
`cargo build --release --example bench --example bench_lstm`.
"""
import datetime, json, os, subprocess, sys, tempfile, textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = os.path.join(ROOT, "benches", "peers")
RESULTS = os.path.join(ROOT, "benches", "results", "readme.json")
README = os.path.join(ROOT, "README.md")
START, END = "<!-- figures: benches/results/readme.json -->", "<!-- /figures -->"
THREADS = (2, 1)

# (script, ratio name the script prints, the README row's label); each row
# is the ratio's median over the rounds, at each thread count in THREADS
FIGURES = [
    ("side_by_side.py", "CNN-T B=64: our vmap(grad), Auto / torch.func",
     "per-sample gradients, tutorial CNN, B=64: ours / torch.func `vmap(grad)`"),
    ("side_by_side.py", "CNN-O B=64: our vmap(grad), Auto / torch.func",
     "per-sample gradients, Opacus CNN, B=64: ours / torch.func `vmap(grad)`"),
    ("side_by_side_dp.py", "tutorial CNN: our DP step (ghost) / Opacus ghost clipping step",
     "DP-SGD step, tutorial CNN, B=64: ours / Opacus's ghost clipping"),
    ("side_by_side_dp.py", "tiny_lm: our DP step (ghost) / Opacus ghost clipping step",
     "DP-SGD step, small transformer, B=32: ours / Opacus's ghost clipping"),
    ("side_by_side_lstm.py", "per-sample gradients: ours / Opacus DPLSTM, time",
     "per-sample gradients, LSTM, B=64: ours / Opacus's `DPLSTM`"),
]
# each script's arguments after ROUNDS, and whether it runs both thread
# counts itself (rounds.paired) or once per thread count (paired.rounds)
SCRIPTS = {"side_by_side.py": (["5", "", "T,O"], False), "side_by_side_dp.py": (["7"], False),
           "side_by_side_lstm.py": (["5"], True)}


def sh(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout.strip()


def cpu():
    model = next((l.split(":", 1)[1].strip() for l in sh("lscpu").splitlines() if l.startswith("Model name")), "?")
    return f"{model}, {os.cpu_count()} CPUs"


def peers_versions():
    py = os.environ.get("PY", "python3")
    code = "import torch, opacus; print(f'torch {torch.__version__.split(\"+\")[0]}, Opacus {opacus.__version__}')"
    return subprocess.run([py, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def run_script(script, rounds, threads):
    """The ratios `script` writes to RATIOS_JSON, at `threads` (None: the
    script sets both thread counts itself)."""
    args, _ = SCRIPTS[script]
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    env = dict(os.environ, RATIOS_JSON=path)
    if threads is not None:
        env.update(PEER_THREADS=str(threads), RAYON_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    print(f"running {script} at {threads or 'each of the'} thread(s) ...", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, os.path.join(PEERS, script), str(rounds), *args], check=True, cwd=ROOT,
                   env=env, stdout=sys.stderr)
    with open(path) as f:
        rows = json.load(f)["ratios"]
    os.unlink(path)
    return [dict(r, script=script) for r in rows]


def measure(rounds):
    rows = []
    for script, (_, both) in SCRIPTS.items():
        for threads in ([None] if both else THREADS):
            rows += run_script(script, rounds, threads)
    figures = []
    for script, ratio, label in FIGURES:
        found = {r["threads"]: r for r in rows if r["script"] == script and r["ratio"] == ratio}
        missing = [t for t in THREADS if t not in found]
        if missing:
            raise SystemExit(f"{script} printed no '{ratio}' at {missing} thread(s)")
        figures.append({"label": label, "script": script, "ratio": ratio,
                        "median": [round(found[t]["median"], 4) for t in THREADS],
                        "min": [round(found[t]["min"], 4) for t in THREADS],
                        "max": [round(found[t]["max"], 4) for t in THREADS]})
    doc = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "cpu": cpu(),
           "commit": sh("git", "rev-parse", "--short", "HEAD"), "peers": peers_versions(), "rounds": rounds,
           "threads": list(THREADS), "figures": figures, "all_ratios": rows}
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def table(doc):
    """The README's block: one line saying where and when, then the table."""
    heads = " | ".join(f"{t} thread{'s' if t > 1 else ''}" for t in doc["threads"])
    said = (f"Measured side by side on {doc['date']} ({doc['cpu']}; {doc['peers']}; commit {doc['commit']}), "
            f"medians of {doc['rounds']} paired rounds, below 1 favouring this crate (`scripts/readme_figures.py` "
            "reruns the sitting and writes this; more in [benchmarks](docs/benchmarks.md)):")
    lines = textwrap.wrap(said, 100) + ["", f"| ratio of times | {heads} |", "| --- |" + " --- |" * len(doc["threads"])]
    for fig in doc["figures"]:
        lines.append(f"| {fig['label']} | " + " | ".join(f"{m:.2f}" for m in fig["median"]) + " |")
    return lines


def write():
    with open(RESULTS) as f:
        doc = json.load(f)
    with open(README) as f:
        text = f.read()
    if START not in text or END not in text:
        raise SystemExit(f"README.md lacks the markers {START} ... {END}")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    with open(README, "w") as f:
        f.write(head + START + "\n" + "\n".join(table(doc)) + "\n" + END + tail)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "measure":
        measure(int(sys.argv[2]) if len(sys.argv) > 2 else 3)
        write()
    elif what == "write":
        write()
    else:
        raise SystemExit(__doc__)
