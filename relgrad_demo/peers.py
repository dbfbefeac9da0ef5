"""`--peers`: this repo's sharding v2 beside what a torch user would pick instead.

Trains the same LM on the same data with sharding 2 and no pipeline (2 processes, each its half
of every batch, `micro_batches` micro-batches per step) under every system in `SYSTEMS`: this
repo's sharding v2 with release off and on (PipelineParallel with one stage), torch's
DistributedDataParallel(gradient_as_bucket_view=True) + ZeroRedundancyOptimizer(AdamW), and
FSDP2 (`fully_shard` on every layer and the root); with `--free-grads-in-comm` also v2 with
release + free_grads_in_comm (`FREE_SYSTEM`); with `--dp`, data parallel 2 instead: torch's DDP
and the README's recipe (a), release off and on (`DP_SYSTEMS`). The runs live side by side and
train in turns (`job.measure`), so the figures are the allocator's, each run's own, and the step
times are paired. All start from the same weights; the losses and final params are compared
with the first system's: DDP + ZeRO computes the same sums in the same order as v2 off, recipe
(a) as DDP on 2 ranks (bitwise equal expected), FSDP2 reduces in its own way (about 1e-7 apart).

To add a system: one line in SYSTEMS, a builder `build(ctx, ledger, recorder, tid)` (ctx: a
`Context`) returning a run with `step(x, y) -> loss` and `params()` (full tensors, in the
layers' order).
"""
import contextlib
import statistics
import time
import warnings
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from relgrad_demo.job import PipelineRun, make_strategy, warm_up_then_measure
from relgrad_demo.lm import Corpus, lm_layers, lm_loss
from relgrad_demo.phases import PHASES
from relgrad_demo.report import quartiles, time_ratio
from relgrad import HybridCommunicateGroup
from comm_buffer import (HOOK_ACTION, FusedCommBuffer, assign_group_by_size, broadcast_buffers,
                         bw_hook_func)

_now = time.perf_counter_ns


class Context:
    """What every system's builder reads: `opts` (the peers' layout: sharding 2, v2, no
    pipeline, no dp; the LM without the tie and clipping), the topology `hcg`, `vocab`
    (size), `device`, and `mesh`, a 1-D device mesh of all ranks made on first use (making
    one per build would add a group each time)."""

    def __init__(self, opts, vocab, device):
        # Without the main job's tie and clipping: torch's clip_grad_norm_ sums the squares
        # in another order, so the systems could no longer agree bit for bit.
        self.opts = {**opts, "pp": 1, "sharding": 2, "dp": 1, "split_param": True,
                     "tie_and_clip": False}
        self.hcg = HybridCommunicateGroup(make_strategy(self.opts))
        self.vocab, self.device, self._mesh = vocab, device, None

    @property
    def mesh(self):
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh
            self._mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        return self._mesh


def _v2(mode, ctx, ledger, recorder, tid, **flags):
    """This repo's sharding v2 under release `mode` (job.MODES), one pipeline stage; `flags`
    override the CLI's for this system (e.g. a layout flag that make_strategy reads)."""
    opts = {**ctx.opts, **flags}
    return PipelineRun(make_strategy(opts, mode), ctx.hcg, opts, ctx.vocab, ctx.device, ledger,
                       recorder, tid)


class _TorchRun:
    """The LM as one nn.Sequential trained by a plain accumulation loop: micro-batch k runs
    forward and backward of `loss / micro_batches` (as PipelineParallel scales it), the grad
    sync only on the last one; then the optimizer steps and `zero_grad()` drops the grads
    (torch's default, set_to_none=True). `phase_marks()`: (perf_counter ns, bytes) at each
    of `phases.PHASES` in the latest step; None at "after collectives" (its collectives
    complete inside the last backward) unless `_sync()`, run after it, marks it."""

    def _mark(self, phase):
        self._marks[phase] = (_now(), self.ledger.now())

    def phase_marks(self):
        """(perf_counter ns, bytes) or None per `phases.PHASES`, in the latest step."""
        return self._marks

    def _layers(self, ctx):
        return [build() for build in lm_layers(ctx.vocab, ctx.opts, ctx.device)]

    def _train(self, x, y, no_sync):
        self._marks = [None] * len(PHASES)
        self._mark(0)
        acc, total = self.acc, torch.zeros((), device=x.device)
        for k, (xk, yk) in enumerate(zip(x.chunk(acc), y.chunk(acc))):
            with no_sync(k < acc - 1):
                t0 = _now()
                loss = lm_loss(self.model(xk), yk).float() / acc
                t1 = _now()
                if k == 0:
                    self._mark(1)
                loss.backward()
                if k == 0:
                    self._mark(2)
                self.recorder.span(f"F{k}", self.tid, t0, t1)
                self.recorder.span(f"B{k}", self.tid, t1, _now())
            total += loss.detach()
        self._mark(3)
        self._sync()
        with self.recorder.timed("optimizer step", self.tid):
            self.optimizer.step()
        self._mark(5)
        self._zero_grad()
        self._mark(6)
        return total

    def _sync(self):  # recipe (a): scale_grads()
        pass

    def _zero_grad(self):
        self.optimizer.zero_grad()


class DdpRun(_TorchRun):
    """torch's DistributedDataParallel over the default group with its defaults
    (gradient_as_bucket_view=False, broadcast_buffers=True) and plain AdamW."""

    def __init__(self, ctx, ledger, recorder, tid, bucket_view=False):
        from torch.nn.parallel import DistributedDataParallel
        self.acc, self.recorder, self.tid = ctx.opts["micro_batches"], recorder, tid
        self.ledger, self._marks = ledger, [None] * len(PHASES)
        self.model = DistributedDataParallel(nn.Sequential(*self._layers(ctx)),
                                             gradient_as_bucket_view=bucket_view)
        self.optimizer = self._optimizer(ctx)

    def _optimizer(self, ctx):
        return torch.optim.AdamW(self.model.parameters(), lr=ctx.opts["lr"], weight_decay=0.01)

    def step(self, x, y):
        """One step on a (batch, block) int64 batch; returns the loss (0-d fp32 tensor)."""
        return self._train(x, y, lambda skip: self.model.no_sync() if skip
                           else contextlib.nullcontext())

    def params(self):
        """The full params (each rank holds them all), in the layers' order."""
        return [p.detach() for p in self.model.module.parameters()]


class DdpZeroRun(DdpRun):
    """DdpRun with gradient_as_bucket_view=True and ZeroRedundancyOptimizer(AdamW): each
    rank steps its share of the params."""

    def __init__(self, ctx, ledger, recorder, tid):
        super().__init__(ctx, ledger, recorder, tid, bucket_view=True)

    def _optimizer(self, ctx):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return ZeroRedundancyOptimizer(
            self.model.parameters(), optimizer_class=torch.optim.AdamW, lr=ctx.opts["lr"],
            weight_decay=0.01)


class RecipeARun(_TorchRun):
    """The README's recipe (a): the params in FusedCommBuffer ALL_REDUCE buckets, each param
    hooked with `bw_hook_func`; per step broadcast_buffers, the micro-batches, scale_grads()
    ("after collectives"), AdamW, zero_grad(set_to_none=release), then release() if on."""

    def __init__(self, release, ctx, ledger, recorder, tid):
        self.acc, self.recorder, self.tid = ctx.opts["micro_batches"], recorder, tid
        self.ledger, self._marks, self.release = ledger, [None] * len(PHASES), release
        self.model = nn.Sequential(*self._layers(ctx))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=ctx.opts["lr"],
                                           weight_decay=0.01)
        buckets = assign_group_by_size(list(self.model.parameters()))
        self.buffers = [FusedCommBuffer(i, bucket, None, self.acc, HOOK_ACTION.ALL_REDUCE,
                                        release_grads=release) for i, bucket in buckets.items()]
        for buffer in self.buffers:  # the hooks hold the buffers weakly: self keeps them
            for p in buffer.params:
                p.register_post_accumulate_grad_hook(bw_hook_func(buffer, p))

    def step(self, x, y):
        """One step on a (batch, block) int64 batch; returns the loss (0-d fp32 tensor)."""
        broadcast_buffers(self.model, None)  # the LM has no module buffers: a no-op here
        return self._train(x, y, lambda skip: contextlib.nullcontext())

    def _sync(self):
        with self.recorder.timed("scale_grads", self.tid):
            for buffer in self.buffers:
                buffer.scale_grads()
        self._mark(4)

    def _zero_grad(self):
        self.optimizer.zero_grad(set_to_none=self.release)
        for buffer in self.buffers if self.release else ():
            buffer.release()

    def params(self):
        """The params (each rank holds them all), in the layers' order."""
        return [p.detach() for p in self.model.parameters()]


class Fsdp2Run(_TorchRun):
    """torch's FSDP2: `fully_shard` on every layer, then the root, over a 1-D mesh of all
    ranks; AdamW steps the sharded params (DTensors)."""

    def __init__(self, ctx, ledger, recorder, tid):
        from torch.distributed.fsdp import fully_shard
        # FSDP2 warns that a layer returns a view (an in-place op on it would skip its
        # backward hook); these layers' outputs are only read out of place.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
        self.acc, self.recorder, self.tid = ctx.opts["micro_batches"], recorder, tid
        self.ledger, self._marks = ledger, [None] * len(PHASES)
        layers = self._layers(ctx)
        self.model = nn.Sequential(*layers)
        for layer in layers:
            fully_shard(layer, mesh=ctx.mesh)
        fully_shard(self.model, mesh=ctx.mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=ctx.opts["lr"],
                                           weight_decay=0.01)

    def step(self, x, y):
        """One step on a (batch, block) int64 batch; returns the loss (0-d fp32 tensor)."""
        def sync(skip):
            self.model.set_requires_gradient_sync(not skip)
            return contextlib.nullcontext()
        return self._train(x, y, sync)

    def params(self):  # full_tensor() all-gathers: every rank calls it, in the same order
        return [p.detach().full_tensor() for p in self.model.parameters()]


# name -> builder; the first is the baseline the others are compared with.
SYSTEMS = {
    "v2 release off": partial(_v2, "off"),
    "v2 release on": partial(_v2, "on"),
    "DDP + ZeRO": DdpZeroRun,
    "FSDP2": Fsdp2Run,
}
# With --free-grads-in-comm: a fifth row, each bucket's unread part freed during backward.
FREE_SYSTEM = ("v2 release + free-in-comm", partial(_v2, "free"))
# With --dp (opts["dp"] 2): data parallel, no sharding; DDP is the baseline.
DP_SYSTEMS = {
    "DDP": DdpRun,
    "recipe (a) release off": partial(RecipeARun, False),
    "recipe (a) release on": partial(RecipeARun, True),
}


def systems(opts):
    """The systems `opts` asks for: DP_SYSTEMS with dp > 1, else SYSTEMS, plus FREE_SYSTEM
    when "free" is in its modes."""
    if opts.get("dp", 1) > 1:
        return dict(DP_SYSTEMS)
    chosen = dict(SYSTEMS)
    if "free" in opts.get("modes", ()):
        chosen[FREE_SYSTEM[0]] = FREE_SYSTEM[1]
    return chosen


def peers_job(rank, world_size, opts):
    """Per-rank body of `--peers` (2 ranks): every system in SYSTEMS, measured in turns.

    Returns {"rank", "runs": {system: measures}, "diff": {system: (max |loss diff|, max
    |param diff|) against the baseline, this rank}, "params" (elements), "trace"}.
    Raises ValueError unless world_size is 2.
    """
    if world_size != 2:
        raise ValueError(f"--peers runs on 2 processes (sharding 2 or dp 2), got {world_size}")
    device = torch.device(opts.get("device") or "cpu")
    corpus = Corpus(opts)
    ctx = Context(opts, len(corpus.vocab), device)
    builders = {name: partial(build, ctx) for name, build in systems(opts).items()}
    runs, measures, recorder = warm_up_then_measure(
        builders, opts["steps"], lambda step: corpus.batch(step, rank, world_size, device),
        device, opts.get("trace") is not None)
    base = next(iter(runs))
    base_params = runs[base].params()
    diff = {}
    for name, run in runs.items():
        losses = zip(measures[name]["losses"], measures[base]["losses"])
        diff[name] = (max(abs(a - b) for a, b in losses),
                      max(float((a - b).abs().max()) for a, b in zip(run.params(), base_params)))
    trace = (recorder.chrome_events(rank, f"rank {rank}", list(runs)) if recorder.enabled
             else None)
    return {"rank": rank, "runs": measures, "diff": diff, "trace": trace,
            "params": sum(p.numel() for p in base_params)}


def summarize(results, opts):
    """The `--peers --json` object:

        config    processes, layout, steps, micro_batches, micro_batch_size, model params,
                  grad_bytes (G: the whole model's fp32 grads, bytes), systems (names)
        baseline  the system the others are compared with ("v2 release off"; --dp: "DDP")
        systems   per system:
          idle_bytes_allocator  per rank: bytes the run holds between steps (median after
                                step 1), from the allocator, above the run's start
          peak_bytes            per rank: highest bytes during a step
          idle_G, peak_G        the largest rank's of the two, divided by G
          losses                per step, mean over the 2 data halves
          step_time_s, step_time_iqr_s   median and [q1, q3] of the slower rank's step time
          step_time_ratio       (not the baseline) per step over the baseline's, see
                                report.time_ratio
          loss_max_abs_diff, param_max_abs_diff   against the baseline, over steps and ranks
          bitwise_equal         both are 0
          step_trace            per rank: the last step's memory samples, as in the main
                                job's --json (report.py; for the torch systems the
                                phases are marked around their loop, "after collectives"
                                null but for recipe (a))
        plot      with --plot only, as in the main job's --json (report.py)
    """
    ranks = sorted(results, key=lambda r: r["rank"])
    steps = range(opts["steps"])
    after1 = slice(1, None) if opts["steps"] > 1 else slice(None)
    names = list(ranks[0]["runs"])
    grad_bytes = ranks[0]["params"] * 4
    times = {n: [max(r["runs"][n]["time"][s] for r in ranks) for s in steps] for n in names}
    systems = {}
    for name in names:
        ms = [r["runs"][name] for r in ranks]
        idle = [_median(m["idle"][after1]) for m in ms]
        peak = [None if None in m["peak"] else max(m["peak"]) for m in ms]
        q1, median, q3 = quartiles(times[name][after1])
        loss_diff = max(r["diff"][name][0] for r in ranks)
        param_diff = max(r["diff"][name][1] for r in ranks)
        systems[name] = {
            "idle_bytes_allocator": idle, "peak_bytes": peak,
            "idle_G": None if None in idle else max(idle) / grad_bytes,
            "peak_G": None if None in peak else max(peak) / grad_bytes,
            "losses": [sum(m["losses"][s] for m in ms) / len(ms) for s in steps],
            "step_time_s": median, "step_time_iqr_s": [q1, q3],
            "step_time_ratio": None if name == names[0] else time_ratio(
                times[name][after1], times[names[0]][after1], name, names[0]),
            "loss_max_abs_diff": loss_diff, "param_max_abs_diff": param_diff,
            "bitwise_equal": loss_diff == 0 and param_diff == 0,
            "step_trace": [m["step_trace"] for m in ms],
        }
    layout = "data parallel 2" if opts.get("dp", 1) > 1 else "sharding 2 without pipeline"
    config = {"processes": len(ranks), "layout": layout,
              "steps": opts["steps"], "micro_batches": opts["micro_batches"],
              "micro_batch_size": opts["micro_batch_size"], "params": ranks[0]["params"],
              "grad_bytes": grad_bytes, "systems": names}
    return {"config": config, "baseline": names[0], "systems": systems}


def _median(values):
    return None if None in values else int(statistics.median(values))


def print_report(summary, steps=True):
    """Print the per-step losses (if `steps`) and one line per system."""
    systems, base = summary["systems"], summary["baseline"]
    config = summary["config"]
    if steps:
        for s in range(config["steps"]):
            print(f"step {s + 1:3d}  loss " + "  ".join(
                f"{name} {v['losses'][s]:.6f}" for name, v in systems.items()))
    print(f"\npeers: the same LM ({config['params']:,} params) and data on {config['processes']} "
          f"processes, {config['layout']},\n{config['steps']} steps; G = the model's fp32 grad "
          f"bytes = {config['grad_bytes'] / 1024:,.1f} KiB; bytes: the allocator's, the larger "
          "rank's,\nabove each run's start; step time: per-step ratio to the baseline (runs in "
          "turns), median (middle half)")
    width = max(15, *map(len, systems))
    print(f"{'system':<{width}} | {'between steps':>13} | {'peak':>6} | {'step time':>16} | "
          f"vs {base}: loss, params")
    for name, v in systems.items():
        ratio = v["step_time_ratio"]
        time_text = ("1" if ratio is None else
                     f"{ratio['median']:.2f} ({ratio['iqr'][0]:.2f}-{ratio['iqr'][1]:.2f})")
        agree = ("-" if name == base else "bitwise equal" if v["bitwise_equal"] else
                 f"max |diff| {v['loss_max_abs_diff']:.1e}, {v['param_max_abs_diff']:.1e}")
        print(f"{name:<{width}} | {_g(v['idle_G']):>13} | {_g(v['peak_G']):>6} | {time_text:>16} | "
              f"{agree}")
    for name, v in systems.items():
        if v["step_time_ratio"] is not None:
            print(f"{name} step time: {v['step_time_ratio']['verdict']}")


def _g(value):
    return "n/a" if value is None else f"{value:.2f} G"
