"""Rank-side checks of sharding v1 / v2 (sharding.py): one process, edges, lifetime, state."""
import copy
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from relgrad import register_main_grad_hooks
from relgrad_checks.common import (OPTIMIZERS, _assert_bitwise, _assert_close_each, _assert_moved,
                                   _assert_same_state, _data, _main_grad_oracle, _mlp, _oracle,
                                   _params, _released, _releases, _replica, _same_on_all, _shard,
                                   _sharding_groups, _train)


def _run(hcg, strategy, version, make_model, opt_name, set_to_none=True, sched=False):
    """Each data replica trains 3 steps on its slice of the same batch of 8."""
    model = make_model()
    opt = _shard(version, OPTIMIZERS[opt_name](model.parameters()), hcg, strategy)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if sched else None
    traj = _train(model, opt, 3, 8, _replica(hcg, strategy), set_to_none, scheduler)
    return traj, model, opt


def _check_against_oracle(hcg, strategy, make_model, sched=False):
    """v1/v2 x SGD/Adam x release: like one process, same on all ranks, moving, on == off."""
    group = hcg.get_sharding_parallel_group()
    for version in (1, 2):
        for opt_name in ("sgd", "adam"):
            oracle = _oracle(make_model, opt_name, 3, 8, sched)
            trajs = {}
            for release, st in _releases(strategy):
                # torch's default zero_grad() (set_to_none=True) between steps, except where
                # it is an error (v2 with release off: checked in `lifetime`)
                trajs[release] = _run(hcg, st, version, make_model, opt_name,
                                      release or version == 1, sched)[0]
                _assert_close_each(trajs[release], oracle)
                for step, got in enumerate(trajs[release]):
                    assert _same_on_all(got, group)
                    previous = trajs[release][step - 1]
                    assert step == 0 or any(not torch.equal(a, b) for a, b in zip(got, previous))
            _assert_bitwise(trajs[False], trajs[True])


def against_oracle(rank: int, world: int, dp: int = 1) -> None:
    """v1 / v2 x SGD / Adam x release off / on against one process (sharding world/dp, dp)."""
    hcg, strategy = _sharding_groups(world // dp, dp)
    assert hcg.get_data_parallel_rank() == rank // (world // dp)
    assert hcg.get_sharding_parallel_rank() == rank % (world // dp)
    _check_against_oracle(hcg, strategy, lambda: _mlp([6, 16, 4]))


def edges(rank: int, world: int) -> None:
    """11 elements; v1 with a rank that owns nothing; v2 with padding-only shards."""
    hcg, strategy = _sharding_groups(world)
    _check_against_oracle(hcg, strategy, lambda: _mlp([3, 2, 1]))  # 6 + 2 + 2 + 1 elements

    def three_tensors():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 1, bias=False))

    def three_elements():
        torch.manual_seed(0)
        return nn.Linear(3, 1, bias=False)

    for version, make_model in ((1, three_tensors), (2, three_elements)):
        for release, st in _releases(strategy):
            traj, model, opt = _run(hcg, st, version, make_model, "adam", release)
            _assert_close_each(traj, _oracle(make_model, "adam", 3, 8))
            if version == 1 and world == 4:  # largest first, each to the least loaded rank
                model = nn.Sequential(nn.Linear(2, 1), nn.Linear(4, 4))  # 2, 1, 16, 4 elements
                v1 = _shard(1, OPTIMIZERS["sgd"](model.parameters()), hcg, st)
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


def lifetime(rank: int, world: int, side: str = "pp_configs") -> None:
    """v2: release (`side`'s flag) frees every grad and buffer at clear_grad; off: one address."""
    hcg, strategy = _sharding_groups(world)
    for main_grad in (False, True):
        for release, st in _releases(strategy, side):
            model = _mlp([6, 16, 4])
            if main_grad:
                register_main_grad_hooks(model.parameters())
            opt = _shard(2, OPTIMIZERS["sgd"](model.parameters()), hcg, st)
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


def unused_param(rank: int, world: int) -> None:
    """v2, a param without grad: on == off; a second step() or an early zero_grad() raise."""
    hcg, strategy = _sharding_groups(world)
    trajs = {}
    for release, st in _releases(strategy):
        model = nn.ModuleList([_mlp([6, 16, 4]), nn.Linear(3, 3)])  # [1] is never called
        opt = _shard(2, OPTIMIZERS["adam"](model.parameters()), hcg, st)
        trajs[release] = []
        for step in range(3):
            x, y = _data(step, 8, 6, 4)
            F.mse_loss(model[0](x), y).backward()
            opt.step()
            with pytest.raises(RuntimeError, match="step\\(\\) ran again without the optimizer"):
                opt.step()
            opt.zero_grad(set_to_none=release)
            trajs[release].append(_params(model))
        if release:  # zero_grad() between backward and step() drops every grad
            F.mse_loss(model[0](x), y).backward()
            opt.zero_grad()
            with pytest.raises(ValueError, match="did zero_grad\\(\\) run between backward"):
                opt.step()
    _assert_bitwise(trajs[False], trajs[True])


def sched_and_state(rank: int, world: int) -> None:
    """A torch LR scheduler drives the wrapper; state_dict round-trips this rank's state."""
    hcg, strategy = _sharding_groups(world)
    _check_against_oracle(hcg, strategy, lambda: _mlp([6, 16, 4]), sched=True)
    for version in (1, 2):
        model = _mlp([6, 16, 4])
        opt = _shard(version, OPTIMIZERS["adam"](model.parameters()), hcg, strategy)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        _train(model, opt, [0], set_to_none=False, sched=scheduler)
        assert opt.param_groups[0]["lr"] == 5e-4
        assert opt._inner_opt._inner_opt.param_groups[0]["lr"] == 5e-4
        saved, params = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
        want = _train(model, opt, [1], set_to_none=False)
        model2 = _mlp([6, 16, 4])
        opt2 = _shard(version, OPTIMIZERS["adam"](model2.parameters()), hcg, strategy)
        model2.load_state_dict(params)
        opt2.load_state_dict(saved)
        _assert_bitwise(_train(model2, opt2, [1], set_to_none=False), want)


def main_grad(rank: int, world: int) -> None:
    """bf16 main grads and masters, v1, v2: on == off == one process summing as the ranks do."""
    hcg, strategy = _sharding_groups(world)

    def make():
        return _mlp([6, 16, 4]).to(torch.bfloat16)

    for version in (1, 2):
        trajs, opts = {}, {}
        for release, st in _releases(strategy):
            model = make()
            register_main_grad_hooks(model.parameters())
            opts[release] = _shard(version, OPTIMIZERS["adam"](model.parameters()), hcg, st)

            def main_grads_only(model=model):
                assert all(p.grad is None and p.main_grad.dtype == torch.float32
                           for p in model.parameters())

            trajs[release] = _train(model, opts[release], 3, 8, _replica(hcg, st), release,
                                    after_backward=main_grads_only)
        _assert_bitwise(trajs[False], trajs[True])
        # one process summing the two halves' fp32 main grads as the collective does: the
        # same bits; its params all move (a sharded optimizer that never steps fails here)
        _, oracle, oracle_opt = _main_grad_oracle(
            make, "adam", 3, lambda step: [[(x.bfloat16(), y.bfloat16())]
                                           for x, y in zip(*(t.chunk(2) for t in
                                                             _data(step, 8, 6, 4)))])
        _assert_moved(oracle, list(make().parameters()))
        assert len(trajs[True]) == len(oracle) == 3
        _assert_bitwise(trajs[True], oracle, version)
        for release in (False, True):  # the fp32 masters and Adam's state too
            _assert_same_state(opts[release], oracle_opt)
