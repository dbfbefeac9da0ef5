"""`python relgrad.py --walkthrough`: the life of one fused grad buffer, event by event.

A tiny model (`Affine` layers: a 2 x 2 weight and a 2-element bias each) trains 2 steps of 2
micro-batches with plain SGD, release off and on, in the seed's own paths: `v2`, sharding v2
alone as the seed runs it (no hooks: `reduce_gradients` copies every grad into the buffer at
`step()`, 2 ranks); `v1`, pipeline 2 x sharding 2 with v1 (the pipeline's hooks reduce to each
param's owner, 4 ranks); `dp`, pipeline 2 x dp 2 (the pipeline's all-reduce, 4 ranks). A named
option, `v2-overlap`, runs v2 with its own overlap (`sharding_configs.comm_overlap`, a later
Paddle feature: the buffer fills during backward). Rank 0's events are printed, release off
and on merged: a line both runs made once, the others tagged `off` or `on`. `*N` marks an event
made by the lines of row N of the README's hunk table.

The events are the library's own calls, watched from outside as `phases.PipelineProbe` watches
them for `--trace`: `_Narrator` replaces a few methods on the *instances* (each buffer's
`add_grad`, `_copy_grad_to_buffer`, `_comm_grads`, `scale_grads`, `_clear_grad_storage`; the
optimizer's `step`, `clear_grad` / `zero_grad`, `reduce_gradients`, v2's `_assign_slice_grad`;
the pipeline's `fused_gradient`) by spies that call the original and record what it did, read
from the buffer before and after. Nothing in the library changes and nothing runs when no
walkthrough runs. Offsets are elements of `grad_storage`; one element per rank is watched
(element 0 of its first param), so the reduced value can be checked by hand.
"""
import difflib
import gc
import re
import sys
import time
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from comm_buffer import HOOK_ACTION, main_grad_or_grad
from pipeline import PipelineParallel
from relgrad import DygraphShardingConfig, HybridCommunicateGroup, HybridStrategy, PpConfig
from relgrad_demo.launch import launch
from sharding import DygraphShardingOptimizer, DygraphShardingOptimizerV2

WORLD = {"v2": 2, "v1": 4, "dp": 4, "v2-overlap": 2}  # the layouts and their ranks
DEFAULT = ("v2", "v1", "dp")  # the seed's paths, printed with no value
TITLES = {
    "v2": "sharding v2 alone, as the seed runs it: the buffer is filled at step(); 2 ranks",
    "v1": "pipeline 2 x sharding 2, v1: the pipeline's hooks reduce to each owner; 4 ranks",
    "dp": "pipeline 2 x dp 2: the pipeline's hooks all-reduce; 4 ranks",
    "v2-overlap": "sharding v2 with its own overlap ([later]): hooks fill it in backward",
}
MODES = ("off", "on")  # pp_configs.release_gradients
STEPS, MICRO_BATCHES, LR = 2, 2, 0.25
_ACTIONS = {HOOK_ACTION.ALL_REDUCE: "all-reduce", HOOK_ACTION.REDUCE: "reduce",
            HOOK_ACTION.REDUCE_SCATTER: "reduce-scatter"}

# Kinds of events, in the order a step shows them.
#   config, flag: the release flag as the config holds it and as the optimizer / pipeline
#     read it; build, layout: a buffer is built (storage absent with release)
#   alloc, copy: release, a param's first check-in of a step: the buffer is allocated (first
#     param only) and the grad added into its slot and re-pointed at it
#   add: any other check-in: backward added the grad in place, the address is unchanged
#   comm, wait: the bucket's collective is issued, then waited for and scaled
#   slice: v2 binds its slice params' grads to its shard
#   step: the optimizer steps
#   clear, free: release: grads dropped, then the buffer freed
#   zero: release off: grads zeroed in place, the buffer kept
KINDS = ("config", "flag", "build", "layout", "alloc", "copy", "add", "comm", "wait", "slice",
         "step", "clear", "free", "zero")
# The README's hunk table, mechanism first: (file, function) of each row.
ROWS = {1: ("comm_buffer.py", "flatten_dense_tensors"),
        2: ("comm_buffer.py", "build_reduce_scatter_buffer"),
        3: ("comm_buffer.py", "FusedCommBuffer.add_grad"),
        4: ("comm_buffer.py", "FusedCommBuffer._copy_grad_to_buffer"),
        5: ("comm_buffer.py", "FusedCommBuffer._drop_grad_storage"),
        6: ("comm_buffer.py", "FusedCommBuffer.__init__"),
        7: ("relgrad.py", "PpConfig"),
        8: ("sharding.py", "_Sharding._setup"),
        9: ("sharding.py", "DygraphShardingOptimizerV2._build_comm_buffers"),
        10: ("sharding.py", "DygraphShardingOptimizerV2.clear_grad"),
        11: ("sharding.py", "DygraphShardingOptimizerV2.reduce_gradients"),
        12: ("sharding.py", "DygraphShardingOptimizerV2._assign_slice_grad"),
        13: ("pipeline.py", "PipelineParallel.__init__"),
        14: ("pipeline.py", "PipelineParallel.fused_gradient"),
        15: ("pipeline.py", "PipelineParallel._optimizer_step")}
# Rows no run of the walkthrough can show: 6 refuses fuse_param with release (an error, not a
# step); 12 drops a stale slice main_grad, which clear_grad has already dropped here.
NOT_SHOWN = {6: "a refusal at build", 12: "clear_grad already dropped it"}


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
        self._buffers, self._in_add = [], False

    def emit(self, kind, where, text, mb=None, buffer=None, rows=(), **data):
        self.events.append({"step": self.step, "mb": mb, "kind": kind, "file": where[0],
                            "func": where[1], "text": text, "rows": sorted(rows),
                            "bucket": None if buffer is None else self._bucket(buffer), **data})

    # ---- the buffers ----

    def watch_buffers(self, buffers, built_by, row):
        """Spy on the buffers not seen yet and tell how each was built (by row `row`'s line)."""
        for buffer in buffers:
            if any(buffer is b for b in self._buffers):
                continue
            self._buffers.append(buffer)
            self._built(buffer, built_by, row)
            self._spy_buffer(buffer)

    def _spy_buffer(self, b):
        _spy(b, "add_grad", before=lambda param, *a, **k: self._before_add(b, param),
             after=lambda *a, **k: setattr(self, "_in_add", False))
        _spy(b, "_copy_grad_to_buffer",
             before=lambda param, *a, **k: (b.grad_storage is None,
                                            b._params_step_dict.get(param)),
             after=lambda state, param, *a, **k: self._after_copy(b, param, *state))
        _spy(b, "_comm_grads", before=lambda *a, **k: self._before_comm(b))
        _spy(b, "scale_grads", after=lambda *a, **k: self._after_wait(b))
        _spy(b, "_clear_grad_storage", before=lambda *a, **k: self._before_free(b),
             after=lambda state, *a, **k: self._after_free(b, state))

    def _bucket(self, buffer):
        return f"({', '.join(self.names[p] for p in buffer.params)})"

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

    def _built(self, buffer, built_by, row):
        group = dist.get_process_group_ranks(buffer._comm_group or dist.group.WORLD)
        to = f" to {buffer._dst}" if buffer._act == HOOK_ACTION.REDUCE else ""
        self.emit("build", built_by,
                  f"bucket {self._bucket(buffer)}: {_ACTIONS[buffer._act]}{to} over {group}, "
                  f"release_grads={buffer._release_grads}", buffer=buffer, rows=[row])
        slots = ", ".join(f"{self.names[p]} [{o}, {o + p.numel()})"
                          for p, o, _ in self._slots(buffer))
        text = f"{slots} in {buffer.buffer_size} x fp32 = {self._bytes(buffer)} B"
        if buffer.grad_storage is None:
            text += ": layout only, no storage"
            views = None
        else:
            views = [_offset(main_grad_or_grad(p), buffer.grad_storage) for p in buffer.params]
            text += ": allocated, grads are views"
        scatter = buffer._act == HOOK_ACTION.REDUCE_SCATTER
        layout = "build_reduce_scatter_buffer" if scatter else "flatten_dense_tensors"
        self.emit("layout", ("comm_buffer.py", layout), text, buffer=buffer,
                  bytes=self._bytes(buffer), allocated=buffer.grad_storage is not None, views=views,
                  slots=[o for _, o, _ in self._slots(buffer)],
                  rows=[] if views is not None else [2 if scatter else 1])

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
        self._in_add = True
        mb = buffer._params_step_dict.get(param)
        if mb is None:
            return  # add_grad raises: a check-in too many
        if buffer._release_grads and mb == 0:
            return  # _copy_grad_to_buffer tells
        slot = self._slot_of(buffer, param)
        offset = _offset(main_grad_or_grad(param), buffer.grad_storage)
        same = offset == slot
        where = "in place by backward" if same else "but NOT in its slot's view"
        name, value = self._element(buffer, param)
        self.emit("add", ("comm_buffer.py", "FusedCommBuffer.add_grad"),
                  f"{self.names[param]}: mb {mb}'s grad added {where}; {name} = {_num(value)}",
                  mb=mb, buffer=buffer, param=self.names[param], offset=offset, same=same,
                  value=value)

    def _after_copy(self, buffer, param, was_absent, mb):
        if mb != 0:
            return  # a later check-in: the seed's early return (backward added in place)
        where = ("comm_buffer.py", "FusedCommBuffer._copy_grad_to_buffer")
        rows = [4, 3 if self._in_add else 11]  # called by add_grad, or by v2's step
        mb_text = f"mb {mb}'s" if self._in_add else "the step's"
        if was_absent and buffer.grad_storage is not None:
            self.emit("alloc", where, f"{self.names[param]} first: allocate grad_storage = "
                      f"zeros({buffer.buffer_size}), {self._bytes(buffer)} B",
                      mb=mb if self._in_add else None, buffer=buffer, bytes=self._bytes(buffer),
                      rows=rows)
        slot = self._slot_of(buffer, param)
        offset = _offset(main_grad_or_grad(param), buffer.grad_storage)
        name, value = self._element(buffer, param)
        self.emit("copy", where,
                  f"{self.names[param]}: {mb_text} grad added into slot [{slot}, "
                  f"{slot + param.numel()}), re-pointed at it; {name} = {_num(value)}",
                  mb=mb if self._in_add else None, buffer=buffer, param=self.names[param],
                  offset=offset, same=offset == slot, value=value, rows=rows)

    def _reads(self, buffer):
        """(what this rank reads of `buffer` after its collective, whether that is anything,
        whether it is the watched element)."""
        if buffer._act == HOOK_ACTION.ALL_REDUCE:
            return "reads all", True, True
        if buffer._act == HOOK_ACTION.REDUCE:
            if dist.get_rank() == buffer._dst:
                return "owner: reads all", True, True
            return f"rank {buffer._dst} owns it", False, False
        shard = buffer.buffer_size // buffer._nranks
        begin = dist.get_rank(buffer._comm_group) * shard
        watched = (self._holds(buffer, self.watched)
                   and begin <= self._slot_of(buffer, self.watched) < begin + shard)
        return f"reads [{begin}, {begin + shard})", True, watched

    def _before_comm(self, buffer):
        group = dist.get_process_group_ranks(buffer._comm_group or dist.group.WORLD)
        reads, _, _ = self._reads(buffer)
        kind = _ACTIONS[buffer._act]
        value = self._value(buffer)
        self.emit("comm", ("comm_buffer.py", "FusedCommBuffer._comm_grads"),
                  f"{self._bucket(buffer)} {kind} over {group}, {reads}"
                  + ("" if value is None else f"; sends {self.wname} = {_num(value)}"),
                  buffer=buffer, group=group, sent=value,
                  watched=None if value is None else self.wname)

    def _after_wait(self, buffer):
        _, anything, watched = self._reads(buffer)
        value = self._value(buffer) if watched else None
        text = (f"{self._bucket(buffer)} waited, " + (
            f"scaled by 1/{buffer._nranks}" if anything else "nothing to read here"))
        if value is not None:
            text += f"; {self.wname} = {_num(value)}, the mean over the ranks"
        self.emit("wait", ("comm_buffer.py", "FusedCommBuffer.scale_grads"), text, buffer=buffer,
                  reduced=value, watched=None if value is None else self.wname)

    def _before_free(self, buffer):
        storage = buffer.grad_storage
        return None if storage is None else (weakref.ref(storage), self._bytes(buffer))

    def _after_free(self, buffer, state):
        where = ("comm_buffer.py", "FusedCommBuffer._drop_grad_storage")
        if state is None:
            self.emit("free", where, f"{self._bucket(buffer)}: nothing allocated to free",
                      buffer=buffer, freed=None, rows=[5])
            return
        ref, nbytes = state
        freed = _dead(ref) and buffer.grad_storage is None
        self.emit("free", where, f"{self._bucket(buffer)}: grad_storage None, " + (
                  f"its {nbytes} B freed" if freed else f"its {nbytes} B STILL referenced"),
                  buffer=buffer, freed=freed, bytes=nbytes, rows=[5])

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

    def flag(self, where, text, row):
        """The release flag as the config holds it, or as a constructor read it."""
        self.emit("config" if row == 7 else "flag", where, text, rows=[row])

    def _after_clear(self, mark, method, set_to_zero=None, set_to_none=None):
        if method == "clear_grad":
            zero = True if set_to_zero is None else set_to_zero
            call = f"clear_grad(set_to_zero={zero})"
        else:
            zero = set_to_none is False
            call = f"zero_grad(set_to_none={not zero})"
        grad = main_grad_or_grad(self.watched)
        rows = self.where["clear_rows"][zero]
        if zero:
            kept = sum(b.grad_storage is not None for b in self._buffers)
            event = {"kind": "zero", "text": f"{call}: zeroed in place, buffer kept; "
                     f"{self.wname} = {_num(float(grad.reshape(-1)[0]))}", "kept": kept}
        else:
            dropped = sum(main_grad_or_grad(p) is None for p in self.names)
            event = {"kind": "clear", "text": f"{call}: grads dropped ({dropped} of "
                     f"{len(self.names)} are None)", "dropped": dropped}
        self.events.insert(mark, {"step": self.step, "mb": None, "file": self.where["clear"][0],
                                  "func": self.where["clear"][1], "bucket": None,
                                  "rows": rows, **event})

    def _after_slices(self, optimizer):
        where = ("sharding.py", "DygraphShardingOptimizerV2._assign_slice_grad")
        for buffer in self._buffers:
            for param in buffer.params:
                grad = main_grad_or_grad(optimizer._slice_params[param])
                offset = _offset(grad, buffer.grad_storage)
                if grad is None:
                    text = f"{self.names[param]}: no element on this rank, no slice"
                else:
                    view = buffer._sharding_param_grad_view[param]
                    own = min(offset + grad.numel(), view._index + param.numel()) - offset
                    text = (f"{self.names[param]}: slice grad = elements [{offset}, "
                            f"{offset + grad.numel()}) ({own} real, the rest padding)")
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
    if layout.startswith("v2"):
        return HybridStrategy(sharding_degree=2, accumulate_steps=MICRO_BATCHES,
                              pp_configs=pp_configs, sharding_configs=DygraphShardingConfig(
                                  split_param=True, comm_overlap=layout == "v2-overlap",
                                  accumulate_steps=MICRO_BATCHES))
    return HybridStrategy(pp_degree=2, sharding_degree=2 if layout == "v1" else 1,
                          dp_degree=2 if layout == "dp" else 1, accumulate_steps=MICRO_BATCHES,
                          micro_batch_size=1, pp_configs=pp_configs)


def _flags(narrator, strategy, optimizer=None, model=None):
    """The release flag in the config, and as the constructors read it (rows 7, 13, 8)."""
    release = strategy.pp_configs.release_gradients
    narrator.flag(("relgrad.py", "PpConfig"), f"pp_configs.release_gradients={release}", 7)
    if model is not None:
        narrator.flag(("pipeline.py", "PipelineParallel.__init__"),
                      f"PipelineParallel: _release_gradients = {model._release_gradients}", 13)
    if optimizer is not None and hasattr(optimizer, "pp_release_grads"):
        narrator.flag(("sharding.py", "_Sharding._setup"), f"{type(optimizer).__name__}: "
                      f"pp_release_grads = {optimizer.pp_release_grads}", 8)


def _run_v2(hcg, strategy):
    model = Affine()
    names = {model.w: "w", model.b: "b"}
    narrator = _Narrator(names, model.w, {
        "step": ("sharding.py", "_Sharding.step"),
        "clear": ("sharding.py", "DygraphShardingOptimizerV2.clear_grad"),
        "clear_rows": {True: [], False: [10]},  # set_to_zero: Paddle's own lines; else row 10
        "step_text": f"SGD (lr {LR}) on the slices, params all-gathered"})
    optimizer = DygraphShardingOptimizerV2(torch.optim.SGD(model.parameters(), lr=LR), hcg,
                                           strategy)
    _flags(narrator, strategy, optimizer)
    narrator.watch_buffers(optimizer._comm_buffer_list,
                           ("sharding.py", "DygraphShardingOptimizerV2._build_comm_buffers"), 9)
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
    owned = (f"SGD (lr {LR}) on owned params, then broadcast"
             if hcg.get_sharding_parallel_world_size() > 1 else f"SGD (lr {LR})")
    narrator = _Narrator(names, layer.w, {"step": step_where, "clear": step_where,
                                          "clear_rows": {True: [15], False: [15]},
                                          "step_text": owned})
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    if hcg.get_sharding_parallel_world_size() > 1:
        optimizer = DygraphShardingOptimizer(optimizer, hcg, strategy)
    _flags(narrator, strategy, optimizer, model)
    fused = ("pipeline.py", "PipelineParallel.fused_gradient")
    narrator.watch_buffers([b for bs in model._chunk_2_comm_buffers.values() for b in bs], fused,
                           14)
    # sharding buffers are built in the first train_batch (v1's owners live in the optimizer)
    _spy(model, "fused_gradient", after=lambda *a, **k: narrator.watch_buffers(
        [b for bs in model._chunk_2_comm_buffers.values() for b in bs], fused, 14))
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
        run = _run_v2 if layout.startswith("v2") else _run_pipeline
        narrator, final = run(hcg, strategy)
        events[mode], watched = narrator.events, narrator.names[narrator.watched]
        params[mode] = [p.detach().clone() for p in final]
    # Every rank past every group's setup before any exits: a rank leaving while a peer's
    # gloo group was still connecting aborted that peer now and then (about 1 run in 8 here).
    dist.barrier()
    return {"rank": rank, "stage": hcg.get_stage_id(), "watched": watched,
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


def _line(e, mode=""):
    """One event as printed: `<step mb> <off|on> <function> *<rows> <what happened>`."""
    where = (f"s{e['step']}" + ("" if e["mb"] is None else f" mb{e['mb']}")
             if e["step"] else "build")
    func = e["func"].split(".")[-1] if e["func"] != "PipelineParallel.__init__" else \
        "PipelineParallel"
    star = "*" + ",".join(map(str, e["rows"])) if e["rows"] else ""
    return f"{where:<6} {mode:<3} {func:<27} {star:<5} {e['text']}".rstrip()


def _shown(e, watched):
    """Rank 0's lines of the watched param's bucket (a bucket of other params is alike)."""
    return e.get("param", watched) == watched and (
        e["bucket"] is None or watched in e["bucket"][1:-1].split(", "))


def _pair(off, on):
    """One line for an off and an on line that differ only in False -> True, else None."""
    a, b = re.split(r"( +)", off), re.split(r"( +)", on)
    if len(a) != len(b) or a == b or not all(
            x == y or x.replace("False", "True") == y for x, y in zip(a, b)):
        return None
    return "".join(x if x == y else x.replace("False", "False|True") for x, y in zip(a, b))


def merged(events, watched):
    """Rank 0's lines, release off and on merged step by step: a line both made once (no
    mode; `False|True` where only the flag's value differs), the others tagged off / on."""
    lines = []
    for step in sorted({e["step"] for m in MODES for e in events[m]}):
        off, on = ([e for e in events[m] if e["step"] == step and _shown(e, watched)]
                   for m in MODES)
        a_lines, b_lines = [_line(e) for e in off], [_line(e) for e in on]
        matcher = difflib.SequenceMatcher(None, a_lines, b_lines, autojunk=False)
        for op, a, b, c, d in matcher.get_opcodes():
            if op == "equal":
                lines += a_lines[a:b]
                continue
            if b - a == d - c:  # line by line: one line where only the flag differs
                for x, y in zip(off[a:b], on[c:d]):
                    pair = _pair(_line(x), _line(y))
                    lines += [pair] if pair else [_line(x, "off"), _line(y, "on")]
                continue
            lines += [_line(e, "off") for e in off[a:b]] + [_line(e, "on") for e in on[c:d]]
    return lines


def render(layout, results):
    """The walkthrough's lines for one layout: rank 0's events, release off and on merged,
    then the hand sums of the watched element and whether off and on end bitwise equal."""
    first = results[0]
    lines = [f"== {layout}: {TITLES[layout]}",
             f"   {STEPS} steps x {MICRO_BATCHES} micro-batches (mb), SGD lr {LR}, Affine "
             f"x @ w + b; rank 0, its {first['watched']}'s bucket; *N: row N's lines did it"]
    lines += merged(first["events"], first["watched"])
    for entry in hand_sums(results, "on"):
        if 0 not in entry["group"]:
            continue
        sent = " + ".join(f"{_num(v)}" for _, v in sorted(entry["sent"].items()))
        ok = entry["read"] and all(v == entry["mean"] for v in entry["read"].values())
        off = [e for e in hand_sums(results, "off") if e["step"] == entry["step"]
               and e["group"] == entry["group"]]
        same = len(off) == 1 and off[0]["mean"] == entry["mean"]
        lines.append(f"   by hand, step {entry['step']}: {entry['watched']} = ({sent}) / "
                     f"{len(entry['sent'])} = {_num(entry['mean'])}; read after the collective: "
                     f"{'equal' if ok else 'DIFFERENT'}; off alike: {same}")
    equal = all(r["equal"] for r in results)
    lines.append(f"   release off vs on: params after step {STEPS} bitwise equal on every rank: "
                 f"{equal}")
    return lines


def rank_walkthroughs(rank, world, layouts):
    """`rank_walkthrough` for each of `layouts` (all on `world` ranks), in turn: one start of
    the processes serves several layouts."""
    return [rank_walkthrough(rank, world, layout) for layout in layouts]


def main(which="all", timeout=300.0):
    """`python relgrad.py --walkthrough [v2|v1|dp|v2-overlap]`: run the layouts (one start of
    the local processes per world size; no value: the seed's paths, `DEFAULT`), print their
    lines. Returns the exit status: 0, or 1 if a rank raised (its traceback goes to stderr)."""
    layouts = list(DEFAULT) if which == "all" else [which]
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
