"""Helpers the rank-side checks share: tiny models and data, training loops, oracles, asserts."""
import contextlib
import copy
import gc
import time
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from comm_buffer import HOOK_ACTION, FusedCommBuffer
from relgrad import (DygraphShardingConfig, HybridCommunicateGroup, HybridStrategy, PpConfig,
                     register_main_grad_hooks)
from sharding import DygraphShardingOptimizer, DygraphShardingOptimizerV2, MixPrecisionOptimizer

ACTIONS = (HOOK_ACTION.ALL_REDUCE, HOOK_ACTION.REDUCE, HOOK_ACTION.REDUCE_SCATTER)
VERSIONS = {1: DygraphShardingOptimizer, 2: DygraphShardingOptimizerV2}
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.01),
}
PIPE_SIZES = [6, 8, 8, 8, 4]


# ---------------------------------------------------------------- models, data, strategies

def _slot(numel, elem_size):  # the 256-byte rule, written independently of comm_buffer
    return -(-numel * elem_size // 256) * 256 // elem_size


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


def _io(model):
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return linears[0].in_features, linears[-1].out_features


def _pipe_layers(dtype=torch.float32, main_grad=False):
    layers = list(_mlp(PIPE_SIZES, seed=3).to(dtype))
    if main_grad:
        register_main_grad_hooks([p for layer in layers for p in layer.parameters()])
    return layers


def _mse(out, y):
    return F.mse_loss(out.float(), y.float())


def _params(model):
    """Copies of the model's params (a point of a trajectory)."""
    return [p.detach().clone() for p in model.parameters()]


def _strategy(dp=1, pp=1, sharding=1, acc=1, release=False, split_param=False, **pp_flags):
    return HybridStrategy(dp_degree=dp, pp_degree=pp, sharding_degree=sharding,
                          accumulate_steps=acc,
                          pp_configs=PpConfig(release_gradients=release, **pp_flags),
                          sharding_configs=DygraphShardingConfig(split_param=split_param))


def _sharding_groups(sharding, dp=1, release=False):
    """(hcg, strategy) of sharding x dp."""
    strategy = _strategy(sharding=sharding, dp=dp, release=release)
    return HybridCommunicateGroup(strategy), strategy


def _releases(strategy, side="pp_configs"):
    """(release, a copy of `strategy` with `side`.release_gradients = release), off then on."""
    for release in (False, True):
        copied = copy.deepcopy(strategy)
        getattr(copied, side).release_gradients = release
        yield release, copied


def _for(cls, strategy):
    """`strategy` with the split_param that sharding class `cls` needs (Paddle's v1 / v2 pick)."""
    strategy.sharding_configs.split_param = issubclass(cls, DygraphShardingOptimizerV2)
    return strategy


def _shard(version, opt, hcg, strategy, **kwargs):
    """Torch optimizer `opt` wrapped in sharding `version` (1, 2, or a sharding class)."""
    cls = VERSIONS[version] if version in VERSIONS else version
    return cls(opt, hcg, _for(cls, strategy), **kwargs)


def _replica(hcg, strategy):
    """(replicas, this rank's replica): dp rank x sharding degree + sharding rank."""
    replica = hcg.get_data_parallel_rank() * strategy.sharding_degree \
        + hcg.get_sharding_parallel_rank()
    return strategy.dp_degree * strategy.sharding_degree, replica


# ---------------------------------------------------------------- training and oracles

def _train(model, opt, steps, batch=8, part=(1, 0), set_to_none=True, sched=None, net=None,
           after_backward=None):
    """Train `steps` on part (parts, index) of each `_data` batch through `net`: params per step."""
    net = model if net is None else net
    dtype = next(model.parameters()).dtype
    steps = range(steps) if isinstance(steps, int) else steps
    traj = []
    for step in steps:
        x, y = (t.chunk(part[0])[part[1]].to(dtype) for t in _data(step, batch, *_io(net)))
        _mse(net(x), y).backward()
        if after_backward is not None:
            after_backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        if sched is not None:
            sched.step()
        traj.append(_params(model))
    return traj


def _oracle(make_model, opt_name, steps, batch, sched=False):
    """One process, the whole batch: the reference trajectory (params after each step)."""
    model = make_model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if sched else None
    return _train(model, opt, steps, batch, sched=scheduler)


def _main_grad_oracle(make_model, opt_name, steps, batches):
    """One process, bf16 + fp32 main grads and masters, summing as <= 2 replicas do (bitwise)."""
    model = make_model()
    params = list(model.parameters())
    assert params and all(p.dtype == torch.bfloat16 for p in params)
    assert not any(hasattr(p, "main_grad") for p in params), "make_model adds no hooks"
    register_main_grad_hooks(params)
    opt = MixPrecisionOptimizer(OPTIMIZERS[opt_name](params))
    losses, traj = [], []
    for step in range(steps):
        per_replica = batches(step)
        assert 1 <= len(per_replica) <= 2, len(per_replica)
        sums, step_losses = None, []
        for micro_batches in per_replica:
            assert micro_batches
            total = torch.zeros(())
            for x, y in micro_batches:
                loss = _mse(model(x), y) / len(micro_batches)
                total += loss.detach()
                loss.backward()
            grads = [p.main_grad for p in params]
            sums = grads if sums is None else [a + b for a, b in zip(sums, grads)]
            for p in params:
                p.main_grad = None
            step_losses.append(total)
        for p, s in zip(params, sums):
            p.main_grad = s * (1.0 / len(per_replica))
        opt.step()
        for p in params:
            p.main_grad = None
        losses.append(step_losses)
        traj.append([p.detach().clone() for p in params])
    return losses, traj, opt


def _replica_batch(hcg, strategy, step, mbs, dtype=torch.float32):
    """This replica's chunk of a pipeline test's step batch (`replicas * acc * mbs` rows)."""
    replicas, replica = _replica(hcg, strategy)
    rows = replicas * strategy.accumulate_steps * mbs
    return tuple(t.chunk(replicas)[replica].to(dtype)
                 for t in _data(step, rows, PIPE_SIZES[0], PIPE_SIZES[-1]))


def _pipe_batches(replicas, acc, mbs, dtype=torch.bfloat16):
    """`batches(step)` for `_main_grad_oracle`: the pipeline tests' data, split as they do."""
    def batches(step):
        x, y = (t.to(dtype) for t in _data(step, replicas * acc * mbs, PIPE_SIZES[0],
                                           PIPE_SIZES[-1]))
        return [list(zip(xr.chunk(acc), yr.chunk(acc)))
                for xr, yr in zip(x.chunk(replicas), y.chunk(replicas))]
    return batches


# ---------------------------------------------------------------- comparisons

def _same_on_all(tensors, group=None):
    """True if the concatenated tensors are bitwise equal on every rank of `group`."""
    flat = torch.cat([t.detach().float().reshape(-1) for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, flat, group=group)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _released(*refs, seconds=2.0):
    """True once every weakref is dead (polled: gloo lets go a moment after `wait()`)."""
    deadline = time.monotonic() + seconds
    while any(ref() is not None for ref in refs):
        if time.monotonic() > deadline:
            return False
        gc.collect()
        time.sleep(0.01)
    return True


def _assert_moved(traj, start):
    """Every param changed over the run: the optimizer stepped (sizes asserted first)."""
    assert len(traj) > 0 and len(traj[-1]) == len(start) > 0, (len(traj), len(start))
    unmoved = [i for i, (a, b) in enumerate(zip(traj[-1], start)) if torch.equal(a, b)]
    assert not unmoved, f"params {unmoved} never moved"


def _assert_same_state(opt, oracle_opt, index=None):
    """`opt`'s consolidated masters and state bitwise `oracle_opt`'s (at `index`); collective."""
    full = opt.consolidate_state_dict(to=0)
    if full is None:
        return
    want = oracle_opt.state_dict()
    index = list(range(len(want["masters"]))) if index is None else list(index)
    assert len(index) > 0 and sorted(full["master_weights"]) == list(range(len(index)))
    assert sorted(full["state"]) == list(range(len(index)))
    for i, j in enumerate(index):
        assert torch.equal(full["master_weights"][i], want["masters"][j]), ("master", j)
        entries = want["inner"]["state"][j]
        assert len(entries) > 0 and entries.keys() == full["state"][i].keys(), j
        for name, value in entries.items():
            assert torch.equal(full["state"][i][name].float(), value.float()), (name, j)


def _assert_bitwise(got, want, what=""):
    """Bitwise equal item by item (tensors, values, lists of them), lengths equal and non-zero."""
    got, want = list(got), list(want)
    assert len(got) == len(want) > 0, (what, len(got), len(want))
    for i, (g, w) in enumerate(zip(got, want)):
        if isinstance(g, torch.Tensor):
            assert isinstance(w, torch.Tensor) and torch.equal(g, w), (what, i)
        elif isinstance(g, (list, tuple)):
            _assert_bitwise(g, w, (what, i))
        else:
            assert g == w, (what, i, g, w)


def _assert_close_each(got, want, rtol=1e-5, atol=1e-6):
    """`assert_close` pair by pair (lists of lists too), lengths equal and non-zero first."""
    got, want = list(got), list(want)
    assert len(got) == len(want) > 0, (len(got), len(want))
    for g, w in zip(got, want):
        if isinstance(g, (list, tuple)):
            _assert_close_each(g, w, rtol, atol)
        else:
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol)


@contextlib.contextmanager
def _spy_buffers(sizes=()):
    """Record in the block bucket-size torch.zeros (args) and copies (buffer, first?, allocated)."""
    record = {"zeros": [], "copies": []}
    zeros, copy_in = torch.zeros, FusedCommBuffer._copy_grad_to_buffer

    def counting_zeros(*args, **kwargs):
        if args and args[0] in sizes:
            record["zeros"].append(args)
        return zeros(*args, **kwargs)

    def spy(buf, param):
        first, absent = buf._params_step_dict.get(param) == 0, buf.grad_storage is None
        copy_in(buf, param)
        made = weakref.ref(buf.grad_storage) if absent else None
        record["copies"].append((buf, first, made))

    torch.zeros, FusedCommBuffer._copy_grad_to_buffer = counting_zeros, spy
    try:
        yield record
    finally:
        torch.zeros, FusedCommBuffer._copy_grad_to_buffer = zeros, copy_in
