#!/usr/bin/env python3
"""MiniLM at real size beside Hugging Face's PyTorch and Opacus, in paired
rounds: each round runs, for each variant, `bench_minilm.py` and then
`examples/bench_minilm.rs`, each in a fresh process (the peak resident
memory each prints is that process's), at one thread each and at two.

    CANDLE_FUNC_MINILM="$(scripts/fetch_minilm.sh)" PY="$HOME/peers/bin/python" \
        python3 benches/peers/side_by_side_minilm.py [ROUNDS] [REPS] [base|lora]

The `lora` set times the LoRA DP step (ours, and Opacus 1.6 with peft's
adapters in hooks and ghost mode) beside our full fine-tuning DP step.

from the repository root (build first: cargo build --release --example
bench_minilm). Prints each ratio's median, min and max over the rounds and
the last round's figures. Below 1 favours this crate.
"""
import os
import sys

from rounds import PY, ROOT, paired, run

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
REPS = sys.argv[2] if len(sys.argv) > 2 else "5"
SET = sys.argv[3] if len(sys.argv) > 3 else "base"
# ours, theirs
PAIRS = {
    "base": [("forward", "forward"), ("step", "step"), ("psg", "psg_hooks"), ("dp", "dp_ghost")],
    "lora": [("dp_lora", "dp_lora"), ("dp", "dp_lora_ghost")],
}[SET]


def lora_ratios(t, m):
    return {
        "LoRA DP step / full DP step (ours), time": t("ours", "dp_lora") / t("ours", "dp"),
        "LoRA DP step / full DP step (ours), peak RSS": m("ours", "dp_lora") / m("ours", "dp"),
        "LoRA DP step: ours / Opacus+peft hooks, time": t("ours", "dp_lora") / t("peer", "dp_lora"),
        "LoRA DP step: ours / Opacus+peft hooks, peak RSS": m("ours", "dp_lora") / m("peer", "dp_lora"),
        "LoRA DP step: ours / Opacus+peft ghost, time": t("ours", "dp_lora") / t("peer", "dp_lora_ghost"),
        "LoRA DP step: ours / Opacus+peft ghost, peak RSS": m("ours", "dp_lora") / m("peer", "dp_lora_ghost"),
    }


def main():
    ours_bin = os.path.join(ROOT, "target", "release", "examples", "bench_minilm")

    def one_round(threads):
        got = {}
        for mine, theirs in PAIRS:
            got[("peer", theirs)] = run([PY, os.path.join(ROOT, "benches", "peers", "bench_minilm.py"), theirs, REPS], threads)
            got[("ours", mine)] = run([ours_bin, "--variant", mine, "--reps", REPS], threads)
        t = lambda side, v: got[(side, v)][0]
        m = lambda side, v: got[(side, v)][2]
        out = lora_ratios(t, m) if SET == "lora" else {
            "forward: ours / HF PyTorch": t("ours", "forward") / t("peer", "forward"),
            "training step: ours / HF PyTorch": t("ours", "step") / t("peer", "step"),
            "per-sample gradients: ours / Opacus hooks, time": t("ours", "psg") / t("peer", "psg_hooks"),
            "per-sample gradients: ours / Opacus hooks, peak RSS": m("ours", "psg") / m("peer", "psg_hooks"),
            "DP step (ghost): ours / Opacus ghost, time": t("ours", "dp") / t("peer", "dp_ghost"),
            "DP step (ghost): ours / Opacus ghost, peak RSS": m("ours", "dp") / m("peer", "dp_ghost"),
            "DP step / our training step, time": t("ours", "dp") / t("ours", "step"),
            "DP step / our training step, peak RSS": m("ours", "dp") / m("ours", "step"),
            "Opacus ghost step / HF training step, time": t("peer", "dp_ghost") / t("peer", "step"),
        }
        return out, got

    paired(ROUNDS, one_round)


if __name__ == "__main__":
    main()
