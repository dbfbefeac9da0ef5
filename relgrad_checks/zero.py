"""Rank-side checks of sharding.py: v1 / v2 against one process, lifetime, edges, state."""
import copy
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from relgrad import register_main_grad_hooks
from relgrad import HybridCommunicateGroup
from sharding import DygraphShardingOptimizer, DygraphShardingOptimizerV2, MixPrecisionOptimizer
from relgrad_checks.common import (_for, OPTIMIZERS, _assert_bitwise, _assert_close_each,
                                   _assert_moved, _assert_same_state, _data, _io, _main_grad_oracle,
                                   _mlp, _oracle, _released, _same_on_all, _strategy)


def _sharded(hcg, strategy, version, make_model, opt_name, steps, batch, set_to_none,
             sched=False):
    """Distributed: each data replica trains on its slice of the same batch."""
    model = make_model()
    cls = DygraphShardingOptimizerV2 if version == 2 else DygraphShardingOptimizer
    opt = cls(OPTIMIZERS[opt_name](model.parameters()), hcg, _for(cls, strategy))
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
                    _assert_close_each(got, want, rtol=1e-5, atol=1e-6)
                    assert _same_on_all(got, group)
                    if step:
                        assert any(not torch.equal(a, b)
                                   for a, b in zip(got, trajs[release][step - 1]))
            _assert_bitwise(trajs[False], trajs[True])


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
                _assert_close_each(got, want, rtol=1e-5, atol=1e-6)
            rank = hcg.get_sharding_parallel_rank()
            if version == 1 and world == 4:  # largest first, each to the least loaded rank
                model = nn.Sequential(nn.Linear(2, 1), nn.Linear(4, 4))  # 2, 1, 16, 4 elements
                v1 = DygraphShardingOptimizer(OPTIMIZERS["sgd"](model.parameters()),
                                              hcg, _for(DygraphShardingOptimizer, st))
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


def _check_sharding_lifetime(hcg, strategy, side="pp_configs"):
    """v2: release on frees every grad, main_grad, slice grad and buffer after step() +
    clear_grad(set_to_zero=False); release off keeps them at one address; misuse raises.
    `side`: which config's `release_gradients` turns release on (the PP flag of the seed, or
    the later sharding-side flag)."""
    for main_grad in (False, True):
        for release in (False, True):
            st = copy.deepcopy(strategy)
            getattr(st, side).release_gradients = release
            model = _mlp([6, 16, 4])
            if main_grad:
                register_main_grad_hooks(model.parameters())
            opt = DygraphShardingOptimizerV2(OPTIMIZERS["sgd"](model.parameters()),
                                             hcg, _for(DygraphShardingOptimizerV2, st))
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
        opt = DygraphShardingOptimizerV2(OPTIMIZERS["adam"](model.parameters()),
                                         hcg, _for(DygraphShardingOptimizerV2, st))
        trajs[release] = []
        for step in range(3):
            x, y = _data(step, 8, 6, 4)
            F.mse_loss(model[0](x), y).backward()
            opt.step()
            with pytest.raises(RuntimeError, match="step\\(\\) ran again without the optimizer"):
                opt.step()
            opt.zero_grad(set_to_none=release)
            trajs[release].append([p.detach().clone() for p in model.parameters()])
        if release:  # zero_grad() between backward and step() drops every grad
            F.mse_loss(model[0](x), y).backward()
            opt.zero_grad()
            with pytest.raises(ValueError, match="did zero_grad\\(\\) run between backward"):
                opt.step()
    _assert_bitwise(trajs[False], trajs[True])


def _check_sched_and_state(hcg, strategy):
    """A torch LR scheduler drives the wrapper; state_dict round-trips this rank's state."""
    _check_against_oracle(hcg, strategy, lambda: _mlp([6, 16, 4]), sched=True)
    for version in (1, 2):
        cls = DygraphShardingOptimizerV2 if version == 2 else DygraphShardingOptimizer
        model = _mlp([6, 16, 4])
        opt = cls(OPTIMIZERS["adam"](model.parameters()), hcg, _for(cls, strategy))
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
        opt2 = cls(OPTIMIZERS["adam"](model2.parameters()), hcg, _for(cls, strategy))
        model2.load_state_dict(params)
        opt2.load_state_dict(saved)
        _assert_bitwise(third_step(model2, opt2), want)


def _check_main_grad_sharding(hcg, strategy):
    """bf16 params with fp32 main grads and masters: release on == off, both bitwise equal to
    one process (`_main_grad_oracle`), whose params all move."""
    def make():
        model = _mlp([6, 16, 4]).to(torch.bfloat16)
        register_main_grad_hooks(model.parameters())
        return model

    for version in (1, 2):
        cls = DygraphShardingOptimizerV2 if version == 2 else DygraphShardingOptimizer
        trajs, opts = {}, {}
        for release in (False, True):
            st = copy.deepcopy(strategy)
            st.pp_configs.release_gradients = release
            model = make()
            opt = cls(OPTIMIZERS["adam"](model.parameters()), hcg, _for(cls, st))
            trajs[release], opts[release] = [], opt
            for step in range(3):
                x, y = (t.chunk(2)[hcg.get_sharding_parallel_rank()].bfloat16()
                        for t in _data(step, 8, 6, 4))
                F.mse_loss(model(x).float(), y.float()).backward()
                assert all(p.grad is None and p.main_grad.dtype == torch.float32
                           for p in model.parameters())
                opt.step()
                opt.zero_grad(set_to_none=release)
                trajs[release].append([p.detach().clone() for p in model.parameters()])
        _assert_bitwise(trajs[False], trajs[True])
        # one process summing the two halves' fp32 main grads as the collective does: the
        # same bits; its params all move (a sharded optimizer that never steps fails here)
        _, oracle, oracle_opt = _main_grad_oracle(
            lambda: _mlp([6, 16, 4]).to(torch.bfloat16), "adam", 3,
            lambda step: [[(x.bfloat16(), y.bfloat16())]
                          for x, y in zip(*(t.chunk(2) for t in _data(step, 8, 6, 4)))])
        _assert_moved(oracle, list(_mlp([6, 16, 4]).to(torch.bfloat16).parameters()))
        assert len(trajs[True]) == len(oracle) == 3
        for got, want in zip(trajs[True], oracle):
            assert len(got) == len(want) > 0
            _assert_bitwise(got, want, version)
        for release in (False, True):  # the fp32 masters and Adam's state too
            _assert_same_state(opts[release], oracle_opt)


def _sharding_only(world, dp=1):
    strategy = _strategy(sharding=world // dp, dp=dp)
    return HybridCommunicateGroup(strategy), strategy


def against_oracle(rank, world, dp=1):
    """v1 / v2 x SGD / Adam x release off / on against one process (sharding world/dp, dp)."""
    hcg, strategy = _sharding_only(world, dp)
    assert hcg.get_data_parallel_rank() == rank // (world // dp)
    assert hcg.get_sharding_parallel_rank() == rank % (world // dp)
    _check_against_oracle(hcg, strategy, lambda: _mlp([6, 16, 4]))
    return "ok"


def edges(rank, world):
    """Tiny models: a v1 rank that owns nothing, v2 shards of padding only."""
    _check_edges(*_sharding_only(world))
    return "ok"


def lifetime(rank, world, side="pp_configs"):
    """v2 buffers freed after clear_grad with release, kept at one address without."""
    _check_sharding_lifetime(*_sharding_only(world), side=side)
    return "ok"


def unused_param(rank, world):
    """A param with no grad: release on == off; a second step() and a misplaced zero_grad."""
    _check_unused_param(*_sharding_only(world))
    return "ok"


def sched_and_state(rank, world):
    """LR scheduler through the wrapper; state_dict round trip."""
    _check_sched_and_state(*_sharding_only(world))
    return "ok"


def main_grad(rank, world):
    """bf16 params with fp32 main grads and masters, v1 and v2."""
    _check_main_grad_sharding(*_sharding_only(world))
    return "ok"
