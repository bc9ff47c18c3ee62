#!/usr/bin/env python3
"""A causal language model at real size beside PyTorch, peft and Opacus, in
paired rounds: each round runs, for each variant, `bench_llm.py` and then
`examples/bench_llm.rs`, each in a fresh process (the peak resident memory
each prints is that process's), at one thread each and at two.

    PY="$HOME/peers/bin/python"
    dir="$("$PY" scripts/make_scale_checkpoint.py qwen2-0.5b)"
    PY="$PY" python3 benches/peers/side_by_side_llm.py "$dir" [ROUNDS] [REPS]

from the repository root (build first: cargo build --release --example
bench_llm). Prints each ratio's median, min and max over the rounds and the
last round's figures. Below 1 favours this crate. Opacus's "best mode" is
the faster of its hooks and ghost modes in that round (ghost refuses tied
embeddings; then hooks).
"""
import os
import sys

from rounds import PY, ROOT, paired, run

DIR = sys.argv[1]
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 2
REPS = sys.argv[3] if len(sys.argv) > 3 else "2"
OURS = ["forward", "lora_step", "dp_lora", "dp"]
PEERS = ["forward", "lora_step", "dp_lora", "dp_lora_ghost", "dp", "dp_ghost"]


def main():
    ours_bin = os.path.join(ROOT, "target", "release", "examples", "bench_llm")
    peer = os.path.join(ROOT, "benches", "peers", "bench_llm.py")

    def one_round(threads):
        got = {}
        for v in PEERS:
            got[("peer", v)] = run([PY, peer, DIR, v, REPS], threads)
        for v in OURS:
            got[("ours", v)] = run([ours_bin, "--model", DIR, "--variant", v, "--reps", REPS], threads)
        t = lambda side, v: got[(side, v)][0]
        m = lambda side, v: got[(side, v)][2]

        def best(*vs):
            """The fastest of the peer's modes that ran: (time, peak RSS)."""
            ran = [got[("peer", v)] for v in vs if got[("peer", v)] is not None]
            fastest = min(ran, key=lambda r: r[0])
            return fastest[0], fastest[2]

        out = {
            "forward: ours / PyTorch": t("ours", "forward") / t("peer", "forward"),
            "LoRA step: ours / PyTorch+peft": t("ours", "lora_step") / t("peer", "lora_step"),
            "LoRA DP step: ours / Opacus+peft hooks, time": t("ours", "dp_lora") / t("peer", "dp_lora"),
            "LoRA DP step: ours / Opacus+peft best mode, time": t("ours", "dp_lora") / best("dp_lora", "dp_lora_ghost")[0],
            "LoRA DP step: ours / Opacus+peft best mode, peak RSS": m("ours", "dp_lora") / best("dp_lora", "dp_lora_ghost")[1],
            "full DP step: ours / Opacus hooks, time": t("ours", "dp") / t("peer", "dp"),
            "full DP step: ours / Opacus hooks, peak RSS": m("ours", "dp") / m("peer", "dp"),
        }
        return out, got

    paired(ROUNDS, one_round)


if __name__ == "__main__":
    main()
