"""Rank-side checks of the recovery rule: a refused step is refused on every rank, changes
nothing, and after the documented clear training goes on as one process that skipped it.
Groups and the store get short timeouts (WAIT), so a hang ends as an error."""
import contextlib
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeline import PipelineParallel
from relgrad import HybridCommunicateGroup
from relgrad_checks.common import _data, _io, _mlp, _mse, _pipe_layers, _strategy
from relgrad_checks.loops import (CLASSES, SIZES, backward, caught, cases, clear, own_strategy,
                                  params, sharded)
from relgrad_extras.interleave import PipelineParallelWithInterleave

WAIT = timedelta(seconds=8)  # groups' and store's timeout in a scenario (a shared machine)
LR, ACC, MBS, BATCH = 1e-2, 2, 2, 8


@contextlib.contextmanager
def _short_store_waits():
    """The default store's waits bounded by WAIT inside."""
    store = dist.distributed_c10d._get_default_store()
    old = store.timeout
    store.set_timeout(WAIT)
    try:
        yield
    finally:
        store.set_timeout(old)


def _refused_alike(seen):
    """Raise AssertionError with every rank's `seen` unless each raised, one type."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, seen)
    if not (all(s is not None for s in every) and len({s[0] for s in every}) == 1):
        raise AssertionError(f"the bad step was not refused alike on every rank: {every}")


def _one_process(model, steps, batch, replicas, acc, lr=LR):
    """One process, AdamW(lr) over `steps`, summing grads as the ranks do. -> params"""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for step in steps:
        x, y = _data(step, batch, *_io(model))
        sums = None
        for xr, yr in zip(x.chunk(replicas), y.chunk(replicas)):
            for xm, ym in zip(xr.chunk(acc), yr.chunk(acc)):
                (F.mse_loss(model(xm), ym) / acc).backward()
            grads = [p.grad for p in model.parameters()]
            if sums is None:
                sums = grads
            else:
                sums = [a if a is None else a + b for a, b in zip(sums, grads)]
            opt.zero_grad()
        for p, g in zip(model.parameters(), sums):
            p.grad = None if g is None else g * (1.0 / replicas)
        opt.step()
        opt.zero_grad()
    return params(model)


def _freed(model, opt, release):
    """Whether every fused buffer (the pipeline's, the optimizer's) is freed, with release."""
    buffers = [b for bs in getattr(model, "_chunk_2_comm_buffers", {}).values() for b in bs]
    buffers += getattr(opt, "comm_buffers", [])
    return not release or all(b.grad_storage is None for b in buffers)


def _bad_step(model, opt, change, release, run):
    """`change` on, `run()` caught, `change` off, the clear.
    -> (error, params unchanged, buffers freed (the pipeline's at once), seconds)"""
    change(model, opt, True)
    before, start = params(model), time.monotonic()
    seen = caught(run)
    seconds, after = time.monotonic() - start, params(model)
    at_once = _freed(model, opt, release) if isinstance(model, PipelineParallel) else True
    change(model, opt, False)
    _refused_alike(seen)
    clear(opt, release)
    return seen, all(map(torch.equal, before, after)), at_once and _freed(model, opt, release), \
        seconds


# ---------------------------------------------------------------- under the pipeline

class Wrapped(nn.Module):
    """`layer` run as `mode` says: plain, no_bias, (non_)reentrant under a checkpoint."""

    def __init__(self, layer: nn.Module, mode: str = "plain") -> None:
        super().__init__()
        self.layer, self.mode = layer, mode

    def forward(self, x):
        if self.mode == "no_bias":
            return F.linear(x, self.layer.weight)
        if self.mode == "plain":
            return self.layer(x)
        return checkpoint(self.layer, x, use_reentrant=self.mode == "reentrant")


def _pipe_recovery(st, cls, change, make_layers=_pipe_layers, steps=4, bad=1, lr=LR):
    """`steps` batches under the pipeline, batch `bad` through `_bad_step`. -> (error,
    unchanged, freed, params, one process's for this stage, this stage's bucket sizes)"""
    hcg = HybridCommunicateGroup(st, timeout=WAIT)
    model = PipelineParallel(make_layers(), hcg, st, _mse)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    if cls:
        opt = cls(opt, hcg, st)
    replicas = st.dp_degree * st.sharding_degree
    replica = hcg.get_data_parallel_rank() * st.sharding_degree \
        + hcg.get_sharding_parallel_rank()
    seen, whole = (None, None, None, None), nn.Sequential(*make_layers())  # for one process
    for step in range(steps):
        x, y = (t.chunk(replicas)[replica] for t in _data(step, replicas * ACC * MBS,
                                                          *_io(whole)))
        if step != bad:
            model.train_batch((x, y), opt)
        else:
            seen = _bad_step(model, opt, change, st.pp_configs.release_gradients,
                             lambda: model.train_batch((x, y), opt))
    want = _one_process(whole, [s for s in range(steps) if s != bad], replicas * ACC * MBS,
                        replicas, ACC, lr)
    counts = [len(list(layer.parameters())) for layer in whole]
    cut = [len(counts) * s // st.pp_degree for s in (model.stage_id, model.stage_id + 1)]
    sizes = [len(b.params) for bs in model._chunk_2_comm_buffers.values() for b in bs]
    return (*seen[:3], params(model), want[sum(counts[: cut[0]]): sum(counts[: cut[1]])], sizes)


def _layouts(family, versions=(1, 2), overlaps=(False, True)):
    """(case, strategy, class) of pp 2 x dp 2 or pp 2 x sharding 2, release off / on."""
    for release in (False, True):
        for overlap in overlaps:
            if family == "dp":
                yield (f"overlap={overlap} release={release}", _strategy(
                    dp=2, pp=2, acc=ACC, release=release, dp_comm_overlap=overlap), None)
            for version in versions if family == "sharding" else ():
                yield (f"v{version} overlap={overlap} release={release}", _strategy(
                    pp=2, sharding=2, acc=ACC, release=release, split_param=version == 2,
                    sharding_comm_overlap=overlap), CLASSES[version])


def lr_on_one_stage(rank: int, world: int, family: str) -> dict:
    """The last rank sets its lr 1.25x for batch 1. -> {case: _pipe_recovery's}"""
    def change(model, opt, bad):
        opt.param_groups[0]["lr"] = LR * 1.25 if bad and rank == world - 1 else LR

    with _short_store_waits():
        return {case: _pipe_recovery(st, cls, change) for case, st, cls in _layouts(family)}


def _frozen_bias_layers():
    layers = _pipe_layers()
    layers[4].bias.requires_grad_(False)  # on stage 1, frozen when v2 is built
    return layers


def unfrozen_on_one_stage(rank: int, world: int) -> dict:
    """v2: a bias frozen at build unfrozen on its stage for batch 1. -> {case: ...}"""
    def change(model, opt, bad):
        if model.stage_id == 1:
            model._layers[1].bias.requires_grad_(bad)

    with _short_store_waits():
        return {case: _pipe_recovery(st, cls, change, _frozen_bias_layers)
                for case, st, cls in _layouts("sharding", versions=(2,))}


def _wrapped_layers(index):
    layers = _pipe_layers()
    layers[index] = Wrapped(layers[index])
    return layers


def free_in_comm_pipeline(rank: int, world: int) -> dict:
    """free_grads_in_comm: the last bias gets no grad on rank 3 in batch 1. -> {case: ...}"""
    def change(model, opt, bad):
        if rank == 3:
            model._layers[3].mode = "no_bias" if bad else "plain"

    out = {}
    with _short_store_waits():
        for case, st, cls in _layouts("sharding", overlaps=(True,)):
            if "release=True" in case:
                st.sharding_configs.free_grads_in_comm = True
                out[case] = _pipe_recovery(st, cls, change, lambda: _wrapped_layers(6))
    return out


def reentrant_checkpoint(rank: int, world: int) -> dict:
    """Stage 0's first Linear under a reentrant checkpoint in batch 1. -> {case: ...}"""
    def change(model, opt, bad):
        if model.stage_id == 0:
            model._layers[0].mode = "reentrant" if bad else "non_reentrant"

    with _short_store_waits():
        return {case: _pipe_recovery(st, cls, change, lambda: _wrapped_layers(0))
                for case, st, cls in _layouts("sharding", overlaps=(True,))}


# ---------------------------------------------------------------- sharding's own overlap

class Branchy(nn.Module):
    """`head(tanh(a(x))) + branch(x)`; the branch left out while `use_branch` is False."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.head = nn.Linear(d_in, d_hidden), nn.Linear(d_hidden, d_out)
        self.branch, self.use_branch = nn.Linear(d_in, d_out), True

    def forward(self, x):
        out = self.head(torch.tanh(self.a(x)))
        return out + self.branch(x) if self.use_branch else out


SMALL, LARGE = (4, 8, 3), (512, 512, 512)  # LARGE: 1 MiB weights (one bucket each at 1 MB)
_VERSIONS_RELEASES = list(cases(("v", (1, 2)), ("release", (False, True))))


def _own_recovery(st, make_model, change, steps=4, bad=1, lr=LR):
    """`steps` steps of own overlap on 2 ranks, step `bad` through `_bad_step`. -> (error,
    unchanged, freed, params, one process's, bucket sizes, the bad step's seconds)"""
    hcg = HybridCommunicateGroup(st, timeout=WAIT)
    model, config = make_model(), st.sharding_configs
    opt = CLASSES[2 if config.split_param else 1](
        torch.optim.AdamW(model.parameters(), lr=lr), hcg, st)
    acc, release = config.accumulate_steps, config.release_gradients

    def one_step(step):
        x, y = (t.chunk(2)[dist.get_rank()] for t in _data(step, BATCH, *_io(model)))
        for xm, ym in zip(x.chunk(acc), y.chunk(acc)):
            (F.mse_loss(model(xm), ym) / acc).backward()
        opt.step()

    seen = None, None, None, None
    for step in range(steps):
        if step != bad:
            one_step(step)
            clear(opt, release)
        else:
            seen = _bad_step(model, opt, change, release, lambda: one_step(step))
    want = _one_process(make_model(), [s for s in range(steps) if s != bad], BATCH, 2, acc, lr)
    return (*seen[:3], params(model), want, [len(b.params) for b in opt.comm_buffers], seen[3])


def _branch_left_out(model, opt, bad):
    model.use_branch = not bad or dist.get_rank() != 1  # rank 1's backward skips it


def free_in_comm_own(rank: int, world: int, version: int, case: str) -> tuple:
    """free_grads_in_comm, Branchy(*LARGE): rank 1 leaves the branch out or sets another
    lr. -> _own_recovery's"""
    def other_lr(model, opt, bad):
        opt.param_groups[0]["lr"] = LR * 1.25 if bad and rank == 1 else LR

    st = own_strategy(2, version, free_grads_in_comm=True, comm_buffer_size_MB=1)
    with _short_store_waits():
        return _own_recovery(st, lambda: Branchy(*LARGE),
                             _branch_left_out if case == "branch" else other_lr)


def unused_branch_named(rank: int, world: int) -> dict:
    """Own overlap, acc 2: rank 1 leaves the branch out in step 1. -> {case: ...}"""
    with _short_store_waits():
        return {case: _own_recovery(own_strategy(2, v, acc=ACC, release=r),
                                    lambda: Branchy(*SMALL), _branch_left_out)
                for case, (v, r) in _VERSIONS_RELEASES}


def frozen_after_build(rank: int, world: int) -> dict:
    """Own overlap: the branch frozen on every rank for step 1. -> {case: ...}"""
    def freeze(model, opt, bad):
        model.branch.requires_grad_(not bad)

    with _short_store_waits():
        return {case: _own_recovery(own_strategy(2, v, release=r), lambda: Branchy(*SMALL),
                                    freeze) for case, (v, r) in _VERSIONS_RELEASES}


# ---------------------------------------------------------------- the store does not grow

def _key_counts(step, steps=10):
    """The default store's key count after each of `steps` calls `step(k)`."""
    store, counts = dist.distributed_c10d._get_default_store(), []
    for k in range(steps):
        step(k)
        dist.barrier()
        counts.append(store.num_keys())
        dist.barrier()
    return counts


def store_keys_own_overlap(rank: int, world: int) -> dict:
    """Key counts over 10 steps of own overlap and of plain torch. -> {case: counts}"""
    def loop(model, opt, release, reduce=False):
        def step(k):
            backward(model, rank, world, k)
            for p in model.parameters() if reduce else ():
                dist.all_reduce(p.grad)
            opt.step()
            clear(opt, release)
        return _key_counts(step)

    out = {case: loop(*sharded(world, v, True, 1, r), r) for case, (v, r) in _VERSIONS_RELEASES}
    model = _mlp(SIZES)
    out["plain torch"] = loop(model, torch.optim.AdamW(model.parameters(), lr=LR), True, True)
    return out


def store_keys_train_batch(rank: int, world: int) -> dict:
    """Key counts over 10 train_batch calls of pp 2 x sharding 2. -> {case: counts}"""
    out = {}
    for case, st, cls in _layouts("sharding", overlaps=(True,)):
        hcg = HybridCommunicateGroup(st)
        model = PipelineParallel(_pipe_layers(), hcg, st, _mse)
        opt = cls(torch.optim.AdamW(model.parameters(), lr=LR), hcg, st)
        replica = hcg.get_sharding_parallel_rank()
        out[case] = _key_counts(lambda k: model.train_batch(
            [t.chunk(2)[replica] for t in _data(k, 2 * ACC * MBS, 6, 4)], opt))
    return out


# ---------------------------------------------------------------- one Parameter in two chunks

def param_in_two_chunks(rank: int, world: int) -> dict:
    """Interleave: one nn.Linear at layers 0 and 4. -> {case: (construction's error,
    a later train_batch's)}"""
    out = {}
    with _short_store_waits():
        for case, st, cls in [*_layouts("sharding", (2,), (True,)), *_layouts("dp", (), (True,))]:
            st.pp_configs.num_virtual_pipeline_stages = 2
            hcg = HybridCommunicateGroup(st, timeout=WAIT)
            torch.manual_seed(0)
            shared, built, later = nn.Linear(8, 8), [], None
            layers = [shared, nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), shared, nn.Tanh(),
                      nn.Linear(8, 8)]
            seen = caught(lambda: built.append(
                PipelineParallelWithInterleave(layers, hcg, st, _mse)))
            if built:
                opt = torch.optim.AdamW(built[0].parameters(), lr=LR)
                if cls:
                    opt = cls(opt, hcg, st)
                later = caught(built[0].train_batch, _data(0, ACC * MBS, 8, 8), opt)
            out[case] = (seen, later)
            dist.barrier()  # on WORLD (its long timeout): every rank done with the case
    return out


# ---------------------------------------------------------------- a weight alone in its bucket

def _lone_layers():
    """A 1.03 MiB fp32 weight (528 x 512) first, so it closes a 1 MB bucket alone."""
    torch.manual_seed(0)
    return [nn.Linear(512, 528), nn.Tanh(), nn.Linear(528, 8), nn.Tanh(), nn.Linear(8, 4)]


def lone_weight(rank: int, world: int) -> dict:
    """comm_buffer_size_MB=1, own overlap (2 ranks) or pp 2 x sharding 2 (4).
    -> {case: (params, one process summing as the ranks do, bucket sizes)}"""
    out = {}
    if world == 2:
        for case, (v, r) in _VERSIONS_RELEASES:
            st = own_strategy(2, v, acc=ACC, release=r, comm_buffer_size_MB=1)
            out[case] = _own_recovery(st, lambda: nn.Sequential(*_lone_layers()), None, 3,
                                      None, 1e-3)[3:6]
        return out
    for case, st, cls in _layouts("sharding", overlaps=(True,)):
        st.sharding_configs.comm_buffer_size_MB = 1
        out[case] = _pipe_recovery(st, cls, None, _lone_layers, 3, None, 1e-3)[3:6]
    return out
