"""Rank-side checks of what real training scripts bring (issue 25): `zero_grad()` while
sharding's own overlap has collectives in flight, sparse grads, a replica whose batch does
not split, an all-frozen stage, a weight tied across stages without `shared_weights=`, and
failures that every rank learns of at once."""
import time
from datetime import timedelta

import torch
import torch.nn.functional as F
from torch import nn

from pipeline import PipelineParallel
from relgrad import DygraphShardingConfig, HybridCommunicateGroup, HybridStrategy, PpConfig
from sharding import DygraphShardingOptimizer, DygraphShardingOptimizerV2
from relgrad_checks.loops import STEPS, _micro_batches, _oracle, _sharded

_CLASSES = {1: DygraphShardingOptimizer, 2: DygraphShardingOptimizerV2}


def _caught(fn, *args, **kwargs):
    """`(type name, message)` of what `fn(*args, **kwargs)` raised, or None if it returned."""
    try:
        fn(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 (the test compares what every rank saw)
        return type(error).__name__, str(error)
    return None


# ---------------------------------------------------------------- zero_grad while in flight

def zero_grad_in_flight(rank, world):
    """v1 / v2, own overlap, acc 1, release on / off: backward, zero_grad() (the collectives
    in flight), step(), then zero_grad(), backward, step() for STEPS steps. Returns
    ({(version, release): (what the first zero_grad raised, what step() raised, what the
    next zero_grad raised, params)}, the one-process params after STEPS steps)."""
    out = {}
    for version in (1, 2):
        for release in (True, False):
            model, opt = _sharded(world, version, True, 1, release=release)
            zero = {"set_to_none": release}  # release off: only in place is allowed
            for x, y in _micro_batches(rank, world, 0, 1):
                F.mse_loss(model(x), y).backward()
            first = _caught(opt.zero_grad, **zero)
            stepped = _caught(opt.step)
            again = _caught(opt.zero_grad, **zero)
            for step in range(STEPS):
                for x, y in _micro_batches(rank, world, step, 1):
                    F.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad(**zero)
            out[version, release] = (first, stepped, again,
                                     [p.detach().clone() for p in model.parameters()])
    return out, _oracle(STEPS)[0]


# ---------------------------------------------------------------- sparse grads

class _Bag(nn.Module):
    """nn.Embedding(10, 4, sparse=...) -> mean over the sequence -> Linear(4, 3)."""

    def __init__(self, sparse):
        super().__init__()
        torch.manual_seed(5)
        self.emb, self.head = nn.Embedding(10, 4, sparse=sparse), nn.Linear(4, 3)

    def forward(self, tokens):
        return self.head(self.emb(tokens).mean(1))


def _tokens(step, n):
    gen = torch.Generator().manual_seed(50 + step)
    # repeated tokens in a row: a sparse grad with duplicate indices
    return torch.randint(0, 10, (n, 5), generator=gen), torch.randn(n, 3, generator=gen)


def _sparse_oracle(steps, batch):
    """One process, a dense nn.Embedding, the whole batch, AdamW(1e-2)."""
    model = _Bag(sparse=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = _tokens(step, batch)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def sparse_grads(rank, world):
    """v1 / v2, own overlap off / on, release on / off, acc 2: nn.Embedding(sparse=True)
    trained 3 steps with AdamW on this rank's half of the batch. Returns ({case: params},
    the one-process params)."""
    out, steps, batch, acc = {}, 3, 8, 2
    for version in (1, 2):
        for overlap in (False, True):
            for release in (True, False):
                st = HybridStrategy(sharding_degree=world, sharding_configs=DygraphShardingConfig(
                    split_param=version == 2, comm_overlap=overlap, accumulate_steps=acc,
                    release_gradients=release))
                hcg = HybridCommunicateGroup(st)
                model = _Bag(sparse=True)
                opt = _CLASSES[version](torch.optim.AdamW(model.parameters(), lr=1e-2), hcg, st)
                for step in range(steps):
                    x, y = (t.chunk(world)[rank] for t in _tokens(step, batch))
                    for xm, ym in zip(x.chunk(acc), y.chunk(acc)):
                        (F.mse_loss(model(xm), ym) / acc).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=release)
                out[version, overlap, release] = [p.detach().clone() for p in model.parameters()]
    return out, _sparse_oracle(steps, batch)


class _EmbMean(nn.Module):
    """A pipeline stage's layer: `wte(tokens).mean(1)` (the embedding named as GPT-2's)."""

    def __init__(self, wte):
        super().__init__()
        self.wte = wte

    def forward(self, tokens):
        return self.wte(tokens).mean(1)


PIPE_SPARSE_CASES = ("sharding v1 overlap", "sharding v2 overlap", "dp overlap", "dp")


def sparse_grads_pipeline(rank, world):
    """pp 2 x 2 (sharding with pp_configs.sharding_comm_overlap, v1 / v2; dp with and
    without pp_configs.dp_comm_overlap), release on / off, acc 2: the embedding stage of a
    _Bag(sparse=True) trained 2 steps with AdamW. Returns {(case, release): (this
    stage's params, the one-process params of this stage)}."""
    out, steps, batch, acc = {}, 2, 8, 2
    for case in PIPE_SPARSE_CASES:
        for release in (True, False):
            sharding = case.startswith("sharding")
            flags = {"sharding_comm_overlap": True} if sharding else (
                {"dp_comm_overlap": True} if case == "dp overlap" else {})
            st = HybridStrategy(
                pp_degree=2, sharding_degree=2 if sharding else 1, dp_degree=1 if sharding else 2,
                accumulate_steps=acc, pp_configs=PpConfig(release_gradients=release, **flags),
                sharding_configs=DygraphShardingConfig(split_param="v2" in case))
            hcg = HybridCommunicateGroup(st)
            bag = _Bag(sparse=True)
            model = PipelineParallel([_EmbMean(bag.emb), bag.head], hcg, st, F.mse_loss)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            if sharding:
                opt = _CLASSES[2 if "v2" in case else 1](opt, hcg, st)
            replica = hcg.get_sharding_parallel_rank() if sharding else \
                hcg.get_data_parallel_rank()
            for step in range(steps):
                model.train_batch(tuple(t.chunk(2)[replica] for t in _tokens(step, batch)), opt)
            # the rank grid differs per topology: this rank's stage with it
            oracle = _sparse_oracle(steps, batch)
            out[case, release] = ([p.detach().clone() for p in model.parameters()],
                                  oracle[:1] if hcg.get_stage_id() == 0 else oracle[1:])
    return out


# ---------------------------------------------------------------- a batch that does not split

def batch_does_not_split(rank, world):
    """pp 1 x dp 2, acc 2, a group timeout of 20 s: rank 0 gets 3 samples, rank 1 none.
    Returns (what train_batch raised, seconds it took)."""
    st = HybridStrategy(dp_degree=2, accumulate_steps=2)
    hcg = HybridCommunicateGroup(st, timeout=timedelta(seconds=20))
    model = PipelineParallel([nn.Linear(3, 2)], hcg, st, F.mse_loss)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    n = 3 if rank == 0 else 0
    start = time.monotonic()
    seen = _caught(model.train_batch, (torch.ones(n, 3), torch.zeros(n, 2)), opt)
    return seen, time.monotonic() - start


# ---------------------------------------------------------------- an all-frozen stage

FROZEN_CASES = ((2, False), (2, True), (1, False), (1, True))  # (version, pipeline overlap)


def frozen_stage(rank, world):
    """pp 2 x sharding 2, release on, acc 2: layers Linear(3, 4), Tanh, Linear(4, 2) with the
    last frozen, so stage 1 holds no trainable param; v1 / v2, pipeline sharding overlap off /
    on, 2 steps of SGD. Returns {case: (what training raised, this stage's params, the
    one-process params of this stage)}."""
    out = {}
    for version, overlap in FROZEN_CASES:
        st = HybridStrategy(pp_degree=2, sharding_degree=2, accumulate_steps=2,
                            pp_configs=PpConfig(release_gradients=True,
                                                sharding_comm_overlap=overlap),
                            sharding_configs=DygraphShardingConfig(split_param=version == 2))
        hcg = HybridCommunicateGroup(st)

        def layers():
            torch.manual_seed(11)
            built = [nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)]
            built[2].requires_grad_(False)
            return built

        model = PipelineParallel(layers(), hcg, st, F.mse_loss, seg_boundaries=[0, 2, 3])
        opt = _CLASSES[version](torch.optim.SGD(model.parameters(), lr=0.1), hcg, st)
        reference = nn.Sequential(*layers())
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        error = None
        for step in range(2):
            gen = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 3, generator=gen), torch.randn(8, 2, generator=gen)
            F.mse_loss(reference(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            part = (x.chunk(2)[hcg.get_sharding_parallel_rank()],
                    y.chunk(2)[hcg.get_sharding_parallel_rank()])
            error = error or _caught(model.train_batch, part, opt)
        mine = list(reference.parameters())
        mine = mine[:2] if hcg.get_stage_id() == 0 else mine[2:]
        out[version, overlap] = (error, [p.detach().clone() for p in model.parameters()],
                                 [p.detach().clone() for p in mine])
    return out


# ---------------------------------------------------------------- a tie split across stages

class _Head(nn.Module):
    def __init__(self, wte):
        super().__init__()
        self.lm_head = nn.Linear(4, 10, bias=False)
        self.lm_head.weight = wte.weight  # tied inside the model, as GPT-2's

    def forward(self, h):
        return self.lm_head(h)


def tie_across_stages(rank, world):
    """pp 2: [embedding, Linear, Linear, head] with the head's weight the embedding's
    Parameter object, cut [0, 2) and [2, 4). Returns (what building without shared_weights
    raised, what building with the tie raised, what one train_batch of the tied build
    raised)."""
    st = HybridStrategy(pp_degree=2, accumulate_steps=2)
    hcg = HybridCommunicateGroup(st)

    def layers():
        torch.manual_seed(3)
        wte = nn.Embedding(10, 4)
        return [_EmbMean(wte), nn.Linear(4, 4), nn.Linear(4, 4), _Head(wte)]

    untied = _caught(PipelineParallel, layers(), hcg, st, F.mse_loss)
    tie = [("0.wte.weight", "3.lm_head.weight")]
    tied = _caught(PipelineParallel, layers(), hcg, st, F.mse_loss, shared_weights=tie)
    model = PipelineParallel(layers(), hcg, st, F.mse_loss, shared_weights=tie)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randint(0, 10, (4, 3), generator=torch.Generator().manual_seed(0)),
             torch.zeros(4, 10))
    return untied, tied, _caught(model.train_batch, batch, opt)


# ---------------------------------------------------------------- clip_grad_norm_ agreed

def clip_arguments_differ(rank, world):
    """v1 / v2, own overlap off / on: after one backward, rank 1 calls clip_grad_norm_ with
    another max_norm, then with an invalid one, then step() while rank 0 clips; then both
    clip with 0.05 and step, for STEPS steps. Returns ({case: (the three errors, the
    seconds each took, params)}, the one-process params clipped at 0.05)."""
    out = {}
    for version in (1, 2):
        for overlap in (False, True):
            model, opt = _sharded(world, version, overlap, 1)
            for x, y in _micro_batches(rank, world, 0, 1):
                F.mse_loss(model(x), y).backward()
            calls = [lambda: opt.clip_grad_norm_(1.0 if rank == 0 else 2.0),
                     lambda: opt.clip_grad_norm_(1.0 if rank == 0 else 0.0),
                     lambda: opt.clip_grad_norm_(1.0) if rank == 0 else opt.step()]
            errors, spent = [], []
            for call in calls:
                start = time.monotonic()
                errors.append(_caught(call))
                spent.append(time.monotonic() - start)
            for step in range(STEPS):  # the first step goes on with the same grads
                if step > 0:
                    for x, y in _micro_batches(rank, world, step, 1):
                        F.mse_loss(model(x), y).backward()
                opt.clip_grad_norm_(0.05)
                opt.step()
                opt.zero_grad()
            out[version, overlap] = (errors, spent,
                                     [p.detach().clone() for p in model.parameters()])
    return out, _oracle(STEPS, 0.05)[0]


# ---------------------------------------------------------------- incomplete buckets, ends

def incomplete_tied_and_interleaved(rank, world):
    """pp 2 x sharding 2, pipeline sharding overlap, release on, acc 2: on global rank 3
    (stage 1) one param gets no grad in micro-batch 1, (a) in a bucket that holds a copy tied
    across stages (shared_weights), (b) under the interleaved schedule (2 virtual stages).
    Returns {case: (what train_batch raised, what a second train_batch that uses every param
    raised)}."""
    from relgrad_checks.failures import Scale, _SometimesUnused, _mean_loss, _pp_strategy
    from relgrad_extras.interleave import PipelineParallelWithInterleave
    out = {}
    for case in ("tied", "interleaved"):
        st = _pp_strategy(2, 2, 2, release=True, split_param=True, sharding_comm_overlap=True)
        hcg = HybridCommunicateGroup(st)
        if case == "tied":
            model = PipelineParallel([Scale(), _SometimesUnused(3)], hcg, st, _mean_loss,
                                     shared_weights=[("0.w", "1.w")])
        else:
            st.pp_configs.num_virtual_pipeline_stages = 2
            model = PipelineParallelWithInterleave(
                [Scale(), Scale(), Scale(), _SometimesUnused(3)], hcg, st, _mean_loss)
        opt = DygraphShardingOptimizerV2(torch.optim.SGD(model.parameters(), lr=0.1), hcg, st)
        data = (torch.ones(4, 1), torch.zeros(4, 1))
        seen = _caught(model.train_batch, data, opt)
        for module in model.modules():
            if isinstance(module, _SometimesUnused):
                module.rank = -1  # every param used from now on: the next step runs
        out[case] = (seen, _caught(model.train_batch, data, opt))
    return out


def direct_call_bad_batch(rank, world):
    """pp 2, acc 2, a group timeout of 20 s, forward_backward_pipeline called directly (no
    train_batch) with 3 samples on stage 0 and 4 on stage 1 (plain and interleaved, 2
    virtual stages), then a good call. Returns {case: (what the call raised, seconds it
    took, what the good call raised)}."""
    from relgrad_checks.failures import Scale, _mean_loss, _pp_strategy
    from relgrad_extras.interleave import PipelineParallelWithInterleave
    out = {}
    for case in ("plain", "interleaved"):
        st = _pp_strategy(2, 1, 2)
        hcg = HybridCommunicateGroup(st, timeout=timedelta(seconds=20))
        if case == "plain":
            model = PipelineParallel([Scale(), Scale()], hcg, st, _mean_loss)
        else:
            st.pp_configs.num_virtual_pipeline_stages = 2
            model = PipelineParallelWithInterleave([Scale() for _ in range(4)], hcg, st,
                                                   _mean_loss)
        n = 3 if hcg.get_stage_id() == 0 else 4
        start = time.monotonic()
        seen = _caught(model.forward_backward_pipeline, (torch.ones(n, 1), torch.zeros(n, 1)))
        spent = time.monotonic() - start
        good = _caught(model.forward_backward_pipeline, (torch.ones(4, 1), torch.zeros(4, 1)))
        out[case] = (seen, spent, good)
    return out


# ---------------------------------------------------------------- misuse on one rank only

def zero_grad_on_one_rank(rank, world):
    """v1 / v2 without overlap, release on / off: backward on every rank, zero_grad() on rank
    1 only, step(); then zero_grad() and STEPS steps of plain training. Returns ({(version,
    release): (what the first step() raised, params)}, the one-process params after STEPS
    steps)."""
    out = {}
    for version in (1, 2):
        for release in (True, False):
            model, opt = _sharded(world, version, False, 1, release=release)
            zero = {"set_to_none": release}  # release off: v2 zeroes in place only
            for x, y in _micro_batches(rank, world, 0, 1):
                F.mse_loss(model(x), y).backward()
            if rank == 1:
                opt.zero_grad(**zero)
            stepped = _caught(opt.step)
            opt.zero_grad(**zero)
            for step in range(STEPS):
                for x, y in _micro_batches(rank, world, step, 1):
                    F.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad(**zero)
            out[version, release] = (stepped, [p.detach().clone() for p in model.parameters()])
    return out, _oracle(STEPS)[0]


def grad_clip_differs(rank, world):
    """Paddle's clip with clip_norm 1.0 on rank 0 and 0.5 on rank 1: given to a v1 / v2
    constructor (sharding 2), and to train_batch (pp 1 x dp 2); then the same clip on both,
    which must train. Returns {where: what it raised}, plus "agreed": what the agreed
    train_batch raised (None)."""
    from relgrad_extras.grad_clip import ClipGradByGlobalNorm
    clip = ClipGradByGlobalNorm(1.0 if rank == 0 else 0.5)
    seen = {}
    for version in (1, 2):
        st = HybridStrategy(sharding_degree=2, sharding_configs=DygraphShardingConfig(
            split_param=version == 2))
        model = nn.Linear(3, 2)
        seen[f"v{version}"] = _caught(_CLASSES[version], torch.optim.SGD(model.parameters(),
                                                                          lr=0.1),
                                      HybridCommunicateGroup(st), st, grad_clip=clip)
    st = HybridStrategy(dp_degree=2, accumulate_steps=1)
    model = PipelineParallel([nn.Linear(3, 2)], HybridCommunicateGroup(st), st, F.mse_loss)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.ones(2, 3), torch.zeros(2, 2))
    seen["train_batch"] = _caught(model.train_batch, batch, opt, grad_clip=clip)
    seen["agreed"] = _caught(model.train_batch, batch, opt,
                             grad_clip=ClipGradByGlobalNorm(1.0))
    return seen
