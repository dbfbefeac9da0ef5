"""Rank-side checks, on gloo, of what runs on NCCL: the collectives `comm_buffer` picks where
the backend is not gloo (`_stages_full_copies` False: reduce-scatter / all-gather with this
rank's shard of the buffer as output), batched shape metadata, timeouts on any backend, and
the current-device agreement."""
import contextlib
import copy
from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

import comm_buffer
from relgrad import register_main_grad_hooks
from comm_buffer import agree
from relgrad import SET_DEVICE_FIX, group_timeout
from pipeline import PipelineParallel, PipelineStageTimeout
from relgrad import DygraphShardingConfig, HybridCommunicateGroup, HybridStrategy, PpConfig
from relgrad_checks.common import (OPTIMIZERS, PIPE_SIZES, _assert_bitwise, _assert_moved,
                                   _data, _for, _mlp, _mse, _pipe_layers, _replica_batch)
from relgrad_checks.sharding_overlap import _CLASSES
from sharding import DygraphShardingOptimizer, DygraphShardingOptimizerV2


@contextlib.contextmanager
def _branch(nccl, counts):
    """Inside: with `nccl`, `_stages_full_copies` says False (what NCCL runs), else as it
    is (gloo: in-place all-reduce and broadcasts); `counts` counts the reduce-scatters and
    all-gathers into a shard that the buffers issue."""
    saved = (comm_buffer._stages_full_copies, comm_buffer._reduce_scatter,
             comm_buffer._all_gather)

    def reduce_scatter(output, input, group):
        counts["reduce_scatter"] += 1
        return saved[1](output, input, group)

    def all_gather(output, input, group):
        counts["all_gather"] += 1
        return saved[2](output, input, group)

    if nccl:
        comm_buffer._stages_full_copies = lambda group, tensor: False
    comm_buffer._reduce_scatter, comm_buffer._all_gather = reduce_scatter, all_gather
    try:
        yield
    finally:
        (comm_buffer._stages_full_copies, comm_buffer._reduce_scatter,
         comm_buffer._all_gather) = saved


def _strategy_own(world, acc, release, free, overlap):
    return HybridStrategy(
        sharding_degree=world,
        pp_configs=PpConfig(release_gradients=release),
        sharding_configs=DygraphShardingConfig(accumulate_steps=acc, comm_overlap=overlap,
                                               free_grads_in_comm=free))


def _make_model(bf16):
    model = _mlp([6, 16, 4])
    if bf16:  # bf16 params, fp32 main grads (and masters in the optimizer)
        model = model.to(torch.bfloat16)
        register_main_grad_hooks(model.parameters())
    return model


def _train_own(hcg, version, strategy, bf16, steps=3, batch=24):
    """Sharding's own buffers, no pipeline: each rank trains on its slice of the batch in
    `acc` micro-batches; returns the params and, for bf16, the fp32 masters after each
    step."""
    rank, nranks = dist.get_rank(), dist.get_world_size()
    acc = strategy.sharding_configs.accumulate_steps
    model = _make_model(bf16)
    cls = _CLASSES[version]
    opt = cls(OPTIMIZERS["adam"](model.parameters()), hcg, _for(cls, strategy))
    traj = []
    for step in range(steps):
        x, y = (t.chunk(nranks)[rank] for t in _data(step, batch, 6, 4))
        for xb, yb in zip(x.chunk(acc), y.chunk(acc)):
            (F.mse_loss(model(xb.to(torch.bfloat16 if bf16 else torch.float32)).float(),
                        yb) / acc).backward()
        opt.step()
        opt.zero_grad(set_to_none=strategy.pp_configs.release_gradients)
        traj.append([p.detach().clone() for p in model.parameters()] + _state(opt))
    return traj


def _state(opt):
    """The sharded optimizer's whole state gathered on rank 0 (fp32 masters, Adam's moments)
    as a list of tensors; [] elsewhere. Collective over the sharding group."""
    full = opt.consolidate_state_dict(to=0)
    if full is None:
        return []
    masters = full.get("master_weights", {})  # fp32 params: none
    masters = [masters[i] for i in sorted(masters)]
    moments = [v for i in sorted(full["state"]) for _, v in sorted(full["state"][i].items())
               if isinstance(v, torch.Tensor)]
    assert moments, "Adam's state is gathered"
    return masters + moments


# (release, free_grads_in_comm): off, on, on + free
_RELEASE = ((False, False), (True, False), (True, True))


def own_buffers(rank, world):
    """No pipeline, v1 and v2 (fp32; bf16 + fp32 main grads), own overlap on and off
    (v2 keeps buffers either way), acc 1 and 2, release off / on / on + free_grads_in_comm
    (v1: own overlap, acc 2, on + free):
    the run with NCCL's collectives is bitwise equal to the run with gloo's, for params and
    masters; the NCCL run issued reduce-scatters (v2: and all-gathers), the gloo run none.
    v1 (reduce to the owner, then broadcast) picks nothing by backend: both runs issue the
    same collectives, checked here all the same."""
    hcg = HybridCommunicateGroup(_strategy_own(world, 1, False, False, True))
    compared = Counter()
    for version, bf16, overlap, acc in ((2, False, True, 1), (2, False, True, 2),
                                        (2, False, False, 1), (2, True, True, 2),
                                        (2, True, False, 1), (1, False, True, 2)):
        for release, free in _RELEASE if version == 2 else ((True, True),):
            st = _strategy_own(world, acc, release, free, overlap)
            trajs, counts = {}, {}
            for nccl in (False, True):
                counts[nccl] = Counter()
                with _branch(nccl, counts[nccl]):
                    trajs[nccl] = _train_own(hcg, version, copy.deepcopy(st), bf16)
            case = (version, bf16, overlap, acc, release, free)
            assert counts[False] == Counter(), (case, counts[False])
            if version == 2:  # 3 steps, each bucket reduce-scattered and all-gathered once
                assert counts[True]["reduce_scatter"] >= 3, (case, counts[True])
                assert counts[True]["all_gather"] >= 3, (case, counts[True])
            else:
                assert counts[True] == Counter(), (case, counts[True])
            start = [p.detach() for p in _make_model(bf16).parameters()]
            _assert_moved([t[:len(start)] for t in trajs[True]], start)
            _assert_bitwise(trajs[False], trajs[True], case)
            compared[version] += 1
    return dict(compared)


@contextlib.contextmanager
def _no_unbatched_p2p(seen):
    """Inside: every `dist.isend` / `dist.irecv` called outside `batch_isend_irecv` is
    appended to `seen`; `seen["batches"]` counts the batches (P2POps keep the real ops)."""
    real = {"isend": dist.isend, "irecv": dist.irecv}
    real_op, real_batch = dist.P2POp, dist.batch_isend_irecv

    def wrapped(name):
        def op(*args, **kwargs):
            seen["unbatched"].append(name)
            return real[name](*args, **kwargs)
        return op

    fakes = {name: wrapped(name) for name in real}
    to_real = {id(fake): real[name] for name, fake in fakes.items()}

    def p2p_op(op, *args, **kwargs):
        return real_op(to_real.get(id(op), op), *args, **kwargs)

    def batch(ops):
        seen["batches"] += 1
        return real_batch(ops)

    dist.isend, dist.irecv = fakes["isend"], fakes["irecv"]
    dist.P2POp, dist.batch_isend_irecv = p2p_op, batch
    try:
        yield
    finally:
        dist.isend, dist.irecv = real["isend"], real["irecv"]
        dist.P2POp, dist.batch_isend_irecv = real_op, real_batch


def _train_pipe(hcg, version, strategy, steps=3, mbs=2, bf16=False):
    """pp 2 x sharding 2 under the pipeline's sharding comm overlap; params (and masters)
    after each step."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    model = PipelineParallel(_pipe_layers(dtype, main_grad=bf16), hcg, strategy, _mse)
    cls = DygraphShardingOptimizerV2 if version == 2 else DygraphShardingOptimizer
    opt = cls(OPTIMIZERS["adam"](model.parameters()), hcg, _for(cls, strategy))
    traj = []
    for step in range(steps):
        model.train_batch(_replica_batch(hcg, strategy, step, mbs, dtype), opt)
        traj.append([p.detach().clone() for p in model.parameters()] + _state(opt))
    return traj, model


def pipeline_sharding(rank, world):
    """pp 2 x sharding 2, pipeline sharding comm overlap, v2 (fp32; bf16 + fp32 main grads)
    with release off / on / on + free_grads_in_comm and v1 with on + free, acc 2, 2 steps:
    NCCL's collectives give params and optimizer state bitwise equal to gloo's; every p2p
    message, shape metadata included, goes through batch_isend_irecv."""
    hcg, compared, seen = None, Counter(), {"unbatched": [], "batches": 0}
    cases = [(2, bf16, *r) for bf16 in (False, True) for r in _RELEASE] + [(1, False, True, True)]
    for version, bf16, release, free in cases:
        st = HybridStrategy(
            pp_degree=2, sharding_degree=2, accumulate_steps=2,
            pp_configs=PpConfig(release_gradients=release, sharding_comm_overlap=True),
            sharding_configs=DygraphShardingConfig(split_param=version == 2,
                                                   free_grads_in_comm=free))
        hcg = hcg or HybridCommunicateGroup(st)
        trajs, counts = {}, {}
        for nccl in (False, True):
            counts[nccl] = Counter()
            with _branch(nccl, counts[nccl]), _no_unbatched_p2p(seen):
                trajs[nccl], model = _train_pipe(hcg, version, copy.deepcopy(st), steps=2,
                                                 bf16=bf16)
        case = (version, bf16, release, free)
        assert counts[False] == Counter(), (case, counts[False])
        if version == 2:  # 2 steps, each bucket reduce-scattered and all-gathered once
            assert counts[True]["reduce_scatter"] >= 2, (case, counts[True])
            assert counts[True]["all_gather"] >= 2, (case, counts[True])
        n_params = len(list(model.parameters()))
        assert n_params > 0 and (len(trajs[True][-1]) > n_params or rank != 0)  # state too
        _assert_bitwise(trajs[False], trajs[True], case)
        compared[version] += 1
    assert seen["batches"] > 0 and seen["unbatched"] == [], seen
    return dict(compared)


class _FakeWork:
    """A p2p / collective work whose `wait(timeout)` records the timeout and raises `error`."""

    def __init__(self, error=None):
        self.error, self.timeouts = error, []

    def wait(self, timeout=None):
        self.timeouts.append(timeout)
        if self.error is not None:
            raise self.error
        return True


def timeouts_any_backend(rank, world):
    """pp 2 on groups built with a 13 s timeout: the pipeline reads 13 s; a p2p wait that
    raises NCCL's "timing out" text (and gloo's "Timed out") ends in PipelineStageTimeout
    naming the other stage and quoting 13 s, the wait having been given 13 s; another error
    passes through; the entry check's all-reduce is waited with the group's timeout, and an
    NCCL timeout there names the stage too. Returns the messages."""
    st = HybridStrategy(pp_degree=2)
    hcg = HybridCommunicateGroup(st, timeout=timedelta(seconds=13))
    model = PipelineParallel(_pipe_layers(), hcg, st, _mse)
    other = 1 - rank
    assert group_timeout(hcg.get_pipe_parallel_group()) == timedelta(seconds=13)
    assert model._p2p_timeout == timedelta(seconds=13)
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
        model._wait_p2p([_FakeWork(RuntimeError("NCCL error: unhandled system error"))],
                        [other])
        raise AssertionError("a non-timeout error was swallowed")
    except RuntimeError as error:
        assert not isinstance(error, TimeoutError) and "unhandled system" in str(error)
    real_all_reduce, works = dist.all_reduce, []

    def timing_out(tensor, group=None, async_op=False, **kwargs):
        assert async_op, "the entry check must wait with a timeout (async_op=True)"
        works.append(_FakeWork(RuntimeError("Watchdog caught collective operation timeout: "
                                            "WorkNCCL(OpType=ALLREDUCE) ran for 13000 ms")))
        return works[-1]

    dist.all_reduce = timing_out
    try:
        model._agree_at_entry()
        raise AssertionError("the entry check's timeout was swallowed")
    except PipelineStageTimeout as error:
        texts.append(str(error))
    finally:
        dist.all_reduce = real_all_reduce
    assert [w.timeouts for w in works] == [[timedelta(seconds=13)]], works
    dist.barrier()  # both ranks done with the store keys before the next scenario
    return texts


def device_agreement(rank, world):
    """check_current_device's agreement through the store, with a problem on the last rank
    only, raises the same ValueError on every rank (naming that rank and the set_device
    line); with none it returns quietly."""
    rule = f"DygraphShardingOptimizerV2: {SET_DEVICE_FIX}"
    agree([None], [(rule, None)], via_store=True)
    problem = "params on cuda:1 but the current CUDA device is cuda:0" if rank == world - 1 \
        else None
    try:
        agree([None], [(rule, problem)], via_store=True)
    except ValueError as error:
        return str(error)
    return None


def interleave_p2p_batched(rank, world):
    """pp 2 with 2 virtual stages, one forward-backward over 4 micro-batches: every p2p
    message, the shape metadata of each chunk boundary included, goes through
    batch_isend_irecv. Returns the number of batches."""
    from relgrad_checks.common import _strategy
    from relgrad_checks.interleave import _interleaved
    strategy = _strategy(pp=2, acc=4)
    model = _interleaved(strategy, HybridCommunicateGroup(strategy))
    seen = {"unbatched": [], "batches": 0}
    with _no_unbatched_p2p(seen):
        model.forward_backward_pipeline(_data(0, 8, PIPE_SIZES[0], PIPE_SIZES[-1]))
    assert seen["unbatched"] == [], seen
    return seen["batches"]
