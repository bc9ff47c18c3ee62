"""Writes tests/fixtures/dp/pld_cases.json: epsilons from Google's
dp_accounting (PLD with value discretisation 1e-4, and RDP) for the
sampling schemes the trainer offers. Run offline, once:

    ~/peers/bin/pip install dp-accounting==0.6.0
    ~/peers/bin/python scripts/make_pld_cases.py > tests/fixtures/dp/pld_cases.json

Conventions (the crate's, stated so the test can map them):
* "poisson": each step is PoissonSampledDpEvent(q, GaussianDpEvent(sigma)),
  add-or-remove-one; PLD and RDP.
* "without_replacement": B of N each step (q = B / N), replace-one. The
  clipped sum moves by up to 2C when one example is replaced, so the step is
  the PLD of the Gaussian with std sigma under REPLACE adjacency (components
  at +1 and -1), and for RDP SampledWithoutReplacementDpEvent(N, B,
  GaussianDpEvent(sigma / 2)) (dp_accounting's RDP takes the ratio of the
  noise to the l2 sensitivity, here 2C).
* "truncated_poisson": TruncatedSubsampledGaussianDpEvent(N, q, max_batch,
  sigma), add-or-remove-one, PLD only.
A history is a list of segments [sigma, q, steps] (truncated: [sigma, q,
steps, N, max_batch]; without replacement: [sigma, q, steps, N]).
"""
import json
import math
import sys
import time

import dp_accounting
from dp_accounting import dp_event as ev
from dp_accounting.pld import pld_privacy_accountant as pa
from dp_accounting.rdp import rdp_privacy_accountant as ra

REL = dp_accounting.NeighboringRelation
DELTAS = [1e-5, 1e-6, 1e-7]
N = 60000


def event(scheme, seg):
    sigma, q, steps = seg[0], seg[1], seg[2]
    if scheme == "poisson":
        return ev.SelfComposedDpEvent(ev.PoissonSampledDpEvent(q, ev.GaussianDpEvent(sigma)), steps)
    if scheme == "truncated_poisson":
        n, b = seg[3], seg[4]
        return ev.SelfComposedDpEvent(ev.TruncatedSubsampledGaussianDpEvent(n, q, b, sigma), steps)
    raise ValueError(scheme)


def pld_eps(scheme, history):
    t = time.time()
    if scheme == "without_replacement":
        from dp_accounting.pld import privacy_loss_distribution as pld
        total = None
        for sigma, q, steps, _n in history:
            one = pld.from_gaussian_mechanism(
                standard_deviation=sigma, sampling_prob=q,
                value_discretization_interval=1e-4,
                neighboring_relation=REL.REPLACE_ONE).self_compose(steps)
            total = one if total is None else total.compose(one)
        eps = [total.get_epsilon_for_delta(d) for d in DELTAS]
    else:
        acc = pa.PLDAccountant(REL.ADD_OR_REMOVE_ONE, value_discretization_interval=1e-4)
        for seg in history:
            acc.compose(event(scheme, seg))
        eps = [acc.get_epsilon(d) for d in DELTAS]
    return eps, time.time() - t


def rdp_eps(scheme, history):
    if scheme == "truncated_poisson":
        return None
    if scheme == "poisson":
        acc = ra.RdpAccountant(neighboring_relation=REL.ADD_OR_REMOVE_ONE)
        for sigma, q, steps in history:
            acc.compose(event(scheme, [sigma, q, steps]))
    else:
        acc = ra.RdpAccountant(neighboring_relation=REL.REPLACE_ONE)
        for sigma, q, steps, n in history:
            b = round(q * n)
            acc.compose(ev.SelfComposedDpEvent(
                ev.SampledWithoutReplacementDpEvent(n, b, ev.GaussianDpEvent(sigma / 2)), steps))
    return [acc.get_epsilon(d) for d in DELTAS]


def histories():
    for q in [0.001, 0.004, 0.01, 0.05]:
        for sigma in [0.7, 1.0, 2.0]:
            for steps in [10, 1000, 20000]:
                yield "poisson", [[sigma, q, steps]]
                b = round(q * N)
                yield "without_replacement", [[sigma, b / N, steps, N]]
    # sigma or q changing mid-run (a schedule, adaptive clipping)
    yield "poisson", [[1.0, 0.01, 500], [0.8, 0.01, 500]]
    yield "poisson", [[1.2, 0.004, 1000], [1.2, 0.02, 200], [2.0, 0.004, 3000]]
    yield "poisson", [[s, 0.01, 200] for s in [1.5, 1.3, 1.1, 0.9, 0.7]]
    yield "without_replacement", [[1.0, 600 / N, 500, N], [0.8, 600 / N, 500, N]]
    yield "without_replacement", [[1.2, 240 / N, 1000, N], [1.2, 1200 / N, 200, N]]
    for sigma, q, b in [(1.0, 0.004, 250), (1.0, 0.004, 260), (0.8, 0.01, 620), (2.0, 0.001, 70)]:
        for steps in [100, 2000]:
            yield "truncated_poisson", [[sigma, q, steps, N, b]]


def main():
    cases = []
    for scheme, history in histories():
        rdp = rdp_eps(scheme, history)
        # very large epsilons need enormous grids and say nothing useful
        if rdp is not None and rdp[0] > 60:
            continue
        eps, secs = pld_eps(scheme, history)
        cases.append({"sampling": scheme, "history": history, "deltas": DELTAS,
                      "pld_epsilon": eps, "rdp_epsilon": rdp, "seconds": round(secs, 3)})
        print(scheme, history, eps, rdp, f"{secs:.2f}s", file=sys.stderr)
    json.dump({"generator": "scripts/make_pld_cases.py",
               "dp_accounting": "0.6.0", "value_discretization_interval": 1e-4,
               "cases": cases}, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
