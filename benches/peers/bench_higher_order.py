"""torch.func's higher-order transforms on the workloads of `bench --only
NTK,HO`: the NTK tutorial's two methods on the CNN of `examples/ntk.rs`
(conv 3->16 k3, relu, conv 16->16 k3, relu, flatten, linear 2304->10;
inputs 20 and 5 images of 3x16x16), and a Hessian-vector product by
forward over reverse (`jvp(grad(f))`, the tangent only) against one
gradient of an MLP loss (784-128-10, tanh, B=64, with respect to the
inputs). Medians of REPS (default 5) after a warm-up, 2 threads.

    $HOME/peers/bin/python benches/peers/bench_higher_order.py [REPS]
"""
import statistics, sys, time
import torch
import torch.nn as nn
from torch.func import functional_call, jacrev, jvp, vjp, vmap

torch.set_num_threads(2)
torch.manual_seed(0)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3)
        self.conv2 = nn.Conv2d(16, 16, 3)
        self.fc = nn.Linear(16 * 12 * 12, 10)

    def forward(self, x):
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        return self.fc(x.flatten(1))


net = CNN()
params = {k: v.detach() for k, v in net.named_parameters()}
x1, x2 = torch.randn(20, 3, 16, 16), torch.randn(5, 3, 16, 16)


def fnet_single(params, x):
    return functional_call(net, params, (x.unsqueeze(0),)).squeeze(0)


def ntk_jacobian_contraction(params, x1, x2):
    jac1 = vmap(jacrev(fnet_single), (None, 0))(params, x1)
    jac1 = [j.flatten(2) for j in jac1.values()]
    jac2 = vmap(jacrev(fnet_single), (None, 0))(params, x2)
    jac2 = [j.flatten(2) for j in jac2.values()]
    return torch.stack([torch.einsum("Naf,Mbf->NMab", j1, j2) for j1, j2 in zip(jac1, jac2)]).sum(0)


def ntk_vps(params, x1, x2):
    def get_ntk(x1, x2):
        def func_x1(params):
            return fnet_single(params, x1)

        def func_x2(params):
            return fnet_single(params, x2)

        output, vjp_fn = vjp(func_x1, params)

        def get_ntk_slice(vec):
            vjps = vjp_fn(vec)
            _, jvps = jvp(func_x2, (params,), vjps)
            return jvps

        basis = torch.eye(output.numel(), dtype=output.dtype).view(output.numel(), -1)
        return vmap(get_ntk_slice)(basis)

    return vmap(vmap(get_ntk, (None, 0)), (0, None))(x1, x2)


REPS = int(sys.argv[1]) if len(sys.argv) > 1 else 5


def median_ms(f, reps=REPS):
    f()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


with torch.no_grad():
    a, b = ntk_jacobian_contraction(params, x1, x2), ntk_vps(params, x1, x2)
    print(f"torch.func NTK {tuple(a.shape)}: the two methods differ by {(a - b).abs().max().item():.2e}")
    print(f"RESULT NTK jacobian contraction median {median_ms(lambda: ntk_jacobian_contraction(params, x1, x2)):.3f} ms")
    print(f"RESULT NTK ntk-vector products median {median_ms(lambda: ntk_vps(params, x1, x2)):.3f} ms")

# the MLP loss of `bench --only HO`, as a function of the inputs
w1, w2 = torch.randn(128, 784) * 0.05, torch.randn(10, 128) * 0.1
x, v = torch.randn(64, 784), torch.randn(64, 784)


def loss(x):
    h = torch.tanh(x @ w1.t())
    return torch.log_softmax(h @ w2.t(), 1).sum()


g = torch.func.grad(loss)
hvp = lambda x, v: torch.func.jvp(g, (x,), (v,))[1]
print(f"RESULT HO MLP grad median {median_ms(lambda: g(x)):.3f} ms")
print(f"RESULT HO MLP hvp median {median_ms(lambda: hvp(x, v)):.3f} ms")
