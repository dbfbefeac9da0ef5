"""Rank-side checks of comm_buffer.py's buffer: layout, actions, lifetime, main grads, misuse."""
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from comm_buffer import FusedCommBuffer, bw_hook_func, main_grad_or_grad
from relgrad import register_main_grad_hooks
from relgrad_checks.common import (ACTIONS, _assert_bitwise, _backward_int_grads, _new_params,
                                   _released, _slot, _spy_buffers)

ALL_REDUCE, REDUCE, REDUCE_SCATTER = ACTIONS


def _check_layout(rank: int, world: int) -> None:
    """Offsets, padded sizes and buffer sizes follow Paddle's formulas."""
    params = _new_params([(1000,), (8, 8), (3,)], torch.bfloat16)
    buf = FusedCommBuffer(0, params, None, act=ALL_REDUCE, use_main_grad=True)
    slots = [_slot(p.numel(), 2) for p in params]
    assert slots == [1024, 128, 128]  # bf16: 1000 -> 1024 elements
    assert [buf.param2offset[p] for p in params] == [0, 1024, 1152]
    assert buf.buffer_size == sum(slots) and buf.grad_storage.dtype == torch.float32
    assert buf.grad_storage.numel() == buf.buffer_size
    assert params[1].main_grad.data_ptr() == buf.grad_storage[1024:].data_ptr()
    # reduce-scatter: unit (256 / 2) * world; params straddle ranks; overlaps may be empty
    params = _new_params([(300,), (10, 100), (20,)], torch.bfloat16)
    before = [p.detach().clone() for p in params]
    buf = FusedCommBuffer(0, params, None, act=REDUCE_SCATTER, release_grads=True)
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


def _hooked(params, acc=1, act=ALL_REDUCE, dst=None, **kwargs):
    """One bucket of `params` (REDUCE: to global rank 1 unless `dst`), its hooks registered."""
    if dst is None:
        dst = 1 if act == REDUCE else -1
    buf = FusedCommBuffer(0, params, None, acc, act, dst, **kwargs)
    for p in params:
        p.register_post_accumulate_grad_hook(bw_hook_func(buf, p))
    return buf


def _end_step(buf, params, release):
    """Release off: zero the (main) grads in place; on: drop main grads, release the buffer."""
    for p in params:
        if not release:
            main_grad_or_grad(p).zero_()
        elif buf.use_main_grad:
            p.main_grad = None
    if release:
        buf._clear_grad_storage()


def _buckets(shapes, accs):
    """(act, acc, release, params, buf) for each action, acc and release off / on: fresh
    params of `shapes` in a hooked bucket."""
    for act in ACTIONS:
        for acc in accs:
            for release in (False, True):
                params = _new_params(shapes)
                yield act, acc, release, params, _hooked(params, acc, act, release_grads=release)


def _check_actions(rank: int, world: int) -> None:
    """Each action equals a per-param collective done by hand; release on == off, bitwise."""
    shapes = [(7, 5), (13,), (3, 4, 2), (70,)]
    results = {}
    for act, acc, release, params, buf in _buckets(shapes, (1, 4)):
        results[act, acc, release] = []
        for step in range(3):
            local = [torch.zeros(s) for s in shapes]
            for k in range(acc):
                assert buf._task is None, "the collective fired before the last check-in"
                assert not (release and k == 0) or buf.grad_storage is None
                for acc_g, c in zip(local, _backward_int_grads(params, rank, step, k)):
                    acc_g += c
            assert buf._task is not None, "the collective did not fire"
            buf.scale_grads()
            got = _expected_and_got(buf, params, local, act, rank, world)
            results[act, acc, release].append(got)
            _end_step(buf, params, release)
            assert not release or all(p.grad is None for p in params)
    for (act, acc, release), on in results.items():
        if release:
            for off_step, on_step in zip(results[act, acc, False], on):
                assert torch.equal(off_step, on_step)


def _expected_and_got(buf, params, local, act, rank, world):
    """Compare the buffer's result with per-param collectives on the summed local grads."""
    expected = []
    for g in local:
        g = g.clone()
        if act == REDUCE:
            dist.reduce(g, dst=1)
        else:
            dist.all_reduce(g)
        expected.append(g / world)
    if act == ALL_REDUCE or (act == REDUCE and rank == 1):
        for p, e in zip(params, expected):
            assert torch.equal(p.grad, e), "fused result differs from per-param collective"
        return torch.cat([p.grad.reshape(-1) for p in params])
    if act == REDUCE:
        return torch.zeros(0)
    full = torch.zeros(buf.buffer_size)
    used = torch.zeros(buf.buffer_size, dtype=torch.bool)
    for p, e in zip(params, expected):
        index = buf._sharding_param_grad_view[p]._index
        full[index : index + p.numel()] = e.reshape(-1)
        used[index : index + p.numel()] = True
    shard = buf.buffer_size // world
    mine = buf.grad_storage[rank * shard : (rank + 1) * shard]
    assert torch.equal(mine, full[rank * shard : (rank + 1) * shard])
    assert torch.all(buf.grad_storage[~used] == 0), "grad padding is not zero"
    assert torch.all(buf.param_storage[~used] == 0), "param padding is not zero"
    for p in params:
        view = buf._sharding_param_grad_view[p]
        if view._slice_grad is not None:
            assert torch.equal(view._slice_grad, full[view._param_begin : view._param_end])
    return mine.clone()


def _check_lifetime(rank: int, world: int) -> None:
    """Release: one allocation per step at its first check-in, freed at release; off: one place."""
    for act in ACTIONS:
        dst = 0 if act == REDUCE else -1
        params = _new_params([(33,), (5, 5)])
        buf = _hooked(params, 2, act, dst, release_grads=True)
        for step in range(3):
            assert buf.grad_storage is None
            with _spy_buffers({buf.buffer_size}) as record:
                for k in range(2):
                    _backward_int_grads(params, rank, step, k)
            assert record["zeros"] == [(buf.buffer_size,)]
            buf.scale_grads()
            old = weakref.ref(buf.grad_storage)
            for p in params:
                p.grad = None  # the caller drops the grads (clear_grad(set_to_zero=False))
            buf._clear_grad_storage()
            assert _released(old), "the released buffer is still alive"
        buf._clear_grad_storage()  # documented no-op: nothing allocated this step
        params = _new_params([(33,), (5, 5)])
        buf = _hooked(params, 2, act, dst, release_grads=False)
        address = buf.grad_storage.data_ptr()
        for step in range(3):
            for k in range(2):
                _backward_int_grads(params, rank, step, k)
            buf.scale_grads()
            assert buf.grad_storage.data_ptr() == address
            for p in params:
                assert p.grad.untyped_storage().data_ptr() == address
                p.grad.zero_()


def _check_main_grad(rank: int, world: int) -> None:
    """bf16 params, fp32 main_grad, 2 micro-batches of 128 and 0.5: exactly 128.5."""
    one = torch.ones((), dtype=torch.bfloat16)
    assert (one * 128 + one * 0.5).item() == 128.0, "bf16 alone would lose the 0.5"
    for act in (ALL_REDUCE, REDUCE_SCATTER):
        outs = []
        for release in (False, True):
            (p,) = _new_params([(6,)], torch.bfloat16)
            register_main_grad_hooks([p])
            buf = _hooked([p], 2, act, release_grads=release)
            assert buf.use_main_grad and (release or buf.grad_storage.dtype == torch.float32)
            for step in range(3):
                for scale in (128.0, 0.5):
                    (p * scale).sum().backward()
                    assert p.grad is None
                buf.scale_grads()
                assert p.main_grad.dtype == torch.float32
                if act == ALL_REDUCE:
                    assert torch.all(p.main_grad == 128.5)
                view = buf._sharding_param_grad_view[p] if act == REDUCE_SCATTER else None
                if view is not None and view._slice_grad is not None:
                    assert torch.all(view._slice_grad[: max(0, 6 - view._param_begin)] == 128.5)
                outs.append(buf.grad_storage.clone())
                _end_step(buf, [p], release)
        _assert_bitwise(outs[:3], outs[3:])


def _check_misuse(rank: int, world: int) -> None:
    """Bad arguments and misuse raise clear errors on every rank."""
    params = _new_params([(4,), (3,)])
    for match, built_of, args, kwargs in (
            ("act must be", params, (), {"act": None}), ("act must be", params, (), {"act": 7}),
            ("needs dst", params, (), {"act": REDUCE}),
            ("only meaningful with act=REDUCE", params, (), {"act": ALL_REDUCE, "dst": 0}),
            ("fuse_param=True and release_grads=True", params, (),
             {"act": ALL_REDUCE, "fuse_param": True, "release_grads": True}),
            ("at least one param", [], (), {"act": ALL_REDUCE}),
            ("acc_steps must be an int >= 1", _new_params([(4,)]), (0,), {"act": ALL_REDUCE}),
            ("acc_steps must be an int >= 1", _new_params([(4,)]), (2.5,), {"act": ALL_REDUCE}),
            ("do not require grad", [torch.zeros(3)], (), {"act": ALL_REDUCE}),
            (f"needs dst, the owner's global rank in comm_group.*got {world}",
             _new_params([(4,)]), (), {"act": REDUCE, "dst": world})):
        with pytest.raises(ValueError, match=match):
            FusedCommBuffer(0, built_of, None, *args, **kwargs)
    buf = FusedCommBuffer(0, params, None, act=ALL_REDUCE)
    with pytest.raises(ValueError, match="not in bucket"):
        buf.add_grad(nn.Parameter(torch.zeros(4)))
    for p in params:
        p.register_post_accumulate_grad_hook(bw_hook_func(buf, p))
    params[0].grad = params[0].grad * 2  # out of place between steps: back in its slot (DDP)
    sum(p.sum() for p in params).backward()
    buf.scale_grads()
    assert params[0].grad.data_ptr() == buf.grad_storage.data_ptr()
    assert torch.equal(params[0].grad, torch.ones(4))
    with pytest.raises(RuntimeError, match=r"no collective in flight.*missing: #0 \(0 of 1\)"):
        buf.scale_grads()
    (lone,) = _new_params([(4,)])
    lone_buf = _hooked([lone], 2)  # kept alive: the hooks hold it weakly
    lone.sum().backward()
    lone.grad = lone.grad * 2  # out of place within a step
    with pytest.raises(ValueError, match="address of the grad"):
        lone.sum().backward()
    with pytest.raises(RuntimeError, match="release_grads=False: its grad buffer must persist"):
        buf._clear_grad_storage()
    _check_skipped_parts(rank)


def _check_skipped_parts(rank):
    """Release by hand: a skipped part of a step or a stale main_grad raises; fuse_param."""
    params = _new_params([(4,), (3,)])
    buf = _hooked(params, 2, release_grads=True)
    for _ in range(2):
        _backward_int_grads(params, rank, 0, 0)
    buf.scale_grads()
    for p in params:
        p.grad = None  # the optimizer's zero_grad(), but no _clear_grad_storage()
    with pytest.raises(ValueError,
                       match="a backward reached its params while last step's buffer is allocated"):
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
    buf = _hooked([p], 2, release_grads=True)
    register_main_grad_hooks([p])
    with pytest.raises(ValueError, match="register_main_grad_hooks before the buffer's hooks"):
        p.sum().backward()
    fused = _new_params([(4,), (3,)])
    values = [p.detach().clone() for p in fused]
    buf = FusedCommBuffer(0, fused, None, act=ALL_REDUCE, fuse_param=True)
    assert fused[1].data_ptr() == buf.param_storage[buf.param2offset[fused[1]]:].data_ptr()
    _assert_bitwise(fused, values)


def _signed_zero_grads(params, k):
    """One micro-batch: `params[0]`'s grad nonzero, `params[1]`'s -0.0 everywhere."""
    p, z = params
    c = torch.rand(z.shape, generator=torch.Generator().manual_seed(k)) + 1
    ((p * (k + 1)).sum() + (c * z).sum() * -0.0).backward()


def _check_sign_of_zero(rank: int, world: int) -> None:
    """A grad element that is -0.0 in every micro-batch ends as +0.0, release on and off."""
    shapes = [(5,), (300,)]  # v2, 2 ranks: z's 300 elements straddle both shards
    (z,) = _new_params(shapes[1:])  # the -0.0 is real: a plain backward keeps it
    _signed_zero_grads([torch.zeros(5, requires_grad=True), z], 0)
    assert z.grad.numel() == 300 and torch.all(torch.signbit(z.grad)), z.grad
    bits = {}
    for act, acc, release, params, buf in _buckets(shapes, (1, 2)):
        reads = act != REDUCE or rank == 1  # the reduce's owner (dst 1) alone reads the sum
        bits[act, acc, release] = []
        for step in range(2):
            for k in range(acc):
                _signed_zero_grads(params, k)
            buf.scale_grads()
            if act == REDUCE_SCATTER:  # this rank's piece of z
                read = [buf._sharding_param_grad_view[params[1]]._slice_grad]
            else:
                read = [params[1].grad] if reads else []
            assert len(read) == int(reads)
            assert all(g is not None and g.numel() > 0 for g in read)
            bits[act, acc, release].append([g.view(torch.int32).clone() for g in read])
            _end_step(buf, params, release)
    for (act, acc, release), on in bits.items():
        if not release:
            continue
        off = bits[act, acc, False]
        assert len(off) == len(on) == 2
        for off_step, on_step in zip(off, on):
            assert len(off_step) == len(on_step)
            for a, b in zip(off_step, on_step):
                assert torch.equal(a, b), (act, acc, a, b)
                assert torch.all(a == 0), "-0.0 + the zero buffer must give +0.0"


def _check_main_grad_before_hooks(rank: int, world: int) -> None:
    """A buffer built before `register_main_grad_hooks` trains as release off."""
    for act in (ALL_REDUCE, REDUCE_SCATTER):
        finals = {}
        for release in (False, True):
            params = _new_params([(6,), (3, 5)], torch.bfloat16)
            buf = FusedCommBuffer(0, params, None, 2, act, use_main_grad=True,
                                  release_grads=release)
            assert release or all(hasattr(p, "main_grad") for p in params)
            assert not release or buf.grad_storage is None
            assert not release or not any(hasattr(p, "main_grad") for p in params)
            register_main_grad_hooks(params)
            for p in params:
                p.register_post_accumulate_grad_hook(bw_hook_func(buf, p))
            for step in range(3):
                for k in range(2):
                    _backward_int_grads(params, rank, step, k)
                buf.scale_grads()
                assert all(p.grad is None and p.main_grad.dtype == torch.float32
                           for p in params)
                _sgd_step(buf, params, act)
                _end_step(buf, params, release)
            finals[release] = [p.detach().clone() for p in params]
        start = _new_params([(6,), (3, 5)], torch.bfloat16)
        assert not any(torch.equal(a, b) for a, b in zip(finals[True], start)), "no training"
        _assert_bitwise(finals[False], finals[True])


@torch.no_grad()
def _sgd_step(buf, params, act):
    """SGD, lr 1/8, on the main grads: v2 steps its shard, then all-gathers."""
    if act != REDUCE_SCATTER:
        for p in params:
            p.sub_((0.125 * p.main_grad).to(p.dtype))
        return
    for view in buf._sharding_param_grad_view.values():
        if view._slice_grad is not None:
            shard = buf.param_storage[view._param_begin : view._param_end]
            shard.sub_((0.125 * view._slice_grad).to(shard.dtype))
    buf.sync_params()
