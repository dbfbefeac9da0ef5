"""Rank-side checks of sharding's own comm overlap and of free_grads_in_comm (v1 and v2)."""
import time
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from comm_buffer import HOOK_ACTION, main_grad_or_grad
from pipeline import PipelineParallel
from relgrad import DygraphShardingConfig, HybridCommunicateGroup, HybridStrategy, PpConfig
from sharding import DygraphShardingOptimizer, DygraphShardingOptimizerV2
from relgrad_checks.common import (OPTIMIZERS, PIPE_SIZES, _assert_bitwise, _assert_close_each,
                                   _data, _io, _mlp, _mse, _oracle, _params, _pipe_layers,
                                   _released, _same_on_all, _shard, _spy_buffers)


class _SmallBucketsV2(DygraphShardingOptimizerV2):
    """v2 with 512-byte buckets, so that a small model spreads over several buckets."""

    def _build_comm_buffers(self, acc_steps, group_size=None):
        super()._build_comm_buffers(acc_steps, group_size=512)


class _SmallBucketsV1(DygraphShardingOptimizer):
    """v1 with 1-byte buckets under comm_overlap: one bucket per param."""

    def _build_owner_buffers(self, acc_steps, group_size=None):
        super()._build_owner_buffers(acc_steps, group_size=1)


class _OneParamBucketsV2(DygraphShardingOptimizerV2):
    """v2 with 1-byte buckets: one bucket per param."""

    def _build_comm_buffers(self, acc_steps, group_size=None):
        super()._build_comm_buffers(acc_steps, group_size=1)


_CLASSES = {1: DygraphShardingOptimizer, 2: _SmallBucketsV2}


def _own_strategy(sharding, acc, release, free=False, overlap=True):
    return HybridStrategy(
        sharding_degree=sharding,
        pp_configs=PpConfig(release_gradients=release),
        sharding_configs=DygraphShardingConfig(split_param=False, accumulate_steps=acc,
                                               comm_overlap=overlap, free_grads_in_comm=free))


def _counts(record):
    """(bucket-size allocations, grads moved in at a first check-in) seen by `_spy_buffers`."""
    return len(record["zeros"]), sum(first for _, first, _ in record["copies"])


# ---------------------------------------------------------------- watching a bucket's collective

def _read_part(buf, rank):
    """What this rank reads of `buf` after its collective: v2 its shard, v1 the owner all."""
    if buf._act == HOOK_ACTION.REDUCE_SCATTER:
        shard = buf.buffer_size // buf._nranks
        if buf.grad_storage.numel() == shard:  # freed in comm: only the shard is left
            return buf.grad_storage
        return buf.grad_storage[rank * shard : (rank + 1) * shard]
    return buf.grad_storage if dist.get_rank() == buf._dst else None


def _watch(buf, record, free, timing=None, buffers=()):
    """Wrap `_complete_comm`: record the read part, check the rest freed (free) and when."""
    original = buf._complete_comm

    def complete_comm():
        if timing is not None:
            timing["entries"].append(timing["in_backward"]
                                     and any(b._task is None for b in buffers))
        full = weakref.ref(buf.grad_storage)
        grads = [weakref.ref(main_grad_or_grad(p)) for p in buf.params]
        scaled = _counting_muls(original)
        part = _read_part(buf, buf._comm_group_rank)
        buf._completions += 1  # keyed: with free the buckets complete in issue order
        record.append(((buf._watch_index, buf._completions),
                       None if part is None else part.clone()))
        # only what this rank reads is scaled (Paddle scales the whole buffer)
        assert scaled == ([] if part is None else [part.numel()]), scaled
        if free and part is None:  # v1, not the owner: nothing of the bucket is left
            assert buf.grad_storage is None and _released(full, *grads), \
                "a non-owner still holds the reduced bucket"
        elif free and buf._act == HOOK_ACTION.REDUCE:  # v1, the owner: everything stays
            assert buf.grad_storage is full() and all(g() is not None for g in grads)
        elif free:  # v2: only the shard, a storage of its own that the slice grads view
            assert _released(full, *grads), "the full buffer outlived the reduce-scatter"
            assert part.untyped_storage().nbytes() == part.numel() * part.element_size()
            base = part.untyped_storage().data_ptr()
            views = buf._sharding_param_grad_view.values()
            assert all(v._slice_grad.untyped_storage().data_ptr() == base
                       for v in views if v._has_local)

    buf._complete_comm = complete_comm
    buf._comm_group_rank = dist.get_rank(buf._comm_group)
    buf._watch_index, buf._completions = len(_watched), 0
    _watched.append(None)


_watched = []  # one entry per watched buffer: gives each its index (the same order per run)


def _counting_muls(fn):
    """Call `fn()`; return the numel of each tensor multiplied (mul_ or *) meanwhile."""
    muls, scaled = {name: getattr(torch.Tensor, name) for name in ("mul_", "__mul__")}, []

    def counting(name):
        def mul(tensor, *args):
            scaled.append(tensor.numel())
            return muls[name](tensor, *args)
        return mul

    for name in muls:
        setattr(torch.Tensor, name, counting(name))
    try:
        fn()
    finally:
        for name, original in muls.items():
            setattr(torch.Tensor, name, original)
    return scaled


def _assert_same_runs(parts, trajs, buckets=True):
    """Same read parts per (bucket, n-th completion), and same params, as release off."""
    assert len(parts[False]) == len(parts[True]) and (len(parts[True]) > 0) == buckets
    # both runs watched their buckets in the same order: shift the indices to start at 0
    keyed = {}
    for free, pairs in parts.items():
        first = min((key[0] for key, _ in pairs), default=0)
        keyed[free] = {(key[0] - first, key[1]): part for key, part in pairs}
        assert len(keyed[free]) == len(pairs)
    assert keyed[False].keys() == keyed[True].keys()
    for key, a in keyed[False].items():
        b = keyed[True][key]
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), key
    assert any(a is not None for a in keyed[True].values()) == buckets
    _assert_bitwise(trajs[False], trajs[True])


# ---------------------------------------------------------------- sharding's own overlap

def _train_own(hcg, cls, strategy, watch=None, free=False, record=None, timing=None):
    """3 steps of `acc` micro-batches on this rank's slice of 24 rows: the params per step.
    With `timing`, on a 6-param MLP whose layers' backward sleeps 5 ms (gloo finishes)."""
    group_rank, nranks = dist.get_rank(), dist.get_world_size()
    acc = strategy.sharding_configs.accumulate_steps
    overlap = strategy.sharding_configs.comm_overlap
    if timing is None:
        timing = {"in_backward": False, "entries": []}
        model = _mlp([6, 16, 4])
    else:
        model = _mlp([6, 16, 16, 4])
        for layer in model:
            layer.register_full_backward_pre_hook(lambda *_: time.sleep(0.005))
    opt = _shard(cls, OPTIMIZERS["adam"](model.parameters()), hcg, strategy)
    buffers = opt.comm_buffers
    for buf in buffers:
        if watch is not None:
            _watch(buf, watch, free, timing, buffers)
    traj = []
    for step in range(3):
        x, y = (t.chunk(nranks)[group_rank] for t in _data(step, 24, *_io(model)))
        for xb, yb in zip(x.chunk(acc), y.chunk(acc)):
            assert all(b._task is None for b in buffers), "a collective fired too early"
            loss = F.mse_loss(model(xb), yb) / acc
            timing["in_backward"] = True
            loss.backward()
            timing["in_backward"] = False
        assert all((b._task is not None) == overlap for b in buffers), "no collective issued"
        with _spy_buffers({b.buffer_size for b in buffers}) as seen:
            opt.step()
        if record is not None:
            record["zeros"] += seen["zeros"]
            record["copies"] += seen["copies"]
        if free and not issubclass(cls, DygraphShardingOptimizerV2) and not overlap:
            owned = [opt._param2rank[p] == group_rank for p in model.parameters()]
            assert [p.grad is not None for p in model.parameters()] == owned
        opt.zero_grad(set_to_none=strategy.pp_configs.release_gradients)
        traj.append(_params(model))
    return traj


def own_overlap(rank: int, world: int) -> None:
    """Own overlap, v1 and v2, acc 1 and 4: one process, on == off, one allocation, misuse."""
    hcg = HybridCommunicateGroup(_own_strategy(world, 1, False))
    for version in (1, 2):
        for acc in (1, 4):
            oracle = _oracle(lambda: _mlp([6, 16, 4]), "adam", 3, 24)
            trajs = {}
            for release in (False, True):
                record, st = {"zeros": [], "copies": []}, _own_strategy(world, acc, release)
                trajs[release] = _train_own(hcg, _CLASSES[version], st, record=record)
                assert not release or _counts(record) == (0, 0), _counts(record)
                _assert_close_each(trajs[release], oracle)
                assert all(_same_on_all(got) for got in trajs[release])
            _assert_bitwise(trajs[False], trajs[True])
        _check_one_allocation_per_bucket(hcg, version, world)
        _check_own_overlap_misuse(hcg, version, world)
    _check_config_errors(hcg, world)


def _check_one_allocation_per_bucket(hcg, version, world):
    """Release, acc 2: one allocation per bucket and step, none at step()."""
    model = _mlp([6, 16, 4])
    opt = _shard(_CLASSES[version], OPTIMIZERS["sgd"](model.parameters()), hcg,
                 _own_strategy(world, 2, True))
    buffers = opt.comm_buffers
    sizes = {b.buffer_size for b in buffers}
    assert len(buffers) >= 2
    for step in range(3):
        x, y = _data(step, 8, 6, 4)
        for k, (xb, yb) in enumerate(zip(x.chunk(2), y.chunk(2))):
            with _spy_buffers(sizes) as record:
                (F.mse_loss(model(xb), yb) / 2).backward()
            n_params = sum(len(b.params) for b in buffers)
            want = (len(buffers), n_params) if k == 0 else (0, 0)
            assert _counts(record) == want, (k, _counts(record))
        with _spy_buffers(sizes) as record:
            opt.step()
        assert _counts(record) == (0, 0), _counts(record)
        opt.zero_grad()
        assert all(b.grad_storage is None for b in buffers)


def _check_own_overlap_misuse(hcg, version, world):
    """An unused param, too few or too many backward passes raise everywhere."""
    for release in (False, True):
        st = _own_strategy(world, 2, release)
        model = nn.ModuleList([_mlp([6, 16, 4]), nn.Linear(3, 3)])  # [1] is never called
        opt = _shard(_CLASSES[version], OPTIMIZERS["sgd"](model.parameters()), hcg, st)
        x, y = _data(0, 8, 6, 4)
        for _ in range(2):
            F.mse_loss(model[0](x), y).backward()
        with pytest.raises(ValueError, match="did not get accumulate_steps=2"):
            opt.step()
        assert _same_on_all([torch.ones(3)])
        model = _mlp([6, 16, 4])
        opt = _shard(_CLASSES[version], OPTIMIZERS["sgd"](model.parameters()), hcg, st)
        F.mse_loss(model(x), y).backward()  # 1 of 2 micro-batches
        with pytest.raises(ValueError, match="did not get accumulate_steps=2"):
            opt.step()
        opt.zero_grad(set_to_none=release)
        for _ in range(3):  # a third one: counted, raised at step() on every rank
            F.mse_loss(model(x), y).backward()
        with pytest.raises(ValueError, match=r"did not get accumulate_steps=2 .*"
                           r"global rank 0: 3 backward passes, the fewest for a param 2"):
            opt.step()
        assert _same_on_all([torch.ones(3)])


def _check_config_errors(hcg, world):
    with pytest.raises(ValueError, match="free_grads_in_comm needs release"):
        HybridStrategy(sharding_configs=DygraphShardingConfig(free_grads_in_comm=True))
    with pytest.raises(ValueError, match="comm_overlap is sharding's own overlap"):
        HybridStrategy(pp_degree=2, sharding_configs=DygraphShardingConfig(comm_overlap=True))
    for version in (1, 2):
        free = _own_strategy(world, 1, True, free=True)
        free.pp_configs.release_gradients = False  # past HybridStrategy's own check
        both = _own_strategy(world, 1, True)
        both.pp_configs.sharding_comm_overlap = True
        piped = _own_strategy(world, 1, True)
        piped.pp_degree = 2
        for st, match in ((free, "free_grads_in_comm needs release"),
                          (both, "cannot both be on"),
                          (piped, "needs pp_degree 1 .*, got 2 and False")):
            with pytest.raises(ValueError, match=match):
                _shard(_CLASSES[version], OPTIMIZERS["sgd"](_mlp([2, 2]).parameters()), hcg, st)
    st = _own_strategy(world, 1, True, free=True, overlap=False)
    st.pp_configs.delay_scale_loss = True
    with pytest.raises(ValueError, match="free_grads_in_comm with split_param: "
                                         "delay_scale_loss would miss"):
        _shard(_CLASSES[2], OPTIMIZERS["sgd"](_mlp([2, 2]).parameters()), hcg, st)
    params = [nn.Parameter(torch.zeros(3))]
    from relgrad_extras.free_in_comm import FreeInCommBuffer  # [later]: a plug-in
    with pytest.raises(ValueError, match="needs release_grads=True"):
        FreeInCommBuffer(0, params, None, act=HOOK_ACTION.REDUCE_SCATTER)
    with pytest.raises(ValueError, match="nothing to free with act=ALL_REDUCE"):
        FreeInCommBuffer(0, params, None, act=HOOK_ACTION.ALL_REDUCE, release_grads=True)


# ---------------------------------------------------------------- free_grads_in_comm

def free_in_comm(rank: int, world: int) -> None:
    """v1 and v2, own overlap (acc 1, 4) or none: free_grads_in_comm frees the unread part."""
    hcg = HybridCommunicateGroup(_own_strategy(world, 1, False))
    for version in (1, 2):
        for acc, overlap in ((1, True), (4, True), (1, False)):  # without: step() reduces
            parts, trajs = {False: [], True: []}, {}
            for free in (False, True):
                st = _own_strategy(world, acc, release=free, free=free, overlap=overlap)
                trajs[free] = _train_own(hcg, _CLASSES[version], st, watch=parts[free], free=free)
            _assert_same_runs(parts, trajs, buckets=overlap or version == 2)


def free_in_comm_pipeline(rank: int, world: int) -> None:
    """`free_in_comm`'s checks on the pipeline's buffers (pp 2 x sharding 2)."""
    hcg = None
    for version in (1, 2):
        for acc in (1, 4):
            parts, trajs = {False: [], True: []}, {}
            for free in (False, True):
                st = HybridStrategy(
                    pp_degree=2, sharding_degree=2, accumulate_steps=acc,
                    pp_configs=PpConfig(release_gradients=free, sharding_comm_overlap=True),
                    sharding_configs=DygraphShardingConfig(split_param=version == 2,
                                                           free_grads_in_comm=free))
                hcg = hcg or HybridCommunicateGroup(st)
                trajs[free] = _train_pipe(hcg, version, st, parts[free], free)
            _assert_same_runs(parts, trajs)


def _train_pipe(hcg, version, strategy, record, free, mbs=2):
    model = PipelineParallel(_pipe_layers(), hcg, strategy, _mse)
    opt = _shard(version, OPTIMIZERS["adam"](model.parameters()), hcg, strategy)
    acc, replica = strategy.accumulate_steps, hcg.get_sharding_parallel_rank()
    if free:  # at the optimizer step the freed grads are still gone (v2: all params' grads,
        inner_step = opt._inner_opt.step  # v1: those this rank does not own)

        def checked_step(*args, **kwargs):
            assert all(main_grad_or_grad(p) is None for p in model.parameters()
                       if version == 2 or opt._param2rank[p] != replica), "freed grads are back"
            return inner_step(*args, **kwargs)

        opt._inner_opt.step = checked_step
    traj = []
    for step in range(3):
        x, y = (t.chunk(2)[replica]
                for t in _data(step, 2 * acc * mbs, PIPE_SIZES[0], PIPE_SIZES[-1]))
        model._prepare_training(opt, None)
        for buf in [b for bs in model._chunk_2_comm_buffers.values() for b in bs]:
            if not hasattr(buf, "_comm_group_rank"):
                _watch(buf, record, free)
        model.forward_backward_pipeline((x, y))
        model._optimizer_step()
        traj.append(_params(model))
    return traj


def free_during_backward(rank: int, world: int) -> None:
    """6 buckets, v1, v2, acc 1, 4: free completes collectives in the last backward."""
    hcg = HybridCommunicateGroup(_own_strategy(world, 1, False))
    for version, cls in ((1, _SmallBucketsV1), (2, _OneParamBucketsV2)):
        for acc in (1, 4):
            parts, trajs, timings = {False: [], True: []}, {}, {}
            for free in (False, True):
                timings[free] = {"in_backward": False, "entries": []}
                st = _own_strategy(world, acc, release=free, free=free)
                st.sharding_configs.split_param = version == 2
                trajs[free] = _train_own(hcg, cls, st, parts[free], free, timing=timings[free])
            _assert_same_runs(parts, trajs)
            for free, timing in timings.items():
                timing = timing["entries"]
                buckets = len(timing) // 3  # 3 steps, one completion per bucket and step
                assert buckets >= 6 and len(timing) == 3 * buckets, (version, acc, timing)
                # release off completes at step(); free: what has finished by a later check-in
                # (never waiting there; each layer's backward sleeps 5 ms to let gloo finish)
                early = sum(timing)
                assert (early >= 3) if free else early == 0, (version, acc, free, timing)


def end_of_backward_bytes(rank: int, world: int) -> tuple:
    """v2, 1 MB buckets: growth after backward <= G + bucket + 256 KiB; (G, bucket, growth)."""
    from relgrad_demo.memory import allocator_in_use_bytes
    st = _own_strategy(world, 1, True)
    st.sharding_configs.split_param = True
    st.sharding_configs.comm_buffer_size_MB = 1
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])  # 1.05 M params
    opt = DygraphShardingOptimizerV2(OPTIMIZERS["adam"](model.parameters()),
                                     HybridCommunicateGroup(st), st)
    buffers = opt.comm_buffers
    grad_bytes = sum(b.buffer_size * 4 for b in buffers)
    bucket = max(b.buffer_size * 4 for b in buffers)
    assert len(buffers) >= 4 and bucket <= 1024 * 1024 + 512 * 4 * 2, (len(buffers), bucket)
    cpu = torch.device("cpu")
    growth = []
    for step in range(4):
        x = torch.randn(2, 512, generator=torch.Generator().manual_seed(step))
        before = allocator_in_use_bytes(cpu)
        model(x).square().mean().backward()
        growth.append(allocator_in_use_bytes(cpu) - before)
        opt.step()
        opt.zero_grad()
    assert len(growth) == 4
    for g in growth[1:]:  # step 1 also builds AdamW's state
        assert g <= grad_bytes + bucket + 256 * 1024, (g, grad_bytes, bucket)
    return grad_bytes, bucket, growth
