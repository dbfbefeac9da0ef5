"""Rank-side checks of the pipeline (pipeline.py): 1F1B against one process, release, collectives,
errors; the one-process reference and the spies the interleaved checks share."""
import contextlib
import copy
import time
import types
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipeline import PipelineParallel
from relgrad_extras.interleave import PipelineParallelWithInterleave
from relgrad import HybridCommunicateGroup
from sharding import DygraphShardingOptimizerV2
from relgrad_checks.common import (OPTIMIZERS, PIPE_SIZES, _assert_bitwise, _assert_close_each,
                                   _assert_moved, _assert_same_state, _data, _main_grad_oracle,
                                   _mse, _params, _pipe_batches, _pipe_layers, _released,
                                   _releases, _replica, _replica_batch, _same_on_all, _shard,
                                   _spy_buffers, _strategy)

_V1 = lambda opt, hcg, st: _shard(1, opt, hcg, st)
_V2 = lambda opt, hcg, st: _shard(2, opt, hcg, st)


def _expected_1f1b(stages, stage, acc):
    warm = min(stages - stage - 1, acc)
    trace = [("F", k) for k in range(warm)]
    for i in range(acc - warm):
        trace += [("F", warm + i), ("B", i)]
    return trace + [("B", acc - warm + j) for j in range(warm)]


def _pipe_oracle(opt_name, steps, batch, dtype=torch.float32):
    """One process, the whole model and batch: (losses, params after each step)."""
    model = nn.Sequential(*_pipe_layers(dtype))
    opt = OPTIMIZERS[opt_name](model.parameters())
    losses, traj = [], []
    for step in range(steps):
        x, y = (t.to(dtype) for t in _data(step, batch, PIPE_SIZES[0], PIPE_SIZES[-1]))
        loss = _mse(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        traj.append(_params(model))
    return losses, traj


def _reference(hcg, base, opt_name, dtype, main_grad, steps, mbs):
    """One process: (losses, params per step, the MixPrecision optimizer or None)."""
    replicas, replica = _replica(hcg, base)
    if not main_grad:
        losses, traj = _pipe_oracle(opt_name, steps, replicas * base.accumulate_steps * mbs,
                                    dtype)
        assert len(traj) == steps
        return losses, traj, None
    losses, traj, opt = _main_grad_oracle(lambda: nn.Sequential(*_pipe_layers(dtype)), opt_name,
                                          steps, _pipe_batches(replicas, base.accumulate_steps,
                                                               mbs, dtype))
    _assert_moved(traj, [p.detach() for layer in _pipe_layers(dtype) for p in layer.parameters()])
    assert len(traj) == steps
    return [step_losses[replica] for step_losses in losses], traj, opt


def _assert_like(reference, losses, traj, part=slice(None), what=""):
    """Each step's loss and params like `_reference`'s: bitwise with main grads, else close."""
    want_losses, oracle, oracle_opt = reference
    assert len(losses) == len(traj) == len(oracle), (len(losses), len(traj), len(oracle))
    for loss, got, want_loss, want in zip(losses, traj, want_losses, oracle):
        assert len(got) == len(want[part]) > 0, (len(got), len(want[part]))
        if oracle_opt is not None:
            assert torch.equal(loss, want_loss), (loss, want_loss)
            _assert_bitwise(got, want[part], what)
            continue
        mean = loss.clone()
        dist.all_reduce(mean)
        torch.testing.assert_close(mean / dist.get_world_size(), want_loss, rtol=1e-5, atol=1e-6)
        _assert_close_each(got, want[part])


def _stage_slice(model, hcg):
    """Indices of this stage's params within the whole model's parameter list."""
    counts = [len(list(layer.parameters())) for layer in _pipe_layers()]
    bounds = [len(counts) * s // model.num_stages for s in range(model.num_stages + 1)]
    s = hcg.get_stage_id()
    return slice(sum(counts[: bounds[s]]), sum(counts[: bounds[s + 1]]))


def _buffers(model):
    """The pipeline's fused buffers, every chunk's."""
    return [b for bs in model._chunk_2_comm_buffers.values() for b in bs]


def _own_buffers(opt):
    """v2's own REDUCE_SCATTER buffers (built when the pipeline does not overlap), else []."""
    if isinstance(opt, DygraphShardingOptimizerV2) and not opt.pp_overlap:
        return list(getattr(opt, "_comm_buffer_list", []))
    return []


@contextlib.contextmanager
def _spy_collectives():
    """Yield `seen`: `.calls` gets (tensor, `seen.model`'s position) per collective."""
    seen = types.SimpleNamespace(model=None, calls=[])
    originals = {name: getattr(dist, name)
                 for name in ("all_reduce", "reduce", "reduce_scatter_single")}
    for name, original in originals.items():

        def wrapped(tensor, *args, _original=original, _name=name, **kwargs):
            buffer_tensor = args[0] if _name == "reduce_scatter_single" else tensor
            if seen.model is not None and seen.model.schedule_trace:
                seen.calls.append((buffer_tensor, seen.model.schedule_trace[-1]))
            return _original(tensor, *args, **kwargs)

        setattr(dist, name, wrapped)
    try:
        yield seen
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _release_probe(seen, release, overlap, fires_at=None):
    """train_batch checking the buffers' life and firing (`release`, `overlap` as asked;
    interleaved: `fires_at`, each chunk's collective's position in the schedule)."""
    addresses = []

    def probe(model, opt, data, step=None):
        seen.model = model
        own = _own_buffers(opt)
        assert not release or all(b.grad_storage is None for b in _buffers(model) + own)
        seen.calls.clear()
        with _spy_buffers() as record:
            model._prepare_training(opt, None)
            loss = model._schedule(data)  # as train_batch: no entry agreement in the window
            buffers = _buffers(model)
            _check_schedule(model, seen, record, own, release, overlap, fires_at)
            seen.calls.clear()  # it holds the buffers too
            storages = [weakref.ref(b.grad_storage) for b in buffers]
            model._optimizer_step()
        _check_own_buffers(seen, record, own, release, addresses)
        _check_released(model, data, buffers, own, storages, release)
        return loss
    return probe


def _check_schedule(model, seen, record, own, release, overlap, fires_at):
    """One collective per bucket, after its chunk's last backward (plain 1F1B: in the last
    one; interleaved: at `fires_at[chunk]`), one allocation per bucket; own buffers idle."""
    by_chunk, buffers = model._chunk_2_comm_buffers, _buffers(model)
    interleaved = isinstance(model, PipelineParallelWithInterleave)
    first_copy = [made is not None for _, _, made in record["copies"]]
    assert bool(buffers) == overlap, (len(buffers), overlap)
    assert bool(by_chunk) == bool(model._comm_overlap) == overlap, (len(by_chunk), overlap)
    assert not (buffers and own), "v2 has its own buffers only without pipeline overlap"
    if interleaved and model._comm_overlap:
        assert sorted(by_chunk) == [0, 1] and all(by_chunk.values()), "a bucket per chunk"
        assert model.accumulate_steps == 4 and fires_at is not None  # FIRES_AT's case
    for chunk, chunk_buffers in by_chunk.items():
        last = ("B", model.accumulate_steps - 1)  # the last micro-batch's backward
        want = last
        if interleaved:  # the chunk's last backward; Paddle fires where FIRES_AT says
            last = ("B", model.accumulate_steps - 1, chunk)
            want = fires_at[chunk]
        for b in chunk_buffers:
            when = [w for t, w in seen.calls if t is b.grad_storage]
            assert when == [want], (chunk, when)
            assert model.schedule_trace.index(when[0]) >= model.schedule_trace.index(last)
    if release and buffers:  # exactly one allocation per bucket this step, the first copy's
        allocating = [buf for buf, _, made in record["copies"] if made is not None]
        assert sorted(map(id, allocating)) == sorted(map(id, buffers))
        assert first_copy[0] is True and first_copy.count(True) == len(buffers)
    if own:  # v2's own buffers: no hooks without overlap, nothing copied in backward
        assert not first_copy and not seen.calls, (first_copy, len(seen.calls))
        assert all((b.grad_storage is None) == release for b in own)


def _check_own_buffers(seen, record, own, release, addresses):
    """v2's own buffers at step(): one reduce-scatter each; with release allocated once and
    freed, without at one address across steps."""
    first_copy = [made is not None for _, _, made in record["copies"]]
    allocated = [made for _, _, made in record["copies"] if made is not None]
    if own:  # one reduce-scatter per own buffer, at step()
        made = [a() for a in allocated] if release else [b.grad_storage for b in own]
        assert len(made) == len(own), (len(made), len(own))
        for storage in made:
            assert storage is not None and sum(t is storage for t, _ in seen.calls) == 1
        del made, storage  # no reference of ours may keep a released buffer alive
    seen.calls.clear()
    if own and release:  # step() allocated each once (copying the grads in), then freed
        assert first_copy.count(True) == len(allocated) == len(own), (first_copy, len(own))
        assert all(b.grad_storage is None for b in own)
        assert _released(*allocated), "a released v2 buffer is still alive"
    if own and not release:  # backward wrote into the buffers' views; nothing allocated
        assert not allocated and all(b.grad_storage is not None for b in own)
        addresses.append([b.grad_storage.data_ptr() for b in own])
        assert addresses[0] == addresses[-1], "release off keeps one buffer per bucket"


def _check_released(model, data, buffers, own, storages, release):
    """After the step: release leaves no buffer or grad (plain 1F1B: eval allocates none
    either); off keeps grads and buffers."""
    params = list(model.parameters())
    assert params
    assert all((b.grad_storage is None) == release for b in buffers + own)
    if not release:  # zeroed in place, kept
        assert all(p.grad is not None or getattr(p, "main_grad", None) is not None
                   for p in params), "release off keeps the grads"
        return
    assert _released(*storages), "a released buffer is still alive"
    assert all(p.grad is None and getattr(p, "main_grad", None) is None
               for p in params), "release leaves no grad behind"
    if not isinstance(model, PipelineParallelWithInterleave):
        model.eval_batch(data)
        assert all(b.grad_storage is None for b in buffers + own)


def _pipe_run(hcg, strategy, opt_name, steps, mbs, wrap=None, dtype=torch.float32,
              main_grad=False, probe=None):
    """Train a pipeline; return (losses, params after each step, model) of this rank."""
    model = PipelineParallel(_pipe_layers(dtype, main_grad), hcg, strategy, _mse)
    opt = OPTIMIZERS[opt_name](model.parameters())
    if wrap:
        opt = wrap(opt, hcg, strategy)
    losses, traj = [], []
    for step in range(steps):
        x, y = _replica_batch(hcg, strategy, step, mbs, dtype)
        losses.append(probe(model, opt, (x, y), step) if probe else model.train_batch((x, y), opt))
        traj.append(_params(model))
        assert model.schedule_trace == _expected_1f1b(model.num_stages, model.stage_id,
                                                      strategy.accumulate_steps)
    return losses, traj, model


def _check_pipeline(hcg, base, wrap, opt_name="adam", dtype=torch.float32, main_grad=False,
                    steps=3, mbs=2):
    """Release off and on: per step like one process (`_reference`), bitwise like each other."""
    reference = _reference(hcg, base, opt_name, dtype, main_grad, steps, mbs)
    overlap = base.pp_configs.sharding_comm_overlap or base.pp_configs.dp_comm_overlap
    runs = {}
    with _spy_collectives() as seen:
        for release, strategy in _releases(base):
            probe = _release_probe(seen, release, overlap)
            losses, traj, model = _pipe_run(hcg, strategy, opt_name, steps, mbs, wrap, dtype,
                                            main_grad, probe)
            runs[release] = (losses, traj)
            part = _stage_slice(model, hcg)
            if main_grad:  # this stage's fp32 masters and Adam's state too
                _assert_same_state(model.optimizer, reference[2],
                                   range(len(reference[1][0]))[part])
            assert all(_same_on_all([loss], hcg.get_pipe_parallel_group()) for loss in losses)
            _assert_like(reference, losses, traj, part)
    _assert_bitwise(runs[False], runs[True])


def pp_sharding(rank: int, world: int, version: int, opt_name: str = "adam",
                main_grad: bool = False, overlap: bool = True) -> None:
    """pp 2 x sharding 2 (4 ranks), v1 or v2, sharding comm overlap on or off."""
    strategy = _strategy(pp=2, sharding=2, acc=4, sharding_comm_overlap=overlap,
                         split_param=version == 2)
    hcg = HybridCommunicateGroup(strategy)
    assert (hcg.get_stage_id(), hcg.get_sharding_parallel_rank()) == divmod(rank, 2)
    assert hcg.get_rank_from_stage(1) == 2 + rank % 2
    dtype = torch.bfloat16 if main_grad else torch.float32
    _check_pipeline(hcg, strategy, _V2 if version == 2 else _V1, opt_name=opt_name,
                    dtype=dtype, main_grad=main_grad)


def sharding_flag_under_pp_overlap(rank: int, world: int) -> None:
    """pp 2 x sharding 2, v2, sharding-side flag only: pipeline buffers persist."""
    strategy = _strategy(pp=2, sharding=2, acc=4, sharding_comm_overlap=True,
                         split_param=True)
    strategy.sharding_configs.release_gradients = True
    hcg = HybridCommunicateGroup(strategy)
    addresses = []

    def probe(model, opt, data, step):
        loss = model.train_batch(data, opt)
        buffers = _buffers(model)
        assert buffers and all(b.grad_storage is not None for b in buffers)
        addresses.append([b.grad_storage.data_ptr() for b in buffers])
        return loss

    losses, traj, model = _pipe_run(hcg, strategy, "sgd", 3, 2, _V2, probe=probe)
    assert addresses[0] == addresses[1] == addresses[2]
    _, oracle = _pipe_oracle("sgd", 3, 2 * 4 * 2)
    _assert_close_each(traj, [want[_stage_slice(model, hcg)] for want in oracle])
    with pytest.raises(ValueError, match="should not erase grad buffer"):
        model.optimizer.zero_grad()  # set_to_none=True would detach grads from the buffers


def pp_dp(rank: int, world: int, overlap: bool) -> None:
    """pp 2 x dp 2 (4 ranks), dp comm overlap on (Adam) or off (SGD: Adam would hide 1/dp)."""
    strategy = _strategy(dp=2, pp=2, acc=4, dp_comm_overlap=overlap)
    hcg = HybridCommunicateGroup(strategy)
    if overlap:
        _check_pipeline(hcg, strategy, None)
    else:
        _check_pipeline(hcg, strategy, None, opt_name="sgd", steps=2)


def paramless_first_stage(rank: int, world: int) -> None:
    """Explicit boundaries; a first stage without params builds no buffer and still runs."""
    strategy = _strategy(dp=2, pp=2, acc=4, dp_comm_overlap=True)
    hcg = HybridCommunicateGroup(strategy)
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


def pp_only(rank: int, world: int, delay_scale_loss: bool) -> None:
    """pp 2 (2 ranks), SGD, with or without delay_scale_loss."""
    strategy = _strategy(pp=2, acc=4, delay_scale_loss=delay_scale_loss)
    _check_pipeline(HybridCommunicateGroup(strategy), strategy, None, opt_name="sgd")


def loss_scaled_once(rank: int, world: int) -> None:
    """4 micro-batches of 1 and 1 of 4 give one process's grads: the loss scaled once."""
    hcg = HybridCommunicateGroup(_strategy(pp=2, acc=4))
    x, y = _data(0, 4, PIPE_SIZES[0], PIPE_SIZES[-1])
    oracle = nn.Sequential(*_pipe_layers())
    _mse(oracle(x), y).backward()
    want = [p.grad for p in oracle.parameters()]
    for acc in (4, 1):
        model = PipelineParallel(_pipe_layers(), hcg, _strategy(pp=2, acc=acc), _mse)
        model.forward_backward_pipeline((x, y))
        got = [p.grad for p in model.parameters()]
        _assert_close_each(got, want[_stage_slice(model, hcg)], rtol=1e-5, atol=1e-7)


def eval_and_errors(rank: int, world: int) -> None:
    """eval_batch equals one process; a bad batch and bad overlap configs raise."""
    strategy = _strategy(pp=2, acc=4)
    hcg = HybridCommunicateGroup(strategy)
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


def _failing_loss(out, y):
    _failing_loss.calls = getattr(_failing_loss, "calls", 0) + 1
    if _failing_loss.calls == 2:
        raise RuntimeError("injected failure in the last stage")
    return _mse(out, y)


def _failing_worker(rank: int, world: int) -> None:
    strategy = _strategy(pp=2, acc=4)
    model = PipelineParallel(_pipe_layers(), HybridCommunicateGroup(strategy), strategy,
                             _failing_loss)
    model.train_batch(_data(0, 8, PIPE_SIZES[0], PIPE_SIZES[-1]),
                      torch.optim.SGD(model.parameters(), lr=0.1))


def _hanging_worker(rank, world, hold=60.0):
    """Rank 0 polls for a message never sent while rank 1 lives: only a timeout ends it."""
    if rank == 0:
        work = dist.irecv(torch.zeros(1), src=1)  # rank 1 never sends
        deadline = time.monotonic() + hold
        while not work.is_completed() and time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        time.sleep(hold)
