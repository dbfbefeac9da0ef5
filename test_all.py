"""Tests for relgrad: comm buffers, sharding v1/v2, the 1F1B pipeline, config and the demo.

Multi-rank tests spawn their own gloo ranks through `relgrad.launch` (127.0.0.1, a port the OS
picks, a timeout; a rank that raises ends them all). Each rank runs a group of scenarios and
asserts against something independent: a per-parameter collective done by hand, one process
training the same model on the whole batch (the oracle), and release off vs on (bitwise).
"""
import copy
import gc
import json
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import comm_buffer
from comm_buffer import HOOK_ACTION, FusedCommBuffer, bw_hook_func, register_main_grad_hooks
from pipeline import PipelineParallel
from relgrad import (DygraphShardingConfig, HybridCommunicateGroup, HybridStrategy, PpConfig,
                     launch, live_grad_bytes)
from sharding import DygraphShardingOptimizer, DygraphShardingOptimizerV2, MixPrecisionOptimizer

TIMEOUT = 120  # seconds per launch; a hang fails the test instead of blocking the suite
ACTIONS = (HOOK_ACTION.ALL_REDUCE, HOOK_ACTION.REDUCE, HOOK_ACTION.REDUCE_SCATTER)


# ---------------------------------------------------------------- helpers (run in the ranks)

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


# ---------------------------------------------------------------- comm_buffer.py

def _check_layout(rank, world):
    """Offsets, padded sizes and buffer sizes follow Paddle's formulas."""
    params = _new_params([(1000,), (8, 8), (3,)], torch.bfloat16)
    buf = FusedCommBuffer(0, params, None, act=HOOK_ACTION.ALL_REDUCE, use_main_grad=True)
    slots = [_slot(p.numel(), 2) for p in params]
    assert slots == [1024, 128, 128]  # bf16: 1000 -> 1024 elements
    assert [buf.param2offset[p] for p in params] == [0, 1024, 1152]
    assert buf.buffer_size == sum(slots) and buf.grad_storage.dtype == torch.float32
    assert buf.grad_storage.numel() == buf.buffer_size
    assert params[1].main_grad.data_ptr() == buf.grad_storage[1024:].data_ptr()

    # reduce-scatter: unit (256 / 2) * world; params straddle ranks; overlaps may be empty
    params = _new_params([(300,), (10, 100), (20,)], torch.bfloat16)
    before = [p.detach().clone() for p in params]
    buf = FusedCommBuffer(0, params, None, act=HOOK_ACTION.REDUCE_SCATTER, release_grads=True)
    unit = 128 * world
    padded = [-(-p.numel() // unit) * unit for p in params]
    assert buf.buffer_size == sum(padded) and buf.buffer_size % world == 0
    shard = buf.buffer_size // world
    lo, hi = rank * shard, (rank + 1) * shard
    index, owners = 0, []
    for p, size, old in zip(params, padded, before):
        view = buf._sharding_param_grad_view[p]
        assert (view._index, view._padded_size) == (index, size)
        assert (view._param_begin, view._param_end) == (max(index, lo), min(index + size, hi))
        assert view._has_local == (max(index, lo) < min(index + p.numel(), hi))
        assert torch.equal(p, old) and p.data_ptr() == buf.param_storage[index:].data_ptr()
        owners.append([r for r in range(world)
                       if max(index, r * shard) < min(index + p.numel(), (r + 1) * shard)])
        index += size
    assert len(owners[1]) == 2, "the 1000-element param straddles two ranks"
    assert any(rank not in o for o in owners), "some param does not touch this rank"
    if world == 4:  # worked example of build_reduce_scatter_buffer's docstring
        assert padded == [512, 1024, 512] and owners == [[0], [1, 2], [3]]


def _check_actions(rank, world):
    """Each action equals a per-param collective done by hand; release on == off, bitwise."""
    shapes = [(7, 5), (13,), (3, 4, 2), (70,)]
    for act in ACTIONS:
        for acc in (1, 4):
            results = {}
            for release in (False, True):
                params = _new_params(shapes)
                dst = 1 if act == HOOK_ACTION.REDUCE else -1
                buf = FusedCommBuffer(0, params, None, acc, act, dst, release_grads=release)
                for p in params:
                    p.register_post_accumulate_grad_hook(bw_hook_func(buf, p))
                results[release] = []
                for step in range(3):
                    local = [torch.zeros(s) for s in shapes]
                    for k in range(acc):
                        assert buf._task is None, "the collective fired before the last check-in"
                        if release and k == 0:
                            assert buf.grad_storage is None
                        for acc_g, c in zip(local, _backward_int_grads(params, rank, step, k)):
                            acc_g += c
                    assert buf._task is not None, "the collective did not fire"
                    buf.scale_grads()
                    got = _expected_and_got(buf, params, local, act, rank, world)
                    results[release].append(got)
                    if release:
                        buf._clear_grad_storage()
                        assert all(p.grad is None for p in params)
                    else:
                        for p in params:
                            p.grad.zero_()
            for off, on in zip(results[False], results[True]):
                assert torch.equal(off, on)


def _expected_and_got(buf, params, local, act, rank, world):
    """Compare the buffer's result with per-param collectives on the summed local grads."""
    expected = []
    for g in local:
        g = g.clone()
        if act == HOOK_ACTION.REDUCE:
            dist.reduce(g, dst=1)
        else:
            dist.all_reduce(g)
        expected.append(g / world)
    if act == HOOK_ACTION.ALL_REDUCE or (act == HOOK_ACTION.REDUCE and rank == 1):
        for p, e in zip(params, expected):
            assert torch.equal(p.grad, e), "fused result differs from per-param collective"
        return torch.cat([p.grad.reshape(-1) for p in params])
    if act == HOOK_ACTION.REDUCE:
        return torch.zeros(0)
    full = torch.zeros(buf.buffer_size)
    for p, e in zip(params, expected):
        index = buf._sharding_param_grad_view[p]._index
        full[index : index + p.numel()] = e.reshape(-1)
    shard = buf.buffer_size // world
    mine = buf.grad_storage[rank * shard : (rank + 1) * shard]
    assert torch.equal(mine, full[rank * shard : (rank + 1) * shard])
    _assert_padding_zero(buf, params)
    for p in params:
        view = buf._sharding_param_grad_view[p]
        if view._slice_grad is not None:
            assert torch.equal(view._slice_grad, full[view._param_begin : view._param_end])
    return mine.clone()


def _assert_padding_zero(buf, params):
    used = torch.zeros(buf.buffer_size, dtype=torch.bool)
    for p in params:
        index = buf._sharding_param_grad_view[p]._index
        used[index : index + p.numel()] = True
    assert torch.all(buf.grad_storage[~used] == 0), "grad padding is not zero"
    assert torch.all(buf.param_storage[~used] == 0), "param padding is not zero"


def _check_lifetime(rank, world):
    """Release on: absent before each step's first check-in, one allocation per step, freed
    after release. Release off: one buffer at one address that every grad shares."""
    for act in ACTIONS:
        params = _new_params([(33,), (5, 5)])
        dst = 0 if act == HOOK_ACTION.REDUCE else -1
        buf = FusedCommBuffer(0, params, None, 2, act, dst, release_grads=True)
        for p in params:
            p.register_post_accumulate_grad_hook(bw_hook_func(buf, p))
        zeros, calls = torch.zeros, []

        def counting_zeros(*args, **kwargs):
            calls.append(args)
            return zeros(*args, **kwargs)

        for step in range(3):
            assert buf.grad_storage is None
            torch.zeros = counting_zeros
            try:
                for k in range(2):
                    _backward_int_grads(params, rank, step, k)
            finally:
                torch.zeros = zeros
            assert [c for c in calls if c[0] == buf.buffer_size] == [(buf.buffer_size,)]
            calls.clear()
            buf.scale_grads()
            old = weakref.ref(buf.grad_storage)
            for p in params:
                p.grad = None  # the caller drops the grads (clear_grad(set_to_zero=False))
            buf._clear_grad_storage()
            assert _released(old), "the released buffer is still alive"
        buf._clear_grad_storage()  # documented no-op: nothing allocated this step

        params = _new_params([(33,), (5, 5)])
        buf = FusedCommBuffer(0, params, None, 2, act, dst, release_grads=False)
        for p in params:
            p.register_post_accumulate_grad_hook(bw_hook_func(buf, p))
        address = buf.grad_storage.data_ptr()
        for step in range(3):
            for k in range(2):
                _backward_int_grads(params, rank, step, k)
            buf.scale_grads()
            assert buf.grad_storage.data_ptr() == address
            for p in params:
                assert p.grad.untyped_storage().data_ptr() == address
                p.grad.zero_()


def _check_main_grad(rank, world):
    """bf16 params, fp32 main_grad, 2 micro-batches of 128 and 0.5: exactly 128.5."""
    one = torch.ones((), dtype=torch.bfloat16)
    assert (one * 128 + one * 0.5).item() == 128.0, "bf16 alone would lose the 0.5"
    for act in (HOOK_ACTION.ALL_REDUCE, HOOK_ACTION.REDUCE_SCATTER):
        outs = []
        for release in (False, True):
            (p,) = _new_params([(6,)], torch.bfloat16)
            register_main_grad_hooks([p])
            buf = FusedCommBuffer(0, [p], None, 2, act, release_grads=release)
            assert buf.use_main_grad and (release or buf.grad_storage.dtype == torch.float32)
            p.register_post_accumulate_grad_hook(bw_hook_func(buf, p))
            for step in range(3):
                for scale in (128.0, 0.5):
                    (p * scale).sum().backward()
                    assert p.grad is None
                buf.scale_grads()
                assert p.main_grad.dtype == torch.float32
                if act == HOOK_ACTION.ALL_REDUCE:
                    assert torch.all(p.main_grad == 128.5)
                view = (buf._sharding_param_grad_view[p]
                        if act == HOOK_ACTION.REDUCE_SCATTER else None)
                if view is not None and view._slice_grad is not None:
                    assert torch.all(view._slice_grad[: max(0, 6 - view._param_begin)] == 128.5)
                outs.append(buf.grad_storage.clone())
                if release:
                    p.main_grad = None
                    buf._clear_grad_storage()
                else:
                    p.main_grad.zero_()
        assert all(torch.equal(a, b) for a, b in zip(outs[:3], outs[3:]))


def _check_misuse(rank, world):
    """Bad arguments and misuse raise clear errors on every rank."""
    params = _new_params([(4,), (3,)])
    with pytest.raises(ValueError, match="act must be"):
        FusedCommBuffer(0, params, None, act=None)
    with pytest.raises(ValueError, match="act must be"):
        FusedCommBuffer(0, params, None, act=7)
    with pytest.raises(ValueError, match="needs dst"):
        FusedCommBuffer(0, params, None, act=HOOK_ACTION.REDUCE)
    with pytest.raises(ValueError, match="only meaningful with act=REDUCE"):
        FusedCommBuffer(0, params, None, act=HOOK_ACTION.ALL_REDUCE, dst=0)
    with pytest.raises(ValueError, match="fuse_param=True and release_grads=True"):
        FusedCommBuffer(0, params, None, act=HOOK_ACTION.ALL_REDUCE, fuse_param=True,
                        release_grads=True)
    with pytest.raises(ValueError, match="at least one param"):
        FusedCommBuffer(0, [], None, act=HOOK_ACTION.ALL_REDUCE)
    buf = FusedCommBuffer(0, params, None, act=HOOK_ACTION.ALL_REDUCE)
    with pytest.raises(ValueError, match="not in bucket"):
        buf.add_grad(nn.Parameter(torch.zeros(4)))
    for p in params:
        p.register_post_accumulate_grad_hook(bw_hook_func(buf, p))
    params[0].grad = params[0].grad * 2  # out of place: the grad leaves its slot
    with pytest.raises(ValueError, match="address of the grad"):
        sum(p.sum() for p in params).backward()
    with pytest.raises(RuntimeError, match=r"no collective in flight.*missing: #0 \(0 of 1\)"):
        buf.scale_grads()
    with pytest.raises(RuntimeError, match="release_grads=False: its grad buffer must persist"):
        buf._clear_grad_storage()
    for acc_steps in (0, 2.5):
        with pytest.raises(ValueError, match="acc_steps must be an int >= 1"):
            FusedCommBuffer(0, _new_params([(4,)]), None, acc_steps, act=HOOK_ACTION.ALL_REDUCE)
    with pytest.raises(ValueError, match="do not require grad"):
        FusedCommBuffer(0, [torch.zeros(3)], None, act=HOOK_ACTION.ALL_REDUCE)
    with pytest.raises(ValueError, match=f"dst={world} must be the global rank of a member"):
        FusedCommBuffer(0, _new_params([(4,)]), None, act=HOOK_ACTION.REDUCE, dst=world)

    # release on, used by hand: each skipped part of the step raises at the next check-in
    params = _new_params([(4,), (3,)])
    buf = FusedCommBuffer(0, params, None, 2, act=HOOK_ACTION.ALL_REDUCE, release_grads=True)
    for p in params:
        p.register_post_accumulate_grad_hook(bw_hook_func(buf, p))
    for _ in range(2):
        _backward_int_grads(params, rank, 0, 0)
    buf.scale_grads()
    for p in params:
        p.grad = None  # the optimizer's zero_grad(), but no _clear_grad_storage()
    with pytest.raises(ValueError, match="new step started while last step's grad buffer"):
        _backward_int_grads(params, rank, 1, 0)
    buf._clear_grad_storage()
    _backward_int_grads(params, rank, 1, 0)
    for p in params:
        p.grad = None  # zero_grad() between micro-batches
    with pytest.raises(ValueError, match="address of the grad"):
        _backward_int_grads(params, rank, 1, 1)
    buf._clear_grad_storage()  # drops the half step: its check-ins go with it
    for k in range(2):
        _backward_int_grads(params, rank, 2, k)
    buf.scale_grads()

    # main-grad hooks registered after the buffer's: add_grad would read a stale main_grad
    (p,) = _new_params([(6,)], torch.bfloat16)
    p.main_grad = None
    buf = FusedCommBuffer(0, [p], None, 2, act=HOOK_ACTION.ALL_REDUCE, release_grads=True)
    p.register_post_accumulate_grad_hook(bw_hook_func(buf, p))
    register_main_grad_hooks([p])
    with pytest.raises(ValueError, match="must be registered before the buffer's hooks"):
        p.sum().backward()
    # fuse_param (without release) moves params into one flat buffer
    fused = _new_params([(4,), (3,)])
    values = [p.detach().clone() for p in fused]
    buf = FusedCommBuffer(0, fused, None, act=HOOK_ACTION.ALL_REDUCE, fuse_param=True)
    assert fused[1].data_ptr() == buf.param_storage[buf.param2offset[fused[1]]:].data_ptr()
    assert all(torch.equal(p, v) for p, v in zip(fused, values))


def _comm_buffer_worker(rank, world):
    torch.manual_seed(0)
    _check_layout(rank, world)
    _check_actions(rank, world)
    _check_lifetime(rank, world)
    _check_main_grad(rank, world)
    _check_misuse(rank, world)
    return "ok"


@pytest.mark.parametrize("world", [2, 4])
def test_comm_buffer(world):
    """Check layout, the three actions (acc 1 and 4), lifetime, fp32 main grads and misuse."""
    assert launch(_comm_buffer_worker, world, timeout=TIMEOUT) == ["ok"] * world


def test_assign_group_by_size():
    """Check buckets close at the byte cap, keep one dtype each, and keep param order."""
    ps = [torch.zeros(100), torch.zeros(100, dtype=torch.bfloat16), torch.zeros(100),
          torch.zeros(50), torch.zeros(10)]
    groups = comm_buffer.assign_group_by_size(ps, group_size=800)
    assert [[id(p) for p in g] for g in groups.values()] == [
        [id(ps[0]), id(ps[2])], [id(ps[1])], [id(ps[3]), id(ps[4])]]
    late = [torch.zeros(10, dtype=torch.bfloat16), torch.zeros(300)]  # closes first
    groups = comm_buffer.assign_group_by_size(late, group_size=800)
    assert [[id(p) for p in g] for g in groups.values()] == [[id(late[0])], [id(late[1])]]
    with pytest.raises(ValueError, match="group_size"):
        comm_buffer.assign_group_by_size(ps, group_size=0)


# ---------------------------------------------------------------- sharding.py

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


def _sharded(hcg, strategy, version, make_model, opt_name, steps, batch, set_to_none,
             sched=False):
    """Distributed: each data replica trains on its slice of the same batch."""
    model = make_model()
    cls = DygraphShardingOptimizerV2 if version == 2 else DygraphShardingOptimizer
    opt = cls(OPTIMIZERS[opt_name](model.parameters()), hcg, strategy)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if sched else None
    replicas = strategy.dp_degree * strategy.sharding_degree
    replica = hcg.get_data_parallel_rank() * strategy.sharding_degree \
        + hcg.get_sharding_parallel_rank()
    traj = []
    for step in range(steps):
        x, y = (t.chunk(replicas)[replica] for t in _data(step, batch, *_io(model)))
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        if scheduler:
            scheduler.step()
        traj.append([p.detach().clone() for p in model.parameters()])
    return traj, model, opt


def _check_against_oracle(hcg, strategy, make_model, steps=3, batch=8, sched=False):
    """v1/v2 x SGD/Adam x release off/on: oracle-equal each step, equal across sharding ranks,
    release on == off bitwise, non-zero updates; zero_grad() works with release on."""
    group = hcg.get_sharding_parallel_group()
    for version in (1, 2):
        for opt_name in ("sgd", "adam"):
            oracle = _oracle(make_model, opt_name, steps, batch, sched)
            trajs = {}
            for release in (False, True):
                st = copy.deepcopy(strategy)
                st.pp_configs.release_gradients = release
                # torch's default zero_grad() (set_to_none=True) between steps, except where
                # it is an error (v2 with release off: tested in _check_sharding_lifetime)
                set_to_none = release or version == 1
                trajs[release], _, opt = _sharded(hcg, st, version, make_model, opt_name,
                                                  steps, batch, set_to_none, sched=sched)
                for step, (got, want) in enumerate(zip(trajs[release], oracle)):
                    for g, w in zip(got, want):
                        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
                    assert _same_on_all(got, group)
                    if step:
                        assert any(not torch.equal(a, b)
                                   for a, b in zip(got, trajs[release][step - 1]))
            for off, on in zip(trajs[False], trajs[True]):
                assert all(torch.equal(a, b) for a, b in zip(off, on))


def _check_edges(hcg, strategy):
    """11 elements; v1 with a rank that owns nothing; v2 with padding-only shards."""
    world = strategy.sharding_degree
    _check_against_oracle(hcg, strategy, lambda: _mlp([3, 2, 1]))  # 6 + 2 + 2 + 1 elements
    def three_tensors():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 1, bias=False))

    def three_elements():
        torch.manual_seed(0)
        return nn.Linear(3, 1, bias=False)

    for version, make_model in ((1, three_tensors), (2, three_elements)):
        for release in (False, True):
            st = copy.deepcopy(strategy)
            st.pp_configs.release_gradients = release
            traj, model, opt = _sharded(hcg, st, version, make_model, "adam", 3, 8, release)
            for got, want in zip(traj, _oracle(make_model, "adam", 3, 8)):
                for g, w in zip(got, want):
                    torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
            rank = hcg.get_sharding_parallel_rank()
            if version == 1 and world == 4:  # largest first, each to the least loaded rank
                model = nn.Sequential(nn.Linear(2, 1), nn.Linear(4, 4))  # 2, 1, 16, 4 elements
                v1 = DygraphShardingOptimizer(OPTIMIZERS["sgd"](model.parameters()), hcg, st)
                assert [v1._param2rank[p] for p in model.parameters()] == [2, 3, 0, 1]
            if version == 1:
                empty = rank not in opt._param2rank.values()
                assert empty == (world == 4 and rank == 3)
            else:
                empty = rank > 0  # 3 elements padded to 64 * world: only rank 0 holds any
            if empty:
                assert len(opt.state) == 0, "a rank with nothing to own holds optimizer state"


def _grad_refs(model, opt):
    tensors = []
    for p in list(model.parameters()) + list(getattr(opt, "_slice_params", {}).values()):
        tensors += [p.grad, getattr(p, "main_grad", None)]
    for buf in getattr(opt, "_comm_buffer_list", []):
        tensors.append(buf.grad_storage)
        tensors += [v._slice_grad for v in buf._sharding_param_grad_view.values()]
    return tensors


def _check_sharding_lifetime(hcg, strategy):
    """v2: release on frees every grad, main_grad, slice grad and buffer after step() +
    clear_grad(set_to_zero=False); release off keeps them at one address; misuse raises."""
    for main_grad in (False, True):
        for release in (False, True):
            st = copy.deepcopy(strategy)
            st.pp_configs.release_gradients = release
            model = _mlp([6, 16, 4])
            if main_grad:
                register_main_grad_hooks(model.parameters())
            opt = DygraphShardingOptimizerV2(OPTIMIZERS["sgd"](model.parameters()), hcg, st)
            addresses = None
            for step in range(3):
                x, y = _data(step, 8, 6, 4)
                F.mse_loss(model(x), y).backward()
                opt.step()
                (buf,) = opt._comm_buffer_list
                storage = weakref.ref(buf.grad_storage)
                if release:
                    opt.clear_grad(set_to_zero=False)
                    assert _released(storage), "the released grad buffer is still alive"
                    assert all(t is None for t in _grad_refs(model, opt))
                else:
                    opt.clear_grad()
                    now = [t.data_ptr() for t in _grad_refs(model, opt) if t is not None]
                    assert addresses in (None, now) and len(now) > 0
                    addresses = now
            if not release:
                with pytest.raises(ValueError, match="should not erase grad buffer"):
                    opt.zero_grad()  # torch's default set_to_none=True


def _check_unused_param(hcg, strategy):
    """v2 with a param that gets no grad: release on and off give the same bits."""
    trajs = {}
    for release in (False, True):
        st = copy.deepcopy(strategy)
        st.pp_configs.release_gradients = release
        model = nn.ModuleList([_mlp([6, 16, 4]), nn.Linear(3, 3)])  # [1] is never called
        opt = DygraphShardingOptimizerV2(OPTIMIZERS["adam"](model.parameters()), hcg, st)
        trajs[release] = []
        for step in range(3):
            x, y = _data(step, 8, 6, 4)
            F.mse_loss(model[0](x), y).backward()
            opt.step()
            with pytest.raises(RuntimeError, match="step\\(\\) ran again without clear_grad"):
                opt.step()
            opt.zero_grad(set_to_none=release)
            trajs[release].append([p.detach().clone() for p in model.parameters()])
        if release:  # zero_grad() between backward and step() drops every grad
            F.mse_loss(model[0](x), y).backward()
            opt.zero_grad()
            with pytest.raises(ValueError, match="did zero_grad\\(\\) run between backward"):
                opt.step()
    for off, on in zip(trajs[False], trajs[True]):
        assert all(torch.equal(a, b) for a, b in zip(off, on))


def _check_sched_and_state(hcg, strategy):
    """A torch LR scheduler drives the wrapper; state_dict round-trips this rank's state."""
    _check_against_oracle(hcg, strategy, lambda: _mlp([6, 16, 4]), sched=True)
    for version in (1, 2):
        cls = DygraphShardingOptimizerV2 if version == 2 else DygraphShardingOptimizer
        model = _mlp([6, 16, 4])
        opt = cls(OPTIMIZERS["adam"](model.parameters()), hcg, strategy)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        x, y = _data(0, 8, 6, 4)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        scheduler.step()
        assert opt.param_groups[0]["lr"] == 5e-4
        assert opt._inner_opt._inner_opt.param_groups[0]["lr"] == 5e-4
        saved, params = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())

        def third_step(m, o):
            x, y = _data(1, 8, 6, 4)
            F.mse_loss(m(x), y).backward()
            o.step()
            return [p.detach().clone() for p in m.parameters()]

        want = third_step(model, opt)
        model2 = _mlp([6, 16, 4])
        opt2 = cls(OPTIMIZERS["adam"](model2.parameters()), hcg, strategy)
        model2.load_state_dict(params)
        opt2.load_state_dict(saved)
        assert all(torch.equal(a, b) for a, b in zip(third_step(model2, opt2), want))


def _check_main_grad_sharding(hcg, strategy):
    """bf16 params with fp32 main grads and masters: release on == off, close to the oracle."""
    def make():
        model = _mlp([6, 16, 4]).to(torch.bfloat16)
        register_main_grad_hooks(model.parameters())
        return model

    for version in (1, 2):
        cls = DygraphShardingOptimizerV2 if version == 2 else DygraphShardingOptimizer
        trajs = {}
        for release in (False, True):
            st = copy.deepcopy(strategy)
            st.pp_configs.release_gradients = release
            model = make()
            opt = cls(OPTIMIZERS["adam"](model.parameters()), hcg, st)
            trajs[release] = []
            for step in range(3):
                x, y = (t.chunk(2)[hcg.get_sharding_parallel_rank()].bfloat16()
                        for t in _data(step, 8, 6, 4))
                F.mse_loss(model(x).float(), y.float()).backward()
                assert all(p.grad is None and p.main_grad.dtype == torch.float32
                           for p in model.parameters())
                opt.step()
                opt.zero_grad(set_to_none=release)
                trajs[release].append([p.detach().clone() for p in model.parameters()])
        for off, on in zip(trajs[False], trajs[True]):
            assert all(torch.equal(a, b) for a, b in zip(off, on))
        model = make()
        start = [p.detach().clone() for p in model.parameters()]
        opt = MixPrecisionOptimizer(OPTIMIZERS["adam"](model.parameters()))
        for step in range(3):
            x, y = (t.bfloat16() for t in _data(step, 8, 6, 4))
            F.mse_loss(model(x).float(), y.float()).backward()
            opt.step()
            opt.zero_grad()
        assert all(not torch.equal(a, b) for a, b in zip(start, model.parameters()))
        for got, want in zip(trajs[True][-1], model.parameters()):
            torch.testing.assert_close(got.float(), want.detach().float(), rtol=0, atol=2e-2)


def _sharding_worker(rank, world):
    if world == 2:
        strategy = _strategy(sharding=2)
        hcg = HybridCommunicateGroup(strategy)
        _check_against_oracle(hcg, strategy, lambda: _mlp([6, 16, 4]))
        _check_sharding_lifetime(hcg, strategy)
        _check_unused_param(hcg, strategy)
        _check_sched_and_state(hcg, strategy)
        _check_main_grad_sharding(hcg, strategy)
    else:
        strategy = _strategy(sharding=4)
        hcg = HybridCommunicateGroup(strategy)
        _check_edges(hcg, strategy)
        strategy = _strategy(dp=2, sharding=2)  # data parallel beside sharding
        hcg = HybridCommunicateGroup(strategy)
        assert hcg.get_data_parallel_rank() == rank // 2
        assert hcg.get_sharding_parallel_rank() == rank % 2
        _check_against_oracle(hcg, strategy, lambda: _mlp([6, 16, 4]))
    return "ok"


@pytest.mark.parametrize("world", [2, 4])
def test_sharding(world):
    """Check v1 and v2 against one process, release on vs off, lifetime, edges and dp."""
    assert launch(_sharding_worker, world, timeout=TIMEOUT) == ["ok"] * world


# ---------------------------------------------------------------- pipeline.py

PIPE_SIZES = [6, 8, 8, 8, 4]


def _pipe_layers(dtype=torch.float32, main_grad=False):
    layers = list(_mlp(PIPE_SIZES, seed=3).to(dtype))
    if main_grad:
        register_main_grad_hooks([p for layer in layers for p in layer.parameters()])
    return layers


def _mse(out, y):
    return F.mse_loss(out.float(), y.float())


def _expected_1f1b(stages, stage, acc):
    warm = min(stages - stage - 1, acc)
    trace = [("F", k) for k in range(warm)]
    for i in range(acc - warm):
        trace += [("F", warm + i), ("B", i)]
    return trace + [("B", acc - warm + j) for j in range(warm)]


def _pipe_run(hcg, strategy, opt_name, steps, mbs, wrap=None, dtype=torch.float32,
              main_grad=False, probe=None):
    """Train a pipeline; return (losses, params after each step, model) of this rank."""
    model = PipelineParallel(_pipe_layers(dtype, main_grad), hcg, strategy, _mse)
    opt = OPTIMIZERS[opt_name](model.parameters())
    if wrap:
        opt = wrap(opt, hcg, strategy)
    acc = strategy.accumulate_steps
    replicas = strategy.dp_degree * strategy.sharding_degree
    replica = hcg.get_data_parallel_rank() * strategy.sharding_degree \
        + hcg.get_sharding_parallel_rank()
    losses, traj = [], []
    for step in range(steps):
        x, y = (t.chunk(replicas)[replica].to(dtype)
                for t in _data(step, replicas * acc * mbs, PIPE_SIZES[0], PIPE_SIZES[-1]))
        losses.append(probe(model, opt, (x, y), step) if probe else model.train_batch((x, y), opt))
        traj.append([p.detach().clone() for p in model.parameters()])
        assert model.schedule_trace == _expected_1f1b(model.num_stages, model.stage_id, acc)
    return losses, traj, model


def _pipe_oracle(opt_name, steps, batch, dtype=torch.float32, main_grad=False):
    model = nn.Sequential(*_pipe_layers(dtype, main_grad))
    opt = OPTIMIZERS[opt_name](model.parameters())
    if main_grad:
        opt = MixPrecisionOptimizer(opt)
    losses, traj = [], []
    for step in range(steps):
        x, y = (t.to(dtype) for t in _data(step, batch, PIPE_SIZES[0], PIPE_SIZES[-1]))
        loss = _mse(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        traj.append([p.detach().clone() for p in model.parameters()])
    return losses, traj


def _stage_slice(model, hcg):
    """Indices of this stage's params within the whole model's parameter list."""
    counts = [len(list(layer.parameters())) for layer in _pipe_layers()]
    bounds = [len(counts) * s // model.num_stages for s in range(model.num_stages + 1)]
    s = hcg.get_stage_id()
    return slice(sum(counts[: bounds[s]]), sum(counts[: bounds[s + 1]]))


def _release_probe(collectives):
    """train_batch, checking the buffers' life and when each bucket's collective fires."""
    def probe(model, opt, data, step):
        buffers = [b for bs in model._chunk_2_comm_buffers.values() for b in bs]
        release = model._release_gradients
        assert not release or all(b.grad_storage is None for b in buffers)
        first_copy = []
        original = FusedCommBuffer._copy_grad_to_buffer

        def spy(self, param):
            first_copy.append(self.grad_storage is None)
            return original(self, param)

        FusedCommBuffer._copy_grad_to_buffer = spy
        collectives.clear()
        try:
            model._prepare_training(opt, None)
            model.train()
            loss = model.forward_backward_pipeline(data)
        finally:
            FusedCommBuffer._copy_grad_to_buffer = original
        buffers = [b for bs in model._chunk_2_comm_buffers.values() for b in bs]
        last = ("B", model.accumulate_steps - 1)
        for b in buffers:  # one collective per bucket, in the last micro-batch's backward
            assert [when for t, when in collectives if t is b.grad_storage] == [last]
        if release and buffers:
            assert first_copy[0] is True and first_copy.count(True) == len(buffers)
        collectives.clear()  # it holds the buffers too
        storages = [weakref.ref(b.grad_storage) for b in buffers]
        model._optimizer_step()
        if release:
            assert all(b.grad_storage is None for b in buffers)
            assert _released(*storages), "a released buffer is still alive"
            assert all(p.grad is None and getattr(p, "main_grad", None) is None
                       for p in model.parameters()), "release leaves no grad behind"
            model.eval_batch(data)
            assert all(b.grad_storage is None for b in buffers)
        return loss
    return probe


def _spy_collectives(model_ref, collectives):
    """Wrap the buffers' collectives to record (tensor, schedule position) of each call;
    returns a function that puts the originals back."""
    originals = {name: getattr(dist, name)
                 for name in ("all_reduce", "reduce", "reduce_scatter_single")}
    for name, original in originals.items():

        def wrapped(tensor, *args, _original=original, _name=name, **kwargs):
            buffer_tensor = args[0] if _name == "reduce_scatter_single" else tensor
            model = model_ref[0]
            if model is not None and model.schedule_trace:
                collectives.append((buffer_tensor, model.schedule_trace[-1]))
            return _original(tensor, *args, **kwargs)

        setattr(dist, name, wrapped)
    return lambda: [setattr(dist, name, fn) for name, fn in originals.items()]


def _check_pipeline(hcg, base, wrap, opt_name="adam", dtype=torch.float32, main_grad=False,
                    steps=3, mbs=2):
    """Release off and on: per step equal to one process, and bitwise equal to each other."""
    replicas = base.dp_degree * base.sharding_degree
    oracle_losses, oracle = _pipe_oracle(opt_name, steps, replicas * base.accumulate_steps * mbs,
                                         dtype, main_grad)
    runs, collectives, model_ref = {}, [], [None]
    restore = _spy_collectives(model_ref, collectives)
    try:
        for release in (False, True):
            strategy = copy.deepcopy(base)
            strategy.pp_configs.release_gradients = release
            probe = _release_probe(collectives)

            def tracked(model, opt, data, step, probe=probe):
                model_ref[0] = model
                return probe(model, opt, data, step)

            losses, traj, model = _pipe_run(hcg, strategy, opt_name, steps, mbs, wrap, dtype,
                                            main_grad, tracked)
            runs[release] = (losses, traj)
            part = _stage_slice(model, hcg)
            tol = dict(rtol=0, atol=2e-2) if main_grad else dict(rtol=1e-5, atol=1e-6)
            for loss, got, want_loss, want in zip(losses, traj, oracle_losses, oracle):
                assert _same_on_all([loss], hcg.get_pipe_parallel_group())
                mean = loss.clone()
                dist.all_reduce(mean)
                torch.testing.assert_close(mean / dist.get_world_size(), want_loss, **tol)
                for g, w in zip(got, want[part]):
                    torch.testing.assert_close(g.float(), w.float(), **tol)
    finally:
        restore()
    (l_off, t_off), (l_on, t_on) = runs[False], runs[True]
    assert all(torch.equal(a, b) for a, b in zip(l_off, l_on))
    assert all(torch.equal(a, b) for s_off, s_on in zip(t_off, t_on) for a, b in zip(s_off, s_on))


def _pipeline_worker_4(rank, world):
    v1 = lambda opt, hcg, st: DygraphShardingOptimizer(opt, hcg, st)
    v2 = lambda opt, hcg, st: DygraphShardingOptimizerV2(opt, hcg, st)
    strategy = _strategy(pp=2, sharding=2, acc=4, sharding_comm_overlap=True)
    hcg = HybridCommunicateGroup(strategy)
    assert (hcg.get_stage_id(), hcg.get_sharding_parallel_rank()) == divmod(rank, 2)
    assert hcg.get_rank_from_stage(1) == 2 + rank % 2
    _check_pipeline(hcg, strategy, v1)
    split = copy.deepcopy(strategy)
    split.sharding_configs.split_param = True
    _check_pipeline(hcg, split, v2, opt_name="sgd")
    _check_pipeline(hcg, split, v2, dtype=torch.bfloat16, main_grad=True)
    no_overlap = copy.deepcopy(split)
    no_overlap.pp_configs.sharding_comm_overlap = False
    _check_pipeline(hcg, no_overlap, v2)  # v2's own buffers: the #58621 path
    strategy = _strategy(dp=2, pp=2, acc=4, dp_comm_overlap=True)
    hcg = HybridCommunicateGroup(strategy)
    _check_pipeline(hcg, strategy, None)
    # dp without overlap; SGD, since Adam would hide a missing 1/dp
    _check_pipeline(hcg, _strategy(dp=2, pp=2, acc=4), None, opt_name="sgd", steps=2)

    # explicit boundaries; a first stage without params builds no buffer and still runs
    torch.manual_seed(5)
    layers = [nn.Tanh(), nn.Linear(6, 4)]
    oracle = copy.deepcopy(nn.Sequential(*layers))
    model = PipelineParallel(layers, hcg, strategy, _mse, seg_boundaries=[0, 1, 2])
    assert list(model._layers) == [layers[hcg.get_stage_id()]]
    assert bool(model._chunk_2_comm_buffers) == (hcg.get_stage_id() == 1)
    x, y = _data(0, 16, 6, 4)
    model.forward_backward_pipeline(tuple(t.chunk(2)[hcg.get_data_parallel_rank()]
                                          for t in (x, y)))
    _mse(oracle(x), y).backward()
    for got, want in zip(model.parameters(), oracle[1].parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-7)
    return "ok"


def _pipeline_worker_2(rank, world):
    strategy = _strategy(pp=2, acc=4)
    hcg = HybridCommunicateGroup(strategy)
    _check_pipeline(hcg, strategy, None, opt_name="sgd")
    delay = copy.deepcopy(strategy)
    delay.pp_configs.delay_scale_loss = True
    _check_pipeline(hcg, delay, None, opt_name="sgd")

    # 4 micro-batches of 1 sample == 1 micro-batch of 4 samples: the loss is scaled once
    grads = []
    for acc, mbs in ((4, 1), (1, 4)):
        model = PipelineParallel(_pipe_layers(), hcg, _strategy(pp=2, acc=acc), _mse)
        model.forward_backward_pipeline(_data(0, 4, PIPE_SIZES[0], PIPE_SIZES[-1]))
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)

    model = PipelineParallel(_pipe_layers(), hcg, strategy, _mse)
    assert len(model._layers) == (3, 4)[hcg.get_stage_id()]  # 7 layers: [0, 3) and [3, 7)
    x, y = _data(0, 8, PIPE_SIZES[0], PIPE_SIZES[-1])
    want = _mse(nn.Sequential(*_pipe_layers())(x), y)
    torch.testing.assert_close(model.eval_batch((x, y)), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="does not split into accumulate_steps=4"):
        model.train_batch((x[:6], y[:6]), torch.optim.SGD(model.parameters(), lr=0.1))
    for flags, match in (({"dp_comm_overlap": True}, "dp_comm_overlap needs dp_degree > 1"),
                         ({"sharding_comm_overlap": True}, "needs sharding_degree > 1"),
                         ({"dp_comm_overlap": True, "sharding_comm_overlap": True},
                          "cannot both be on")):
        with pytest.raises(ValueError, match=match):
            PipelineParallel(_pipe_layers(), hcg, _strategy(pp=2, acc=4, **flags), _mse)
    return "ok"


@pytest.mark.parametrize("world", [2, 4])
def test_pipeline(world):
    """Check 1F1B against one process (pp 2; pp 2 x sharding 2 v1/v2; pp 2 x dp 2), release on
    vs off, collective timing, buffer lifetime, loss scaling and config errors."""
    worker = _pipeline_worker_2 if world == 2 else _pipeline_worker_4
    assert launch(worker, world, timeout=TIMEOUT) == ["ok"] * world


def _failing_loss(out, y):
    _failing_loss.calls = getattr(_failing_loss, "calls", 0) + 1
    if _failing_loss.calls == 2:
        raise RuntimeError("injected failure in the last stage")
    return _mse(out, y)


def _failing_worker(rank, world):
    strategy = _strategy(pp=2, acc=4)
    model = PipelineParallel(_pipe_layers(), HybridCommunicateGroup(strategy), strategy,
                             _failing_loss)
    model.train_batch(_data(0, 8, PIPE_SIZES[0], PIPE_SIZES[-1]),
                      torch.optim.SGD(model.parameters(), lr=0.1))


def test_failing_rank_ends_all():
    """Check a rank that raises mid-schedule brings every rank down, well within the timeout."""
    start = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException, match="injected failure"):
        launch(_failing_worker, 2, timeout=60)
    assert time.monotonic() - start < 30


def _hanging_worker(rank, world):
    if rank == 0:
        dist.recv(torch.zeros(1), src=1)  # rank 1 never sends


def test_hang_fails_on_timeout():
    """Check a rank stuck waiting for a peer fails the launch instead of hanging."""
    start = time.monotonic()
    with pytest.raises((TimeoutError, mp.ProcessRaisedException)):
        launch(_hanging_worker, 2, timeout=8)
    assert time.monotonic() - start < 40


# ---------------------------------------------------------------- relgrad.py

def test_config_errors():
    """Check invalid strategies raise ValueError that names the rule and the values."""
    with pytest.raises(ValueError, match="pp_degree must be an int >= 1, got 0"):
        HybridStrategy(pp_degree=0)
    with pytest.raises(ValueError, match="dp_degree must be an int >= 1, got '2'"):
        HybridStrategy(dp_degree="2")
    with pytest.raises(ValueError, match="accumulate_steps must be an int >= 1"):
        HybridStrategy(accumulate_steps=0)
    with pytest.raises(ValueError, match=r"= 4 \(1 \* 2 \* 2\) must equal the world size 2"):
        HybridStrategy(pp_degree=2, sharding_degree=2).check_world_size(2)
    with pytest.raises(ValueError, match="enable_timer is not implemented"):
        PpConfig(enable_timer=True)
    with pytest.raises(ValueError, match="comm_overlap is not implemented"):
        DygraphShardingConfig(comm_overlap=True)
    strategy = HybridStrategy(pp_configs=PpConfig(release_gradients=True))
    assert strategy.hybrid_configs["pp_configs"].release_gradients is True


def _run_json(cmd):
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT,
                          cwd=str(Path(__file__).parent))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # exactly one JSON object on stdout


def test_main_job_json():
    """Check the demo end to end: off and on bitwise equal, 0 idle grad bytes with release on
    and the whole buffer with it off, the allocator agreeing with our count."""
    result = _run_json([sys.executable, "relgrad.py", "--json", "--steps", "6", "--layers", "2",
                        "--d-model", "128", "--block", "32", "--micro-batch-size", "2"])
    off, on = result["modes"]["off"], result["modes"]["on"]
    assert result["bitwise_equal"] is True and off["losses"] == on["losses"]
    assert len(off["losses"]) == 6 and off["losses"][-1] < off["losses"][0]
    assert all(n == 0 for n in on["idle_grad_bytes_counted"])
    assert all(n > 100_000 for n in off["idle_grad_bytes_counted"])
    for counted, a_off, a_on in zip(off["idle_grad_bytes_counted"],
                                    off["idle_grad_bytes_allocator"],
                                    on["idle_grad_bytes_allocator"]):
        assert abs((a_off - a_on) - counted) <= 0.05 * counted, (a_off - a_on, counted)
    assert off["step_time_s"] > 0 and on["step_time_s"] > 0


def test_torchrun_json():
    """Check `relgrad.py` joins a torchrun job (the several-machines path) and reports."""
    result = _run_json([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", "relgrad.py", "--json", "--pp", "2",
                        "--sharding", "1", "--steps", "3", "--layers", "2", "--block", "32"])
    assert result["bitwise_equal"] is True and result["stages"] == [0, 1]
    assert result["modes"]["on"]["idle_grad_bytes_counted"] == [0, 0]
    assert all(n > 0 for n in result["modes"]["off"]["idle_grad_bytes_counted"])


def test_cli_errors():
    """Check bad flags fail before any rank starts, naming the flag and the fix."""
    for args, message in ((["--pp", "0"], "--pp must be >= 1, got 0"),
                          (["--d-model", "30"], "multiple of the 4 attention heads"),
                          (["--data", "/no/such/file"], "cannot read"),
                          (["--pp", "3", "--sharding", "1", "--layers", "0"], "--layers must")):
        done = subprocess.run([sys.executable, "relgrad.py", *args], capture_output=True,
                              text=True, timeout=60, cwd=str(Path(__file__).parent))
        assert done.returncode == 2 and message in done.stderr, done.stderr


def test_live_grad_bytes():
    """Check the demo's own count: distinct storages behind grads and buffers, counted once."""
    model = nn.Linear(10, 10)  # 100 + 10 elements
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    buffer = type("Buffer", (), {"grad_storage": torch.zeros(1000)})()
    assert live_grad_bytes(model, opt, [buffer]) == 4000
    model.weight.grad = buffer.grad_storage[:100].view(10, 10)  # a view: same storage
    model.bias.grad = torch.zeros(10)
    assert live_grad_bytes(model, opt, [buffer]) == 4000 + 40
