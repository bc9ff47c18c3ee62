"""The peer scripts' timing: warm-ups, then repetitions, medians (as
`benches/peers/bench_torch.py` times its workloads), printed as the
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


def process_result(variant, run, reps, threads):
    """Times `run` once cold and `reps` times warm in this process and prints
    `RESULT peer_<variant> median <ms> ms first_ms <ms> peak_rss_mib <MiB>
    threads <n>`, the line the one-variant-per-process side-by-side scripts
    read (the process's peak resident memory is the variant's)."""
    import resource

    start = time.perf_counter()
    run()
    first = (time.perf_counter() - start) * 1e3
    times = []
    for _ in range(reps):
        s = time.perf_counter()
        run()
        times.append((time.perf_counter() - s) * 1e3)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"RESULT peer_{variant} median {statistics.median(times):.2f} ms first_ms {first:.1f} peak_rss_mib {peak:.1f} threads {threads}")
