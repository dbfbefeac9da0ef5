"""`python relgrad.py --walkthrough`: the life of one fused grad buffer, event by event.

A tiny model (`Affine` layers: a 2 x 2 weight and a 2-element bias each) trains 2 steps of 2
micro-batches with plain SGD, release off and then on, in three layouts: sharding v2 alone with
its own overlap (`v2`: reduce-scatter, 2 ranks), pipeline 2 x sharding 2 with v1 (`v1`: the
pipeline's reduce to each param's owner, 4 ranks), pipeline 2 x dp 2 (`dp`: the pipeline's
all-reduce, 4 ranks; `dp_comm_overlap` needs dp > 1 and pp > 1, so 2 ranks cannot show it).
Each rank prints one line per event of its buffers' lives, tagged `[file: function]` with the
function that made it happen (the README's hunk table names the same functions).

The events are the library's own calls, watched from outside as `phases.PipelineProbe` watches
them for `--trace`: `_Narrator` replaces a few methods on the *instances* (each buffer's
`add_grad`, `_copy_grad_to_buffer`, `_comm_grads`, `scale_grads`, `_clear_grad_storage`; the
optimizer's `step`, `clear_grad` / `zero_grad`, v2's `_assign_slice_grad`; the pipeline's
`fused_gradient`) by spies that call the original and record what it did, read from the buffer
before and after. Nothing in the library changes and nothing runs when no walkthrough runs.
Addresses are element offsets into `grad_storage`; one element per rank is watched (element 0
of its first param), so the reduced value can be checked by hand: the mean of the ranks' sums.
"""
import gc
import sys
import time
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from comm_buffer import HOOK_ACTION, _stages_full_copies, main_grad_or_grad
from pipeline import PipelineParallel
from relgrad import DygraphShardingConfig, HybridCommunicateGroup, HybridStrategy, PpConfig
from relgrad_demo.launch import launch
from sharding import DygraphShardingOptimizer, DygraphShardingOptimizerV2

WORLD = {"v2": 2, "v1": 4, "dp": 4}  # the layouts, in the order shown, and their ranks
TITLES = {
    "v2": "sharding v2 alone, its own overlap (sharding_configs.comm_overlap): reduce-scatter; "
          "2 ranks",
    "v1": "pipeline 2 x sharding 2, v1 (pp_configs.sharding_comm_overlap): the pipeline's "
          "reduce to each param's owner; 4 ranks",
    "dp": "pipeline 2 x dp 2 (pp_configs.dp_comm_overlap): the pipeline's all-reduce; 4 ranks "
          "(dp overlap needs dp > 1 and pp > 1)",
}
MODES = ("off", "on")  # pp_configs.release_gradients
STEPS, MICRO_BATCHES, LR = 2, 2, 0.25
_ACTIONS = {HOOK_ACTION.ALL_REDUCE: "all-reduce", HOOK_ACTION.REDUCE: "reduce",
            HOOK_ACTION.REDUCE_SCATTER: "reduce-scatter"}

# Kinds of events, in the order a step shows them.
#   build, layout: a buffer is built (grad storage absent with release, allocated without)
#   alloc, copy: release, a param's first check-in of a step: the buffer is allocated (first
#     param only) and the grad added into its slot and re-pointed at it
#   add: any other check-in: backward added the grad in place, the address is unchanged
#   comm, wait: the bucket's collective is issued, then waited for and scaled
#   slice: v2 binds its slice params' grads to its shard
#   step: the optimizer steps
#   clear, free: release: grads dropped, then the buffer freed
#   zero: release off: grads zeroed in place, the buffer kept
# The tags that name a hunk of the seed diff (the README's "Read it beside the diff"; the
# layout functions are the constructor's part, point 1 of `tensor_fusion_helper.py`). Lines
# with other tags show the calls around the hunks: the collective, the wait, the step.
SEED_HUNKS = {
    ("comm_buffer.py", "flatten_dense_tensors"), ("comm_buffer.py", "build_reduce_scatter_buffer"),
    ("comm_buffer.py", "add_grad"), ("comm_buffer.py", "_copy_grad_to_buffer"),
    ("comm_buffer.py", "_clear_grad_storage"),
    ("sharding.py", "DygraphShardingOptimizerV2._build_comm_buffers"),
    ("sharding.py", "DygraphShardingOptimizerV2._assign_slice_grad"),
    ("sharding.py", "DygraphShardingOptimizerV2.clear_grad"),
    ("pipeline.py", "PipelineParallel.fused_gradient"),
    ("pipeline.py", "PipelineParallel._optimizer_step"),
}
KINDS = ("build", "layout", "alloc", "copy", "add", "comm", "wait", "slice", "step", "clear",
         "free", "zero")


class Affine(nn.Module):
    """`x @ w + b` with `w` (2, 2) starting as the identity and `b` (2,) as zeros, so every
    grad and update of the walkthrough is a short exact binary fraction."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.eye(2))
        self.b = nn.Parameter(torch.zeros(2))

    def forward(self, x):  # (rows, 2) -> (rows, 2)
        return x @ self.w + self.b


def _loss(out, label):  # one row per micro-batch: the sum is the mean over the micro-batch
    return (out * label).sum()


def _inputs(replica, step):
    """(MICRO_BATCHES, 2): micro-batch m of data replica d in step s is `[1 + m + 2d + 4(s-1),
    1]`; with the loss scaled by 1/MICRO_BATCHES, w[0, 0]'s grad in the first layer is half of
    its first entry (replica 0, step 1: 0.5 and 1.0, sum 1.5; replica 1: 1.5 and 2.0, sum 3.5;
    reduced: 2.5)."""
    first = torch.arange(MICRO_BATCHES, dtype=torch.float32) + 1 + 2 * replica + 4 * (step - 1)
    return torch.stack([first, torch.ones(MICRO_BATCHES)], dim=1)


def _num(x):
    return f"{x:g}"


def _offset(tensor, storage):
    """`tensor`'s first element as an element offset into `storage`; None: not a view of it."""
    if tensor is None or storage is None:
        return None
    if tensor.untyped_storage().data_ptr() != storage.untyped_storage().data_ptr():
        return None
    return (tensor.data_ptr() - storage.data_ptr()) // storage.element_size()


def _dead(ref, seconds=2.0):
    """True once `ref` is dead. Polls: gloo's worker thread lets go of a finished collective's
    tensors a moment after `wait()` returns."""
    deadline = time.monotonic() + seconds
    while ref() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.005)
    return ref() is None


class _Narrator:
    """Spies on one run's buffers and optimizer; `events` is what they saw, in order.

    `names`: param -> its name; `watched`: the param whose element 0 is followed; `where`:
    the (file, function) tags of the run's optimizer step ("step") and grad clearing
    ("clear"), and how its step line starts ("step_text").
    """

    def __init__(self, names, watched, where):
        self.names, self.watched, self.where = names, watched, where
        self.wname = f"{names[watched]}[0,0]"
        self.events, self.step = [], 0
        self._buffers = []

    def emit(self, kind, where, text, mb=None, buffer=None, **data):
        self.events.append({"step": self.step, "mb": mb, "kind": kind, "file": where[0],
                            "func": where[1], "text": text,
                            "bucket": None if buffer is None else self._bucket(buffer), **data})

    # ---- the buffers ----

    def watch_buffers(self, buffers, built_by):
        """Spy on the buffers not seen yet and tell how each was built."""
        for buffer in buffers:
            if any(buffer is b for b in self._buffers):
                continue
            self._buffers.append(buffer)
            self._built(buffer, built_by)
            self._spy_buffer(buffer)

    def _spy_buffer(self, b):
        _spy(b, "add_grad", before=lambda param, *a, **k: self._before_add(b, param))
        _spy(b, "_copy_grad_to_buffer",
             before=lambda param, *a, **k: (b.grad_storage is None,
                                            b._params_step_dict.get(param)),
             after=lambda state, param, *a, **k: self._after_copy(b, param, *state))
        _spy(b, "_comm_grads", before=lambda *a, **k: self._before_comm(b))
        _spy(b, "scale_grads", after=lambda *a, **k: self._after_wait(b))
        _spy(b, "_clear_grad_storage", before=lambda *a, **k: self._before_free(b),
             after=lambda state, *a, **k: self._after_free(b, state))

    def _bucket(self, buffer):
        return f"bucket ({', '.join(self.names[p] for p in buffer.params)})"

    def _holds(self, buffer, param):
        return any(p is param for p in buffer.params)  # `in` would compare tensors by value

    def _slots(self, buffer):
        """[(param, offset, padded elements)] in buffer order."""
        if buffer._act == HOOK_ACTION.REDUCE_SCATTER:
            views = buffer._sharding_param_grad_view
            return [(p, views[p]._index, views[p]._padded_size) for p in buffer.params]
        offsets = [buffer.param2offset[p] for p in buffer.params] + [buffer.buffer_size]
        return [(p, o, nxt - o) for p, o, nxt in zip(buffer.params, offsets, offsets[1:])]

    def _slot_of(self, buffer, param):
        return next(o for p, o, _ in self._slots(buffer) if p is param)

    def _bytes(self, buffer):
        return buffer.buffer_size * buffer._dtype.itemsize

    def _built(self, buffer, built_by):
        group = dist.get_process_group_ranks(buffer._comm_group or dist.group.WORLD)
        to = f" to rank {buffer._dst}" if buffer._act == HOOK_ACTION.REDUCE else ""
        self.emit("build", built_by,
                  f"{self._bucket(buffer)}: FusedCommBuffer(id {buffer._id}, "
                  f"{_ACTIONS[buffer._act]}{to} over ranks {group}, acc_steps="
                  f"{buffer._acc_steps}, release_grads={buffer._release_grads})", buffer=buffer)
        slots = ", ".join(f"{self.names[p]} [{o}, {o + p.numel()}) in a slot of {size}"
                          for p, o, size in self._slots(buffer))
        text = (f"{slots}: {buffer.buffer_size} x {str(buffer._dtype).replace('torch.', '')} "
                f"= {self._bytes(buffer)} B")
        if buffer._act == HOOK_ACTION.REDUCE_SCATTER:
            shard = buffer.buffer_size // buffer._nranks
            text += "; shards: " + ", ".join(f"rank {r} [{i * shard}, {(i + 1) * shard})"
                                             for i, r in enumerate(group))
        if buffer.grad_storage is None:
            text += "; grad_storage None until the first check-in"
            views = None
        else:
            views = [_offset(main_grad_or_grad(p), buffer.grad_storage) for p in buffer.params]
            text += (f"; grad_storage allocated now (zeros), the grads are views at offsets "
                     f"{', '.join(map(str, views))}")
        layout = ("build_reduce_scatter_buffer" if buffer._act == HOOK_ACTION.REDUCE_SCATTER
                  else "flatten_dense_tensors")
        self.emit("layout", ("comm_buffer.py", layout), text, buffer=buffer,
                  bytes=self._bytes(buffer), allocated=buffer.grad_storage is not None, views=views,
                  slots=[o for _, o, _ in self._slots(buffer)])

    def _value(self, buffer):
        """The watched element in `buffer`'s storage (None: not in this buffer / no storage)."""
        if not self._holds(buffer, self.watched) or buffer.grad_storage is None:
            return None
        return float(buffer.grad_storage[self._slot_of(buffer, self.watched)])

    def _element(self, buffer, param):
        """(name, value) of `param`'s element 0 in its slot: the watched one is `w[0,0]`."""
        name = self.wname if param is self.watched else f"{self.names[param]}[0]"
        return name, float(buffer.grad_storage[self._slot_of(buffer, param)])

    def _before_add(self, buffer, param):
        mb = buffer._params_step_dict.get(param)
        if mb is None:
            return  # add_grad raises: a check-in too many
        if buffer._release_grads and mb == 0:
            return  # _copy_grad_to_buffer tells
        slot = self._slot_of(buffer, param)
        offset = _offset(main_grad_or_grad(param), buffer.grad_storage)
        same = offset == slot
        where = "same address" if same else "NOT its slot's view"
        name, value = self._element(buffer, param)
        self.emit("add", ("comm_buffer.py", "add_grad"),
                  f"{self.names[param]}: backward added mb {mb}'s grad in place, the grad is "
                  f"still the view at offset {offset} ({where}); {name} = {_num(value)}",
                  mb=mb, buffer=buffer, param=self.names[param], offset=offset, same=same,
                  value=value)

    def _after_copy(self, buffer, param, was_absent, mb):
        if mb != 0:
            return  # a later check-in: the seed's early return (backward added in place)
        where = ("comm_buffer.py", "_copy_grad_to_buffer")
        if was_absent and buffer.grad_storage is not None:
            dtype = str(buffer._dtype).replace("torch.", "")
            self.emit("alloc", where,
                      f"first check-in ({self.names[param]}): allocate grad_storage = zeros("
                      f"{buffer.buffer_size}) {dtype}, {self._bytes(buffer)} B",
                      mb=mb, buffer=buffer, bytes=self._bytes(buffer))
        slot = self._slot_of(buffer, param)
        offset = _offset(main_grad_or_grad(param), buffer.grad_storage)
        name, value = self._element(buffer, param)
        self.emit("copy", where,
                  f"{self.names[param]}: mb {mb}'s grad added into slot [{slot}, "
                  f"{slot + param.numel()}), the grad re-pointed to it (a view at offset "
                  f"{offset}); {name} = {_num(value)}",
                  mb=mb, buffer=buffer, param=self.names[param], offset=offset,
                  same=offset == slot, value=value)

    def _reads(self, buffer):
        """(what this rank reads of `buffer` after its collective, whether that is anything,
        whether it is the watched element)."""
        if buffer._act == HOOK_ACTION.ALL_REDUCE:
            return "every rank reads all", True, True
        if buffer._act == HOOK_ACTION.REDUCE:
            if dist.get_rank() == buffer._dst:
                return "this rank owns it, reads all", True, True
            return f"rank {buffer._dst} owns it, this rank reads nothing", False, False
        shard = buffer.buffer_size // buffer._nranks
        begin = dist.get_rank(buffer._comm_group) * shard
        watched = (self._holds(buffer, self.watched)
                   and begin <= self._slot_of(buffer, self.watched) < begin + shard)
        return f"this rank reads its shard [{begin}, {begin + shard})", True, watched

    def _before_comm(self, buffer):
        group = dist.get_process_group_ranks(buffer._comm_group or dist.group.WORLD)
        reads, _, _ = self._reads(buffer)
        to = f" to rank {buffer._dst}" if buffer._act == HOOK_ACTION.REDUCE else ""
        kind = _ACTIONS[buffer._act]
        if buffer._act == HOOK_ACTION.REDUCE_SCATTER and _stages_full_copies(
                buffer._comm_group, buffer.grad_storage):  # what runs on gloo (see there)
            kind = "reduce-scatter, run on gloo as an in-place all-reduce,"
        value = self._value(buffer)
        self.emit("comm", ("comm_buffer.py", "_comm_grads"),
                  f"{self._bucket(buffer)}: {kind}{to} (sum) of its "
                  f"{buffer.buffer_size} elements over ranks {group}; {reads}"
                  + ("" if value is None else
                     f"; sends {self.wname} = {_num(value)}"),
                  buffer=buffer, group=group, sent=value,
                  watched=None if value is None else self.wname)

    def _after_wait(self, buffer):
        _, anything, watched = self._reads(buffer)
        value = self._value(buffer) if watched else None
        text = (f"{self._bucket(buffer)}: waited, " + (
            f"scaled what this rank reads by 1/{buffer._nranks}" if anything else
            "nothing read or scaled here"))
        if value is not None:
            text += f"; {self.wname} = {_num(value)}, the mean of the sums"
        elif self._holds(buffer, self.watched):
            text += f"; {self.wname} is not read here"
        self.emit("wait", ("comm_buffer.py", "scale_grads"), text, buffer=buffer, reduced=value,
                  watched=None if value is None else self.wname)

    def _before_free(self, buffer):
        storage = buffer.grad_storage
        return None if storage is None else (weakref.ref(storage), self._bytes(buffer))

    def _after_free(self, buffer, state):
        if state is None:
            self.emit("free", ("comm_buffer.py", "_clear_grad_storage"),
                      f"{self._bucket(buffer)}: nothing allocated, nothing to free",
                      buffer=buffer, freed=None)
            return
        ref, nbytes = state
        freed = _dead(ref) and buffer.grad_storage is None
        self.emit("free", ("comm_buffer.py", "_clear_grad_storage"),
                  f"{self._bucket(buffer)}: grad_storage None, "
                  + (f"its {nbytes} B freed (no tensor points into it)" if freed
                     else f"its {nbytes} B STILL referenced"), buffer=buffer, freed=freed,
                  bytes=nbytes)

    # ---- the optimizer ----

    def watch_optimizer(self, optimizer):
        _spy(optimizer, "step", before=lambda *a, **k: float(self.watched.detach()[0, 0]),
             after=lambda before, *a, **k: self._after_step(before))
        method = "clear_grad" if hasattr(optimizer, "clear_grad") else "zero_grad"
        _spy(optimizer, method, before=lambda *a, **k: len(self.events),
             after=lambda mark, *a, **k: self._after_clear(mark, method, *a, **k))
        if isinstance(optimizer, DygraphShardingOptimizerV2):
            _spy(optimizer, "_assign_slice_grad",
                 after=lambda *a, **k: self._after_slices(optimizer))

    def _after_step(self, before):
        after = float(self.watched.detach()[0, 0])
        self.emit("step", self.where["step"], f"{self.where['step_text']}: {self.wname} "
                  f"{_num(before)} -> {_num(after)}", before=before, after=after)

    def _after_clear(self, mark, method, set_to_zero=None, set_to_none=None):
        if method == "clear_grad":
            zero = True if set_to_zero is None else set_to_zero
            call = f"clear_grad(set_to_zero={zero})"
        else:
            zero = set_to_none is False
            call = f"zero_grad(set_to_none={not zero})"
        grad = main_grad_or_grad(self.watched)
        if zero:
            kept = [f"{self._bucket(b)} {self._bytes(b)} B" for b in self._buffers
                    if b.grad_storage is not None]
            offset = next((_offset(grad, b.grad_storage) for b in self._buffers
                           if self._holds(b, self.watched)), None)
            event = {"kind": "zero", "text": f"{call}: grads zeroed in place, buffers kept "
                     f"({', '.join(kept)}); {self.names[self.watched]}.grad still the view at "
                     f"offset {offset}, {self.wname} = {_num(float(grad.reshape(-1)[0]))}",
                     "kept": len(kept)}
        else:
            dropped = sum(main_grad_or_grad(p) is None for p in self.names)
            event = {"kind": "clear", "text": f"{call}: grads dropped ({dropped} of "
                     f"{len(self.names)} are None)", "dropped": dropped}
        self.events.insert(mark, {"step": self.step, "mb": None, "file": self.where["clear"][0],
                                  "func": self.where["clear"][1], "bucket": None, **event})

    def _after_slices(self, optimizer):
        where = ("sharding.py", "DygraphShardingOptimizerV2._assign_slice_grad")
        for buffer in self._buffers:
            for param in buffer.params:
                grad = main_grad_or_grad(optimizer._slice_params[param])
                offset = _offset(grad, buffer.grad_storage)
                if grad is None:
                    text = f"{self.names[param]}: none of its elements on this rank, no slice"
                else:
                    view = buffer._sharding_param_grad_view[param]
                    own = min(offset + grad.numel(), view._index + param.numel()) - offset
                    text = (f"{self.names[param]}: slice grad bound to buffer elements "
                            f"[{offset}, {offset + grad.numel()}) ({own} of "
                            f"{self.names[param]}, {grad.numel() - own} padding): what this "
                            "rank steps")
                self.emit("slice", where, text, buffer=buffer, param=self.names[param],
                          offset=offset)


def _spy(obj, method, before=None, after=None):
    """Replace `obj.method` on the instance by a call of the original between `before(*args)`
    and `after(what before returned, *args)`."""
    original = getattr(obj, method)

    def spy(*args, **kwargs):
        state = before(*args, **kwargs) if before is not None else None
        out = original(*args, **kwargs)
        if after is not None:
            after(state, *args, **kwargs)
        return out

    setattr(obj, method, spy)


# ---- the runs: one per layout and release mode, on every rank ----

def _strategy(layout, release):
    pp_configs = PpConfig(release_gradients=release,
                          sharding_comm_overlap=layout == "v1", dp_comm_overlap=layout == "dp")
    if layout == "v2":
        return HybridStrategy(sharding_degree=2, accumulate_steps=MICRO_BATCHES,
                              pp_configs=pp_configs, sharding_configs=DygraphShardingConfig(
                                  split_param=True, comm_overlap=True,
                                  accumulate_steps=MICRO_BATCHES))
    return HybridStrategy(pp_degree=2, sharding_degree=2 if layout == "v1" else 1,
                          dp_degree=2 if layout == "dp" else 1, accumulate_steps=MICRO_BATCHES,
                          micro_batch_size=1, pp_configs=pp_configs)


def _run_v2(hcg, strategy):
    model = Affine()
    names = {model.w: "w", model.b: "b"}
    narrator = _Narrator(names, model.w, {
        "step": ("sharding.py", "_Sharding.step"),
        "clear": ("sharding.py", "DygraphShardingOptimizerV2.clear_grad"),
        "step_text": f"SGD (lr {LR}) on this rank's slices, then the params all-gathered "
                     "(on gloo: a broadcast per shard)"})
    optimizer = DygraphShardingOptimizerV2(torch.optim.SGD(model.parameters(), lr=LR), hcg,
                                           strategy)
    narrator.watch_buffers(optimizer._comm_buffer_list,
                           ("sharding.py", "DygraphShardingOptimizerV2._build_comm_buffers"))
    narrator.watch_optimizer(optimizer)
    release = strategy.pp_configs.release_gradients
    for step in range(1, STEPS + 1):
        narrator.step = step
        for x in _inputs(hcg.get_sharding_parallel_rank(), step):
            (_loss(model(x[None]), torch.ones(1, 2)) / MICRO_BATCHES).backward()
        optimizer.step()
        optimizer.clear_grad(set_to_zero=not release)  # Paddle's loop: the seed's clear_grad
    return narrator, list(model.parameters())


def _run_pipeline(hcg, strategy):
    model = PipelineParallel([Affine(), Affine()], hcg, strategy, _loss)
    stage = hcg.get_stage_id()
    layer = model._layers[0]
    names = {layer.w: f"w{stage}", layer.b: f"b{stage}"}
    step_where = ("pipeline.py", "PipelineParallel._optimizer_step")
    owned = (f"v1: SGD (lr {LR}) on the params this rank owns, then each broadcast from its "
             "owner" if hcg.get_sharding_parallel_world_size() > 1 else
             f"optimizer.step(): SGD (lr {LR})")
    narrator = _Narrator(names, layer.w, {"step": step_where, "clear": step_where,
                                          "step_text": owned})
    fused = ("pipeline.py", "PipelineParallel.fused_gradient")
    narrator.watch_buffers([b for bs in model._chunk_2_comm_buffers.values() for b in bs], fused)
    # sharding buffers are built in the first train_batch (v1's owners live in the optimizer)
    _spy(model, "fused_gradient", after=lambda *a, **k: narrator.watch_buffers(
        [b for bs in model._chunk_2_comm_buffers.values() for b in bs], fused))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    if hcg.get_sharding_parallel_world_size() > 1:
        optimizer = DygraphShardingOptimizer(optimizer, hcg, strategy)
    narrator.watch_optimizer(optimizer)
    replica = (hcg.get_data_parallel_rank() * hcg.get_sharding_parallel_world_size()
               + hcg.get_sharding_parallel_rank())
    for step in range(1, STEPS + 1):
        narrator.step = step
        model.train_batch((_inputs(replica, step), torch.ones(MICRO_BATCHES, 2)), optimizer)
    return narrator, list(model.parameters())


def rank_walkthrough(rank, world, layout):
    """On every rank: run `layout` release off, then on. Returns {"rank", "stage", "sharding"
    and "dp" (this rank's index along each), "events": {mode: [event dicts, in order]},
    "equal": this rank's params after the last step bitwise equal between the modes}.
    Raises ValueError unless `world` is `WORLD[layout]`."""
    if world != WORLD[layout]:
        raise ValueError(f"layout {layout!r} runs on {WORLD[layout]} ranks, got {world}")
    events, params = {}, {}
    hcg = HybridCommunicateGroup(_strategy(layout, False))  # the groups serve both modes
    for mode in MODES:
        strategy = _strategy(layout, mode == "on")
        run = _run_v2 if layout == "v2" else _run_pipeline
        narrator, final = run(hcg, strategy)
        events[mode] = narrator.events
        params[mode] = [p.detach().clone() for p in final]
    # Every rank past every group's setup before any exits: a rank leaving while a peer's
    # gloo group was still connecting aborted that peer now and then (about 1 run in 8 here).
    dist.barrier()
    return {"rank": rank, "stage": hcg.get_stage_id(),
            "sharding": hcg.get_sharding_parallel_rank(), "dp": hcg.get_data_parallel_rank(),
            "events": events,
            "equal": all(torch.equal(a, b) for a, b in zip(params["off"], params["on"]))}


# ---- the report ----

def hand_sums(results, mode):
    """Per (step, group): the watched element as each rank sent it, their mean (float32, as
    the buffer computes it: sum, then times 1/n) and what the readers saw after the wait.
    Returns [{"step", "group", "watched", "sent": {rank: value}, "mean", "read": {rank: value}}]."""
    sums = {}
    for r in results:
        for e in r["events"][mode]:
            if e["kind"] == "comm" and e["sent"] is not None:
                entry = sums.setdefault((e["step"], tuple(e["group"])), {
                    "step": e["step"], "group": e["group"], "watched": e["watched"],
                    "sent": {}, "read": {}})
                entry["sent"][r["rank"]] = e["sent"]
    for r in results:
        for e in r["events"][mode]:
            if e["kind"] == "wait" and e["reduced"] is not None:
                for (step, group), entry in sums.items():
                    if step == e["step"] and r["rank"] in group:
                        entry["read"][r["rank"]] = e["reduced"]
    for entry in sums.values():
        sent = torch.tensor([entry["sent"][r] for r in sorted(entry["sent"])])
        entry["mean"] = float(sent.sum() * (1.0 / len(sent)))
    return list(sums.values())


def _rank_title(layout, r):
    if layout == "v2":
        return f"rank {r['rank']} (sharding rank {r['sharding']})"
    other = f"sharding rank {r['sharding']}" if layout == "v1" else f"dp rank {r['dp']}"
    return f"rank {r['rank']} (stage {r['stage']}, {other})"


def render(layout, results):
    """The walkthrough's lines for one layout: per mode, per rank in order, one line per event
    (`s<step> mb<micro-batch>  [file: function] what happened`), then the hand sums."""
    lines = [f"== {layout}: {TITLES[layout]}",
             f"   {STEPS} steps x {MICRO_BATCHES} micro-batches (mb), SGD lr {LR}; Affine "
             "layers x @ w + b (w 2 x 2, b 2); offsets in elements of grad_storage; "
             "[file: function]* is a hunk of the seed diff"]
    for mode in MODES:
        lines.append(f"-- release {mode} (pp_configs.release_gradients="
                     f"{mode == 'on'})")
        for r in results:
            lines.append(f"{_rank_title(layout, r)}")
            for e in r["events"][mode]:
                where = (f"s{e['step']}" + ("" if e["mb"] is None else f" mb{e['mb']}")
                         if e["step"] else "build")
                star = "*" if (e["file"], e["func"]) in SEED_HUNKS else ""
                lines.append(f"  {where:<7} [{e['file']}: {e['func']}]{star} {e['text']}")
        for entry in hand_sums(results, mode):
            sent = " + ".join(f"{_num(v)} (rank {k})" for k, v in sorted(entry["sent"].items()))
            read = ", ".join(f"rank {k} {_num(v)}" for k, v in sorted(entry["read"].items()))
            ok = all(v == entry["mean"] for v in entry["read"].values()) and entry["read"]
            lines.append(f"  by hand, step {entry['step']}, {entry['watched']}: ({sent}) / "
                         f"{len(entry['sent'])} = {_num(entry['mean'])}; read after the "
                         f"collective: {read} {'(equal)' if ok else '(DIFFERENT)'}")
    equal = all(r["equal"] for r in results)
    lines.append(f"   release off vs on: params after step {STEPS} bitwise equal on every rank: "
                 f"{equal}")
    return lines


def rank_walkthroughs(rank, world, layouts):
    """`rank_walkthrough` for each of `layouts` (all on `world` ranks), in turn: one start of
    the processes serves several layouts."""
    return [rank_walkthrough(rank, world, layout) for layout in layouts]


def main(which="all", timeout=300.0):
    """`python relgrad.py --walkthrough [v2|v1|dp]`: run the layouts (one start of the local
    processes per world size), print their lines in the order of WORLD. Returns the exit
    status: 0, or 1 if a rank raised (its traceback goes to stderr)."""
    layouts = list(WORLD) if which == "all" else [which]
    for i, world in enumerate(dict.fromkeys(WORLD[layout] for layout in layouts)):
        mine = [layout for layout in layouts if WORLD[layout] == world]
        try:
            per_rank = launch(rank_walkthroughs, world, (mine,), timeout=timeout)
        except mp.ProcessRaisedException as e:
            print(f"relgrad: a rank failed; its traceback:{e}", file=sys.stderr)
            return 1
        for j, layout in enumerate(mine):
            if i or j:
                print()
            print("\n".join(render(layout, [r[j] for r in per_rank])))
            sys.stdout.flush()
    return 0
