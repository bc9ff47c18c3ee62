"""A one-layer LSTM classifier (vocabulary 1000, embedding 64, hidden 128,
4 classes) on a batch of B=64 sequences of T=64 tokens, in PyTorch, one
variant per process so that the process's peak resident memory is that
variant's:

* psg_dplstm: every parameter's per-sample gradient with Opacus 1.6's
  `DPLSTM` (its re-implementation of the LSTM as linear layers per step,
  which its hooks handle) under `GradSampleModule` hooks;
* torch_func: the same with `torch.func.vmap(grad)` over `nn.LSTM`; it
  prints what torch.func says when it cannot run it.

    "$HOME/peers/bin/python" benches/peers/bench_lstm.py VARIANT [REPS]

The batch is the one `examples/bench_lstm.rs` draws (the same recurrence).
PEER_THREADS sets torch's threads (default 2).
"""
import os
import sys
import warnings

import torch
from timing import process_result

warnings.filterwarnings("ignore")
torch.set_num_threads(int(os.environ.get("PEER_THREADS", "2")))
B, T, V, E, H, C = 64, 64, 1000, 64, 128, 4


def batch():
    ids = torch.zeros(B, T, dtype=torch.long)
    state = 12345
    for i in range(B):
        for t in range(T):
            state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
            ids[i, t] = (state >> 33) % V
    return ids, torch.arange(B) % C


class Classifier(torch.nn.Module):
    def __init__(self, lstm):
        super().__init__()
        self.emb = torch.nn.Embedding(V, E)
        self.rnn = lstm
        self.fc = torch.nn.Linear(H, C)

    def forward(self, ids):
        _, (h, _) = self.rnn(self.emb(ids))
        return self.fc(h[-1])


def main():
    variant = sys.argv[1]
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    ids, y = batch()
    loss_fn = torch.nn.CrossEntropyLoss()
    torch.manual_seed(0)
    if variant == "psg_dplstm":
        from opacus import GradSampleModule
        from opacus.layers import DPLSTM

        model = GradSampleModule(Classifier(DPLSTM(E, H, batch_first=True)))

        def run():
            model.zero_grad()
            for p in model.parameters():
                p.grad_sample = None
            loss_fn(model(ids), y).backward()  # fills every p.grad_sample
    elif variant == "torch_func":
        from torch.func import functional_call, grad, vmap

        model = Classifier(torch.nn.LSTM(E, H, batch_first=True))
        params = {k: v.detach() for k, v in model.named_parameters()}

        def loss(p, x, t):
            out = functional_call(model, p, (x.unsqueeze(0),))
            return loss_fn(out, t.unsqueeze(0))

        def run():
            vmap(grad(loss), in_dims=(None, 0, 0))(params, ids, y)

        try:
            run()
        except Exception as e:  # record what torch.func says
            msg = " ".join(str(e).split())[:300]
            print(f"RESULT peer_torch_func unsupported: {type(e).__name__}: {msg}")
            return
    else:
        sys.exit(f"unknown variant {variant}")
    process_result(variant, run, reps, torch.get_num_threads())


if __name__ == "__main__":
    main()
