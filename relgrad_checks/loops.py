"""Rank-side checks of the torch loop around the sharding optimizers (loop orders,
`clip_grad_norm_`, setups that differ) and the scaffolding the other loop checks share: an MLP,
its micro-batches, a sharded optimizer, training steps, one process on the whole batch."""
from collections.abc import Callable, Iterable, Iterator
from itertools import product

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from comm_buffer import HOOK_ACTION, FusedCommBuffer, assign_group_by_size, bw_hook_func
from relgrad import DygraphShardingConfig, HybridCommunicateGroup, HybridStrategy
from relgrad_checks.common import _data, _mlp
from relgrad_extras.grad_clip import ClipGradByGlobalNorm
from sharding import DygraphShardingOptimizer, DygraphShardingOptimizerV2

SIZES, BATCH, STEPS, LR = [6, 16, 16, 4], 16, 3, 1e-2
CLASSES = {1: DygraphShardingOptimizer, 2: DygraphShardingOptimizerV2}


# ---------------------------------------------------------------- the scaffolding

def caught(fn: Callable, *args, **kwargs) -> tuple[str, str] | None:
    """(type name, text) of what `fn(*args, **kwargs)` raised, or None if it returned."""
    try:
        fn(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 (the test compares what every rank saw)
        return type(error).__name__, str(error)
    return None


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def clear(opt, release: bool = True) -> None:
    """The documented clear: drop the grads (release on) or zero them (release off)."""
    opt.zero_grad(set_to_none=release)


def cases(*axes: tuple[str, tuple]) -> Iterator[tuple[str, tuple]]:
    """("a=1 b=x", (1, "x")) for each combination of `axes`, each a (name, values) pair."""
    for values in product(*(v for _, v in axes)):
        yield " ".join(f"{n}={v}" for (n, _), v in zip(axes, values)), values


def own_strategy(world: int, version: int, overlap: bool = True, acc: int = 1,
                 release: bool = True, **config) -> HybridStrategy:
    """Sharding v`version` over all `world` ranks, no pipeline, its own overlap on or off."""
    return HybridStrategy(sharding_degree=world, sharding_configs=DygraphShardingConfig(
        split_param=version == 2, comm_overlap=overlap, accumulate_steps=acc,
        release_gradients=release, **config))


def sharded(world: int, version: int, overlap: bool, acc: int,
            release: bool = True) -> tuple[nn.Module, object]:
    """(the MLP, sharding v`version` over AdamW(LR)) on every rank."""
    strategy = own_strategy(world, version, overlap, acc, release)
    model = _mlp(SIZES)
    opt = CLASSES[version](torch.optim.AdamW(model.parameters(), lr=LR),
                           HybridCommunicateGroup(strategy), strategy)
    return model, opt


def hooked(weights: Iterable, group, acc: int, release: bool) -> list[FusedCommBuffer]:
    """The bare FusedCommBuffers (all-reduce) of `weights`, each grad checked in by its hook."""
    buffers = []
    for i, bucket in assign_group_by_size(list(weights)).items():
        buffers.append(FusedCommBuffer(i, bucket, group, acc, HOOK_ACTION.ALL_REDUCE,
                                       release_grads=release))
        for p in bucket:
            p.register_post_accumulate_grad_hook(bw_hook_func(buffers[-1], p))
    return buffers


def micro_batches(rank: int, world: int, step: int, acc: int) -> list[tuple]:
    """This rank's `acc` micro-batches (x, y) of the step's batch of BATCH rows."""
    x, y = _data(step, BATCH, SIZES[0], SIZES[-1])
    return list(zip(x.chunk(world)[rank].chunk(acc), y.chunk(world)[rank].chunk(acc)))


def backward(model: nn.Module, rank: int, world: int, step: int, acc: int = 1,
             scale: Callable | None = None) -> None:
    """The backward passes of this rank's micro-batches (each loss / acc, then `scale`)."""
    for x, y in micro_batches(rank, world, step, acc):
        loss = F.mse_loss(model(x), y) / acc
        if scale is not None:
            loss = scale(loss)
        loss.backward()


def train(model: nn.Module, opt, rank: int, world: int, steps: Iterable, release: bool = True,
          acc: int = 1, clip: float | None = None) -> None:
    """Each of `steps`: backward, opt.clip_grad_norm_(clip) if given, step(), the clear."""
    for step in steps:
        backward(model, rank, world, step, acc)
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        clear(opt, release)


def oracle(steps: Iterable = range(STEPS), clip: float | None = None,
           grads: list | None = None) -> tuple[list, list]:
    """One process, the whole batch, AdamW(LR), torch's clip_grad_norm_(clip) if given, each
    step's grads appended to `grads`. -> (params after the last step, clip's norms)"""
    model = _mlp(SIZES)
    opt, norms = torch.optim.AdamW(model.parameters(), lr=LR), []
    for step in steps:
        x, y = _data(step, BATCH, SIZES[0], SIZES[-1])
        F.mse_loss(model(x), y).backward()
        if grads is not None:
            grads.append([p.grad.clone() for p in model.parameters()])
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
        opt.zero_grad()
    return params(model), norms


# ---------------------------------------------------------------- the loop around sharding

def loop_orders(rank: int, world: int) -> tuple[dict, list]:
    """Both loop orders, v1 / v2, own overlap off / on, acc 1 / 4. -> ({case: (per step:
    buffers holding storage and a grad at the forward, every grad after step(); params,
    buffers)}, one process)"""
    out = {}
    for case in product((1, 2), (False, True), (1, 4), ("step_then_zero", "zero_at_top")):
        version, overlap, acc, order = case
        model, opt = sharded(world, version, overlap, acc)
        held, at_forward, after_step = [], [], []
        for step in range(STEPS):
            if order == "zero_at_top":
                opt.zero_grad()
            held.append([b.grad_storage is not None for b in opt.comm_buffers])
            at_forward.append(any(p.grad is not None for p in model.parameters()))
            backward(model, rank, world, step, acc)
            opt.step()
            after_step.append(all(p.grad is not None for p in model.parameters()))
            if order == "step_then_zero":
                opt.zero_grad()
        out[case] = (held, at_forward, after_step, params(model), len(opt.comm_buffers))
    return out, oracle()[0]


def clip_grad_norm(rank: int, world: int) -> tuple[dict, dict]:
    """opt.clip_grad_norm_(c) before step(), c 0.05 / 100, v1 / v2, overlap, acc 1 / 4.
    -> ({case: (params, norms)}, {c: one process's (params, norms)})"""
    out = {}
    for case in product((0.05, 100.0), (1, 2), (False, True), (1, 4)):
        clip, version, overlap, acc = case
        model, opt = sharded(world, version, overlap, acc)
        norms = []
        for step in range(STEPS):
            backward(model, rank, world, step, acc)
            norms.append(opt.clip_grad_norm_(clip))
            opt.step()
            opt.zero_grad()
        out[case] = (params(model), norms)
    return out, {clip: oracle(clip=clip) for clip in (0.05, 100.0)}


def clip_grad_norm_misuse(rank: int, world: int) -> bool:
    """clip_grad_norm_ misused four ways raises on every rank; the optimizer steps after."""
    model, opt = sharded(world, 2, True, 1)
    backward(model, rank, world, 0)
    for bad in (0.0, float("inf")):
        with pytest.raises(ValueError, match="finite number > 0"):
            opt.clip_grad_norm_(bad)
    with pytest.raises(ValueError, match="norm_type=2"):
        opt.clip_grad_norm_(1.0, norm_type=1)
    opt.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match="ran twice"):
        opt.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
    strategy = HybridStrategy(sharding_degree=world)
    clipped = DygraphShardingOptimizer(torch.optim.SGD(_mlp(SIZES).parameters(), lr=0.1),
                                       HybridCommunicateGroup(strategy), strategy,
                                       grad_clip=ClipGradByGlobalNorm(1.0))
    with pytest.raises(ValueError, match="clip twice"):
        clipped.clip_grad_norm_(1.0)
    dist.barrier()
    return True


def setup_mismatch(rank: int, world: int) -> tuple[list, list]:
    """Ranks building the optimizer otherwise; models seeded apart; add_param_group under
    own overlap. -> ([(what differs, the error's text)], the params at the start)"""
    first, adamw = rank == 0, torch.optim.AdamW
    table = {  # what differs: (lr, torch optimizer, class, split_param's version, overlap, sizes)
        "lr": (1e-2 if first else 2e-2, adamw, 2, 2, True, SIZES),
        "optimizer": (1e-2, adamw if first else torch.optim.Adam, 2, 2, True, SIZES),
        "split_param": (1e-2, adamw, 2 if first else 1, 2, True, SIZES),
        "overlap": (1e-2, adamw, 1, 1, first, SIZES),
        "width": (1e-2, adamw, 2, 2, True, SIZES if first else [6, 8, 4]),
    }
    messages = []
    for name, (lr, optimizer, version, split, overlap, sizes) in table.items():
        strategy = own_strategy(world, split, overlap)
        with pytest.raises(ValueError, match="must build the optimizer alike") as info:
            CLASSES[version](optimizer(_mlp(sizes).parameters(), lr=lr),
                             HybridCommunicateGroup(strategy), strategy)
        messages.append((name, str(info.value)))
    strategy = own_strategy(world, 1)
    model = _mlp(SIZES, seed=rank)  # seeded apart: every rank starts from rank 0's params
    opt = DygraphShardingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   HybridCommunicateGroup(strategy), strategy)
    start = params(model)
    with pytest.raises(ValueError, match="add_param_group is not supported with sharding_"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))]})
    dist.barrier()
    return messages, start


def torch_clip_in_flight(rank: int, world: int) -> tuple[dict, list]:
    """torch's clip before step() under own overlap, then training on.
    -> ({version: (the error's text, params)}, one process)"""
    out = {}
    for version in (1, 2):
        model, opt = sharded(world, version, True, 1)
        backward(model, rank, world, 0)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        with pytest.raises(ValueError, match="changed in place while its bucket") as info:
            opt.step()
        opt.zero_grad()
        train(model, opt, rank, world, range(STEPS))
        out[version] = (str(info.value), params(model))
    return out, oracle()[0]


def unused_on_one_rank(rank: int, world: int) -> dict:
    """Own overlap, 3 buckets: rank 1 skips the branch whose bucket fires first on rank 0.
    -> {version: (the error's text up to its rank's part, params after a good step)}"""
    out = {}
    for version in (1, 2):
        strategy = own_strategy(world, version, comm_buffer_size_MB=1)
        torch.manual_seed(0)
        # one bucket each (>= 1 MB), of different sizes: a bucket issued out of turn would
        # meet another size on the other rank (gloo: a crash or a hang)
        a = torch.nn.Linear(500, 600, bias=False)
        b, head = torch.nn.Linear(600, 600, bias=False), torch.nn.Linear(600, 600, bias=False)
        model = torch.nn.ModuleList([a, b, head])
        opt = CLASSES[version](torch.optim.SGD(model.parameters(), lr=0.1),
                               HybridCommunicateGroup(strategy), strategy)
        assert len(opt.comm_buffers) == 3
        x = torch.randn(4, 500)
        h = a(x)
        h = h + b(h) if rank == 0 else h  # rank 1 leaves b out: its bucket never completes
        head(h).square().mean().backward()
        with pytest.raises(ValueError, match="did not get accumulate_steps") as info:
            opt.step()
        opt.zero_grad()
        h = a(x)
        head(h + b(h)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        out[version] = (str(info.value).split(" On this rank:")[0], params(model))
    return out
