"""Helpers the rank-side checks share: tiny models, data, oracles, comparisons."""
import copy
import gc
import time
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from comm_buffer import HOOK_ACTION, register_main_grad_hooks
from relgrad import DygraphShardingConfig, HybridStrategy, PpConfig
from sharding import DygraphShardingOptimizerV2

ACTIONS = (HOOK_ACTION.ALL_REDUCE, HOOK_ACTION.REDUCE, HOOK_ACTION.REDUCE_SCATTER)


def _slot(numel, elem_size):  # the 256-byte rule, written independently of comm_buffer
    return -(-numel * elem_size // 256) * 256 // elem_size


def _same_on_all(tensors, group=None):
    """True if the concatenated tensors are bitwise equal on every rank of `group`."""
    flat = torch.cat([t.detach().float().reshape(-1) for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, flat, group=group)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _released(*refs, seconds=2.0):
    """True once every weakref is dead. Polls: gloo's worker thread lets go of a finished
    collective's tensors a moment after `wait()` returns."""
    deadline = time.monotonic() + seconds
    while any(ref() is not None for ref in refs):
        if time.monotonic() > deadline:
            return False
        gc.collect()
        time.sleep(0.01)
    return True


def _new_params(shapes, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return [nn.Parameter(torch.randn(s).to(dtype)) for s in shapes]


def _backward_int_grads(params, rank, step, k):
    """One micro-batch whose grad is a small integer tensor per (rank, step, micro-batch)."""
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + k)
    coeffs = [torch.randint(-8, 9, p.shape, generator=gen).float() for p in params]
    sum((p * c).sum() for p, c in zip(params, coeffs)).backward()
    return coeffs



def _mlp(sizes, seed=0):
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def _data(step, n, d_in, d_out):
    gen = torch.Generator().manual_seed(7 + step)
    return torch.randn(n, d_in, generator=gen), torch.randn(n, d_out, generator=gen)


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.01),
}


def _strategy(dp=1, pp=1, sharding=1, acc=1, release=False, split_param=False, **pp_flags):
    return HybridStrategy(dp_degree=dp, pp_degree=pp, sharding_degree=sharding,
                          accumulate_steps=acc,
                          pp_configs=PpConfig(release_gradients=release, **pp_flags),
                          sharding_configs=DygraphShardingConfig(split_param=split_param))


def _oracle(make_model, opt_name, steps, batch, sched=False):
    """One process, the whole batch: the reference trajectory (params after each step)."""
    model = make_model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if sched else None
    traj = []
    for step in range(steps):
        x, y = _data(step, batch, *_io(model))
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if scheduler:
            scheduler.step()
        traj.append([p.detach().clone() for p in model.parameters()])
    return traj


def _io(model):
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return linears[0].in_features, linears[-1].out_features


PIPE_SIZES = [6, 8, 8, 8, 4]


def _pipe_layers(dtype=torch.float32, main_grad=False):
    layers = list(_mlp(PIPE_SIZES, seed=3).to(dtype))
    if main_grad:
        register_main_grad_hooks([p for layer in layers for p in layer.parameters()])
    return layers


def _mse(out, y):
    return F.mse_loss(out.float(), y.float())



def _for(cls, strategy):
    """`strategy` with sharding_configs.split_param as the sharding class `cls` needs (Paddle
    picks v1 or v2 from that field; the classes refuse the other value)."""
    strategy.sharding_configs.split_param = issubclass(cls, DygraphShardingOptimizerV2)
    return strategy
