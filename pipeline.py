"""Pipeline parallelism with 1F1B, fused grad comm overlap and `release_gradients` in torch.

Mirrors `PipelineParallel` (fleet/meta_parallel/pipeline_parallel.py) at commit 9b40c67f672f
(PR #59739), with Megatron-LM's non-interleaved 1F1B. Phases of `train_batch`: warm-up ->
steady 1F1B -> cool-down -> wait and scale -> step -> release (with release, every buffer is
freed after the step). Beyond Paddle: one agreement opens a step; p2p waits time out
(`PipelineStageTimeout`); a rank that raises ends its process and the launcher ends the job.
Sections: comm overlap, one training step, eval, point-to-point. Ties, Paddle's clip and
interleave live in relgrad_extras/. Reference: Narayanan et al. (2021).
"""
from collections import defaultdict
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from comm_buffer import (HOOK_ACTION, FusedCommBuffer, agree, assign_group_by_size, comm_device,
                         first_few, global_rank, is_timeout_error, main_grad_or_grad as _grad)
from relgrad import (GradMarks, HybridCommunicateGroup, HybridStrategy, Phase,
                     check_current_device, clear_grad_func, extras, group_timeout)
from sharding import (UNSLOTTED_RULE, BucketScheduler, _comm_buffer_bytes, agreed_all_reduce_mean,
                      plug_free_in_comm)

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]  # p2p meta codes
_META_LEN = 10  # dtype code, ndim, up to 8 dims
_ABANDONED = []  # p2p works that timed out: kept, the backend may still fill their buffers
STEP_REFUSED_RULE = ("train_batch's step was refused on some rank, so on every rank (its grads "
                     "dropped, its buffers released): fix the cause, clear the grads and go on")


class PipelineStageTimeout(TimeoutError):
    """A stage waited past the pipe group's timeout for another stage (which is named)."""


def _cut_layers(layers, seg_boundaries, parts):  # `parts + 1` rising boundaries; default even
    bounds = seg_boundaries or [len(layers) * i // parts for i in range(parts + 1)]
    if (len(bounds) != parts + 1 or bounds[0] != 0 or bounds[-1] != len(layers)
            or any(a > b for a, b in zip(bounds, bounds[1:]))):
        raise ValueError(f"seg_boundaries must rise from 0 to len(layers)={len(layers)} "
                         f"in {parts + 1} entries; got {bounds}")
    return bounds


def _chunk_of(bounds, name):  # the model chunk (stage) that holds layer name's index
    index = int(name.split(".")[0])
    return max(c for c in range(len(bounds) - 1) if bounds[c] <= index)


def _build_segment(layers):  # a zero-argument callable is built here (Paddle's LayerDesc)
    modules = []
    for layer in layers:
        modules.append(layer if isinstance(layer, nn.Module) else layer())
    return nn.Sequential(*modules)


def _batch_size(data):  # the samples of `data = (inputs, labels)`, or None
    try:
        return int(data[0].shape[0])
    except (TypeError, ValueError, AttributeError, IndexError, KeyError):
        return None


def _clear_grad(optimizer, set_to_zero=True):  # Paddle's `clear_grad`, or torch's `zero_grad`
    if hasattr(optimizer, "clear_grad"):
        optimizer.clear_grad(set_to_zero=set_to_zero)
    else:
        optimizer.zero_grad(set_to_none=not set_to_zero)


class PipelineParallel(nn.Module):
    """One pipeline stage of `layers`, trained with 1F1B (Paddle's `PipelineParallel`).

    `layers`: nn.Modules or zero-argument callables (Paddle's LayerDesc); stage s holds
    `layers[b[s]:b[s+1]]` (`seg_boundaries` b; default even). `loss_fn(output, label)`: a
    scalar. `shared_weights`: ties across stages, e.g. `[("0.tok.weight", "5.proj.weight")]`."""

    _interleaved = False  # relgrad_extras.interleave: the schedule fires the buckets

    def __init__(self, layers: Iterable, hcg: HybridCommunicateGroup, strategy: HybridStrategy,
                 loss_fn: Callable, seg_boundaries: list | None = None,
                 shared_weights: list | None = None) -> None:
        super().__init__()
        pp_configs = strategy.hybrid_configs["pp_configs"]
        self._hcg, self._strategy, self._loss_fn = hcg, strategy, loss_fn
        self.num_stages, self.stage_id = hcg.get_pipe_parallel_world_size(), hcg.get_stage_id()
        self.accumulate_steps = strategy.accumulate_steps
        self.micro_batch_size = strategy.micro_batch_size
        self._dp_comm_overlap = pp_configs.dp_comm_overlap
        self._sharding_comm_overlap = pp_configs.sharding_comm_overlap
        self._delay_scale_loss = pp_configs.delay_scale_loss
        # Seed hunk: read pp_configs.release_gradients
        self._release_gradients = strategy.hybrid_configs["pp_configs"].release_gradients

        self._sharding_split_param = strategy.hybrid_configs["sharding_configs"].split_param
        self._check_config(hcg, pp_configs.num_virtual_pipeline_stages)
        self._comm_overlap = self._dp_comm_overlap or self._sharding_comm_overlap
        layers = list(layers)  # Paddle is handed a PipelineLayer; here the stage is cut
        self._layers, bounds = self._build_layers(layers, seg_boundaries)
        self._chunk_2_comm_buffers = defaultdict(list)
        self._sharding_hooks_registered = False
        self.optimizer = self.lr_scheduler = None
        self._init_beyond_paddle(layers, bounds, shared_weights)  # skippable: see there
        if self._dp_comm_overlap:
            self.fused_gradient(self._layers, hcg.get_data_parallel_group(),
                                self.accumulate_steps, dp=True)

    def _init_beyond_paddle(self, layers, bounds, shared_weights):
        """Beyond Paddle: checks, p2p timeout, ties, the bucket scheduler, the phase (own attrs)."""
        self._check_untied_shares(layers, bounds, shared_weights)
        check_current_device(list(self._layers.parameters()),
                             [self._hcg.get_pipe_parallel_group()], "PipelineParallel")
        self.schedule_trace = []  # ("F" | "B", micro-batch[, chunk]) in the order run
        # nccl's first call on a group batch_isend_irecv uses must involve all its ranks
        dist.barrier(group=self._hcg.get_pipe_parallel_group())
        self._p2p_timeout = group_timeout(self._hcg.get_pipe_parallel_group())
        self._shared = self._shared_weights(shared_weights, bounds)
        self._scheduler = BucketScheduler(fire_on_hook=not self._interleaved)
        self._grad_clip, self._phase = None, Phase.IDLE
        self._marks = GradMarks(list(self._layers.parameters()))  # for a plain optimizer

    def _check_config(self, hcg, num_virtual_stages):  # Paddle's overlap rules
        if self._dp_comm_overlap and self._sharding_comm_overlap:
            raise ValueError("pp_configs.dp_comm_overlap and sharding_comm_overlap cannot both be "
                             "on; turn one off")
        dp, sharding = hcg.get_data_parallel_world_size(), hcg.get_sharding_parallel_world_size()
        for on, axis, degree in ((self._dp_comm_overlap, "dp", dp),
                                 (self._sharding_comm_overlap, "sharding", sharding)):
            if on and not (degree > 1 and self.num_stages > 1):
                raise ValueError(f"pp_configs.{axis}_comm_overlap needs {axis}_degree > 1 and "
                                 f"pp_degree > 1; got {degree} and {self.num_stages}")
        self._check_virtual_stages(num_virtual_stages)

    def _check_virtual_stages(self, num_virtual_stages):
        if num_virtual_stages != 1:
            raise ValueError(f"pp_configs.num_virtual_pipeline_stages={num_virtual_stages}: build "
                             "PipelineParallelWithInterleave (relgrad_extras.interleave)")

    def _check_untied_shares(self, layers, bounds, shared_weights):
        """Beyond Paddle: one Parameter in two stages' layers must be tied (raised alike)."""
        ties = [set(tie) for tie in shared_weights or ()]
        first = {}  # id(param) -> the first name it was seen under
        built = [(i, layer) for i, layer in enumerate(layers) if isinstance(layer, nn.Module)]
        for i, layer in built:  # a LayerDesc builds its params on its own stage
            for name, p in layer.named_parameters():
                first.setdefault(id(p), f"{i}.{name}")
                tied = any({first[id(p)], f"{i}.{name}"} <= tie for tie in ties)
                self._check_share(first[id(p)], f"{i}.{name}", bounds, tied)

    def _check_share(self, a, b, bounds, tied):
        """Raise unless names `a` and `b` (one Parameter) may share it: tied across stages."""
        stages = [_chunk_of(bounds, n) % self.num_stages for n in (a, b)]
        if stages[0] != stages[1] and not tied:
            raise ValueError(f"one Parameter object is '{a}' on stage {stages[0]} and '{b}' on "
                             f"stage {stages[1]}: tie them with shared_weights=[({a!r}, {b!r})]"
                             ", or untie them")

    def _shared_weights(self, shared_weights, bounds):
        if shared_weights is None:
            return None
        tied = extras("shared_weights", "PipelineParallel(shared_weights=...)")
        return tied.SharedWeights(self._layers, self._hcg, shared_weights, bounds, self._device())

    def _build_layers(self, layers, seg_boundaries):  # this stage's layers, every stage's bounds
        bounds = _cut_layers(layers, seg_boundaries, self.num_stages)
        return _build_segment(layers[bounds[self.stage_id] : bounds[self.stage_id + 1]]), bounds

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # this stage's layers (no communication)
        return self._layers(x)

    # ---- comm overlap: fused buffers whose hooks fire the collectives during backward ----

    def fused_gradient(self, model: nn.Module, comm_group: dist.ProcessGroup | None,
                       acc_steps: int, dp: bool, param2rank: dict | None = None,
                       group_size: int = 128 * 1024 * 1024) -> None:
        """Paddle's: hooked buffers per chunk: ALL_REDUCE dp, REDUCE v1, REDUCE_SCATTER v2."""
        act = HOOK_ACTION.REDUCE_SCATTER if self._sharding_split_param else HOOK_ACTION.REDUCE
        if dp:
            act = HOOK_ACTION.ALL_REDUCE
        chunks = list(model) if isinstance(model, nn.ModuleList) else [model]
        for chunk_idx, chunk in enumerate(chunks):
            var_groups = defaultdict(list)  # dst -> params; Paddle returns at a chunk without any
            for p in chunk.parameters():
                if p.requires_grad and act == HOOK_ACTION.REDUCE:  # v1: to its owner's global rank
                    var_groups[global_rank(comm_group, param2rank[p])].append(p)
                elif p.requires_grad:  # to every rank
                    var_groups[-1].append(p)
            for dst, group_params in var_groups.items():  # owners in order of appearance
                for group_idx, parameters in assign_group_by_size(group_params, group_size).items():
                    # Seed hunk: the buffer gets release_grads from pp_configs
                    buffer = FusedCommBuffer(group_idx, parameters, comm_group, acc_steps, act,
                                             dst, release_grads=self._release_gradients)
                    self._chunk_2_comm_buffers[chunk_idx].append(buffer)

        # Paddle's `param._register_backward_hook(self.bw_hook_func(buffer, param))`, through the
        # bucket scheduler: one firing order on every rank; a tied copy's waits for the tie sum
        buffers = [b for bs in self._chunk_2_comm_buffers.values() for b in bs]
        free = not dp and self._strategy.hybrid_configs["sharding_configs"].free_grads_in_comm
        plug_free_in_comm(buffers, free)  # [later] PaddleNLP #9081
        for buffer in buffers:
            self._scheduler.add(buffer)
            if self._shared and self._shared.holds(buffer.params):
                self._scheduler.held.append(buffer)

    def register_sharding_comm_overlap_hook(self, optimizer: torch.optim.Optimizer) -> None:
        """Build the sharding buffers; lazily, since v1's owner map lives in the optimizer."""
        if self._sharding_hooks_registered:
            return
        param2rank = None if self._sharding_split_param else optimizer._param2rank  # v1's owners
        sharding_configs = self._strategy.hybrid_configs["sharding_configs"]
        size = _comm_buffer_bytes(sharding_configs, 128)  # [later] comm_buffer_size_MB, if set
        self.fused_gradient(self._layers, self._hcg.get_sharding_parallel_group(),
                            self.accumulate_steps, dp=False, param2rank=param2rank, group_size=size)
        self._sharding_hooks_registered = True

    # ---- one training step ----

    def train_batch(self, data: tuple, optimizer: torch.optim.Optimizer,
                    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                    grad_clip: Callable | None = None) -> torch.Tensor:
        """1F1B over `data = (inputs, labels)`, then `_optimizer_step`; the mean loss everywhere."""
        self._check_accumulation()  # before _prepare_training builds sharding buffers
        refused = None  # a stage that refuses to start tells the others at the entry agreement
        try:
            self._prepare_training(optimizer, lr_scheduler, grad_clip)
        except (ValueError, TypeError) as error:
            refused = error
        self._agree_at_entry(refused, data)
        loss = self._schedule(data)
        self._optimizer_step()
        return loss

    def forward_backward_pipeline(self, data: tuple) -> torch.Tensor:
        """The schedule alone; calls before one step accumulate (not with overlap, ties)."""
        self._check_accumulation()
        self._agree_at_entry(None, data)
        return self._schedule(data)

    def _agree_groups(self):  # pipe, sharding, dp: together every rank of the job
        hcg, groups = self._hcg, [self._hcg.get_pipe_parallel_group()]
        if hcg.get_sharding_parallel_world_size() > 1:
            groups.append(hcg.get_sharding_parallel_group())
        if hcg.get_data_parallel_world_size() > 1:
            groups.append(hcg.get_data_parallel_group())
        return groups

    def _agree_at_entry(self, refused=None, data=None):
        """Beyond Paddle: before the first p2p, raise everywhere what a rank saw (or time out)."""
        batch = None if data is None else self._batch_problem(data)
        clip = (self._grad_clip is not None, getattr(self._grad_clip, "clip_norm", None))
        try:
            agree(self._agree_groups(), [
                ("train_batch: a batch does not split into accumulate_steps micro-batches; pass "
                 "micro_batch_size * accumulate_steps samples on every rank", batch),
                ("train_batch refused", refused and f"{type(refused).__name__}: {refused}")],
                [("accumulate_steps", self.accumulate_steps),
                 ("the batch's samples", _batch_size(data)),
                 ("train_batch's grad_clip (given, clip_norm)", clip)],
                device=self._device(), timeout=self._p2p_timeout, title=(
                    "train_batch's entry check: every rank of the job must run the same "
                    "accumulate_steps, batch size and grad_clip (build each HybridStrategy alike)"))
        except TimeoutError as error:
            absent = sorted(getattr(error, "absent", ()))
            who = "a rank of the job (its arrival was not seen: an earlier failure?)"
            if absent:
                who = f"stage(s) {self._stages_of(absent)} of the pipe (global rank(s) {absent})"
            raise self._stage_timeout(f"train_batch's entry check: {who} did not reach it",
                                      who) from error

    def _prepare_training(self, optimizer, lr_scheduler, grad_clip=None):
        if grad_clip is not None:  # a Paddle-style clip: relgrad_extras.grad_clip checks it
            extras("grad_clip", "train_batch(grad_clip=)").check(grad_clip)
        if grad_clip is not None and hasattr(optimizer, "reduce_gradients"):
            raise ValueError("a sharding optimizer clips in its own step(): pass grad_clip to "
                             f"{type(optimizer).__name__}(..., grad_clip=), not to train_batch")
        self._grad_clip = grad_clip
        sharding = self._hcg.get_sharding_parallel_world_size()
        if sharding > 1 and not hasattr(optimizer, "reduce_gradients"):
            raise ValueError(f"sharding_degree={sharding} needs a sharding optimizer "
                             f"(DygraphShardingOptimizer or ...V2); got {type(optimizer).__name__}")
        if sharding > 1 and self._sharding_split_param != hasattr(optimizer, "_slice_params"):
            raise ValueError("sharding_configs.split_param must match the optimizer: True with "
                             "DygraphShardingOptimizerV2, False with DygraphShardingOptimizer")
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        if self._sharding_comm_overlap:
            self.register_sharding_comm_overlap_hook(optimizer)

    def _schedule(self, data):
        """Warm-up, steady 1F1B, cool-down, then `_finish_schedule`; returns the mean loss."""
        inputs, labels = self._new_batch(data)
        self.schedule_trace, queue = [], []  # queue: (input, output) awaiting their backward
        acc = self.accumulate_steps
        warm = min(self.num_stages - self.stage_id - 1, acc)
        for k in range(warm):  # warm-up: forwards only
            x = self.recv_forward(inputs[k])
            out = self._forward_step(x, labels[k], k)
            self.send_forward(out)
            queue.append((x, out))
        if warm < acc:
            x = self.recv_forward(inputs[warm])
        for k in range(warm, acc):  # steady 1F1B: forward k, then backward k - warm
            out = self._forward_step(x, labels[k], k)
            out_grad = self.send_forward_recv_backward(out)
            queue.append((x, out))
            in_grad = self._backward_step(*queue.pop(0), out_grad, k - warm)
            if k == acc - 1:
                self.send_backward(in_grad)
            else:
                x = self.send_backward_recv_forward(in_grad, inputs[k + 1])
        for k in range(acc - warm, acc):  # cool-down: the remaining backwards
            x, out = queue.pop(0)
            out_grad = self.recv_backward(out)
            self.send_backward(self._backward_step(x, out, out_grad, k))
        self._finish_schedule()
        return self._broadcast_final_loss()

    def _finish_schedule(self):
        """Tie sums; with comm overlap every bucket issued in order, agreed, waited, scaled."""
        if self._shared:
            self._shared.allreduce_shared_weight_gradients()
        if self._comm_overlap:
            self._scheduler.fire(self._scheduler.held)  # held back for the tie sum
            self._scheduler.fire()
            try:
                self._scheduler.wait_and_agree(self._agree_groups(), self._device())
            except ValueError:  # refused on every rank, each settled: the step is dropped
                self._discard_grads()
                raise
        self._phase = Phase.SCHEDULED  # only a schedule that ended (a gone peer leaves IDLE)

    def eval_batch(self, data: tuple, compute_loss: bool = True) -> torch.Tensor | None:
        """Forward only over the pipe (Paddle's `eval_batch`): the mean loss on every rank, or
        with `compute_loss=False` the last stage's outputs (None on the other stages)."""
        inputs, labels = self._new_batch(data)
        last = self.stage_id == self.num_stages - 1
        outputs = []
        with torch.no_grad():
            for k in range(self.accumulate_steps):
                out = self._layers(self.recv_forward(inputs[k]))
                if last and compute_loss:
                    self._total_loss += self._loss_fn(out, labels[k]).float()
                elif last:
                    outputs.append(out)
                else:
                    self.send_forward(out)
        if not compute_loss:
            return torch.cat(outputs) if outputs else None
        if not self._delay_scale_loss:  # else _broadcast_final_loss divides the sum once
            self._total_loss /= self.accumulate_steps
        return self._broadcast_final_loss()

    def _new_batch(self, data):
        """`data`'s micro-batches; the activations' meta and the loss start afresh."""
        self._meta_sent = self._meta_recv = None
        self._total_loss = torch.zeros((), device=self._device())
        return self._micro_batches(data)

    def _batch_problem(self, data):
        batch = _batch_size(data)
        if batch is None:
            return f"data must be (inputs, labels) with the batch on dim 0; got {type(data)}"
        acc, size = self.accumulate_steps, self.micro_batch_size
        if batch == 0 or batch % acc or (size and batch != size * acc):
            return (f"a batch of {batch} samples does not split into accumulate_steps={acc} "
                    f"micro-batches of micro_batch_size={size or 'batch/acc'}")
        return None

    def _micro_batches(self, data):
        problem = self._batch_problem(data)
        if problem is not None:
            raise ValueError(f"{problem}; pass micro_batch_size * accumulate_steps samples")
        return data[0].chunk(self.accumulate_steps), data[1].chunk(self.accumulate_steps)

    def _forward_step(self, x, label, k):
        self.schedule_trace.append(("F", k))
        out = self._layers(x)
        return self._loss_of(out, label) if self.stage_id == self.num_stages - 1 else out

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

    def _broadcast_final_loss(self):  # the mean loss, from the last stage to the pipe
        loss = self._total_loss
        if self._delay_scale_loss:
            loss = loss / self.accumulate_steps
        dist.broadcast(loss, src=self._hcg.get_rank_from_stage(self.num_stages - 1),
                       group=self._hcg.get_pipe_parallel_group())
        return loss

    @torch.no_grad()
    def _optimizer_step(self):
        """Step, then release (seed hunk) or zero the grads, then the LR scheduler."""
        self._agree_on_step()  # beyond Paddle (skippable): reduce, agreed over the whole job
        self.optimizer.step()
        # Seed hunk: with release, drop the grads and free every chunk's buffers; else zero
        if self._release_gradients:
            _clear_grad(self.optimizer, set_to_zero=False)
            for _, buffers in self._chunk_2_comm_buffers.items():
                for buffer in buffers:
                    buffer._clear_grad_storage()
        else:
            _clear_grad(self.optimizer, set_to_zero=True)

        self._marks.clear()  # beyond Paddle (skippable): nothing written since
        if self.lr_scheduler:
            self.lr_scheduler.step()

    def _agree_on_step(self):
        """Beyond Paddle: each stage reduces and agrees; a refusal anywhere drops it everywhere."""
        params = list(self._layers.parameters())
        refused = None
        try:
            self._reduce_for_step(params)
        except ValueError as error:
            refused = f"{type(error).__name__}: {error}"
        try:
            agree(self._agree_groups(), [(STEP_REFUSED_RULE, refused)], device=self._device())
        except Exception:  # refused (or a rank timed out): this step is dropped here too
            self._discard_grads()
            raise
        self._phase = Phase.IDLE
        if self._grad_clip is not None:  # on reduced grads, before the step and the release
            groups = extras("grad_clip", "train_batch(grad_clip=)").norm_groups(self._hcg)
            self._grad_clip([(p, _grad(p)) for p in params], groups, self._device())

    def _reduce_for_step(self, params):
        """delay_scale_loss, then HybridParallelOptimizer's reduce (sharding's or the dp one)."""
        for p in params:  # delay_scale_loss: in place (Paddle's `grad.scale(1/acc)` rebinds it)
            if self._delay_scale_loss and _grad(p) is not None:
                _grad(p).mul_(1.0 / self.accumulate_steps)
        slotted = set()
        for buffer in self._scheduler.buffers:
            slotted.update(id(p) for p in buffer.params)
        unslotted = [p for p in params if p.requires_grad and id(p) not in slotted]
        if self._comm_overlap and unslotted:
            shapes = [str(tuple(p.shape)) for p in unslotted]
            raise ValueError(f"{UNSLOTTED_RULE} (params of shapes {first_few(shapes)})")
        if hasattr(self.optimizer, "finish_grad_sync"):
            self.optimizer.finish_grad_sync()
            return
        written = self._marks.written()
        if self._hcg.get_data_parallel_world_size() > 1:  # the hyper-parameters agreed too
            written = agreed_all_reduce_mean(
                params, self._hcg.get_data_parallel_group(), self._device(),
                self.optimizer.param_groups, written, reduce=not self._dp_comm_overlap)
        for p, some_rank in zip(params, written):
            if not some_rank:  # a zeroed grad no rank wrote (release off): not stepped, as torch
                clear_grad_func(p, set_to_zero=False)

    @torch.no_grad()
    def _discard_grads(self):
        """Drop (release) or zero this step's grads and buffers, not stepped (after an error)."""
        self._phase = Phase.IDLE
        if self.optimizer is not None:
            _clear_grad(self.optimizer, set_to_zero=not self._release_gradients)
            self._marks.clear()
        if self._release_gradients:
            for buffer in self._scheduler.buffers:  # every model chunk's
                buffer._clear_grad_storage()

    def _check_accumulation(self):
        """A second schedule before the step, with overlap or ties: raised on every rank."""
        ties = self._shared is not None and self._shared.across_stages
        if self._phase == Phase.SCHEDULED and (self._comm_overlap or ties):
            what = "comm overlap" if self._comm_overlap else "shared_weights"
            raise ValueError(f"forward_backward_pipeline ran again before the optimizer step: "
                             f"with {what} each call reduces the grads; step between calls")

    # ---- point-to-point between neighbouring stages ----

    def _device(self):
        return comm_device(self._layers.parameters(), self._hcg.get_pipe_parallel_group())

    # Megatron's named operations, one batched exchange each: `out` goes to the next stage and its
    # grad comes back (last stage: None); `in_grad` goes back, the next input comes in (first: data)

    def send_forward(self, out: torch.Tensor) -> None:
        self._p2p(send_next=out)

    def recv_forward(self, first_stage_input: torch.Tensor) -> torch.Tensor:
        return self._p2p(recv_prev=True, fallback=first_stage_input)

    def send_forward_recv_backward(self, out: torch.Tensor) -> torch.Tensor | None:
        return self._p2p(send_next=out, recv_next=out)

    def send_backward_recv_forward(self, in_grad: torch.Tensor | None,
                                   first_stage_input: torch.Tensor) -> torch.Tensor:
        return self._p2p(send_prev=in_grad, recv_prev=True, fallback=first_stage_input)

    def send_backward(self, in_grad: torch.Tensor | None) -> None:
        self._p2p(send_prev=in_grad)

    def recv_backward(self, out: torch.Tensor) -> torch.Tensor | None:
        return self._p2p(recv_next=out)

    def _p2p(self, send_next=None, send_prev=None, recv_next=None, recv_prev=False, fallback=None):
        """Batched isend / irecv with the neighbours; returns the input from the previous stage
        (on the first: `fallback`), or the grad of `recv_next` from the next one, or None."""
        first, last = self.stage_id == 0, self.stage_id == self.num_stages - 1
        prev = None if first else self._hcg.get_rank_from_stage(self.stage_id - 1)
        nxt = None if last else self._hcg.get_rank_from_stage(self.stage_id + 1)
        group, ops, got = self._hcg.get_pipe_parallel_group(), [], fallback
        if send_next is not None and not last:
            if self._meta_sent is None:  # shape and dtype of activations, once per batch
                self._p2p_one(dist.isend, self._meta(send_next), nxt, group)
                self._meta_sent = True
            ops.append(dist.P2POp(dist.isend, send_next.detach().contiguous(), nxt, group))
        if send_prev is not None and not first:
            ops.append(dist.P2POp(dist.isend, send_prev.contiguous(), prev, group))
        if recv_prev and not first:
            if self._meta_recv is None:
                meta = torch.zeros(_META_LEN, dtype=torch.long, device=self._device())
                self._p2p_one(dist.irecv, meta, prev, group)
                self._meta_recv = (_DTYPES[int(meta[0])], meta[2 : 2 + int(meta[1])].tolist())
            dtype, shape = self._meta_recv
            got = torch.empty(shape, dtype=dtype, device=self._device())
            ops.append(dist.P2POp(dist.irecv, got, prev, group))
        if recv_next is not None and not last:
            got = torch.empty_like(recv_next)
            ops.append(dist.P2POp(dist.irecv, got, nxt, group))
        if ops:
            self._wait_p2p(dist.batch_isend_irecv(ops), [op.peer for op in ops])
        if recv_prev and not first:  # an activation: its grad goes back to the previous stage
            got.requires_grad_(got.is_floating_point())
        return got

    def _p2p_one(self, op, tensor, peer, group):  # batched: nccl opens a communicator per pair
        self._wait_p2p(dist.batch_isend_irecv([dist.P2POp(op, tensor, peer, group)]), [peer])

    def _wait_p2p(self, works, peers):
        """Beyond Paddle: wait for p2p `works` (peers: global ranks) within the group's timeout."""
        if len(peers) != len(works):  # one work for a coalesced batch: any peer may be late
            peers = [None] * len(works)
        for work, peer in zip(works, peers):
            try:
                work.wait(self._p2p_timeout)
            except RuntimeError as error:
                if not is_timeout_error(error):
                    raise
                _ABANDONED.append(works)  # the backend must not free a buffer it may fill
                stages = list(range(self.num_stages)) if peer is None else self._stages_of([peer])
                raise self._stage_timeout(f"stage(s) {stages} did not answer a p2p message",
                                          f"stage(s) {stages}") from error

    def _stages_of(self, ranks):  # the stages whose global rank is in `ranks`
        return [s for s in range(self.num_stages) if self._hcg.get_rank_from_stage(s) in ranks]

    def _stage_timeout(self, what, who):
        return PipelineStageTimeout(
            f"stage {self.stage_id} (global rank {dist.get_rank()}): {what} within the pipe group's"
            f" timeout of {self._p2p_timeout.total_seconds():g} s: {who} failed or stopped")

    def _meta(self, t):
        if t.dim() > _META_LEN - 2 or t.dtype not in _DTYPES:
            raise ValueError(f"stage outputs must be float tensors of at most {_META_LEN - 2} "
                             f"dims; got {t.dtype} with shape {tuple(t.shape)}")
        dims = list(t.shape) + [0] * (_META_LEN - 2 - t.dim())
        return torch.tensor([_DTYPES.index(t.dtype), t.dim()] + dims, device=t.device)
