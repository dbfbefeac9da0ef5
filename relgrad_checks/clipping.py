"""Rank-side checks of grad_clip and shared_weights (relgrad_extras/): global-norm clipping over
pp x sharding (and pp x dp), weights tied across stages, accumulating over schedule calls."""
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from relgrad_extras.grad_clip import ClipGradByGlobalNorm
from pipeline import PipelineParallel
from relgrad import HybridCommunicateGroup
from sharding import DygraphShardingOptimizer
from relgrad_checks.common import (OPTIMIZERS, _assert_bitwise, _assert_close_each, _data, _mse,
                                   _params, _same_on_all, _shard, _strategy)


class Scale(nn.Module):
    """`x * w` with one scalar weight: a stage whose grad is computed by hand."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([float(value)]))

    def forward(self, x):
        return x * self.w


def _mean_loss(out, y):
    return out.mean()


def _variants(versions=(1, 2)):
    return [(v, overlap, release) for v in versions for overlap in (False, True)
            for release in (False, True)]


def _pp2(version, overlap, release, layers, loss, clip, **pipe_kwargs):
    """(strategy, hcg, pipeline, clip) of pp 2 x sharding 2 (`version`) or pp 2 x dp 2."""
    if version:
        strategy = _strategy(pp=2, sharding=2, acc=2, release=release,
                             sharding_comm_overlap=overlap, split_param=version == 2)
    else:
        strategy = _strategy(dp=2, pp=2, acc=2, release=release, dp_comm_overlap=overlap)
    hcg = HybridCommunicateGroup(strategy)
    model = PipelineParallel(layers, hcg, strategy, loss, **pipe_kwargs)
    return strategy, hcg, model, ClipGradByGlobalNorm(clip)


def _train_batch(model, data, opt, version, grad_clip):
    """train_batch clipped by sharding's step (`version`) or, without sharding, by the pipeline."""
    if version:
        return model.train_batch(data, opt)
    return model.train_batch(data, opt, grad_clip=grad_clip)


def _assert_release_keeps_bits(runs):
    """Each run with release on (last key field) bitwise equal to its run with release off."""
    for key, values in runs.items():
        off = key[:-1] + (False,)
        if key[-1] and off in runs:
            _assert_bitwise(values, runs[off], key)


def _clipped_oracle(model, steps, clip, data_of, opt=None, loss=_mse):
    """One process, torch's clip_grad_norm_ before each step: (norms, params)."""
    opt = OPTIMIZERS["sgd"](model.parameters()) if opt is None else opt
    norms, traj = [], []
    for step in range(steps):
        x, y = data_of(step)
        loss(model(x), y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
        opt.zero_grad()
        traj.append(_params(model))
    return norms, traj


# ---------------------------------------------------------------- clipping

def _hand_clip(steps, clip, lr, frozen=False, a=3.0, b=4.0):
    """Norms and (a, b) per step of `z = b * a * x`, Paddle's coefficient, in floats."""
    norms, params = [], []
    for step in range(steps):
        x_mean = 3.0 * (step + 1)
        grad_a, grad_b = (0.0 if frozen else b * x_mean), a * x_mean
        norm = math.sqrt(grad_a ** 2 + grad_b ** 2)
        coef = clip / (max(norm, clip) + 1e-6)
        a, b = a - lr * coef * grad_a, b - lr * coef * grad_b
        norms.append(norm)
        params.append((a, b))
    return norms, params


def _scalar_batch(step):
    # whole batch: 4 samples, mean 3 * (step + 1); a replica takes its half
    x = torch.tensor([[1.0], [2.0], [3.0], [6.0]]) * (step + 1)
    return x, x


def _scale_layers(frozen):
    layers = [Scale(3.0), Scale(4.0)]
    layers[0].w.requires_grad_(not frozen)
    return layers


def clip_global_norm(rank: int, world: int, steps: int = 3, clip: float = 1.0,
                     lr: float = 0.1) -> None:
    """pp 2 x (sharding 2 | dp 2), overlap, release: the norm and update as by hand."""
    hands, oracles = {}, {}
    for frozen in (False, True):
        hands[frozen] = _hand_clip(steps, clip, lr, frozen)
        model = nn.Sequential(*_scale_layers(frozen))
        oracles[frozen] = _clipped_oracle(model, steps, clip, _scalar_batch,
                                          torch.optim.SGD(model.parameters(), lr=lr), _mean_loss)
    assert min(hands[True][0]) > clip  # the clip is active: max_norm below the norm
    configs = [("sharding", v, overlap, release) for v, overlap, release in _variants()]
    configs += [("dp", None, overlap, release) for _, overlap, release in _variants((1,))]
    configs += [("frozen", None, True, True)]  # stage 0 has no trainable param
    runs = {}
    for config in configs:
        frozen = config[0] == "frozen"
        runs[config] = _clipped_run(config, hands[frozen], oracles[frozen], steps, clip, lr)
    _assert_release_keeps_bits(runs)


def _clipped_run(config, hand, oracle, steps, clip, lr):
    """One `clip_global_norm` layout against the hand values and torch's."""
    kind, version, overlap, release = config
    (hand_norms, hand_params), (torch_norms, torch_params) = hand, oracle
    strategy, hcg, model, grad_clip = _pp2(version, overlap, release,
                                           _scale_layers(kind == "frozen"), _mean_loss, clip)
    stage = hcg.get_stage_id()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    if version:
        opt = _shard(version, opt, hcg, strategy, grad_clip=grad_clip)
    if version == 1:
        assert set(opt._param2rank.values()) == {0}  # sharding rank 1 owns nothing
    replica = hcg.get_data_parallel_rank() + hcg.get_sharding_parallel_rank()
    norms, traj = [], []
    for step in range(steps):
        x = _scalar_batch(step)[0].chunk(2)[replica]
        _train_batch(model, (x, x), opt, version, grad_clip)
        norm = grad_clip.global_norm
        assert norm.dtype == torch.float32 and _same_on_all([norm], None)
        assert math.isclose(float(norm), hand_norms[step], rel_tol=1e-6), \
            (config, step, float(norm), hand_norms[step])
        torch.testing.assert_close(norm, torch_norms[step], rtol=1e-6, atol=0)
        (w,) = _params(model)
        assert math.isclose(float(w), hand_params[step][stage], rel_tol=1e-6)
        torch.testing.assert_close(w, torch_params[step][stage], rtol=1e-6, atol=0)
        norms.append(norm.clone())
        traj.append(w)
    if version == 2:
        views = [view for b in opt._comm_buffer_list
                 for view in b._sharding_param_grad_view.values()]
        assert [v._has_local for v in views] == [hcg.get_sharding_parallel_rank() == 0]
    if version == 1 and not overlap and not release:  # misuse: raised before any comm
        with pytest.raises(ValueError, match="clips in its own step"):
            model.train_batch((x, x), opt, grad_clip=grad_clip)
        with pytest.raises(TypeError, match="grad_clip must be None or"):
            _shard(1, torch.optim.SGD(model.parameters(), lr=lr), hcg, strategy,
                   grad_clip=torch.nn.utils.clip_grad_norm_)
    return norms + traj


# ---------------------------------------------------------------- tied weights

def _tied_layers():
    """[T, tanh, A | B, tanh, T'], T' tied to T; v1 owners 0, 1 | 0, 1; v2 at 0, 128."""
    layers = []
    for seed in range(6):
        torch.manual_seed(seed)
        layers.append(nn.Tanh() if seed in (1, 4) else nn.Linear(8, 8, bias=False))
    return layers


def _tied_oracle(steps, clip, batch):
    """One process using one weight twice, clipped: (norms, {0, 2, 3, 5: weight})."""
    layers = _tied_layers()
    layers[5] = layers[0]
    norms, traj = _clipped_oracle(nn.Sequential(*layers), steps, clip,
                                  lambda step: _data(step, batch, 8, 8))
    return norms, [{0: w[0], 2: w[1], 3: w[2], 5: w[0]} for w in traj]


def tied_weights(rank: int, world: int, steps: int = 3, clip: float = 0.05) -> None:
    """pp 2 x (sharding 2 | dp 2): a tie owned by different ranks trains as one weight."""
    batch = 2 * 2 * 2  # replicas x micro-batches x samples
    oracle_norms, oracle = _tied_oracle(steps, clip, batch)
    assert len(oracle_norms) == steps and all(float(n) > clip for n in oracle_norms)  # active
    runs = {}
    for version, overlap, release in _variants() + _variants((None,)):
        strategy, hcg, model, grad_clip = _pp2(version, overlap, release, _tied_layers(), _mse,
                                               clip, shared_weights=[("0.weight", "5.weight")])
        stage = hcg.get_stage_id()
        replica = hcg.get_sharding_parallel_rank() + hcg.get_data_parallel_rank()
        tied = model._layers[0 if stage == 0 else 2].weight
        assert getattr(tied, "is_firstly_shared", True) == (stage == 0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if version:
            opt = _shard(version, opt, hcg, strategy, grad_clip=grad_clip)
        if version == 1:  # different owners on the two stages
            assert opt._param2rank[tied] == stage
        traj = []
        for step in range(steps):
            x, y = (t.chunk(2)[replica] for t in _data(step, batch, 8, 8))
            _train_batch(model, (x, y), opt, version, grad_clip)
            assert _same_on_all([tied], None), (version, overlap, release, step)
            torch.testing.assert_close(grad_clip.global_norm, oracle_norms[step],
                                       rtol=1e-5, atol=0)
            want = [oracle[step][i] for i in ((0, 2) if stage == 0 else (3, 5))]
            traj.append(_params(model))
            _assert_close_each(traj[-1], want)
        if version == 2:  # the tied copies sit on different shards on the two stages
            view = next(b._sharding_param_grad_view[tied] for b in opt._comm_buffer_list
                        if tied in b._sharding_param_grad_view)
            assert view._index == 128 * stage and view._has_local == (replica == stage)
        runs[version, overlap, release] = traj
    _assert_release_keeps_bits(runs)
    _check_tie_misuse(model, hcg, strategy, (t.chunk(2)[replica] for t in _data(0, batch, 8, 8)))


def _check_tie_misuse(model, hcg, strategy, data):
    """A second schedule call before the step and misspelled ties raise everywhere."""
    x, y = data
    model.forward_backward_pipeline((x, y))
    with pytest.raises(ValueError, match="ran again before the optimizer step: with comm"):
        model.forward_backward_pipeline((x, y))
    for ties, error, match in (([("0.weight", "5.bias")], ValueError, "not a trainable param"),
                               ([("0.weight", "x.weight")], ValueError, "<layer index>"),
                               ([("0.weight",)], ValueError, ">= 2 distinct"),
                               (("0.weight", "5.weight"), TypeError, "list of ties")):
        with pytest.raises(error, match=match):
            PipelineParallel(_tied_layers(), hcg, strategy, _mse, shared_weights=ties)
    dist.barrier()  # every rank raised and got here


# ---------------------------------------------------------------- several schedule calls

def accumulate_calls(rank: int, world: int, steps: int = 3) -> None:
    """Two schedule calls per step: a = b = 0.6, 0.36, 0.216; with overlap refused."""
    for overlap in (False, True):
        for release in (False, True):
            strategy = _strategy(pp=2, sharding=2, acc=1, release=release,
                                 sharding_comm_overlap=overlap)
            hcg = HybridCommunicateGroup(strategy)
            model = PipelineParallel([Scale(1.0), Scale(1.0)], hcg, strategy,
                                     lambda out, y: out.mean() / 2)
            opt = DygraphShardingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), hcg,
                                           strategy)
            x1, x2 = ((1.0, 5.0), (3.0, 7.0))[hcg.get_sharding_parallel_rank()]
            x1, x2 = torch.tensor([[x1]]), torch.tensor([[x2]])
            for step, want in zip(range(steps), (0.6, 0.36, 0.216)):
                model.forward_backward_pipeline((x1, x1))
                if overlap:
                    with pytest.raises(ValueError, match="ran again before the optimizer step"):
                        model.train_batch((x2, x2), opt)
                    break
                model.train_batch((x2, x2), opt)
                (w,) = model.parameters()
                assert math.isclose(float(w), want, rel_tol=1e-6), (release, step, float(w))
    dist.barrier()  # every rank got here: none is blocked in a collective


def second_call_refused_pp3(rank: int, world: int) -> None:
    """pp 3, first-last tie: a second schedule call raises on every stage."""
    strategy = _strategy(pp=3, acc=2, release=True)
    hcg = HybridCommunicateGroup(strategy)
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4, bias=False), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(),
              nn.Linear(4, 4, bias=False)]
    model = PipelineParallel(layers, hcg, strategy, _mse, seg_boundaries=[0, 2, 4, 5],
                             shared_weights=[("0.weight", "4.weight")])
    model._prepare_training(torch.optim.SGD(model.parameters(), lr=0.1), None)
    data = _data(0, 4, 4, 4)
    model.forward_backward_pipeline(data)
    with pytest.raises(ValueError, match="ran again before the optimizer step: with "
                                         "shared_weights"):
        model.forward_backward_pipeline(data)
    dist.barrier()
