"""The peer scripts' timing: warm-ups, then repetitions, medians (as
`../shared/peers/bench_torch.py` times its workloads), printed as the
`RESULT <name> median <ms> ms` lines `paired.py` reads."""
import statistics, time


def bench(name, f, reps, warm=3, extra=lambda: ""):
    """Times `f`; `extra()` is appended to the line, read after the runs."""
    for _ in range(warm):
        f()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append((time.perf_counter() - t) * 1e3)
    print(f"RESULT {name:<45} median {statistics.median(ts):10.3f} ms  min {min(ts):10.3f}  max {max(ts):10.3f}  (n={reps}){extra()}", flush=True)
