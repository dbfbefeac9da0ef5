"""Rank-side checks, on gloo, of what runs on NCCL: the collectives `comm_buffer` picks where the
backend is not gloo (`_stages_full_copies` False: reduce-scatter / all-gather into this rank's
shard), batched p2p shape metadata, timeouts on any backend, the current-device agreement."""
import contextlib
import copy
from collections import Counter
from datetime import timedelta
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

import comm_buffer
from comm_buffer import agree
from pipeline import PipelineParallel, PipelineStageTimeout
from relgrad import SET_DEVICE_FIX, HybridCommunicateGroup, group_timeout, register_main_grad_hooks
from relgrad_checks.common import (OPTIMIZERS, PIPE_SIZES, _assert_bitwise, _assert_moved, _data,
                                   _for, _mlp, _mse, _pipe_layers, _replica_batch, _strategy)
from relgrad_checks.loops import CLASSES, own_strategy
from relgrad_extras.interleave import PipelineParallelWithInterleave
from sharding import DygraphShardingOptimizerV2

RELEASE = ((False, False), (True, False), (True, True))  # (release, free_grads_in_comm)


class _SmallBucketsV2(DygraphShardingOptimizerV2):
    """v2 with 512-byte buckets, so that a small model spreads over several buckets."""

    def _build_comm_buffers(self, acc_steps, group_size=None):
        super()._build_comm_buffers(acc_steps, group_size=512)


@contextlib.contextmanager
def _branch(nccl, counts):
    """Inside: `_stages_full_copies` False with `nccl` (NCCL's path); `counts` counting the
    reduce-scatters and all-gathers into a shard."""
    def counted(name):
        real = getattr(comm_buffer, "_" + name)

        def call(output, input, group):
            counts[name] += 1
            return real(output, input, group)
        return mock.patch.object(comm_buffer, "_" + name, call)

    with counted("reduce_scatter"), counted("all_gather"), contextlib.ExitStack() as stack:
        if nccl:
            stack.enter_context(mock.patch.object(comm_buffer, "_stages_full_copies",
                                                  lambda group, tensor: False))
        yield


def _both_branches(train, case, version, steps):
    """`train()` on gloo's path, then NCCL's: only the latter (v2) reduce-scatters and
    all-gathers into a shard, once a step at least. -> (both results, NCCL's counts)"""
    runs, counts = [], []
    for nccl in (False, True):
        counts.append(Counter())
        with _branch(nccl, counts[-1]):
            runs.append(train())
    assert counts[0] == Counter(), (case, counts[0])
    if version == 2:
        assert counts[1]["reduce_scatter"] >= steps, (case, counts[1])
        assert counts[1]["all_gather"] >= steps, (case, counts[1])
    return runs, counts[1]


def _model(bf16):
    model = _mlp([6, 16, 4])
    if bf16:  # bf16 params, fp32 main grads (and masters in the optimizer)
        model = model.to(torch.bfloat16)
        register_main_grad_hooks(model.parameters())
    return model


def _state(opt):
    """The optimizer's whole state on rank 0 (fp32 masters, Adam's moments); [] elsewhere."""
    full = opt.consolidate_state_dict(to=0)
    if full is None:
        return []
    masters = full.get("master_weights", {})  # fp32 params: none
    moments = []
    for i in sorted(full["state"]):
        moments += [v for _, v in sorted(full["state"][i].items()) if isinstance(v, torch.Tensor)]
    assert moments, "Adam's state is gathered"
    return [masters[i] for i in sorted(masters)] + moments


def _train_own(hcg, version, strategy, bf16, steps=3, batch=24):
    """Own buffers, this rank's slice in `acc` micro-batches. -> params and state per step"""
    rank, nranks = dist.get_rank(), dist.get_world_size()
    acc = strategy.sharding_configs.accumulate_steps
    dtype = torch.bfloat16 if bf16 else torch.float32
    model = _model(bf16)
    cls = CLASSES[1] if version == 1 else _SmallBucketsV2
    opt = cls(OPTIMIZERS["adam"](model.parameters()), hcg, _for(cls, strategy))
    traj = []
    for step in range(steps):
        x, y = (t.chunk(nranks)[rank] for t in _data(step, batch, 6, 4))
        for xb, yb in zip(x.chunk(acc), y.chunk(acc)):
            (F.mse_loss(model(xb.to(dtype)).float(), yb) / acc).backward()
        opt.step()
        opt.zero_grad(set_to_none=strategy.sharding_configs.release_gradients)
        traj.append([p.detach().clone() for p in model.parameters()] + _state(opt))
    return traj


def own_buffers(rank: int, world: int) -> dict:
    """No pipeline, v2 (fp32, bf16 + main grads, overlap on / off, acc 1 / 2, each release)
    and v1: NCCL's path bitwise gloo's. -> {version: cases compared}"""
    hcg = HybridCommunicateGroup(own_strategy(world, 1, release=False))
    compared = Counter()
    for version, bf16, overlap, acc in ((2, False, True, 1), (2, False, True, 2),
                                        (2, False, False, 1), (2, True, True, 2),
                                        (2, True, False, 1), (1, False, True, 2)):
        for release, free in RELEASE if version == 2 else ((True, True),):
            st = own_strategy(world, 1, overlap, acc, release, free_grads_in_comm=free)
            case = (version, bf16, overlap, acc, release, free)
            (gloo, nccl), counts = _both_branches(
                lambda: _train_own(hcg, version, copy.deepcopy(st), bf16), case, version, 3)
            if version == 1:  # reduce to the owner, then broadcast: the same on every backend
                assert counts == Counter(), (case, counts)
            start = [p.detach() for p in _model(bf16).parameters()]
            _assert_moved([t[:len(start)] for t in nccl], start)
            _assert_bitwise(gloo, nccl, case)
            compared[version] += 1
    return dict(compared)


@contextlib.contextmanager
def _no_unbatched_p2p(seen):
    """Inside: each isend / irecv outside batch_isend_irecv noted in `seen["unbatched"]`,
    the batches counted in `seen["batches"]`."""
    real = {"isend": dist.isend, "irecv": dist.irecv}
    real_op, real_batch = dist.P2POp, dist.batch_isend_irecv

    def unbatched(name):
        def op(*args, **kwargs):
            seen["unbatched"].append(name)
            return real[name](*args, **kwargs)
        return op

    fakes = {name: unbatched(name) for name in real}
    to_real = {id(fakes[name]): real[name] for name in real}

    def batch(ops):
        seen["batches"] += 1
        return real_batch(ops)

    def p2p_op(op, *args, **kwargs):
        return real_op(to_real.get(id(op), op), *args, **kwargs)

    with mock.patch.multiple(dist, isend=fakes["isend"], irecv=fakes["irecv"],
                             batch_isend_irecv=batch, P2POp=p2p_op):
        yield


def _train_pipe(hcg, version, strategy, bf16, steps=2, mbs=2):
    """pp 2 x sharding 2, sharding overlap. -> (params and state per step, param count)"""
    dtype = torch.bfloat16 if bf16 else torch.float32
    model = PipelineParallel(_pipe_layers(dtype, main_grad=bf16), hcg, strategy, _mse)
    opt = CLASSES[version](OPTIMIZERS["adam"](model.parameters()), hcg,
                           _for(CLASSES[version], strategy))
    traj = []
    for step in range(steps):
        model.train_batch(_replica_batch(hcg, strategy, step, mbs, dtype), opt)
        traj.append([p.detach().clone() for p in model.parameters()] + _state(opt))
    return traj, len(list(model.parameters()))


def pipeline_sharding(rank: int, world: int) -> dict:
    """pp 2 x sharding 2, v2 (fp32, bf16 + main grads, each release) and v1: NCCL's path
    bitwise gloo's, every p2p batched. -> {version: cases compared}"""
    hcg, compared, seen = None, Counter(), {"unbatched": [], "batches": 0}
    cases = [(2, bf16, *r) for bf16 in (False, True) for r in RELEASE] + [(1, False, True, True)]
    for version, bf16, release, free in cases:
        st = _strategy(pp=2, sharding=2, acc=2, release=release, split_param=version == 2,
                       sharding_comm_overlap=True)
        st.sharding_configs.free_grads_in_comm = free
        hcg = hcg or HybridCommunicateGroup(st)
        case = (version, bf16, release, free)
        with _no_unbatched_p2p(seen):
            (gloo, nccl), _ = _both_branches(
                lambda: _train_pipe(hcg, version, copy.deepcopy(st), bf16), case, version, 2)
        n_params = nccl[1]
        assert n_params > 0 and (len(nccl[0][-1]) > n_params or rank != 0)  # state too
        _assert_bitwise(gloo[0], nccl[0], case)
        compared[version] += 1
    assert seen["batches"] > 0 and seen["unbatched"] == [], seen
    return dict(compared)


class _FakeWork:
    """A work whose `wait(timeout)` records the timeout and raises `error`."""

    def __init__(self, error: Exception) -> None:
        self.error, self.timeouts = error, []

    def wait(self, timeout=None):
        self.timeouts.append(timeout)
        raise self.error


def _p2p_timeouts(model, other):
    """The pipeline's errors for p2p waits raising NCCL's and gloo's timeout texts."""
    texts = []
    for text in ("[Rank 0] Work WorkNCCL(SeqNum=3, OpType=RECV) timing out after 13000 ms",
                 "[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 13000ms "
                 "for recv operation to complete"):
        work = _FakeWork(RuntimeError(text))
        try:
            model._wait_p2p([work], [other])
        except PipelineStageTimeout as error:
            texts.append(str(error))
        assert work.timeouts == [timedelta(seconds=13)], work.timeouts
    assert len(texts) == 2, texts
    try:
        model._wait_p2p([_FakeWork(RuntimeError("NCCL error: unhandled system error"))], [other])
        raise AssertionError("a non-timeout error was swallowed")
    except RuntimeError as error:
        assert not isinstance(error, TimeoutError) and "unhandled system" in str(error)
    return texts


def timeouts_any_backend(rank: int, world: int) -> list[str]:
    """pp 2, groups' timeout 13 s: p2p and entry-check waits get 13 s; timeouts end in
    PipelineStageTimeout. -> the three texts"""
    st = _strategy(pp=2)
    hcg = HybridCommunicateGroup(st, timeout=timedelta(seconds=13))
    model = PipelineParallel(_pipe_layers(), hcg, st, _mse)
    assert group_timeout(hcg.get_pipe_parallel_group()) == timedelta(seconds=13)
    assert model._p2p_timeout == timedelta(seconds=13)
    texts, works = _p2p_timeouts(model, 1 - rank), []

    def timing_out(tensor, group=None, async_op=False, **kwargs):
        assert async_op, "the entry check must wait with a timeout (async_op=True)"
        works.append(_FakeWork(RuntimeError("Watchdog caught collective operation timeout: "
                                            "WorkNCCL(OpType=ALLREDUCE) ran for 13000 ms")))
        return works[-1]

    with mock.patch.object(dist, "all_reduce", timing_out):
        try:
            model._agree_at_entry()
            raise AssertionError("the entry check's timeout was swallowed")
        except PipelineStageTimeout as error:
            texts.append(str(error))
    assert [w.timeouts for w in works] == [[timedelta(seconds=13)]], works
    dist.barrier()  # both ranks done with the store keys before the next scenario
    return texts


def device_agreement(rank: int, world: int) -> str | None:
    """The device rule agreed through the store, a problem on the last rank. -> its text"""
    rule = f"DygraphShardingOptimizerV2: {SET_DEVICE_FIX}"
    agree([None], [(rule, None)], via_store=True)
    problem = None
    if rank == world - 1:
        problem = "params on cuda:1 but the current CUDA device is cuda:0"
    try:
        agree([None], [(rule, problem)], via_store=True)
    except ValueError as error:
        return str(error)
    return None


def interleave_p2p_batched(rank: int, world: int) -> int:
    """pp 2, 2 virtual stages, one forward-backward: all p2p batched. -> batches"""
    strategy = _strategy(pp=2, acc=4)
    strategy.pp_configs.num_virtual_pipeline_stages = 2
    model = PipelineParallelWithInterleave(_pipe_layers(), HybridCommunicateGroup(strategy),
                                           strategy, _mse)
    seen = {"unbatched": [], "batches": 0}
    with _no_unbatched_p2p(seen):
        model.forward_backward_pipeline(_data(0, 8, PIPE_SIZES[0], PIPE_SIZES[-1]))
    assert seen["unbatched"] == [], seen
    return seen["batches"]
