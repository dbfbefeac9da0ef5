"""Rank-side checks of the torch optimizer contract of the wrappers (v1, v2, MixPrecision).

Each scenario is a small input a torch user writes, with its right value computed by hand in
the comment beside it (or one process training the same model), never read from the wrapper.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline import PipelineParallel
from relgrad import HybridCommunicateGroup, register_main_grad_hooks
from sharding import DygraphShardingOptimizer, DygraphShardingOptimizerV2, MixPrecisionOptimizer
from relgrad_checks.common import (OPTIMIZERS, _assert_bitwise, _assert_close_each, _data, _mlp,
                                   _oracle, _params, _releases, _same_on_all, _shard,
                                   _sharding_groups, _strategy, _train)

V1, V2 = DygraphShardingOptimizer, DygraphShardingOptimizerV2


class _Params(nn.Module):
    """Scalar params `a`, `b`, ... (shape (1,)) with given start values."""

    def __init__(self, dtype: torch.dtype = torch.float32, **values: float) -> None:
        super().__init__()
        for name, value in values.items():
            self.register_parameter(name, nn.Parameter(torch.tensor([value], dtype=dtype)))


def _wrap(kind, opt, hcg, strategy):
    """`opt` wrapped as `kind`: "mix" (MixPrecisionOptimizer), V1 or V2."""
    if kind == "mix":
        return MixPrecisionOptimizer(opt)
    return _shard(kind, opt, hcg, strategy)


def _scalar(kind, hcg, strategy, lr=1.0, dtype=torch.float32):
    """`_Params(w=1.0)` (bf16: with main-grad hooks) and its SGD(lr) wrapped as `kind`."""
    m = _Params(dtype, w=1.0)
    if dtype == torch.bfloat16:
        register_main_grad_hooks(m.parameters())
    return m, _wrap(kind, torch.optim.SGD(m.parameters(), lr=lr), hcg, strategy)


def _value(p):
    return p.detach().float().item()


def groups_after_load(rank: int, world: int) -> None:
    """An LR set (or scheduled) after load_state_dict reaches the step; a template's raises."""
    hcg, strategy = _sharding_groups(world)
    for kind in ("mix", V1, V2):
        for release, st in _releases(strategy):
            m, opt = _scalar(kind, hcg, st)
            opt.load_state_dict(opt.state_dict())
            opt.param_groups[0]["lr"] = 0.5
            m.w.grad = torch.ones(1)
            opt.step()
            assert _value(m.w) == 0.5, (kind, _value(m.w))  # 1 - 0.5 * 1
            opt.zero_grad(set_to_none=release)
            # an LR scheduler built before the load (a resumed run) still drives the step
            m, opt = _scalar(kind, hcg, st)
            sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.25)
            opt.load_state_dict(opt.state_dict())
            sched.step()  # lr 1.0 -> 0.25
            (m.w * 2).sum().backward()
            opt.step()
            assert _value(m.w) == 0.5, (kind, _value(m.w))  # 1 - 0.25 * 2
            assert opt.state is opt._inner_opt.state
            opt.zero_grad(set_to_none=release)
            # a scheduler built on the torch optimizer before wrapping never reaches the step
            m = _Params(w=1.0)
            template = torch.optim.SGD(m.parameters(), lr=1.0)
            sched = torch.optim.lr_scheduler.StepLR(template, 1, gamma=0.25)
            opt = _wrap(kind, template, hcg, st)
            sched.step()
            (m.w * 2).sum().backward()
            with pytest.raises(ValueError, match="Build the scheduler on the wrapper"):
                opt.step()
            assert _value(m.w) == 1.0


def masters_reload(rank: int, world: int) -> None:
    """bf16 + main_grad: weights loaded into the model after a step are what trains."""
    hcg, strategy = _sharding_groups(world)
    for kind in ("mix", V1, V2):
        for release, st in _releases(strategy):
            m, opt = _scalar(kind, hcg, st, 0.5, torch.bfloat16)
            m.w.sum().backward()  # grad 1 on every rank
            opt.step()
            opt.zero_grad(set_to_none=release)
            assert _value(m.w) == 0.5  # 1 - 0.5 * 1
            m.load_state_dict({"w": torch.tensor([4.0], dtype=torch.bfloat16)})
            m.w.sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=release)
            assert _value(m.w) == 3.5, (kind, _value(m.w))  # 4 - 0.5 * 1, not 0.5 - 0.5
            # untouched targets keep their fp32 masters: three steps of 1e-3 from 1.0 give
            # 0.997, which is 0.99609375 in bf16 (a master reloaded each step stays at 1.0)
            m, opt = _scalar(kind, hcg, st, 1e-3, torch.bfloat16)
            for _ in range(3):
                m.w.sum().backward()
                opt.step()
                opt.zero_grad(set_to_none=release)
            assert _value(m.w) == 0.99609375, (kind, _value(m.w))


def add_param_group(rank: int, world: int) -> None:
    """v1 shards an added group (b = -1.0); MixPrecision gives it a master; v2 raises."""
    hcg, strategy = _sharding_groups(world)
    for release, st in _releases(strategy):
        m = _Params(a=1.0, b=1.0)
        opt = _shard(V1, torch.optim.SGD([m.a], lr=1.0), hcg, st)
        opt.add_param_group({"params": [m.b]})
        assert len(opt.param_groups) == 2  # on every rank, owner or not
        (m.b * (1 if rank == 0 else 3)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=release)
        assert _value(m.b) == -1.0, _value(m.b)  # 1 - 1.0 * (1 + 3) / 2
        assert _value(m.a) == 1.0  # no grad anywhere: not stepped
        with pytest.raises(ValueError, match="already in the optimizer"):
            opt.add_param_group({"params": [m.a]})
        m = _Params(a=1.0, b=1.0)
        opt = _shard(V2, torch.optim.SGD([m.a], lr=1.0), hcg, st)
        with pytest.raises(ValueError, match="build the torch optimizer with every group"):
            opt.add_param_group({"params": [m.b]})
    m = _Params(torch.bfloat16, a=1.0, b=1.0)
    register_main_grad_hooks(m.parameters())
    opt = MixPrecisionOptimizer(torch.optim.SGD([m.a], lr=1.0))
    opt.add_param_group({"params": [m.b], "lr": 0.5})
    assert opt.param_groups[1]["params"][0].dtype == torch.float32  # its master
    (m.a + m.b).sum().backward()
    opt.step()
    assert (_value(m.a), _value(m.b)) == (0.0, 0.5)


def hooks(rank: int, world: int) -> None:
    """torch's hooks run in order; the load pre-hook's lr 0.5 state loads (w: 1, 0, -0.5)."""
    hcg, strategy = _sharding_groups(world)
    for kind in ("mix", V1, V2):
        m, opt = _scalar(kind, hcg, strategy)
        calls, swap = [], {}

        def load_pre(o, sd):
            calls.append(("load_pre", o is opt, sd.get("extra")))
            return {k: v for k, v in swap["sd"].items() if k != "extra"}

        opt.register_step_pre_hook(lambda o, a, k: calls.append(("pre", o is opt)))
        opt.register_step_post_hook(lambda o, a, k: calls.append(("post", o is opt)))
        opt.register_state_dict_pre_hook(lambda o: calls.append(("sd_pre", o is opt)))
        opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 7})
        opt.register_load_state_dict_pre_hook(load_pre)
        opt.register_load_state_dict_post_hook(lambda o: calls.append(("load_post", o is opt)))
        m.w.sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        assert _value(m.w) == 0.0
        opt.param_groups[0]["lr"] = 0.5
        swap["sd"] = opt.state_dict()
        opt.param_groups[0]["lr"] = 1.0
        saved = opt.state_dict()
        assert saved["extra"] == 7 and swap["sd"]["extra"] == 7
        opt.load_state_dict(saved)  # the pre-hook hands back the lr 0.5 state instead
        assert calls == [("pre", True), ("post", True), ("sd_pre", True), ("sd_pre", True),
                         ("load_pre", True, 7), ("load_post", True)], calls
        assert opt.param_groups[0]["lr"] == 0.5
        m.w.sum().backward()
        opt.step()
        assert _value(m.w) == -0.5, (kind, _value(m.w))


def grad_on_some_ranks(rank: int, world: int, dp: int = 1) -> None:
    """A param left out of one rank's loss is stepped on the mean, v1 and v2."""
    hcg, strategy = _sharding_groups(world // dp, dp)
    # 2 ranks: a = 1 - (1 + 3) / 2, b = 1 - (1 + 0) / 2; 4 ranks: a = 1 - (1 + 3 + 5 + 7) / 4,
    # b = 1 - (1 + 3 + 5 + 0) / 4
    want = (-1.0, 0.5) if world == 2 else (-3.0, -1.25)
    for kind in (V1, V2):
        for release, st in _releases(strategy):
            m = _Params(a=1.0, b=1.0, c=1.0)
            opt = _shard(kind, torch.optim.SGD(m.parameters(), lr=1.0), hcg, st)
            k = 2 * rank + 1
            loss = m.a * k + (m.b * k if rank != world - 1 else 0)  # c: no grad anywhere
            loss.sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=release)
            assert (_value(m.a), _value(m.b)) == want, (_value(m.a), _value(m.b))
            assert _value(m.c) == 1.0


def pipeline_dp_grad_on_some_ranks(rank: int, world: int) -> None:
    """pp 2 x dp 2 without overlap: a grad on one dp replica only reaches both, no hang."""
    strategy = _strategy(dp=2, pp=2)
    hcg = HybridCommunicateGroup(strategy)
    layers = [nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False)]
    model = PipelineParallel(layers, hcg, strategy, F.mse_loss)
    (w,) = model.parameters()
    with torch.no_grad():
        w.fill_(1.0)
    if hcg.get_data_parallel_rank() == 0:
        w.grad = torch.full_like(w, 2.0)
    model.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model._optimizer_step()
    assert _value(w) == 0.0, _value(w)  # 1 - (2 + 0) / 2


def _built(kind, st, hcg, opt_name="sgd", dtype=torch.float32):
    """`_mlp([6, 16, 4])` in `dtype` and its `opt_name` optimizer wrapped as `kind`."""
    model = _mlp([6, 16, 4]).to(dtype)
    return model, _shard(kind, OPTIMIZERS[opt_name](model.parameters()), hcg, st)


def v2_model_moved(rank: int, world: int) -> None:
    """v2: model.to(float64).to(float32) trains as one process; a model left in float64 raises."""
    hcg, strategy = _sharding_groups(world)
    oracle = _oracle(lambda: _mlp([6, 16, 4]), "sgd", 3, 8)
    for release, st in _releases(strategy):
        model, opt = _built(V2, st, hcg)
        model.to(torch.float64).to(torch.float32)
        _assert_close_each(_train(model, opt, 3, 8, (world, rank), release), oracle)
        model, opt = _built(V2, st, hcg)
        model.to(torch.float64)
        F.mse_loss(model(_data(0, 8, 6, 4)[0].double()), torch.zeros(8, 4).double()).backward()
        with pytest.raises(ValueError, match="dtype or device"):
            opt.step()


def unfrozen_param(rank: int, world: int) -> None:
    """A layer frozen at build, then unfrozen: v1 trains it as one process; v2 raises."""
    hcg, strategy = _sharding_groups(world)
    oracle = _oracle(lambda: _mlp([6, 16, 4]), "sgd", 3, 8)
    for release, st in _releases(strategy):
        for kind in (V1, V2):
            model = _mlp([6, 16, 4])
            model[2].requires_grad_(False)
            opt = _shard(kind, OPTIMIZERS["sgd"](model.parameters()), hcg, st)
            model[2].requires_grad_(True)
            if kind is V1:
                _assert_close_each(_train(model, opt, 3, 8, (world, rank), release), oracle)
                continue
            F.mse_loss(model(_data(0, 8, 6, 4)[0]), torch.zeros(8, 4)).backward()
            with pytest.raises(ValueError, match="frozen when the fused buffers were built"):
                opt.step()


def main_grad_some_layers(rank: int, world: int) -> None:
    """bf16, main-grad hooks on some layers: v2 raises at build, or at step()."""
    hcg, strategy = _sharding_groups(world)
    for _, st in _releases(strategy):
        model = _mlp([6, 16, 4]).to(torch.bfloat16)
        register_main_grad_hooks(model[0].parameters())
        with pytest.raises(ValueError, match="have no main_grad while others do"):
            _shard(V2, OPTIMIZERS["sgd"](model.parameters()), hcg, st)
        model, opt = _built(V2, st, hcg, dtype=torch.bfloat16)
        register_main_grad_hooks(model[0].parameters())
        model(torch.ones(2, 6, dtype=torch.bfloat16)).float().sum().backward()
        with pytest.raises(ValueError, match="main_grad does not match its bucket"):
            opt.step()


def zero_grad_before_step(rank: int, world: int) -> None:
    """zero_grad() before step(), or assign=True params, raise in v1 and v2."""
    hcg, strategy = _sharding_groups(world)
    for release, st in _releases(strategy):
        for kind in (V1, V2):
            model, opt = _built(kind, st, hcg, "adam")
            F.mse_loss(model(torch.ones(2, 6)), torch.zeros(2, 4)).backward()
            opt.zero_grad(set_to_none=release)
            with pytest.raises(ValueError, match="did zero_grad\\(\\) run between backward"):
                opt.step()
            model, opt = _built(kind, st, hcg, "adam")
            model.load_state_dict(_mlp([6, 16, 4], seed=1).state_dict(), assign=True)
            F.mse_loss(model(torch.ones(2, 6)), torch.zeros(2, 4)).backward()
            with pytest.raises(ValueError, match="assign=True"):
                opt.step()


def no_grad_not_stepped(rank: int, world: int) -> None:
    """AdamW, a layer no rank uses: left untouched, on == off, the rest like one process."""
    hcg, strategy = _sharding_groups(world)

    def make():
        torch.manual_seed(0)
        return nn.ModuleList([nn.Linear(6, 4), nn.Linear(3, 3)])  # [1] is never called

    def adamw(model):
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    for kind in (V1, V2):
        trajs = {}
        for release, st in _releases(strategy):
            model = make()
            start = _params(model[1])
            opt = _shard(kind, adamw(model), hcg, st)
            trajs[release] = _train(model, opt, 3, 8, (world, rank), release, net=model[0])
            _assert_bitwise(start, model[1].parameters())
        _assert_bitwise(trajs[False], trajs[True])
        model = make()
        _assert_close_each(trajs[True], _train(model, adamw(model), 3, 8, net=model[0]))


def grad_scaler(rank: int, world: int) -> None:
    """torch.amp.GradScaler driving a wrapper raises on every rank; params unchanged."""
    hcg, strategy = _sharding_groups(world)
    for kind in ("mix", V1, V2):
        m, opt = _scalar(kind, hcg, strategy)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        scaler.scale(m.w * (rank + 1)).sum().backward()
        with pytest.raises(ValueError, match="GradScaler cannot drive"):
            scaler.step(opt)
        assert _value(m.w) == 1.0
        assert _same_on_all([m.w])


def stateful_template(rank: int, world: int) -> None:
    """A torch optimizer with state is refused everywhere; MixPrecision loads its state."""
    hcg, strategy = _sharding_groups(world)
    for kind in ("mix", V1, V2):
        model = _Params(a=1.0, b=2.0)
        opt = torch.optim.Adam(model.parameters(), lr=0.5)
        if kind == "mix" or rank == 0:  # the sharding wrappers: state on rank 0 only
            (model.a * 3 + model.b).sum().backward()
            opt.step()
        with pytest.raises(ValueError, match="already has state.*(2 param|seen on 1 rank)"):
            _wrap(kind, opt, hcg, strategy)
    # the fix the message names: a fresh optimizer, then load the saved state
    ref = _Params(a=1.0, b=2.0)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.5)
    model = _Params(a=1.0, b=2.0)
    for step in range(2):
        (ref.a * 3 + ref.b).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if step == 0:
            saved = copy.deepcopy(ref_opt.state_dict())
            model.load_state_dict(ref.state_dict())
    mix = MixPrecisionOptimizer(torch.optim.Adam(model.parameters(), lr=0.5))
    mix.load_state_dict(saved)
    (model.a * 3 + model.b).sum().backward()
    mix.step()
    assert (_value(model.a), _value(model.b)) == (_value(ref.a), _value(ref.b))
    assert mix.state_dict()["inner"]["state"][0]["step"].item() == 2
    _check_element_wise(hcg, strategy)


def _check_element_wise(hcg, strategy):
    """v2 refuses Adafactor and an own-step subclass; Adagrad trains under v1."""
    with pytest.raises(ValueError, match="needs an element-wise optimizer.*got Adafactor"):
        _shard(V2, torch.optim.Adafactor(_Params(a=1.0).parameters()), hcg, strategy)

    class Lamb(torch.optim.AdamW):  # a per-tensor trust ratio: wrong on flat slices
        @torch.no_grad()
        def step(self, closure=None):
            return super().step(closure)

    class Quiet(torch.optim.AdamW):  # keeps AdamW's step: element-wise still
        pass

    with pytest.raises(ValueError, match="needs an element-wise optimizer.*got Lamb"):
        _shard(V2, Lamb(_Params(a=1.0).parameters()), hcg, strategy)
    _shard(V2, Quiet(_Params(a=1.0).parameters()), hcg, strategy)
    # Adagrad builds its state when constructed: that is no "state" to drop; v1 trains it as
    # one process does (a = 1 - 0.5 * 3 / sqrt(9) = 0.5 after one step, b likewise 1.5)
    model = _Params(a=1.0, b=2.0)
    v1 = _shard(V1, torch.optim.Adagrad(model.parameters(), lr=0.5), hcg, strategy)
    (model.a * 3 + model.b).sum().backward()
    v1.step()
    assert (_value(model.a), _value(model.b)) == (0.5, 1.5)
