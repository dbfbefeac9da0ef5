"""Rank-side checks of what real training scripts bring: zero_grad() with collectives in flight,
sparse grads, batches that do not split, a frozen stage, ties across stages, misuse on one
rank that every rank learns of at once."""
import time
from datetime import timedelta
from itertools import product

import torch
import torch.nn.functional as F
from torch import nn

from pipeline import PipelineParallel
from relgrad import DygraphShardingConfig, HybridCommunicateGroup, HybridStrategy
from relgrad_checks.common import _strategy
from relgrad_checks.failures import Scale, SometimesUnused, mean_loss, pipeline
from relgrad_checks.loops import (CLASSES, STEPS, backward, caught, clear, oracle, own_strategy,
                                  params, sharded, train)
from relgrad_extras.grad_clip import ClipGradByGlobalNorm
from relgrad_extras.interleave import PipelineParallelWithInterleave


def _timed(fn, *args):
    """(what `fn(*args)` raised or None, the seconds it took)"""
    start = time.monotonic()
    seen = caught(fn, *args)
    return seen, time.monotonic() - start


# ---------------------------------------------------------------- zero_grad() at the wrong time

def zero_grad_in_flight(rank: int, world: int) -> tuple[dict, list]:
    """Own overlap: zero_grad() with collectives in flight, step(), zero_grad(), then
    STEPS steps. -> ({case: (the three errors, params)}, one process)"""
    out = {}
    for version, release in product((1, 2), (True, False)):
        model, opt = sharded(world, version, True, 1, release)
        backward(model, rank, world, 0)
        first = caught(clear, opt, release)
        stepped = caught(opt.step)
        again = caught(clear, opt, release)
        train(model, opt, rank, world, range(STEPS), release)
        out[version, release] = (first, stepped, again, params(model))
    return out, oracle()[0]


def zero_grad_on_one_rank(rank: int, world: int) -> tuple[dict, list]:
    """No overlap: zero_grad() on rank 1 only, step(); cleared, STEPS steps.
    -> ({case: (step()'s error, params)}, one process)"""
    out = {}
    for version, release in product((1, 2), (True, False)):
        model, opt = sharded(world, version, False, 1, release)
        backward(model, rank, world, 0)
        if rank == 1:
            clear(opt, release)
        stepped = caught(opt.step)
        clear(opt, release)
        train(model, opt, rank, world, range(STEPS), release)
        out[version, release] = (stepped, params(model))
    return out, oracle()[0]


def clip_arguments_differ(rank: int, world: int) -> tuple[dict, list]:
    """Rank 1 clips otherwise, invalidly, or steps while rank 0 clips; then both clip at
    0.05. -> ({case: ([(error, seconds)] of the three calls, params)}, one process)"""
    out = {}
    for version, overlap in product((1, 2), (False, True)):
        model, opt = sharded(world, version, overlap, 1)
        backward(model, rank, world, 0)
        calls = [lambda: opt.clip_grad_norm_(1.0 if rank == 0 else 2.0),
                 lambda: opt.clip_grad_norm_(1.0 if rank == 0 else 0.0),
                 lambda: opt.clip_grad_norm_(1.0) if rank == 0 else opt.step()]
        timed = [_timed(call) for call in calls]
        opt.clip_grad_norm_(0.05)  # the first step goes on with the same grads
        opt.step()
        opt.zero_grad()
        train(model, opt, rank, world, range(1, STEPS), clip=0.05)
        out[version, overlap] = (timed, params(model))
    return out, oracle(clip=0.05)[0]


# ---------------------------------------------------------------- sparse grads

class _Bag(nn.Module):
    """nn.Embedding(10, 4, sparse=...) -> mean over the sequence -> Linear(4, 3)."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.emb, self.head = nn.Embedding(10, 4, sparse=sparse), nn.Linear(4, 3)

    def forward(self, tokens):
        return self.head(self.emb(tokens).mean(1))


class _EmbMean(nn.Module):
    """A pipeline stage's layer: `wte(tokens).mean(1)` (the embedding named as GPT-2's)."""

    def __init__(self, wte: nn.Embedding) -> None:
        super().__init__()
        self.wte = wte

    def forward(self, tokens):
        return self.wte(tokens).mean(1)


def _tokens(step, n):
    gen = torch.Generator().manual_seed(50 + step)
    # repeated tokens in a row: a sparse grad with duplicate indices
    return torch.randint(0, 10, (n, 5), generator=gen), torch.randn(n, 3, generator=gen)


def _sparse_oracle(steps, batch=8):
    """One process, a dense nn.Embedding, the whole batch, AdamW(1e-2). -> params"""
    model = _Bag(sparse=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = _tokens(step, batch)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return params(model)


def sparse_grads(rank: int, world: int) -> tuple[dict, list]:
    """nn.Embedding(sparse=True), v1 / v2, own overlap, release, acc 2, 3 AdamW steps.
    -> ({case: params}, one process)"""
    out = {}
    for case in product((1, 2), (False, True), (True, False)):
        version, overlap, release = case
        st = own_strategy(world, version, overlap, 2, release)
        model = _Bag(sparse=True)
        opt = CLASSES[version](torch.optim.AdamW(model.parameters(), lr=1e-2),
                               HybridCommunicateGroup(st), st)
        for step in range(3):
            x, y = (t.chunk(world)[rank] for t in _tokens(step, 8))
            for xm, ym in zip(x.chunk(2), y.chunk(2)):
                (F.mse_loss(model(xm), ym) / 2).backward()
            opt.step()
            clear(opt, release)
        out[case] = params(model)
    return out, _sparse_oracle(3)


PIPE_SPARSE_CASES = ("sharding v1 overlap", "sharding v2 overlap", "dp overlap", "dp")


def sparse_grads_pipeline(rank: int, world: int) -> dict:
    """A sparse embedding stage, pp 2 x sharding 2 or x dp 2, 2 AdamW steps.
    -> {(case, release): (this stage's params, one process's)}"""
    out = {}
    for case, release in product(PIPE_SPARSE_CASES, (True, False)):
        sharding = case.startswith("sharding")
        st = _strategy(pp=2, sharding=2 if sharding else 1, dp=1 if sharding else 2, acc=2,
                       release=release, split_param="v2" in case,
                       sharding_comm_overlap=sharding, dp_comm_overlap=case == "dp overlap")
        hcg = HybridCommunicateGroup(st)
        bag = _Bag(sparse=True)
        model = PipelineParallel([_EmbMean(bag.emb), bag.head], hcg, st, F.mse_loss)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        replica = hcg.get_data_parallel_rank()
        if sharding:
            opt = CLASSES[2 if "v2" in case else 1](opt, hcg, st)
            replica = hcg.get_sharding_parallel_rank()
        for step in range(2):
            model.train_batch(tuple(t.chunk(2)[replica] for t in _tokens(step, 8)), opt)
        want = _sparse_oracle(2)  # this rank's stage of it: the rank grid differs per topology
        out[case, release] = (params(model), want[:1] if hcg.get_stage_id() == 0 else want[1:])
    return out


# ---------------------------------------------------------------- batches, stages, ties

def batch_does_not_split(rank: int, world: int) -> tuple:
    """pp 1 x dp 2, acc 2: rank 0 gets 3 samples, rank 1 none. -> (error, seconds)"""
    st = HybridStrategy(dp_degree=2, accumulate_steps=2)
    hcg = HybridCommunicateGroup(st, timeout=timedelta(seconds=20))
    model = PipelineParallel([nn.Linear(3, 2)], hcg, st, F.mse_loss)
    n = 3 if rank == 0 else 0
    return _timed(model.train_batch, (torch.ones(n, 3), torch.zeros(n, 2)),
                  torch.optim.SGD(model.parameters(), lr=0.1))


FROZEN_CASES = ((2, False), (2, True), (1, False), (1, True))  # (version, pipeline overlap)


def _frozen_layers():
    torch.manual_seed(11)
    built = [nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)]
    built[2].requires_grad_(False)  # stage 1 holds no trainable param
    return built


def frozen_stage(rank: int, world: int) -> dict:
    """pp 2 x sharding 2, stage 1's only Linear frozen, 2 SGD steps.
    -> {case: (what training raised, this stage's params, one process's)}"""
    out = {}
    for version, overlap in FROZEN_CASES:
        st = _strategy(pp=2, sharding=2, acc=2, release=True, split_param=version == 2,
                       sharding_comm_overlap=overlap)
        hcg, model, opt = pipeline(st, _frozen_layers(), version, F.mse_loss,
                                   seg_boundaries=[0, 2, 3])
        reference = nn.Sequential(*_frozen_layers())
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        error = None
        for step in range(2):
            gen = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 3, generator=gen), torch.randn(8, 2, generator=gen)
            F.mse_loss(reference(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            part = tuple(t.chunk(2)[hcg.get_sharding_parallel_rank()] for t in (x, y))
            error = error or caught(model.train_batch, part, opt)
        want = params(reference)
        want = want[:2] if hcg.get_stage_id() == 0 else want[2:]
        out[version, overlap] = (error, params(model), want)
    return out


class _Head(nn.Module):
    def __init__(self, wte: nn.Embedding) -> None:
        super().__init__()
        self.lm_head = nn.Linear(4, 10, bias=False)
        self.lm_head.weight = wte.weight  # tied inside the model, as GPT-2's

    def forward(self, h):
        return self.lm_head(h)


def _tied_layers():
    torch.manual_seed(3)
    wte = nn.Embedding(10, 4)
    return [_EmbMean(wte), nn.Linear(4, 4), nn.Linear(4, 4), _Head(wte)]


def tie_across_stages(rank: int, world: int) -> tuple:
    """pp 2 with the head's weight the embedding's: built without shared_weights, with it,
    then trained. -> (the three errors)"""
    st = HybridStrategy(pp_degree=2, accumulate_steps=2)
    hcg = HybridCommunicateGroup(st)
    untied = caught(PipelineParallel, _tied_layers(), hcg, st, F.mse_loss)
    tie = [("0.wte.weight", "3.lm_head.weight")]
    tied = caught(PipelineParallel, _tied_layers(), hcg, st, F.mse_loss, shared_weights=tie)
    model = PipelineParallel(_tied_layers(), hcg, st, F.mse_loss, shared_weights=tie)
    tokens = torch.randint(0, 10, (4, 3), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return untied, tied, caught(model.train_batch, (tokens, torch.zeros(4, 10)), opt)


def incomplete_tied_and_interleaved(rank: int, world: int) -> dict:
    """On rank 3 a param gets no grad in micro-batch 1, in a bucket with a tied copy
    or interleaved. -> {case: (error, the next train_batch's error)}"""
    out = {}
    for case in ("tied", "interleaved"):
        st = _strategy(pp=2, sharding=2, acc=2, release=True, split_param=True,
                       sharding_comm_overlap=True)
        hcg = HybridCommunicateGroup(st)
        layers = [Scale(), SometimesUnused(3)]
        if case == "tied":
            model = PipelineParallel(layers, hcg, st, mean_loss, shared_weights=[("0.w", "1.w")])
        else:
            st.pp_configs.num_virtual_pipeline_stages = 2
            model = PipelineParallelWithInterleave([Scale(), Scale()] + layers, hcg, st,
                                                   mean_loss)
        opt = CLASSES[2](torch.optim.SGD(model.parameters(), lr=0.1), hcg, st)
        data = (torch.ones(4, 1), torch.zeros(4, 1))
        seen = caught(model.train_batch, data, opt)
        for module in model.modules():
            if isinstance(module, SometimesUnused):
                module.rank = -1  # every param used from now on: the next step runs
        out[case] = (seen, caught(model.train_batch, data, opt))
    return out


def direct_call_bad_batch(rank: int, world: int) -> dict:
    """forward_backward_pipeline called with 3 samples on stage 0, 4 on stage 1, then a
    good call. -> {case: (error, seconds, the good call's error)}"""
    out = {}
    for case in ("plain", "interleaved"):
        st = _strategy(pp=2, acc=2)
        hcg = HybridCommunicateGroup(st, timeout=timedelta(seconds=20))
        if case == "plain":
            model = PipelineParallel([Scale(), Scale()], hcg, st, mean_loss)
        else:
            st.pp_configs.num_virtual_pipeline_stages = 2
            model = PipelineParallelWithInterleave([Scale() for _ in range(4)], hcg, st,
                                                   mean_loss)
        n = 3 if hcg.get_stage_id() == 0 else 4
        seen, spent = _timed(model.forward_backward_pipeline, (torch.ones(n, 1),
                                                               torch.zeros(n, 1)))
        good = caught(model.forward_backward_pipeline, (torch.ones(4, 1), torch.zeros(4, 1)))
        out[case] = (seen, spent, good)
    return out


def grad_clip_differs(rank: int, world: int) -> dict:
    """Paddle's clip at 1.0 on rank 0, 0.5 on rank 1, to v1 / v2 and to train_batch;
    then one clip. -> {where: error}"""
    clip = ClipGradByGlobalNorm(1.0 if rank == 0 else 0.5)
    seen = {}
    for version in (1, 2):
        st = HybridStrategy(sharding_degree=2, sharding_configs=DygraphShardingConfig(
            split_param=version == 2))
        opt = torch.optim.SGD(nn.Linear(3, 2).parameters(), lr=0.1)
        seen[f"v{version}"] = caught(CLASSES[version], opt, HybridCommunicateGroup(st), st,
                                     grad_clip=clip)
    st = HybridStrategy(dp_degree=2, accumulate_steps=1)
    model = PipelineParallel([nn.Linear(3, 2)], HybridCommunicateGroup(st), st, F.mse_loss)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.ones(2, 3), torch.zeros(2, 2))
    seen["train_batch"] = caught(model.train_batch, batch, opt, grad_clip=clip)
    seen["agreed"] = caught(model.train_batch, batch, opt, grad_clip=ClipGradByGlobalNorm(1.0))
    return seen
