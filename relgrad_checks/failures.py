"""Rank-side checks of issue-18's kinds: every rank ends with the same clear error, in bounded
time (a stage that fails alone, a rank that ran fewer backward passes); 16-bit sums that do
not overflow; a scheduler resumed on the v2 pipeline path."""
import copy
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from pipeline import PipelineParallel
from relgrad import DygraphShardingConfig, HybridCommunicateGroup, HybridStrategy, PpConfig
from sharding import DygraphShardingOptimizer, DygraphShardingOptimizerV2


class Scale(nn.Module):
    """`w * x` with a scalar param w = 1."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.w = nn.Parameter(torch.ones((), dtype=dtype))

    def forward(self, x):
        return self.w * x


def _caught(fn, *args):
    """`(type name, message)` of what `fn(*args)` raised, or None if it returned."""
    try:
        fn(*args)
    except Exception as error:  # noqa: BLE001 (the test compares what every rank saw)
        return type(error).__name__, str(error)
    return None


def _pp_strategy(pp, sharding, acc, release=False, split_param=False, **pp_flags):
    return HybridStrategy(pp_degree=pp, sharding_degree=sharding, accumulate_steps=acc,
                          pp_configs=PpConfig(release_gradients=release, **pp_flags),
                          sharding_configs=DygraphShardingConfig(split_param=split_param))


def _mean_loss(out, y):
    return ((out - y) ** 2).mean()


# ---------------------------------------------------------------- kind 1: a stage fails alone

def moved_grad_on_one_stage(rank, world):
    """pp 2 x sharding 2, v1, pipeline sharding overlap, release off; stage 1 rebinds its grads
    out of place after step 1 (the zeroed slot's values, halved). Returns the params after
    step 2, whether the grads sit in their slots again, and the params of the same run
    without the rebind."""
    runs = []
    for rebind in (True, False):
        st = _pp_strategy(2, 2, 2, sharding_comm_overlap=True)
        hcg = HybridCommunicateGroup(st)
        torch.manual_seed(0)
        model = PipelineParallel([Scale(), Scale()], hcg, st, _mean_loss)
        opt = DygraphShardingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), hcg, st)
        data = (torch.arange(4.0).reshape(4, 1), torch.zeros(4, 1))
        model.train_batch(data, opt)
        if rebind and hcg.get_stage_id() == 1:
            for p in model.parameters():
                p.grad = p.grad / 2  # out of place: no longer the buffer's view
        model.train_batch(data, opt)
        buffers = model._chunk_2_comm_buffers[0]
        home = all(p.grad.untyped_storage().data_ptr() ==
                   b.grad_storage.untyped_storage().data_ptr() for b in buffers for p in b.params)
        runs.append(([p.detach().clone() for p in model.parameters()], home))
    return runs


def stage_never_arrives(rank, world, seconds):
    """pp 2: stage 1 builds the pipeline but never calls train_batch. Returns what stage 0
    raised (None on stage 1)."""
    st = _pp_strategy(2, 1, 2)
    hcg = HybridCommunicateGroup(st, timeout=timedelta(seconds=seconds))
    model = PipelineParallel([Scale(), Scale()], hcg, st, _mean_loss)
    if hcg.get_stage_id() == 1:
        return None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return _caught(model.train_batch, (torch.ones(2, 1), torch.zeros(2, 1)), opt)


# ---------------------------------------------------------------- kind 2: fewer backward passes

def _own_overlap_strategy(world, acc, release, split_param):
    return HybridStrategy(
        sharding_degree=world, pp_configs=PpConfig(release_gradients=release),
        sharding_configs=DygraphShardingConfig(split_param=split_param, accumulate_steps=acc,
                                               comm_overlap=True))


def fewer_backward_passes(rank, world, version, release, passes):
    """The issue's example: sharding over all ranks, own comm overlap, accumulate_steps 2,
    Linear(3, 1) and Linear(1, 2) (two buckets for v1's owners), SGD; rank r runs
    `passes[r]` backward passes, then step(). Returns (what step raised, the params after a
    correct step that follows, and a one-process reference of that step)."""
    st = _own_overlap_strategy(world, 2, release, version == 2)
    hcg = HybridCommunicateGroup(st)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 1), nn.Linear(1, 2))
    reference = nn.Sequential(nn.Linear(3, 1), nn.Linear(1, 2))
    reference.load_state_dict(model.state_dict())
    cls = DygraphShardingOptimizer if version == 1 else DygraphShardingOptimizerV2
    opt = cls(torch.optim.SGD(model.parameters(), lr=0.1), hcg, st)
    x = torch.arange(6.0).reshape(2, 3) + rank
    for _ in range(passes[rank]):
        (model(x).square().mean() / 2).backward()
    seen = _caught(opt.step)
    opt.zero_grad(set_to_none=release)
    # the next step is right: both passes on every rank, compared with one process
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for r in range(world):
        xr = torch.arange(6.0).reshape(2, 3) + r
        for _ in range(2):
            (reference(xr).square().mean() / 2 / world).backward()
    ref_opt.step()
    for _ in range(2):
        (model(x).square().mean() / 2).backward()
    opt.step()
    opt.zero_grad(set_to_none=release)
    return seen, [p.detach().clone() for p in model.parameters()], \
        [p.detach().clone() for p in reference.parameters()]


def pipeline_accumulate_steps_differ(rank, world, version):
    """pp 2 x sharding 2 with the pipeline's sharding overlap, release on; global rank 3
    builds its strategy with accumulate_steps 1, the others 2. Returns what train_batch
    raised."""
    st = _pp_strategy(2, 2, 1 if rank == 3 else 2, release=True, split_param=version == 2,
                      sharding_comm_overlap=True)
    hcg = HybridCommunicateGroup(st)
    model = PipelineParallel([Scale(), Scale()], hcg, st, _mean_loss)
    cls = DygraphShardingOptimizer if version == 1 else DygraphShardingOptimizerV2
    opt = cls(torch.optim.SGD(model.parameters(), lr=0.1), hcg, st)
    batch = st.accumulate_steps * 2
    return _caught(model.train_batch, (torch.ones(batch, 1), torch.zeros(batch, 1)), opt)


# ---------------------------------------------------------------- kind 3: 16-bit sums

_PULLS = (40000.0, 30000.0)  # per rank: the fp16 sum 70000 overflows, the mean 35000 fits


def _fp16_case(path, rank, world):
    """One fp16 scalar w = 1 trained one step on rank r with the grad _PULLS[r]; returns w."""
    release = path != "v1 own overlap, release off"
    if path == "dp all-reduce (pipeline, pp 1 x dp 2)":
        st = HybridStrategy(dp_degree=2, pp_configs=PpConfig(release_gradients=True))
        hcg = HybridCommunicateGroup(st)
        model = PipelineParallel([Scale(torch.float16)], hcg, st,
                                 lambda out, y: (out.float() * y).sum())
        opt = torch.optim.SGD(model.parameters(), lr=1e-5)
        model.train_batch((torch.ones(1, 1, dtype=torch.float16),
                           torch.full((1, 1), _PULLS[rank])), opt)
        return model._layers[0].w.detach().clone()
    overlap = "own overlap" in path
    st = HybridStrategy(sharding_degree=2, pp_configs=PpConfig(release_gradients=release),
                        sharding_configs=DygraphShardingConfig(
                            split_param=path.startswith("v2"), comm_overlap=overlap))
    hcg = HybridCommunicateGroup(st)
    model = Scale(torch.float16)
    cls = DygraphShardingOptimizerV2 if path.startswith("v2") else DygraphShardingOptimizer
    opt = cls(torch.optim.SGD(model.parameters(), lr=1e-5), hcg, st)
    (model(torch.ones((), dtype=torch.float16)).float() * _PULLS[rank]).backward()
    opt.step()
    opt.zero_grad(set_to_none=release)
    return model.w.detach().clone()


FP16_PATHS = ("v2, release on", "v2 own overlap, release on", "v1 own overlap, release on",
              "v1 own overlap, release off", "v1, release on",
              "dp all-reduce (pipeline, pp 1 x dp 2)")


def fp16_sums(rank, world):
    """{path: w after one step} for each path of FP16_PATHS."""
    return {path: _fp16_case(path, rank, world) for path in FP16_PATHS}


def fused_buffer_fp32_unchanged(rank, world):
    """An fp32 ALL_REDUCE buffer and all_reduce_mean still scale after the sum: integer
    grads whose mean rounds differently when divided by 3 ranks first. Returns the reduced
    values and this rank's grads."""
    import sharding
    from comm_buffer import HOOK_ACTION, FusedCommBuffer, bw_hook_func
    p = nn.Parameter(torch.zeros(64))
    buf = FusedCommBuffer(0, [p], None, 1, HOOK_ACTION.ALL_REDUCE, release_grads=True)
    p.register_post_accumulate_grad_hook(bw_hook_func(buf, p))
    gen = torch.Generator().manual_seed(rank)  # integers: the sum is exact in any order
    grads = torch.randint(1, 1000, (64,), generator=gen).float()
    (p * grads).sum().backward()
    buf.scale_grads()
    fused = p.grad.clone()
    g = grads.clone()
    sharding.all_reduce_mean([g], None)
    return fused, g, grads


def fp16_pipeline_dp_overlap(rank, world):
    """pp 2 x dp 2, the pipeline's dp_comm_overlap, release on: two fp16 stages `w * x`
    pulled by _PULLS[dp rank]. Returns this stage's w after one step."""
    st = HybridStrategy(dp_degree=2, pp_degree=2,
                        pp_configs=PpConfig(release_gradients=True, dp_comm_overlap=True))
    hcg = HybridCommunicateGroup(st)
    model = PipelineParallel([Scale(torch.float16), Scale(torch.float16)], hcg, st,
                             lambda out, y: (out.float() * y).sum())
    opt = torch.optim.SGD(model.parameters(), lr=1e-5)
    pull = _PULLS[hcg.get_data_parallel_rank()]
    model.train_batch((torch.ones(1, 1, dtype=torch.float16), torch.full((1, 1), pull)), opt)
    return model._layers[0].w.detach().clone()


# ---------------------------------------------------------------- kind 4: resumed scheduler

def resumed_scheduler_v2_pipeline(rank, world, version):
    """The issue's example: pp 2 x sharding 2, pipeline sharding overlap, release on, acc 2,
    SGD(lr 0.1, momentum 0.9) with StepLR(1, 0.5); 2 batches, consolidate per stage; a fresh
    pipeline and optimizer load the model and the dict before any train_batch. Returns (lr
    and initial_lr right after the load, params after 2 more batches resumed, the same
    uninterrupted)."""
    from comm_buffer import global_rank
    from relgrad_checks.common import PIPE_SIZES, _data, _mse, _pipe_layers
    st = _pp_strategy(2, 2, 2, release=True, split_param=version == 2,
                      sharding_comm_overlap=True)
    hcg = HybridCommunicateGroup(st)
    group = hcg.get_sharding_parallel_group()
    cls = DygraphShardingOptimizer if version == 1 else DygraphShardingOptimizerV2

    def build():
        model = PipelineParallel(_pipe_layers(), hcg, st, _mse)
        opt = cls(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), hcg, st)
        return model, opt

    def train(model, opt, sched, steps):
        for step in steps:
            x, y = (t.chunk(2)[hcg.get_sharding_parallel_rank()]
                    for t in _data(step, 8, PIPE_SIZES[0], PIPE_SIZES[-1]))
            model.train_batch((x, y), opt, sched)
        return [p.detach().clone() for p in model.parameters()]

    model, opt = build()
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    train(model, opt, sched, range(2))
    saved = [copy.deepcopy(model.state_dict()), opt.consolidate_state_dict(to=0),
             sched.state_dict()]
    dist.broadcast_object_list(saved, src=global_rank(group, 0), group=group)  # "the file"
    want = train(model, opt, sched, range(2, 4))
    model, opt = build()
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    seen = [opt.param_groups[0]["lr"], opt.param_groups[0].get("initial_lr")]
    torch.optim.lr_scheduler.StepLR(opt, 1, 0.5, last_epoch=1)  # needs initial_lr
    seen.append(opt.param_groups[0]["lr"])  # torch's rule: one more step of the schedule
    train(model, opt, None, range(2, 3))  # v2 cuts the loaded state here: lr stays as set
    seen.append(opt.param_groups[0]["lr"])
    model, opt = build()
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    again = opt.state_dict()  # saved again before the first train_batch: nothing is lost
    model, opt = build()  # torch's recipe: a new scheduler, then its state_dict
    model.load_state_dict(saved[0])
    opt.load_state_dict(again)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    sched.load_state_dict(saved[2])
    return seen, train(model, opt, sched, range(2, 4)), want


def stage_refuses_to_start(rank, world):
    """pp 2 x sharding 2, v2, pipeline sharding overlap: stage 1 alone registers main-grad
    hooks on one of its two params, so building its buffer fails there. Returns what
    train_batch raised."""
    from relgrad import register_main_grad_hooks
    st = _pp_strategy(2, 2, 2, split_param=True, sharding_comm_overlap=True)
    hcg = HybridCommunicateGroup(st)
    model = PipelineParallel([Scale(), Scale(), Scale(), Scale()], hcg, st, _mean_loss)
    if hcg.get_stage_id() == 1:
        register_main_grad_hooks([next(model.parameters())])
    opt = DygraphShardingOptimizerV2(torch.optim.SGD(model.parameters(), lr=0.1), hcg, st)
    return _caught(model.train_batch, (torch.ones(4, 1), torch.zeros(4, 1)), opt)


class _SometimesUnused(nn.Module):
    """`w * x + b`, but on global rank `rank` the second forward leaves b out (no grad)."""

    def __init__(self, rank):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.ones(())), nn.Parameter(torch.zeros(()))
        self.rank, self.calls = rank, 0

    def forward(self, x):
        self.calls += 1
        if dist.get_rank() == self.rank and self.calls == 2:
            return self.w * x
        return self.w * x + self.b


def pipeline_param_left_out(rank, world, version, release):
    """pp 2 x sharding 2, pipeline sharding overlap, acc 2: on global rank 3 (stage 1) one
    param gets no grad in micro-batch 1, so its bucket is incomplete there. Returns what
    train_batch raised, then (after a second train_batch that uses every param) a broadcast
    from rank 0, to show the groups still work."""
    st = _pp_strategy(2, 2, 2, release=release, split_param=version == 2,
                      sharding_comm_overlap=True)
    hcg = HybridCommunicateGroup(st)
    model = PipelineParallel([Scale(), _SometimesUnused(3)], hcg, st, _mean_loss)
    cls = DygraphShardingOptimizer if version == 1 else DygraphShardingOptimizerV2
    opt = cls(torch.optim.SGD(model.parameters(), lr=0.1), hcg, st)
    seen = _caught(model.train_batch, (torch.ones(4, 1), torch.zeros(4, 1)), opt)
    for layer in model._layers:
        layer.rank = -1  # every param used from now on: the next step runs
    model.train_batch((torch.ones(4, 1), torch.zeros(4, 1)), opt)
    probe = torch.tensor([float(rank)])
    dist.broadcast(probe, src=0)
    return seen, float(probe)
