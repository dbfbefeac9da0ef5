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

Weights tied across stages (`shared_weights`, Paddle's SharedLayerDesc) live in
`shared_weights/`; global-norm clipping (`grad_clip`) in `grad_clip/`. The interleaved
schedule (virtual stages, several model chunks per rank) is the subclass
`PipelineParallelWithInterleave` in `pipeline_schedules/interleave.py`.

Leaves out: AMP scaler, timers, freeing sent activations early (Paddle's `_release_output`).

References: Paddle PRs #59739, #58441; Narayanan et al., "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM" (2021); Harlap et al., "PipeDream" (2018).
"""
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

from comm_buffer import (HOOK_ACTION, FusedCommBuffer, assign_group_by_size,
                         bw_hook_func, global_rank, main_grad_or_grad as _grad,
                         share_comm_queue)
from sharding import _check_grad_clip, _extras, agreed_all_reduce_mean, norm_groups

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]  # p2p meta codes
_META_LEN = 10  # dtype code, ndim, up to 8 dims


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
    Raises ValueError for boundaries that do not cover the layers, an overlap config that
    breaks Paddle's rules (dp_comm_overlap needs dp > 1 and pp > 1, sharding_comm_overlap
    needs sharding > 1 and pp > 1, not both), or pp_configs.num_virtual_pipeline_stages > 1
    (that is `PipelineParallelWithInterleave`).
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
        # Seed hunk: read the new flag.
        self._release_gradients = strategy.hybrid_configs["pp_configs"].release_gradients
        self._sharding_split_param = strategy.hybrid_configs["sharding_configs"].split_param
        self._check_overlap_config(hcg)
        # Before any communication, so that a bad config raises on every rank alike.
        self._check_virtual_stages(getattr(pp_configs, "num_virtual_pipeline_stages", 1))
        self._comm_overlap = self._dp_comm_overlap or self._sharding_comm_overlap
        self._layers, bounds = self._build_layers(list(layers), seg_boundaries)

        self._chunk_2_comm_buffers = defaultdict(list)
        self._sharding_hooks_registered = False
        self.optimizer = self.lr_scheduler = None
        # ("F" | "B", micro-batch) in the order run, for tests; the interleaved schedule adds
        # the chunk: ("F" | "B", micro-batch, chunk)
        self.schedule_trace = []
        # With nccl, the first call on the group that batch_isend_irecv uses must involve all
        # its ranks (torch's rule for P2POp); a tiny all-reduce does that on every backend.
        dist.all_reduce(torch.zeros(1, device=self._device()),
                        group=hcg.get_pipe_parallel_group())
        self._shared = self._shared_weights(shared_weights, bounds)
        self._grad_clip = None
        self._grads_pending = False  # a schedule ran and no _optimizer_step since
        if self._dp_comm_overlap:
            self.fused_gradient(self._layers, hcg.get_data_parallel_group(),
                                self.accumulate_steps, dp=True)

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
                    hook = self._shared.hook_func(bucket, buffer)  # a tied copy: check in only
                    if hook is bw_hook_func:  # untied: this schedule's own hook
                        hook = self.bw_hook_func
                    for p in bucket:
                        p.register_post_accumulate_grad_hook(hook(buffer, p))
        # free_grads_in_comm: each bucket freed once its collective is done, during backward
        share_comm_queue([b for bs in self._chunk_2_comm_buffers.values() for b in bs])

    def bw_hook_func(self, buffer, param):
        """The hook each untied param gets (Paddle's method of this name): check in, and fire
        the bucket's collective once all its params are in (comm_buffer.bw_hook_func)."""
        return bw_hook_func(buffer, param)

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
        same on every rank of this pipe. Raises ValueError if the batch does not split into
        `accumulate_steps` micro-batches (of `micro_batch_size`, if set).

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
        self._prepare_training(optimizer, lr_scheduler, grad_clip)
        self.train()
        loss = self.forward_backward_pipeline(data)
        self._optimizer_step()
        return loss

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
        `train_batch` does and raises as it does.

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
        inputs, labels = self._micro_batches(data)
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
            for buffers in self._chunk_2_comm_buffers.values():
                for buffer in buffers:
                    buffer.scale_grads()
        return self._broadcast_final_loss()

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

    def _micro_batches(self, data):
        inputs, labels = data
        batch, acc = inputs.shape[0], self.accumulate_steps
        if batch % acc or (self.micro_batch_size and batch != self.micro_batch_size * acc):
            raise ValueError(f"a batch of {batch} samples does not split into accumulate_steps="
                             f"{acc} micro-batches of micro_batch_size="
                             f"{self.micro_batch_size or 'batch/acc'}; pass "
                             f"micro_batch_size * accumulate_steps samples")
        return inputs.chunk(acc), labels.chunk(acc)

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
        last = self._hcg.get_rank_from_stage(self.num_stages - 1)
        dist.broadcast(loss, src=last, group=self._hcg.get_pipe_parallel_group())
        return loss

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
        self._grads_pending = False
        self.optimizer.step()
        if self._release_gradients:
            _clear_grad(self.optimizer, set_to_zero=False)
            for _, buffers in self._chunk_2_comm_buffers.items():
                for buffer in buffers:
                    buffer._clear_grad_storage()
        else:
            _clear_grad(self.optimizer, set_to_zero=True)
        if self.lr_scheduler:
            self.lr_scheduler.step()

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
                dist.send(self._meta(send_next), dst=nxt, group=group)
                self._meta_sent = True
            ops.append(dist.P2POp(dist.isend, send_next.detach().contiguous(), nxt, group))
        if send_prev is not None and not first:
            ops.append(dist.P2POp(dist.isend, send_prev.contiguous(), prev, group))
        if recv_prev and not first:
            if self._meta_recv is None:
                meta = torch.zeros(_META_LEN, dtype=torch.long, device=self._device())
                dist.recv(meta, src=prev, group=group)
                code, ndim = int(meta[0]), int(meta[1])
                self._meta_recv = (_DTYPES[code], [int(d) for d in meta[2 : 2 + ndim]])
            dtype, shape = self._meta_recv
            got_prev = torch.empty(shape, dtype=dtype, device=self._device())
            ops.append(dist.P2POp(dist.irecv, got_prev, prev, group))
        if recv_next is not None and not last:
            got_next = torch.empty_like(recv_next)
            ops.append(dist.P2POp(dist.irecv, got_next, nxt, group))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        if recv_prev and first:
            return fallback
        if got_prev is not None:
            return got_prev.requires_grad_(got_prev.is_floating_point())
        return got_next

    def _meta(self, t):
        if t.dim() > _META_LEN - 2 or t.dtype not in _DTYPES:
            raise ValueError(f"stage outputs must be float tensors of at most {_META_LEN - 2} "
                             f"dims; got {t.dtype} with shape {tuple(t.shape)}")
        dims = list(t.shape) + [0] * (_META_LEN - 2 - t.dim())
        return torch.tensor([_DTYPES.index(t.dtype), t.dim()] + dims, device=t.device)
