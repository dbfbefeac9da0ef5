"""Rank-side checks of world-size independent checkpoints: consolidate, save, re-shard, resume.

The run: Adam on `_mlp([20, 24, 4])` (weights of 480 and 96 elements: v2 cuts the first across
ranks on 2 and on 3 ranks), batch 12 split evenly over the data replicas, 2 steps, save, 2 more.
References: one process training 4 steps on the whole batch (allclose), the same layout trained
4 steps without a break (bitwise), and a plain torch Adam loading the consolidated dict.
"""
import copy
import os

import pytest
import torch
import torch.distributed as dist

from comm_buffer import global_rank
from pipeline import PipelineParallel
from relgrad import HybridCommunicateGroup, register_main_grad_hooks
from sharding import MixPrecisionOptimizer
from relgrad_checks.common import (OPTIMIZERS, PIPE_SIZES, _assert_bitwise, _assert_close_each,
                                   _assert_moved, _data, _main_grad_oracle, _mlp, _mse, _params,
                                   _pipe_layers, _replica, _shard, _sharding_groups, _strategy,
                                   _train)
from relgrad_checks.pipe import _pipe_oracle, _stage_slice

SIZES, BATCH = [20, 24, 4], 12


def _model(bf16=False):
    model = _mlp(SIZES, seed=5)
    if bf16:
        model.to(torch.bfloat16)
        register_main_grad_hooks(model.parameters())
    return model


def _sharded(version, topology, bf16=False):
    """A model, its v1 / v2 optimizer on `topology` (hcg, strategy), (replicas, replica)."""
    hcg, strategy = topology
    model = _model(bf16)
    opt = _shard(version, OPTIMIZERS["adam"](model.parameters()), hcg, strategy)
    return model, opt, _replica(hcg, strategy)


def _steps(model, opt, steps, part=(1, 0)):
    """Train `steps` (their indices pick the data) on part `part` of the batch: the params."""
    return _train(model, opt, steps, BATCH, part)[-1]


def _one_process(steps, bf16=False):
    """The oracle: one process, the whole batch, plain Adam (MixPrecision for bf16)."""
    model = _model(bf16)
    opt = OPTIMIZERS["adam"](model.parameters())
    if bf16:
        opt = MixPrecisionOptimizer(opt)
    return model, opt, _steps(model, opt, range(steps))


def _same_dict(a, b):
    """Bitwise equal nested dicts / lists of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return (isinstance(b, dict) and a.keys() == b.keys()
                and all(_same_dict(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_dict(x, y) for x, y in zip(a, b))
    return a == b


def _resume(version, topology, saved):
    """A fresh pair loads `saved` (lr, step 2, no grads) and trains steps 2, 3: the params."""
    model, opt, part = _sharded(version, topology)
    model.load_state_dict(saved["model"])
    opt.param_groups[0]["lr"] = 0.5  # the saved hyper-parameters win, as in torch
    opt.load_state_dict(saved["optim"])
    assert opt.param_groups[0]["lr"] == 1e-3
    _assert_no_grads(model, opt)
    assert opt.state and all(float(s["step"]) == 2 for s in opt.state.values())
    return _steps(model, opt, range(2, 4), part)


def _assert_no_grads(model, opt):
    params = list(model.parameters()) + list(getattr(opt, "_slice_params", {}).values())
    assert len(params) > 0
    for p in params:
        assert p.grad is None and getattr(p, "main_grad", None) is None
    buffers = getattr(opt, "_comm_buffer_list", None)  # v2's (built with it, no pipeline)
    assert buffers is None or len(buffers) > 0
    assert all(b.grad_storage is None for b in buffers or [])


def _save_on_rank0(obj, path):
    if dist.get_rank() == 0:
        torch.save(obj, path)
    dist.barrier()


def _bf16_reference(steps):
    """bf16 + main grads: one process summing as 2 ranks do: its MixPrecisionOptimizer."""
    def batches(step):
        x, y = (t.to(torch.bfloat16).chunk(2) for t in _data(step, BATCH, 20, 4))
        return [[(x[r], y[r])] for r in range(2)]

    def make():
        return _mlp(SIZES, seed=5).to(torch.bfloat16)

    _, _, opt = _main_grad_oracle(make, "adam", steps, batches)
    _assert_moved([opt.state_dict()["masters"]], [p.detach().float() for p in make().parameters()])
    return opt


def _check_consolidated(full, oracle_opt, bf16):
    """The consolidated dict: torch's format, the oracle's state (fp32 close, bf16 bitwise)."""
    want = oracle_opt.state_dict()
    want = want["inner"] if bf16 else want  # MixPrecision: the inner torch optimizer's
    assert sorted(full["state"]) == sorted(want["state"]) == [0, 1, 2, 3]
    assert [g["params"] for g in full["param_groups"]] == [[0, 1, 2, 3]]
    assert full["param_groups"][0]["lr"] == want["param_groups"][0]["lr"]
    for i, entries in want["state"].items():
        assert entries.keys() == full["state"][i].keys() and len(entries) == 3  # Adam's
        for name, v in entries.items():
            assert full["state"][i][name].shape == v.shape
            if bf16:
                assert torch.equal(full["state"][i][name].float(), v.float()), (i, name)
            else:
                # atol on the entry's own scale: exp_avg_sq is ~1e-5 here, a fixed 1e-6 is 10%
                torch.testing.assert_close(full["state"][i][name], v, rtol=1e-4,
                                           atol=1e-5 * float(v.abs().max()))
    if not bf16:
        assert "master_weights" not in full
        return
    masters = oracle_opt.state_dict()["masters"]
    assert sorted(full["master_weights"]) == [0, 1, 2, 3] and len(masters) == 4
    for i, m in enumerate(masters):
        assert full["master_weights"][i].dtype == torch.float32
        assert torch.equal(full["master_weights"][i], m), i


def save_on_two(rank: int, world: int, folder: str) -> None:
    """2 ranks: save after 2 steps, resume on 2 (bitwise), 1, torch's Adam (close); misuse."""
    oracle = _one_process(4)[2]
    two, one_beside_dp = _sharding_groups(2, release=True), _sharding_groups(1, 2, True)
    for version in (1, 2):
        for bf16 in (False, True):
            model, opt, part = _sharded(version, two, bf16=bf16)
            _steps(model, opt, range(2), part)
            saved = {"model": copy.deepcopy(model.state_dict()),
                     "optim": opt.consolidate_state_dict(to=0)}
            own = copy.deepcopy(opt.state_dict())
            if not bf16:  # for load_on_three
                torch.save(own, os.path.join(folder, f"own_v{version}_{rank}.pt"))
            if rank == 0:
                reference = _bf16_reference(2) if bf16 else _one_process(2)[1]
                _check_consolidated(saved["optim"], reference, bf16)
            else:
                assert saved["optim"] is None
            path = os.path.join(folder, f"two_v{version}{'_bf16' * bf16}.pt")
            _save_on_rank0(saved, path)
            want = _steps(model, opt, range(2, 4), part)  # no break
            saved = torch.load(path)
            # the same layout: consolidated and per-rank states resume bitwise
            for optim in (saved["optim"], own):
                model2, opt2, _ = _sharded(version, two, bf16=bf16)
                model2.load_state_dict(saved["model"])
                opt2.load_state_dict(optim)
                _assert_no_grads(model2, opt2)
                _assert_bitwise(_steps(model2, opt2, range(2, 4), part), want)
            if not bf16:
                _check_other_layouts(rank, world, version, two, one_beside_dp, saved, own, oracle)


def _check_other_layouts(rank, world, version, two, one_beside_dp, saved, own, oracle):
    """Wrong per-rank states raise; sharding 1, torch's Adam, 1 -> 2 resume (close)."""
    others = [None] * world
    dist.all_gather_object(others, own)
    _, opt3, _ = _sharded(version, two)
    with pytest.raises(ValueError, match=r"(?s)per-rank state_dict\(\) loads only.*"
                       r"sharding_rank: saved 1, here 0.*consolidate_state_dict"):
        opt3.load_state_dict(others[1 - rank] if rank == 0 else own)
    with pytest.raises(ValueError, match="got None: consolidate_state_dict"):
        opt3.load_state_dict(saved["optim"] if rank == 0 else None)
    _assert_close_each(_resume(version, one_beside_dp, saved), oracle)
    model4 = _model()
    model4.load_state_dict(saved["model"])
    adam = OPTIMIZERS["adam"](model4.parameters())
    adam.load_state_dict(saved["optim"])
    _assert_close_each(_steps(model4, adam, range(2, 4)), oracle)
    model5, adam5, _ = _one_process(2)
    state = {"model": model5.state_dict(), "optim": adam5.state_dict()}
    _assert_close_each(_resume(version, two, state), oracle)


def load_on_three(rank: int, world: int, folder: str) -> None:
    """3 ranks: 2-rank checkpoints resume and re-consolidate bitwise; save for 3 -> 2."""
    oracle, three = _one_process(4)[2], _sharding_groups(3, release=True)
    for version in (1, 2):
        saved = torch.load(os.path.join(folder, f"two_v{version}.pt"))
        _assert_close_each(_resume(version, three, saved), oracle)
        for bf16 in (False, True):
            saved = torch.load(os.path.join(folder, f"two_v{version}{'_bf16' * bf16}.pt"))
            _, opt, _ = _sharded(version, three, bf16=bf16)
            opt.load_state_dict(saved["optim"])
            again = opt.consolidate_state_dict(to=2)
            assert (again is None) == (rank != 2)
            assert again is None or _same_dict(again, saved["optim"])
        model, opt, part = _sharded(version, three)
        with pytest.raises(ValueError, match=r"(?s)loads only into the layout.*"
                           r"sharding_degree: saved 2, here 3.*consolidate_state_dict"):
            opt.load_state_dict(torch.load(os.path.join(folder, f"own_v{version}_{rank % 2}.pt")))
        _steps(model, opt, range(2), part)
        saved = {"model": copy.deepcopy(model.state_dict()),
                 "optim": opt.consolidate_state_dict(to=0)}
        _save_on_rank0(saved, os.path.join(folder, f"three_v{version}.pt"))


def load_from_three(rank: int, world: int, folder: str) -> None:
    """2 ranks: the 3-rank checkpoints resume (allclose to one process)."""
    oracle, two = _one_process(4)[2], _sharding_groups(2, release=True)
    for version in (1, 2):
        saved = torch.load(os.path.join(folder, f"three_v{version}.pt"))
        _assert_close_each(_resume(version, two, saved), oracle)


def pipeline_resume(rank: int, world: int) -> None:
    """pp 2 x sharding 2: a stage's consolidated state resumes as if without a break."""
    _, oracle = _pipe_oracle("adam", 4, 8)
    for version in (1, 2):
        strategy = _strategy(pp=2, sharding=2, acc=2, release=True, split_param=version == 2,
                             sharding_comm_overlap=True)
        hcg = HybridCommunicateGroup(strategy)
        group = hcg.get_sharding_parallel_group()

        def build():
            model = PipelineParallel(_pipe_layers(), hcg, strategy, _mse)
            return model, _shard(version, OPTIMIZERS["adam"](model.parameters()), hcg, strategy)

        def train(model, opt, steps):
            for step in steps:
                x, y = (t.chunk(2)[hcg.get_sharding_parallel_rank()]
                        for t in _data(step, 8, PIPE_SIZES[0], PIPE_SIZES[-1]))
                model.train_batch((x, y), opt)
            return _params(model)

        def steps_of(state):  # Adam's step count of every param this rank holds state for
            assert len(state) > 0, "no optimizer state"
            return {float(entries["step"]) for entries in state.values()}

        model, opt = build()
        train(model, opt, range(2))
        saved = [copy.deepcopy(model.state_dict()), opt.consolidate_state_dict(to=0)]
        dist.broadcast_object_list(saved, src=global_rank(group, 0), group=group)  # "the file"
        assert len(saved[1]["state"]) == len(list(model.parameters())) > 0
        assert steps_of(saved[1]["state"]) == {2.0}
        want = train(model, opt, range(2, 4))
        model, opt = build()
        model.load_state_dict(saved[0])
        opt.load_state_dict(saved[1])
        if version == 1:
            assert steps_of(opt.state) == {2.0}
        else:  # v2: no slices before the pipeline builds the buffers
            assert len(opt.state) == 0
        train(model, opt, range(2, 3))
        assert steps_of(opt.state) == {3.0}
        got = train(model, opt, range(3, 4))
        _assert_bitwise(got, want)
        _assert_close_each(got, oracle[-1][_stage_slice(model, hcg)])


def beside_dp(rank: int, world: int) -> None:
    """dp 2 x sharding 2: resume on 2 x 2 (bitwise), on sharding 4 (close); misuse raises."""
    dp_two, four = _sharding_groups(2, 2, True), _sharding_groups(4, release=True)
    oracle = _one_process(4)[2]
    for version in (1, 2):
        model, opt, part = _sharded(version, dp_two)
        _steps(model, opt, range(2), part)
        full = opt.consolidate_state_dict(to=1)
        assert (full is None) == (rank % 2 != 1)
        saved = [{"model": copy.deepcopy(model.state_dict()), "optim": full}]
        dist.broadcast_object_list(saved, src=1)  # "the file" of global rank 1
        want = _steps(model, opt, range(2, 4), part)
        _assert_bitwise(_resume(version, dp_two, saved[0]), want)
        _assert_close_each(_resume(version, four, saved[0]), oracle)
        own = opt.state_dict()
        others = [None] * world
        dist.all_gather_object(others, own)
        _, opt2, _ = _sharded(version, dp_two)
        with pytest.raises(ValueError, match=r"seen on 1 rank\(s\): global rank 2: .*"
                           r"sharding_rank: saved 1, here 0"):
            opt2.load_state_dict(others[3] if rank == 2 else own)
