"""Pipeline parallelism with 1F1B, fused grad comm overlap and `release_gradients` in torch.

Mirrors `PipelineParallel` in `python/paddle/distributed/fleet/meta_parallel/pipeline_parallel.py`
at commit 9b40c67f672f, with the seed diff's hunks (PR #59739), whose schedule descends from
Megatron-LM's non-interleaved 1F1B.

Each rank holds one contiguous stage of a list of layers. `train_batch` cuts the batch into
`accumulate_steps` micro-batches and runs 1F1B: warm-up (stage s of p runs p-s-1 forwards),
steady 1F1B (one forward, one backward, alternating), cool-down (the remaining backwards).
Activations and their grads cross stages by point-to-point send/recv. With comm overlap, each
stage's grads live in `FusedCommBuffer`s whose hooks fire each bucket's collective during the
last micro-batch's backward (dp all-reduce, or sharding reduce / reduce-scatter); after the
schedule every buffer is waited and scaled. `_optimizer_step` then steps and, with
`release_gradients`, drops the grads and frees every buffer until the next step's first backward.
Phases of a step: warm-up -> steady 1F1B -> cool-down -> wait and scale -> step -> release.
Beyond Paddle, so that every rank ends with the same clear error in bounded time: a step opens
with one small all-reduce of flags over the job (`_agree_at_entry`: misuse one stage sees,
a batch that does not split, a stage that refused to start, accumulate_steps that differ),
p2p waits honour the pipe group's timeout and name the stage that did not answer
(`_wait_p2p`), or end within a fraction of a second once a stage has failed in this call
(`_wait_watching`), and a bucket left incomplete on one rank is issued anyway and agreed
on after the schedule (`_scale_and_agree`). A Parameter object in two stages' layers
must be tied with `shared_weights` (`_check_untied_shares`).

Weights tied across stages (`shared_weights`, Paddle's SharedLayerDesc) live in
`relgrad_extras/shared_weights.py`; global-norm clipping (`grad_clip`) in
`relgrad_extras/grad_clip.py`. The interleaved schedule (virtual stages, several model chunks
per rank) is the subclass `PipelineParallelWithInterleave` in `relgrad_extras/interleave.py`.

Leaves out: AMP scaler, timers, freeing sent activations early (Paddle's `_release_output`).

References: Paddle PRs #59739, #58441; Narayanan et al., "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM" (2021); Harlap et al., "PipeDream" (2018).
"""
import hashlib
import os
import queue
import threading
import weakref
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

from comm_buffer import (HOOK_ACTION, FusedCommBuffer, assign_group_by_size,
                         bw_hook_func, check_current_device, global_rank, group_timeout,
                         is_timeout_error, main_grad_or_grad as _grad, share_comm_queue)
from sharding import _check_grad_clip, _extras, agreed_all_reduce_mean, norm_groups

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]  # p2p meta codes
_META_LEN = 10  # dtype code, ndim, up to 8 dims


_MOVED_GRAD_MSG = (
    "The address of the grad/main_grad of a param in a fused buffer changed between steps; "
    "while the buffer holds it (release_gradients off), the grad must stay the view of its "
    "slot. Likely causes: zero_grad(set_to_none=True) / clear_grad(set_to_zero=False), or "
    "an out-of-place op that rebinds the grad (p.grad = p.grad / 2). Change grads in place "
    "(p.grad.div_(2), zero_grad(set_to_none=False)), or turn pp_configs.release_gradients "
    "on")
_INCOMPLETE_MSG = (
    "a fused bucket of the pipeline's comm overlap was not complete after accumulate_steps="
    "{acc} micro-batches: every trainable param of a stage must get a grad in every "
    "micro-batch on every rank (a param that some micro-batches leave out never checks in "
    "acc times, and its bucket's collective would not be issued). Use every param in each "
    "micro-batch, or freeze (requires_grad=False) the ones you leave out before building "
    "the pipeline. The grads of this step are not usable: the step is not taken")
_BATCH_MSG = (
    "train_batch: a batch does not split into accumulate_steps micro-batches (of "
    "micro_batch_size, if set); a rank that started with it would leave the others waiting "
    "in its collectives. Pass micro_batch_size * accumulate_steps samples on every rank")
_ABANDONED = []  # p2p works that timed out: kept, since the backend may still fill their buffers


class PipelineStageTimeout(TimeoutError):
    """A stage waited past the pipe group's timeout for another stage (which is named)."""


class PipelineStageFailed(Exception):
    """Another stage of the pipe failed in this train_batch call while this one waited for
    its p2p message; names that stage and its error (read from the default group's store)."""


_WATCH_SECONDS = 0.2  # how often a p2p wait looks in the store for a stage that failed


def _group_timeout(group):
    """The timeout `group` was created with, for the device its backend serves (gloo / nccl
    options), else torch's default for that backend (`comm_buffer.group_timeout`)."""
    return group_timeout(group)


def _default_store():
    """The default group's store (a side channel beside the collectives), or None."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 (private API)
        return None


def _cut_layers(layers, seg_boundaries, parts):
    """`parts + 1` rising boundaries over `layers`; default an even split by count."""
    bounds = seg_boundaries or [len(layers) * i // parts for i in range(parts + 1)]
    if (len(bounds) != parts + 1 or bounds[0] != 0 or bounds[-1] != len(layers)
            or any(a > b for a, b in zip(bounds, bounds[1:]))):
        raise ValueError(f"seg_boundaries must rise from 0 to len(layers)={len(layers)} "
                         f"in {parts + 1} entries; got {bounds}")
    return bounds


def _build_segment(layers):
    """`nn.Sequential` of `layers`; a zero-argument callable (LayerDesc) is called here."""
    return nn.Sequential(*[l if isinstance(l, nn.Module) else l() for l in layers])


def _clear_grad(optimizer, set_to_zero):
    """Paddle's `optimizer.clear_grad(set_to_zero)`; a plain torch optimizer's `zero_grad`."""
    if hasattr(optimizer, "clear_grad"):
        optimizer.clear_grad(set_to_zero=set_to_zero)
    else:
        optimizer.zero_grad(set_to_none=not set_to_zero)


class _NoTies:
    """What `PipelineParallel` asks of its tied weights when there are none (no ties: no
    collectives, every bucket fires from its own hook)."""

    across_stages = False
    held_buffers = ()

    def __bool__(self):
        return False

    def hook_func(self, bucket, buffer):
        return bw_hook_func

    def allreduce_shared_weight_gradients(self):
        pass


class _P2PWaiter:
    """A daemon thread that runs, one at a time, the p2p waits `_wait_watching` hands it, so
    that the caller can look in the store meanwhile. Beyond Paddle. One per process
    (`_p2p_waiter`): a thread per wait would pay a thread's start per message, and each new
    thread's malloc arena and caches would move the allocator figures the demo reports."""

    def __init__(self):
        self._jobs = queue.SimpleQueue()
        threading.Thread(target=self._serve, args=(self._jobs,), daemon=True,
                         name="relgrad-p2p-wait").start()

    @staticmethod
    def _serve(jobs):
        while (job := jobs.get()) is not None:
            work, timeout, done, caught = job
            try:
                work.wait(timeout)
            except BaseException as error:  # noqa: BLE001 (re-raised by the caller's thread)
                caught.append(error)
            finally:
                # Drop the work (and the tensors it holds) before the caller goes on: it then
                # frees them itself, and no step's buffers wait here for the next message.
                job = work = None
                done.set()

    def submit(self, work, timeout):
        """Queue `work.wait(timeout)`; return (an Event set when it returned or raised, a list
        that then holds what it raised, if anything)."""
        done, caught = threading.Event(), []
        self._jobs.put((work, timeout, done, caught))
        return done, caught

    def close(self):
        """End the thread once the waits queued before are done."""
        self._jobs.put(None)


def _clip_signature(grad_clip):
    """0 for no clip; else 1 + 24 bits of a hash of (type name, clip_norm): equal on every
    rank iff the clips agree (up to a 2**-24 chance), small enough that the entry check's
    int64 sum of squares cannot overflow."""
    if grad_clip is None:
        return 0
    text = repr((type(grad_clip).__name__, getattr(grad_clip, "clip_norm", None)))
    return 1 + int.from_bytes(hashlib.sha256(text.encode()).digest()[:3], "little")


_WAITER = []  # the process's _P2PWaiter, started by the first wait


def _p2p_waiter():
    """The process's `_P2PWaiter`. One for every pipeline of the process: a thread per
    pipeline (the demo builds one per release mode) moves the allocator figures of the runs
    apart by its thread's malloc caches."""
    if not _WAITER:
        _WAITER.append(_P2PWaiter())
    return _WAITER[0]


class PipelineParallel(nn.Module):
    """One pipeline stage of `layers`, trained with 1F1B (Paddle's `PipelineParallel`).

    Args:
        layers: list or nn.Sequential; an item is an nn.Module or a zero-argument callable that
            builds one (Paddle's LayerDesc), called only on the stage that holds it.
        hcg: the topology, e.g. `relgrad.HybridCommunicateGroup`; read here:
            `get_stage_id()`, `get_rank_from_stage(s)`, `get_pipe_parallel_{group,world_size}()`,
            `get_data_parallel_{group,world_size}()`, `get_sharding_parallel_{group,world_size}()`.
        strategy: `relgrad.HybridStrategy`: degrees, accumulate_steps (micro-batches),
            micro_batch_size and pp_configs.
        loss_fn: `loss_fn(output, label) -> scalar`, mean over the micro-batch; last stage only.
        seg_boundaries: stage s holds `layers[b[s]:b[s+1]]`; default an even split by count.
        shared_weights: None or a list of ties, each a tuple of param names in the whole layer
            list, e.g. `[("0.tok.weight", "5.proj.weight")]` (Paddle's SharedLayerDesc): the
            copies start equal (broadcast from the first holder), their grads are summed over
            the holding stages after the schedule, before any dp / sharding collective reads
            them (with comm overlap, their buckets wait for that sum), so they stay equal;
            see `relgrad_extras.shared_weights.SharedWeights` (copy `relgrad_extras/`; without
            it, ties raise ImportError) for the rules and the errors it raises.
    Raises ValueError for boundaries that do not cover the layers, a Parameter object in
    the layers of two stages that no tie of `shared_weights` names, an overlap config that
    breaks Paddle's rules (dp_comm_overlap needs dp > 1 and pp > 1, sharding_comm_overlap
    needs sharding > 1 and pp > 1, not both), or pp_configs.num_virtual_pipeline_stages > 1
    (that is `PipelineParallelWithInterleave`); under nccl, on every stage, for params on a
    GPU other than the current one (`comm_buffer.check_current_device`: no set_device).
    """

    def __init__(self, layers, hcg, strategy, loss_fn, seg_boundaries=None,
                 shared_weights=None):
        super().__init__()
        pp_configs = strategy.hybrid_configs["pp_configs"]
        self._hcg, self._strategy, self._loss_fn = hcg, strategy, loss_fn
        self.num_stages = hcg.get_pipe_parallel_world_size()
        self.stage_id = hcg.get_stage_id()
        self.accumulate_steps = strategy.accumulate_steps
        self.micro_batch_size = strategy.micro_batch_size
        self._dp_comm_overlap = pp_configs.dp_comm_overlap
        self._sharding_comm_overlap = pp_configs.sharding_comm_overlap
        self._delay_scale_loss = pp_configs.delay_scale_loss
        # Seed hunk: read pp_configs.release_gradients.
        self._release_gradients = strategy.hybrid_configs["pp_configs"].release_gradients
        self._sharding_split_param = strategy.hybrid_configs["sharding_configs"].split_param
        # Beyond Paddle: a bad config raises on every rank alike, before any communication.
        self._check_overlap_config(hcg)
        self._check_virtual_stages(getattr(pp_configs, "num_virtual_pipeline_stages", 1))
        self._comm_overlap = self._dp_comm_overlap or self._sharding_comm_overlap
        # Paddle is handed a PipelineLayer; here this stage's layers are cut from the list.
        layers = list(layers)
        self._layers, bounds = self._build_layers(layers, seg_boundaries)
        self._chunk_2_comm_buffers = defaultdict(list)
        self._sharding_hooks_registered = False
        self.optimizer = self.lr_scheduler = None
        self._init_beyond_paddle(layers, bounds, shared_weights)  # skip when reading the seed
        if self._dp_comm_overlap:
            self.fused_gradient(self._layers, hcg.get_data_parallel_group(),
                                self.accumulate_steps, dp=True)

    def _init_beyond_paddle(self, layers, bounds, shared_weights):
        """Beyond Paddle, the end of `__init__`: untied shares and the current device checked
        on every rank before the first collective; an id and a timeout for failing stages
        (`_wait_p2p`); tied weights; the schedule's trace for tests; misuse state. None of it
        touches the fused buffers or release."""
        self._check_untied_shares(layers, bounds, shared_weights)
        # Under nccl, params on a GPU other than the current one (no torch.cuda.set_device)
        # raise here on every stage, before the first collective.
        check_current_device(list(self._layers.parameters()),
                             [self._hcg.get_pipe_parallel_group()], "PipelineParallel")
        # ("F" | "B", micro-batch) in the order run, for tests; the interleaved schedule adds
        # the chunk: ("F" | "B", micro-batch, chunk)
        self.schedule_trace = []
        # With nccl, the first call on the group that batch_isend_irecv uses must involve all
        # its ranks (torch's rule for P2POp); a tiny all-reduce does that on every backend.
        # It also sums one random number per rank into an id this pipe's stages share: the
        # key under which a failing stage leaves its error for the others (`_wait_p2p`).
        uid = torch.tensor([int.from_bytes(os.urandom(5), "little")], device=self._device())
        dist.all_reduce(uid, group=self._hcg.get_pipe_parallel_group())
        self._uid, self._calls = int(uid), 0
        self._entered = False  # train_batch agreed at entry: its schedule does not again
        self._p2p_timeout = _group_timeout(self._hcg.get_pipe_parallel_group())
        self._shared = self._shared_weights(shared_weights, bounds)
        self._grad_clip = None
        self._grads_pending = False  # a schedule ran and no _optimizer_step since
        self._incomplete = None  # (flags, detail) of _scale_and_agree, for the loss's reduce

    def _check_overlap_config(self, hcg):
        pp, dp = self.num_stages, hcg.get_data_parallel_world_size()
        sharding = hcg.get_sharding_parallel_world_size()
        if self._dp_comm_overlap and self._sharding_comm_overlap:
            raise ValueError("pp_configs.dp_comm_overlap and sharding_comm_overlap cannot both "
                             "be on; turn one off")
        if self._dp_comm_overlap and not (dp > 1 and pp > 1):
            raise ValueError(f"pp_configs.dp_comm_overlap needs dp_degree > 1 and pp_degree > "
                             f"1; got dp_degree={dp}, pp_degree={pp}; turn it off")
        if self._sharding_comm_overlap and not (sharding > 1 and pp > 1):
            raise ValueError(f"pp_configs.sharding_comm_overlap needs sharding_degree > 1 and "
                             f"pp_degree > 1; got sharding_degree={sharding}, pp_degree={pp}; "
                             "turn it off")

    def _check_virtual_stages(self, num_virtual_stages):
        if num_virtual_stages != 1:
            raise ValueError(f"pp_configs.num_virtual_pipeline_stages={num_virtual_stages} "
                             "needs the interleaved schedule: build PipelineParallelWithInterleave"
                             " (relgrad_extras.interleave); PipelineParallel runs 1 chunk")

    def _check_untied_shares(self, layers, bounds, shared_weights):
        """Beyond Paddle: raise ValueError (on every rank: each holds the whole layer list)
        for a Parameter object that appears in the layers of two stages without a tie in
        `shared_weights` naming both (e.g. an embedding and an LM head tied inside one
        model, then cut across stages): each stage would train its own copy, and the copies
        drift apart silently. Layers given as LayerDescs (callables) are not seen here."""
        tied = [set(tie) for tie in shared_weights or ()]
        chunks = len(bounds) - 1
        first, problems = {}, []
        for i, layer in enumerate(layers):
            if not isinstance(layer, nn.Module):
                continue
            chunk = max(c for c in range(chunks) if bounds[c] <= i < bounds[c + 1])
            stage = chunk % self.num_stages  # virtual stages: chunk c runs on stage c % pp
            for name, p in layer.named_parameters():
                name = f"{i}.{name}"
                seen = first.setdefault(id(p), (name, stage))
                if seen[1] != stage and not any({seen[0], name} <= tie for tie in tied):
                    problems.append((seen, (name, stage)))
        if problems:
            (a, sa), (b, sb) = problems[0]
            raise ValueError(
                f"one Parameter object is '{a}' on stage {sa} and '{b}' on stage {sb} "
                f"({len(problems)} such pair(s)): each stage would train its own copy and "
                "the copies would drift apart. Tie them with "
                f"PipelineParallel(..., shared_weights=[({a!r}, {b!r})]) (their grads are "
                "then summed over the stages), or give the layers separate params")

    def _shared_weights(self, shared_weights, bounds):
        if shared_weights is None:
            return _NoTies()
        tied = _extras("shared_weights", "PipelineParallel(shared_weights=...)")
        return tied.SharedWeights(self._layers, self._hcg, shared_weights, bounds,
                                  self._device())

    def _build_layers(self, layers, seg_boundaries):
        """This stage's `nn.Sequential` of `layers[b[s]:b[s+1]]`, built from LayerDescs, and
        the boundaries b."""
        bounds = _cut_layers(layers, seg_boundaries, self.num_stages)
        return _build_segment(layers[bounds[self.stage_id] : bounds[self.stage_id + 1]]), bounds

    def forward(self, x):
        """This stage's layers on `x` (no communication)."""
        return self._layers(x)

    # ---- comm overlap: fused buffers whose hooks fire the collectives during backward ----

    def fused_gradient(self, model, comm_group, acc_steps, dp, param2rank=None,
                       group_size=128 * 1024 * 1024):
        """Build `FusedCommBuffer`s for `model`'s trainable params and hook them to `add_grad`.

        Action: ALL_REDUCE for dp; REDUCE to each param's owner (`param2rank`, sharding v1,
        buckets grouped by owner); REDUCE_SCATTER with split_param (v2). `model` is one chunk,
        or an `nn.ModuleList` of this rank's chunks (virtual stages, as Paddle's
        `get_model_chunks()`); chunk i's buckets go to `_chunk_2_comm_buffers[i]`.
        """
        act = (HOOK_ACTION.ALL_REDUCE if dp else HOOK_ACTION.REDUCE_SCATTER
               if self._sharding_split_param else HOOK_ACTION.REDUCE)
        chunks = list(model) if isinstance(model, nn.ModuleList) else [model]
        for chunk_idx, chunk in enumerate(chunks):
            params = [p for p in chunk.parameters() if p.requires_grad]
            if not params:
                continue  # Paddle returns from the whole loop here; we go on to the next chunk
            var_groups = defaultdict(list)
            for p in params:
                var_groups[param2rank[p] if act == HOOK_ACTION.REDUCE else -1].append(p)
            for dst, group_params in var_groups.items():  # owners in order of appearance
                dst = global_rank(comm_group, dst) if dst != -1 else -1
                for idx, bucket in assign_group_by_size(group_params, group_size).items():
                    # Seed hunk: the buffer gets release_grads from pp_configs.
                    buffer = FusedCommBuffer(idx, bucket, comm_group, acc_steps, act, dst,
                                             release_grads=self._release_gradients,
                                             free_grads_in_comm=not dp and self._strategy
                                             .hybrid_configs["sharding_configs"]
                                             .free_grads_in_comm)  # [later], PaddleNLP #9081
                    self._chunk_2_comm_buffers[chunk_idx].append(buffer)
                    # Beyond Paddle: a tied weight's copy only checks in (shared_weights);
                    # without ties every param gets this schedule's hook, as in Paddle.
                    hook = self._shared.hook_func(bucket, buffer)  # a tied copy: check in only
                    if hook is bw_hook_func:  # untied: this schedule's own hook
                        hook = self.bw_hook_func
                    for p in bucket:
                        p.register_post_accumulate_grad_hook(hook(buffer, p))
        # [later] free_grads_in_comm: each bucket freed once its collective is done, during
        # backward (skip when reading the seed: without that flag this does nothing).
        share_comm_queue([b for bs in self._chunk_2_comm_buffers.values() for b in bs])

    def bw_hook_func(self, buffer, param):
        """The hook each untied param gets (Paddle's method of this name): check in, and fire
        the bucket's collective once all its params are in (comm_buffer.bw_hook_func).

        Beyond Paddle, buckets fire in one order on every rank: the order in which they
        completed their first round of check-ins this step (every param once). With the same
        graph in every micro-batch that is the order they complete, so nothing waits; a
        bucket that completes before an earlier one (a param left out of a micro-batch on
        this rank) waits for it, so that `_issue_incomplete` can still match the peers'
        collectives in order. The hook holds the pipeline weakly (see bw_hook_func).
        """
        check_in = bw_hook_func(buffer, param, use_comm=False)
        pipeline_ref, buffer_ref = weakref.ref(self), weakref.ref(buffer)

        def hook(param):
            pipeline, buffer = pipeline_ref(), buffer_ref()
            first = buffer is not None and buffer._params_step_dict.get(param) == 0
            check_in(param)
            if pipeline is not None:
                pipeline._fire_in_order(buffer, first)

        return hook

    def _fire_in_order(self, buffer, first):
        """After a check-in to `buffer` (`first`: the param's first this step): note the
        first-round order, then fire, in that order, every bucket that is complete."""
        if first:
            n = self._first_check_ins[id(buffer)] = self._first_check_ins.get(id(buffer), 0) + 1
            if n == len(buffer.params):
                self._round_order.append(buffer)
        order = self._round_order
        while self._fired < len(order) and order[self._fired]._all_params_checked_in:
            if order[self._fired]._task is None:
                order[self._fired].comm_grads()
            self._fired += 1

    def register_sharding_comm_overlap_hook(self, optimizer):
        """Build the sharding buffers; lazily, since v1's owner map lives in the optimizer."""
        if self._sharding_hooks_registered:
            return
        param2rank = None
        if not self._sharding_split_param:
            param2rank = getattr(optimizer, "_param2rank", None)
            if param2rank is None:
                raise ValueError("sharding_comm_overlap without split_param needs a sharding v1 "
                                 "optimizer (DygraphShardingOptimizer), which owns _param2rank")
        # Paddle's pipeline keeps 128 MB buckets; beyond it, sharding_configs.
        # comm_buffer_size_MB ([later]) sets them here too when it is set.
        sharding_config = self._strategy.hybrid_configs["sharding_configs"]
        mb = getattr(sharding_config, "comm_buffer_size_MB", None)
        size = {} if mb is None else {"group_size": mb * 1024 * 1024}
        self.fused_gradient(self._layers, self._hcg.get_sharding_parallel_group(),
                            self.accumulate_steps, dp=False, param2rank=param2rank, **size)
        self._sharding_hooks_registered = True

    # ---- one training step ----

    def train_batch(self, data, optimizer, lr_scheduler=None, grad_clip=None):
        """Run 1F1B over `data = (inputs, labels)` (batch dim 0), then `_optimizer_step`.

        Every rank of the pipe passes the same batch; stage 0 reads the inputs, the last
        stage the labels. Returns the loss averaged over micro-batches (0-d fp32 tensor), the
        same on every rank of this pipe. Beyond Paddle, raises ValueError on every rank of
        the job, before any p2p or collective of the step, if the batch of some rank does
        not split into `accumulate_steps` micro-batches (of `micro_batch_size`, if set), for
        a grad that left its fused buffer (release off), an error `_prepare_training` raised
        on some rank, or accumulate_steps that differ across ranks; after the schedule, for
        a bucket that was
        incomplete on some rank; PipelineStageTimeout (a TimeoutError) when another stage
        does not answer within the pipe group's timeout, naming it and the error it left.

        `grad_clip`: None or a Paddle-style clip (`relgrad_extras.grad_clip.ClipGradByGlobalNorm`),
        for a plain torch optimizer.
        Paddle finds it inside the optimizer (its `grad_clip`); a torch optimizer has no such
        slot, so it is passed here beside the optimizer, as `lr_scheduler` is. It runs in
        `_optimizer_step` after the dp all-reduce, before the step and the release, over the
        whole model (summed over the pipe). A sharding optimizer takes it in its constructor
        instead (it clips inside its `step()`, after its reduce); passing it here too raises
        ValueError; another type raises TypeError.
        """
        self._check_accumulation()  # before _prepare_training builds sharding buffers
        self._calls += 1
        try:  # a stage that refuses to start (its config, its buffers) tells the others
            self._prepare_training(optimizer, lr_scheduler, grad_clip)
            refused = None
        except (ValueError, TypeError) as error:
            refused = error
        self._agree_at_entry(refused, data)
        self._entered = True  # the schedule below does not agree again
        self.train()
        try:
            loss = self.forward_backward_pipeline(data)
            self._optimizer_step()
        except Exception as error:  # noqa: BLE001 (re-raised; the other stages read it)
            self._post_failure(error)
            raise
        return loss

    # ---- a stage that fails alone: agree first, then let the others know ----

    def _agree_groups(self):
        """The groups whose all-reduces, in turn, sum a flag over every rank of the job:
        pipe, then sharding and dp where they have more than one rank."""
        hcg, groups = self._hcg, [self._hcg.get_pipe_parallel_group()]
        if hcg.get_sharding_parallel_world_size() > 1:
            groups.append(hcg.get_sharding_parallel_group())
        if hcg.get_data_parallel_world_size() > 1:
            groups.append(hcg.get_data_parallel_group())
        return groups

    def _stage_local_problems(self, data=None):
        """Misuse that only this stage can see, as `(rule, detail)` pairs for `agree`.

        Beyond Paddle, whose buffers assert it in the backward hook (on that stage alone,
        while the other stages wait in a p2p receive): with release off, every grad of a
        fused buffer must still be the view of its slot when a step starts. Also beyond
        Paddle, which raises on that rank alone: a batch `data` that does not split into
        the micro-batches (a dp / sharding replica given another batch size than its peers).
        """
        moved = []
        for buffers in self._chunk_2_comm_buffers.values():
            for buffer in buffers:
                moved += buffer._moved_grads()
        batch = None if data is None else self._batch_problem(data)
        return [(_MOVED_GRAD_MSG, ", ".join(moved) or None), (_BATCH_MSG, batch)]

    def _agree_at_entry(self, refused=None, data=None):
        """Beyond Paddle: before any p2p of a step, raise on every rank of the job the misuse
        any stage sees (`_stage_local_problems`), an error that `_prepare_training` raised
        on some rank (`refused`: a config or buffer that one stage finds wrong), a batch
        `data` that does not split into micro-batches on some rank, and
        accumulate_steps that differ across ranks (a rank with fewer micro-batches would
        leave its peers' bucket collectives unmatched) and a `grad_clip` that differs (type or
        clip_norm: each rank would clip alike only by chance), with one small all-reduce per group
        (and, if some rank refused, one more naming it). A stage that never arrives fails
        the others at the group timeout, named."""
        rules = self._stage_local_problems(data)
        acc, clip = self.accumulate_steps, _clip_signature(self._grad_clip)
        flags = torch.tensor([int(d is not None) for _, d in rules]
                             + [int(refused is not None), acc, acc * acc, clip, clip * clip, 1],
                             dtype=torch.int64, device=self._device())
        store = _default_store()
        if refused is not None and store is not None:  # read after the all-reduce below
            store.set(f"relgrad/pipe/refused{dist.get_rank()}",
                      f"{self._calls}|{type(refused).__name__}: {refused}")
        self._store_set(f"at{self.stage_id}", str(self._calls))
        try:  # waited with each group's timeout: on nccl a plain all_reduce does not block
            for group in self._agree_groups():
                dist.all_reduce(flags, group=group, async_op=True).wait(_group_timeout(group))
        except RuntimeError as error:
            if not is_timeout_error(error):
                raise
            absent = [s for s in range(self.num_stages)
                      if self._store_get(f"at{s}") != str(self._calls)]
            raise self._stage_timeout(
                f"train_batch's entry check: stage(s) {absent} of the pipe (global rank(s) "
                f"{[self._hcg.get_rank_from_stage(s) for s in absent]}) did not reach "
                f"train_batch call {self._calls}", absent) from error
        *counts, refusals, total, squares, clips, clip_squares, n = flags.tolist()
        if refusals:
            self._raise_refused(refused, refusals)
        for (rule, detail), count in zip(rules, counts):
            if count:
                here = f"; on this rank: {detail}" if detail is not None else ""
                raise ValueError(f"{rule} (seen on {count} rank(s) of the job{here})")
        if total * total != squares * n:  # not all equal: mean squared != mean of squares
            raise ValueError(
                f"accumulate_steps differs across the ranks of the job (here {acc}, mean "
                f"{total / n:g} over {n} ranks): a rank with fewer micro-batches runs fewer "
                "backward passes, and the bucket collectives and p2p messages of the others "
                "would wait for ever. Build every rank's HybridStrategy with the same "
                "accumulate_steps")
        if clips * clips != clip_squares * n:
            raise ValueError(
                f"train_batch's grad_clip differs across the ranks of the job (here "
                f"{self._grad_clip!r}): each stage would clip by another norm and the model "
                "would differ from one process. Pass the same grad_clip (type and clip_norm) "
                "on every rank")

    def _raise_refused(self, refused, refusals):
        """Raise on every rank what `_prepare_training` raised on one of the `refusals` rank(s)
        (the highest global rank among them, found by one all-reduce MAX), as a ValueError
        naming that rank and stage."""
        who = torch.tensor([dist.get_rank() if refused is not None else -1],
                           dtype=torch.int64, device=self._device())
        for group in self._agree_groups():
            dist.all_reduce(who, group=group, op=dist.ReduceOp.MAX)
        rank = int(who)
        if rank == dist.get_rank():
            text = f"{type(refused).__name__}: {refused}"
        else:
            store, key = _default_store(), f"relgrad/pipe/refused{rank}"
            note = store.get(key).decode() if store is not None and store.check([key]) else ""
            calls, _, text = note.partition("|")
            text = text or "(its error is on that rank)"
        raise ValueError(f"train_batch refused on {refusals} rank(s) of the job, e.g. global "
                         f"rank {rank}: {text}") from refused

    def _store_key(self, name):
        return f"relgrad/pipe/{self._uid}/{name}"

    def _store_set(self, name, value):
        store = _default_store()
        if store is not None:
            store.set(self._store_key(name), value)

    def _store_get(self, name):
        store, key = _default_store(), self._store_key(name)
        if store is None or not store.check([key]):
            return None
        return store.get(key).decode()

    def _post_failure(self, error):
        """Leave this stage's error where the other stages of the pipe look when a p2p wait
        times out (the default group's store), tagged with this train_batch call."""
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        try:
            self._store_set(f"failed{self.stage_id}",
                            f"{self._calls}|{type(error).__name__}: {first[:300]}")
        except Exception:  # noqa: BLE001 (the store may be gone; the error stands)
            pass

    def _stage_timeout(self, what, stages):
        """A TimeoutError for a wait on `stages` that timed out, with what they left."""
        seconds = _group_timeout(self._hcg.get_pipe_parallel_group()).total_seconds()
        failed = self._failed_stages()
        cause = ("; ".join(failed) + " (see its traceback)") if failed else (
            "no stage left an error: it may be stuck, or dead")
        return PipelineStageTimeout(
            f"stage {self.stage_id} (global rank {dist.get_rank()}): {what} within the pipe "
            f"group's timeout of {seconds:g} s; {cause}. Another stage failed or stopped "
            f"answering: stage(s) {sorted(stages)}")

    def _prepare_training(self, optimizer, lr_scheduler, grad_clip=None):
        _check_grad_clip(grad_clip)
        if grad_clip is not None and hasattr(optimizer, "reduce_gradients"):
            raise ValueError("a sharding optimizer clips in its own step(): pass grad_clip to "
                             f"{type(optimizer).__name__}(..., grad_clip=), not to train_batch")
        self._grad_clip = grad_clip
        sharding = self._hcg.get_sharding_parallel_world_size()
        if sharding > 1 and not hasattr(optimizer, "reduce_gradients"):
            raise ValueError(f"sharding_degree={sharding} needs a sharding optimizer "
                             "(sharding.DygraphShardingOptimizer or ...V2); got "
                             f"{type(optimizer).__name__}")
        if self._sharding_split_param != hasattr(optimizer, "_slice_params") and sharding > 1:
            raise ValueError("sharding_configs.split_param must match the optimizer: True with "
                             "DygraphShardingOptimizerV2, False with DygraphShardingOptimizer")
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        if self._sharding_comm_overlap:
            self.register_sharding_comm_overlap_hook(optimizer)

    def forward_backward_pipeline(self, data):
        """Warm-up, steady 1F1B and cool-down over `data`; no optimizer step.

        Leaves this stage's grads accumulated over the micro-batches (and, with comm overlap,
        reduced and scaled; tied copies summed over their stages); returns the loss as
        `train_batch` does and raises as it does (called directly, it opens with the same
        entry agreement, `_enter_schedule`).

        Several calls before one step (accumulating over calls): allowed, and exact, only when
        the pipeline itself communicates no grads at the end of a schedule, i.e. without comm
        overlap and without `shared_weights`: the grads just add up in `.grad` and the
        optimizer's reduce in `step()` reads their sum. With comm overlap or shared weights
        the collectives or the tied sum would run once per call (the second reduce mixing
        reduced and new grads), so a second call before `_optimizer_step` / `train_batch`
        raises ValueError, on every rank and before any communication. Use accumulate_steps
        micro-batches in one call instead.
        """
        self._check_accumulation()
        self._enter_schedule(data)
        inputs, labels = self._micro_batches(data)
        self._round_order, self._first_check_ins, self._fired = [], {}, 0  # _fire_in_order
        self._incomplete = None  # set by _scale_and_agree, read by _broadcast_final_loss
        acc, self.schedule_trace = self.accumulate_steps, []
        self._meta_sent = self._meta_recv = None
        self._total_loss = torch.zeros((), device=self._device())
        startup_steps = min(self.num_stages - self.stage_id - 1, acc)
        steady_steps = acc - startup_steps
        queue = []  # (input, output) of micro-batches whose backward is pending
        fwd = bwd = 0

        # warm-up: forwards only
        for _ in range(startup_steps):
            x = self._recv_forward(inputs[fwd])
            out = self._forward_step(x, labels[fwd], fwd)
            self._send_forward(out)
            queue.append((x, out))
            fwd += 1
        if steady_steps > 0:
            x = self._recv_forward(inputs[fwd])

        # steady 1F1B: one forward, then the backward of the oldest pending micro-batch
        for i in range(steady_steps):
            out = self._forward_step(x, labels[fwd], fwd)
            out_grad = self._p2p(send_next=self._if_not_last(out), recv_next=out)
            queue.append((x, out))
            fwd += 1
            x_done, out_done = queue.pop(0)
            in_grad = self._backward_step(x_done, out_done, out_grad, bwd)
            bwd += 1
            if i == steady_steps - 1:
                self._p2p(send_prev=in_grad)
            else:
                x = self._p2p(send_prev=in_grad, recv_prev=True, fallback=inputs[fwd])

        # cool-down: the remaining backwards
        for _ in range(startup_steps):
            x_done, out_done = queue.pop(0)
            out_grad = self._p2p(recv_next=out_done)
            self._p2p(send_prev=self._backward_step(x_done, out_done, out_grad, bwd))
            bwd += 1

        self._grads_pending = True
        # tied copies: sum over their stages, then fire their buckets (held back in backward)
        self._shared.allreduce_shared_weight_gradients()
        # wait and scale: the collectives were issued by the hooks of the last backward
        if self._comm_overlap:
            buffers = [b for bs in self._chunk_2_comm_buffers.values() for b in bs]
            # the first-round order, then the buckets that never completed a round (backward
            # completes the last buckets first)
            late = self._round_order + [b for b in reversed(buffers)
                                        if b not in self._round_order]
            for buffer in late:
                if buffer._task is None:
                    self._issue_incomplete(buffer)
            self._scale_and_agree(buffers)
        return self._broadcast_final_loss()

    def _enter_schedule(self, data):
        """A direct call of `forward_backward_pipeline` (not from `train_batch`) opens with
        the entry agreement that `train_batch` runs (`_agree_at_entry`), so that a batch that
        does not split or a moved grad on one rank raises on every rank. Beyond Paddle."""
        if self._entered:
            self._entered = False
            return
        self._calls += 1
        self._agree_at_entry(None, data)

    def _issue_incomplete(self, buffer):
        """Beyond Paddle: issue, with what it holds, the collective of a bucket whose params
        did not all check in every micro-batch on this rank (a param without a grad in some
        micro-batch), so that the collectives its peers issued are matched;
        `_scale_and_agree` then raises on every rank. Matched only if the bucket was the
        last one the peers fired (one bucket per stage and owner, as with the default
        128 MB buckets); a different order of buckets cannot be repaired after the fact."""
        if buffer._release_grads:
            for p in buffer.params:
                if buffer._params_step_dict.get(p) == 0:
                    buffer._copy_grad_to_buffer(p)
        buffer._comm_grads()

    def _scale_and_agree(self, buffers):
        """Wait for and scale every bucket, then start the agreement that every bucket was
        complete on every rank: a flag summed over the sharding / dp groups here, and over
        the pipe by the loss's all-reduce (`_broadcast_final_loss`), which raises ValueError
        on every rank if not, naming this rank's check-in counts where it saw them."""
        incomplete = [f"bucket {b._id} ({b._check_in_status()})" for b in buffers
                      if not b._all_params_checked_in]
        for buffer in buffers:
            buffer.scale_grads()
        flag = torch.tensor([int(bool(incomplete))], dtype=torch.int32, device=self._device())
        for group in self._agree_groups()[1:]:  # the pipe comes with the loss
            dist.all_reduce(flag, group=group)
        self._incomplete = (int(flag), "; ".join(incomplete) or None)

    def eval_batch(self, data, compute_loss=True):
        """Forward only over the micro-batches; returns the mean loss (or, if `compute_loss`
        is False, the last stage's outputs concatenated, None on other stages). Raises
        ValueError as `train_batch` does."""
        inputs, labels = self._micro_batches(data)
        self.eval()
        self._meta_sent = self._meta_recv = None
        self._total_loss = torch.zeros((), device=self._device())
        outputs = []
        with torch.no_grad():
            for k in range(self.accumulate_steps):
                x = self._recv_forward(inputs[k])
                out = self._layers(x)
                if self.stage_id == self.num_stages - 1:
                    if compute_loss:
                        self._total_loss += self._loss_fn(out, labels[k]).float()
                    outputs.append(out)
                else:
                    self._send_forward(out)
        if not compute_loss:
            return torch.cat(outputs) if outputs else None
        self._total_loss /= self.accumulate_steps
        return self._broadcast_final_loss(scaled=True)

    def _batch_problem(self, data):
        """What is wrong with `data` as this step's batch (a str), or None."""
        try:
            inputs, labels = data
            batch = inputs.shape[0]
        except (TypeError, ValueError, AttributeError, IndexError):
            return (f"data must be (inputs, labels), tensors with the batch on dim 0; got "
                    f"{type(data).__name__}")
        acc = self.accumulate_steps
        if batch == 0 or batch % acc or (self.micro_batch_size
                                         and batch != self.micro_batch_size * acc):
            return (f"a batch of {batch} samples does not split into accumulate_steps={acc} "
                    f"micro-batches of micro_batch_size={self.micro_batch_size or 'batch/acc'}")
        return None

    def _micro_batches(self, data):
        problem = self._batch_problem(data)
        if problem is not None:
            raise ValueError(f"{problem}; pass micro_batch_size * accumulate_steps samples")
        inputs, labels = data
        return inputs.chunk(self.accumulate_steps), labels.chunk(self.accumulate_steps)

    def _forward_step(self, x, label, k):
        self.schedule_trace.append(("F", k))
        out = self._layers(x)
        if self.stage_id != self.num_stages - 1:
            return out
        return self._loss_of(out, label)

    def _loss_of(self, out, label):
        loss = self._loss_fn(out, label).float()
        if not self._delay_scale_loss:
            loss = loss / self.accumulate_steps  # the one 1/acc scaling of the loss
        self._total_loss += loss.detach()
        return loss

    def _backward_step(self, x, out, out_grad, k):
        self.schedule_trace.append(("B", k))
        if out.requires_grad:  # not on a first stage without params
            torch.autograd.backward(out, grad_tensors=out_grad)
        return x.grad if x.requires_grad else None

    def _broadcast_final_loss(self, scaled=False):
        loss = self._total_loss
        if self._delay_scale_loss and not scaled:
            loss = loss / self.accumulate_steps
        group = self._hcg.get_pipe_parallel_group()
        pending, self._incomplete = self._incomplete, None
        if pending is None:
            last = self._hcg.get_rank_from_stage(self.num_stages - 1)
            dist.broadcast(loss, src=last, group=group)
            return loss
        # Beyond Paddle: with comm overlap one all-reduce carries the loss (only the last
        # stage's is not zero, so the sum is its loss, bitwise) and the incomplete-bucket
        # flags of `_scale_and_agree`, instead of a broadcast and an all-reduce.
        count, detail = pending
        both = torch.stack([loss.float(), torch.tensor(float(count), device=loss.device)])
        dist.all_reduce(both, group=group)
        if both[1] > 0:
            self._discard_grads()
            here = f"; on this rank: {detail}" if detail is not None else ""
            raise ValueError(f"{_INCOMPLETE_MSG.format(acc=self.accumulate_steps)} (seen on "
                             f"{int(both[1])} rank(s) of the job{here})")
        return both[0].clone()

    def _needs_dp_sync(self):
        # HybridParallelOptimizer's dp all-reduce when nothing else does it: no overlap and no
        # sharding optimizer (which does its own, after the sharding reduce).
        return (self._hcg.get_data_parallel_world_size() > 1 and not self._dp_comm_overlap
                and self._hcg.get_sharding_parallel_world_size() == 1)

    @torch.no_grad()
    def _optimizer_step(self):
        """Step, then release (seed hunk) or zero the grads, then the LR scheduler."""
        if self._delay_scale_loss:
            # In place: Paddle rebinds `grad = grad.scale(1/acc)`, which detaches the grad from
            # its buffer (and, for v2, never reaches the slice grads the optimizer reads).
            for p in self._layers.parameters():
                if _grad(p) is not None:
                    _grad(p).mul_(1.0 / self.accumulate_steps)
        if self._needs_dp_sync():  # HybridParallelOptimizer.step's dp all-reduce
            # Beyond Paddle: which params have a grad is agreed over dp first (a param one
            # replica's loss left out would otherwise make the ranks issue different
            # all-reduces); those without one contribute zeros, as in DDP.
            agreed_all_reduce_mean(self._layers.parameters(), self._hcg.get_data_parallel_group())
        if self._grad_clip is not None:  # on reduced grads, before the step and the release
            self._grad_clip([(p, _grad(p)) for p in self._layers.parameters()],
                            norm_groups(self._hcg), self._device())
        self._grads_pending = False  # beyond Paddle: misuse state (skip when reading the seed)
        self.optimizer.step()
        # Seed hunk: with release, drop the grads and free every chunk's buffers; else zero.
        # (`_clear_grad`: Paddle's optimizer.clear_grad, or a plain torch optimizer's zero_grad)
        if self._release_gradients:
            _clear_grad(self.optimizer, set_to_zero=False)
            for _, buffers in self._chunk_2_comm_buffers.items():
                for buffer in buffers:
                    buffer._clear_grad_storage()
        else:
            _clear_grad(self.optimizer, set_to_zero=True)
        if self.lr_scheduler:
            self.lr_scheduler.step()

    @torch.no_grad()
    def _discard_grads(self):
        """Drop (release) or zero this step's grads and buffers without stepping, so that the
        next train_batch starts clean after an error raised on every rank."""
        self._grads_pending = False
        if self.optimizer is not None:  # as _optimizer_step clears them
            _clear_grad(self.optimizer, set_to_zero=not self._release_gradients)
        if self._release_gradients:
            for buffers in self._chunk_2_comm_buffers.values():
                for buffer in buffers:
                    buffer._clear_grad_storage()

    def _check_accumulation(self):
        # Made from the call history, the same on every rank: all raise, none communicates.
        if self._grads_pending and (self._comm_overlap or self._shared.across_stages):
            what = "comm overlap" if self._comm_overlap else "shared_weights"
            raise ValueError(
                f"forward_backward_pipeline ran again before the optimizer step: with {what} "
                "the grads are already reduced / summed once per call, so a second call would "
                "reduce them again. Accumulate in one call (accumulate_steps micro-batches), "
                "or step (train_batch / _optimizer_step) between calls")

    # ---- point-to-point between neighbouring stages ----

    def _device(self):
        p = next(self._layers.parameters(), None)
        if p is not None:
            return p.device
        nccl = dist.get_backend(self._hcg.get_pipe_parallel_group()) == "nccl"
        return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def _if_not_last(self, out):
        return None if self.stage_id == self.num_stages - 1 else out

    def _recv_forward(self, first_stage_input):
        return self._p2p(recv_prev=True, fallback=first_stage_input)

    def _send_forward(self, out):
        self._p2p(send_next=self._if_not_last(out))

    def _p2p(self, send_next=None, send_prev=None, recv_next=None, recv_prev=False,
             fallback=None):
        """Batched isend/irecv with the neighbours; returns what was received, if anything.

        `recv_next` is this stage's output, whose grad comes back from the next stage (same
        shape); `recv_prev` receives the next activation (shape from the first message's meta);
        on stage 0 it returns `fallback`, the micro-batch input. Works on gloo and nccl.
        """
        first, last = self.stage_id == 0, self.stage_id == self.num_stages - 1
        prev = None if first else self._hcg.get_rank_from_stage(self.stage_id - 1)
        nxt = None if last else self._hcg.get_rank_from_stage(self.stage_id + 1)
        group = self._hcg.get_pipe_parallel_group()
        ops, got_prev, got_next = [], None, None
        if send_next is not None:
            if self._meta_sent is None:  # shape and dtype of activations, once per batch
                meta = self._meta(send_next)  # batched (one op), as all p2p here: see _p2p_one
                self._p2p_one(dist.isend, meta, nxt, group)
                self._meta_sent = True
            ops.append(dist.P2POp(dist.isend, send_next.detach().contiguous(), nxt, group))
        if send_prev is not None and not first:
            ops.append(dist.P2POp(dist.isend, send_prev.contiguous(), prev, group))
        if recv_prev and not first:
            if self._meta_recv is None:
                meta = torch.zeros(_META_LEN, dtype=torch.long, device=self._device())
                self._p2p_one(dist.irecv, meta, prev, group)
                code, ndim = int(meta[0]), int(meta[1])
                self._meta_recv = (_DTYPES[code], [int(d) for d in meta[2 : 2 + ndim]])
            dtype, shape = self._meta_recv
            got_prev = torch.empty(shape, dtype=dtype, device=self._device())
            ops.append(dist.P2POp(dist.irecv, got_prev, prev, group))
        if recv_next is not None and not last:
            got_next = torch.empty_like(recv_next)
            ops.append(dist.P2POp(dist.irecv, got_next, nxt, group))
        if ops:
            self._wait_p2p(dist.batch_isend_irecv(ops), [op.peer for op in ops])
        if recv_prev and first:
            return fallback
        if got_prev is not None:
            return got_prev.requires_grad_(got_prev.is_floating_point())
        return got_next

    def _p2p_one(self, op, tensor, peer, group):
        """One isend / irecv of `tensor` with global rank `peer`, sent through
        `batch_isend_irecv` like every other message: on nccl an unbatched isend / irecv
        opens a 2-rank communicator of its own per neighbour pair (GPU memory that
        `torch.cuda.memory_allocated` does not count); a batch uses the group's."""
        self._wait_p2p(dist.batch_isend_irecv([dist.P2POp(op, tensor, peer, group)]), [peer])

    def _wait_p2p(self, works, peers):
        """Wait for p2p `works` (one per op, to or from the global ranks `peers`), each
        within the pipe group's timeout, on gloo as on nccl (gloo waits for ever by default;
        nccl's `wait()` does not block the host unless given a timeout, and its watchdog
        would end the process instead of raising). Beyond Paddle.

        Raises PipelineStageTimeout (a TimeoutError) naming the peer's stage and, if that
        stage (or another) failed in this train_batch call, its error; PipelineStageFailed
        as soon as another stage failed in this call (`_wait_watching`). The timed-out op
        is left pending (it cannot be cancelled): the pipeline is not usable afterwards.
        """
        timeout = self._p2p_timeout
        peers = peers if len(peers) == len(works) else [None] * len(works)
        for work, peer in zip(works, peers):
            try:
                self._wait_watching(work, timeout)
            except RuntimeError as error:
                if not is_timeout_error(error):
                    raise
                _ABANDONED.append(works)  # the backend must not free a buffer it may fill
                stages = [s for s in range(self.num_stages)
                          if peer in (None, self._hcg.get_rank_from_stage(s))]
                raise self._stage_timeout(f"stage(s) {stages} did not answer a p2p message",
                                          stages) from error

    def _wait_watching(self, work, timeout):
        """`work.wait(timeout)` (gloo), looking in the store every `_WATCH_SECONDS` while
        it runs for a stage that failed in this train_batch call (`_post_failure`). Beyond
        Paddle. gloo cannot cut a wait short (a wait that times out closes the connection),
        so the wait runs on the pipeline's waiter thread (`_P2PWaiter`), and this one raises
        PipelineStageFailed
        naming the stage and its error once one is there: the others learn
        of a failure within a fraction of a second, not at the group timeout. The abandoned
        wait ends at the timeout; the pipeline is not usable afterwards, as after a timeout.
        """
        done, caught = _p2p_waiter().submit(work, timeout)
        while not done.wait(_WATCH_SECONDS):
            failed = self._failed_stages()
            if failed:
                _ABANDONED.append(work)  # gloo must not free a buffer it may still fill
                # the waiter is busy until the abandoned wait ends: later waits get a new one
                _WAITER.pop().close()
                raise PipelineStageFailed(
                    f"stage {self.stage_id} (global rank {dist.get_rank()}): while it waited "
                    f"for a p2p message, {'; '.join(failed)} (see its traceback)")
        if caught:
            raise caught[0]
        # No second wait on this thread: gloo's p2p wait is not idempotent (it would block for
        # another message). On nccl, wait(timeout) blocks the host until the op is done, so
        # what this thread enqueues next, on any stream, runs after it.

    def _failed_stages(self):
        """`stage s (global rank r) failed with ...` for each other stage that left an
        error in this train_batch call (`_post_failure`)."""
        failed = []
        for s in range(self.num_stages):
            note = self._store_get(f"failed{s}") if s != self.stage_id else None
            if note and note.split("|", 1)[0] == str(self._calls):
                failed.append(f"stage {s} (global rank {self._hcg.get_rank_from_stage(s)}) "
                              f"failed with {note.split('|', 1)[1]}")
        return failed

    def _meta(self, t):
        if t.dim() > _META_LEN - 2 or t.dtype not in _DTYPES:
            raise ValueError(f"stage outputs must be float tensors of at most {_META_LEN - 2} "
                             f"dims; got {t.dtype} with shape {tuple(t.shape)}")
        dims = list(t.shape) + [0] * (_META_LEN - 2 - t.dim())
        return torch.tensor([_DTYPES.index(t.dtype), t.dim()] + dims, device=t.device)
