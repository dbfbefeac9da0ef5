"""Rank-side checks that a failure ends alike on every rank in bounded time (a stage alone, fewer
backward passes), that 16-bit sums do not overflow, and that a resumed scheduler keeps its state."""
import copy
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import sharding
from comm_buffer import global_rank
from pipeline import PipelineParallel
from relgrad import HybridCommunicateGroup, HybridStrategy, PpConfig, register_main_grad_hooks
from relgrad_checks.common import PIPE_SIZES, _data, _mse, _pipe_layers, _strategy
from relgrad_checks.loops import CLASSES, caught, hooked, own_strategy, params


class Scale(nn.Module):
    """`w * x` with a scalar param w = 1."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones((), dtype=dtype))

    def forward(self, x):
        return self.w * x


class SometimesUnused(nn.Module):
    """`w * x + b`, but on global rank `rank` the second forward leaves b out (no grad)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.w, self.b = nn.Parameter(torch.ones(())), nn.Parameter(torch.zeros(()))
        self.rank, self.calls = rank, 0

    def forward(self, x):
        self.calls += 1
        if dist.get_rank() == self.rank and self.calls == 2:
            return self.w * x
        return self.w * x + self.b


def mean_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def pipeline(st: HybridStrategy, layers: list, version: int | None = None, loss=mean_loss,
             lr: float = 0.1, **kwargs) -> tuple:
    """(hcg, PipelineParallel of `layers`, SGD(lr) in sharding v`version` if given)"""
    hcg = HybridCommunicateGroup(st)
    model = PipelineParallel(layers, hcg, st, loss, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    if version:
        opt = CLASSES[version](opt, hcg, st)
    return hcg, model, opt


def _ones(n):
    return torch.ones(n, 1), torch.zeros(n, 1)


# ---------------------------------------------------------------- a stage fails alone

def moved_grad_on_one_stage(rank: int, world: int) -> list:
    """pp 2 x sharding 2 v1, sharding overlap: stage 1 rebinds its grads out of place
    after step 1. -> [(params after step 2, every grad in its slot)] with and without"""
    runs = []
    for rebind in (True, False):
        torch.manual_seed(0)
        hcg, model, opt = pipeline(_strategy(pp=2, sharding=2, acc=2, sharding_comm_overlap=True),
                                   [Scale(), Scale()], 1)
        data = (torch.arange(4.0).reshape(4, 1), torch.zeros(4, 1))
        model.train_batch(data, opt)
        if rebind and hcg.get_stage_id() == 1:
            for p in model.parameters():
                p.grad = p.grad / 2  # out of place: no longer the buffer's view
        model.train_batch(data, opt)
        home = all(p.grad.untyped_storage().data_ptr() == b.grad_storage.untyped_storage()
                   .data_ptr() for b in model._chunk_2_comm_buffers[0] for p in b.params)
        runs.append((params(model), home))
    return runs


def stage_never_arrives(rank: int, world: int, seconds: float) -> tuple[str, str] | None:
    """pp 2: stage 1 never calls train_batch. -> stage 0's error (None on stage 1)"""
    st = _strategy(pp=2, acc=2)
    hcg = HybridCommunicateGroup(st, timeout=timedelta(seconds=seconds))
    model = PipelineParallel([Scale(), Scale()], hcg, st, mean_loss)
    if hcg.get_stage_id() == 1:
        return None
    return caught(model.train_batch, _ones(2), torch.optim.SGD(model.parameters(), lr=0.1))


def stage_refuses_to_start(rank: int, world: int) -> tuple[str, str] | None:
    """pp 2 x sharding 2 v2: stage 1 alone has main-grad hooks on a param. -> error"""
    st = _strategy(pp=2, sharding=2, acc=2, split_param=True, sharding_comm_overlap=True)
    hcg = HybridCommunicateGroup(st)
    model = PipelineParallel([Scale(), Scale(), Scale(), Scale()], hcg, st, mean_loss)
    if hcg.get_stage_id() == 1:
        register_main_grad_hooks([next(model.parameters())])
    opt = CLASSES[2](torch.optim.SGD(model.parameters(), lr=0.1), hcg, st)
    return caught(model.train_batch, _ones(4), opt)


# ---------------------------------------------------------------- fewer backward passes

def fewer_backward_passes(rank: int, world: int, version: int, release: bool,
                          passes: list) -> tuple:
    """Own overlap, acc 2: rank r runs `passes[r]` backward passes, then a right step.
    -> (step()'s error, params, one process's)"""
    st = own_strategy(world, version, acc=2, release=release)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 1), nn.Linear(1, 2))
    reference = copy.deepcopy(model)
    opt = CLASSES[version](torch.optim.SGD(model.parameters(), lr=0.1),
                           HybridCommunicateGroup(st), st)
    x = torch.arange(6.0).reshape(2, 3) + rank
    for _ in range(passes[rank]):
        (model(x).square().mean() / 2).backward()
    seen = caught(opt.step)
    opt.zero_grad(set_to_none=release)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for r in range(world):  # the next step is right: both passes on every rank
        for _ in range(2):
            (reference(torch.arange(6.0).reshape(2, 3) + r).square().mean() / 2 / world).backward()
    ref_opt.step()
    for _ in range(2):
        (model(x).square().mean() / 2).backward()
    opt.step()
    opt.zero_grad(set_to_none=release)
    return seen, params(model), params(reference)


def pipeline_accumulate_steps_differ(rank: int, world: int,
                                     version: int) -> tuple[str, str] | None:
    """pp 2 x sharding 2, sharding overlap: rank 3's acc is 1, the others' 2. -> error"""
    st = _strategy(pp=2, sharding=2, acc=1 if rank == 3 else 2, release=True,
                   split_param=version == 2, sharding_comm_overlap=True)
    _, model, opt = pipeline(st, [Scale(), Scale()], version)
    return caught(model.train_batch, _ones(st.accumulate_steps * 2), opt)


def pipeline_param_left_out(rank: int, world: int, version: int, release: bool) -> tuple:
    """pp 2 x sharding 2: on rank 3 a param gets no grad in micro-batch 1. -> (error,
    a broadcast from rank 0 after a good train_batch)"""
    st = _strategy(pp=2, sharding=2, acc=2, release=release, split_param=version == 2,
                   sharding_comm_overlap=True)
    _, model, opt = pipeline(st, [Scale(), SometimesUnused(3)], version)
    seen = caught(model.train_batch, _ones(4), opt)
    for layer in model._layers:
        layer.rank = -1  # every param used from now on: the next step runs
    model.train_batch(_ones(4), opt)
    probe = torch.tensor([float(rank)])
    dist.broadcast(probe, src=0)
    return seen, float(probe)


# ---------------------------------------------------------------- 16-bit sums

_PULLS = (40000.0, 30000.0)  # per rank: the fp16 sum 70000 overflows, the mean 35000 fits
FP16_PATHS = ("v2, release on", "v2 own overlap, release on", "v1 own overlap, release on",
              "v1 own overlap, release off", "v1, release on",
              "dp all-reduce (pipeline, pp 1 x dp 2)")


def _fp16_case(path, rank, world):
    """One fp16 scalar w = 1 stepped once with the grad _PULLS[rank]. -> w"""
    if path == "dp all-reduce (pipeline, pp 1 x dp 2)":
        st = HybridStrategy(dp_degree=2, pp_configs=PpConfig(release_gradients=True))
        _, model, opt = pipeline(st, [Scale(torch.float16)], None,
                                 lambda out, y: (out.float() * y).sum(), lr=1e-5)
        model.train_batch((torch.ones(1, 1, dtype=torch.float16),
                           torch.full((1, 1), _PULLS[rank])), opt)
        return model._layers[0].w.detach().clone()
    release = path != "v1 own overlap, release off"
    version = 2 if path.startswith("v2") else 1
    st = own_strategy(2, version, "own overlap" in path, release=release)
    model = Scale(torch.float16)
    opt = CLASSES[version](torch.optim.SGD(model.parameters(), lr=1e-5),
                           HybridCommunicateGroup(st), st)
    (model(torch.ones((), dtype=torch.float16)).float() * _PULLS[rank]).backward()
    opt.step()
    opt.zero_grad(set_to_none=release)
    return model.w.detach().clone()


def fp16_sums(rank: int, world: int) -> dict:
    """{path: w after one step} for each path of FP16_PATHS."""
    return {path: _fp16_case(path, rank, world) for path in FP16_PATHS}


def fp16_pipeline_dp_overlap(rank: int, world: int) -> torch.Tensor:
    """pp 2 x dp 2, dp_comm_overlap: fp16 stages pulled by _PULLS[dp rank]. -> w"""
    st = _strategy(dp=2, pp=2, release=True, dp_comm_overlap=True)
    hcg, model, opt = pipeline(st, [Scale(torch.float16), Scale(torch.float16)], None,
                               lambda out, y: (out.float() * y).sum(), lr=1e-5)
    pull = _PULLS[hcg.get_data_parallel_rank()]
    model.train_batch((torch.ones(1, 1, dtype=torch.float16), torch.full((1, 1), pull)), opt)
    return model._layers[0].w.detach().clone()


def fused_buffer_fp32_unchanged(rank: int, world: int) -> tuple:
    """An fp32 buffer and all_reduce_mean on integer grads, 3 ranks. -> (both, grads)"""
    p = nn.Parameter(torch.zeros(64))
    buffers = hooked([p], None, 1, True)
    gen = torch.Generator().manual_seed(rank)  # integers: the sum is exact in any order
    grads = torch.randint(1, 1000, (64,), generator=gen).float()
    (p * grads).sum().backward()
    buffers[0].scale_grads()
    mean = grads.clone()
    sharding.all_reduce_mean([mean], None)
    return p.grad.clone(), mean, grads


# ---------------------------------------------------------------- a resumed scheduler

def _resumable(st, version, hcg):
    """(build, train, load) of resumed_scheduler's pipeline, SGD(0.1, momentum 0.9)."""
    def build():
        model = PipelineParallel(_pipe_layers(), hcg, st, _mse)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, CLASSES[version](opt, hcg, st)

    def train(model, opt, sched, steps):
        for step in steps:
            x, y = (t.chunk(2)[hcg.get_sharding_parallel_rank()]
                    for t in _data(step, 8, PIPE_SIZES[0], PIPE_SIZES[-1]))
            model.train_batch((x, y), opt, sched)
        return params(model)

    def load(model_state, opt_state):
        model, opt = build()
        model.load_state_dict(model_state)
        opt.load_state_dict(opt_state)
        return model, opt

    return build, train, load


def resumed_scheduler_v2_pipeline(rank: int, world: int, version: int) -> tuple:
    """pp 2 x sharding 2, StepLR(1, 0.5): 2 batches, saved, loaded before any
    train_batch. -> (lrs read, params of 2 more batches resumed, the same uninterrupted)"""
    st = _strategy(pp=2, sharding=2, acc=2, release=True, split_param=version == 2,
                   sharding_comm_overlap=True)
    hcg = HybridCommunicateGroup(st)
    group = hcg.get_sharding_parallel_group()
    build, train, load = _resumable(st, version, hcg)
    model, opt = build()
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    train(model, opt, sched, range(2))
    saved = [copy.deepcopy(model.state_dict()), opt.consolidate_state_dict(to=0),
             sched.state_dict()]
    dist.broadcast_object_list(saved, src=global_rank(group, 0), group=group)  # "the file"
    want = train(model, opt, sched, range(2, 4))
    model, opt = load(saved[0], saved[1])
    seen = [opt.param_groups[0]["lr"], opt.param_groups[0].get("initial_lr")]
    torch.optim.lr_scheduler.StepLR(opt, 1, 0.5, last_epoch=1)  # needs initial_lr
    seen.append(opt.param_groups[0]["lr"])  # torch's rule: one more step of the schedule
    train(model, opt, None, range(2, 3))  # v2 cuts the loaded state here: lr stays as set
    seen.append(opt.param_groups[0]["lr"])
    again = load(saved[0], saved[1])[1].state_dict()  # saved again before any train_batch
    model, opt = load(saved[0], again)  # torch's recipe: a new scheduler, then its state
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    sched.load_state_dict(saved[2])
    return seen, train(model, opt, sched, range(2, 4)), want
