"""The main job: train the LM once per release mode, the runs in turns, measuring each one.

Each rank builds one run per mode (`MODES`: release off, on), all alive at once, and trains them
in turns, step by step, in the order A B B A A B ... so that neither mode always runs first
while the machine's load drifts. Each run's bytes come from the allocator by difference
(`memory.Ledger`), so a run is not charged for the others. Per step and run it records the
loss, the bytes held between steps, our own count of grad bytes, the peak during the step, the
step's wall time and, for the latest step, the bytes at each phase boundary
(`phases.PHASES`); after every `--eval-every` steps, the peak of an eval pass (forward only, no
grad, a larger batch), where the bytes a run holds between steps decide the peak. The runs
see the same data and start from the same weights, so release off and on must end bitwise
equal.

To add a mode: one line in MODES (the config fields it sets) and one flag in relgrad.py that
appends its name to `opts["modes"]`. A layout rule (which overlap runs where) is one line in
`make_strategy`.
"""
import gc
import hashlib
import time
from functools import partial

import torch

from relgrad_demo.lm import Corpus, lm_layers, lm_loss, lm_shared_weights
from relgrad_demo.memory import Ledger, PeakSampler, allocator_in_use_bytes, live_grad_bytes
from relgrad_demo.phases import PipelineProbe, action_name, comm_buffers
from relgrad_demo.trace import Recorder
from relgrad_extras.grad_clip import ClipGradByGlobalNorm
from pipeline import PipelineParallel
from relgrad_extras.interleave import PipelineParallelWithInterleave
from relgrad import (DygraphShardingConfig, HybridCommunicateGroup, HybridStrategy, PpConfig)
from sharding import (DygraphShardingOptimizer, DygraphShardingOptimizerV2,
                      MixPrecisionOptimizer)

# Release modes: name -> the config fields ("section.field": value) the mode sets on top of
# the layout's strategy. The first mode is the baseline the others are compared with.
MODES = {
    "off": {},
    "on": {"pp_configs.release_gradients": True},
    "free": {"pp_configs.release_gradients": True, "sharding_configs.free_grads_in_comm": True},
}


def make_strategy(opts, mode="off"):
    """The HybridStrategy that runs for `opts` (the CLI's flags) and `mode`.

    Comm overlap is on only where Paddle allows it and `--overlap` asks for it: the
    pipeline's sharding overlap needs sharding > 1 and pp > 1; its dp overlap needs dp > 1,
    pp > 1 and no sharding (both at once is not allowed); without a pipeline (pp 1) sharding
    overlaps with its own hooks (sharding_configs.comm_overlap, accumulate_steps = the
    micro-batches). So `--pp 1 --sharding 1` runs without overlap whatever the flag says.
    `--vpp V` sets pp_configs.num_virtual_pipeline_stages.
    Raises ValueError (from the config classes) for a field value they reject.
    """
    pp, sharding, dp, overlap = opts["pp"], opts["sharding"], opts["dp"], opts["overlap"]
    fields = {"pp_configs": {"sharding_comm_overlap": overlap and sharding > 1 and pp > 1,
                             "dp_comm_overlap": overlap and sharding == 1 and dp > 1 and pp > 1,
                             "num_virtual_pipeline_stages": opts.get("vpp", 1)},
              "sharding_configs": {"split_param": opts["split_param"],
                                   "comm_overlap": overlap and sharding > 1 and pp == 1,
                                   "accumulate_steps": opts["micro_batches"],
                                   "comm_buffer_size_MB": opts.get("comm_buffer_mb")}}
    for key, value in MODES[mode].items():
        section, name = key.split(".")
        fields[section][name] = value
    strategy = HybridStrategy(
        dp_degree=dp, pp_degree=pp, sharding_degree=sharding,
        accumulate_steps=opts["micro_batches"], micro_batch_size=opts["micro_batch_size"],
        pp_configs=PpConfig(**fields["pp_configs"]),
        sharding_configs=DygraphShardingConfig(**fields["sharding_configs"]))
    return strategy


def build_optimizer(model, strategy, hcg, opts, grad_clip=None):
    """AdamW over the stage's params, wrapped by sharding v1 / v2 (sharding > 1; they clip
    with `grad_clip`) or, for --main-grad without sharding, by MixPrecisionOptimizer."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=opts["lr"], weight_decay=0.01)
    if strategy.sharding_degree > 1:
        cls = DygraphShardingOptimizerV2 if opts["split_param"] else DygraphShardingOptimizer
        return cls(optimizer, hcg, strategy, grad_clip=grad_clip)
    if opts["main_grad"]:
        return MixPrecisionOptimizer(optimizer)
    return optimizer


class PipelineRun:
    """This repo's system: PipelineParallel over the LM with `build_optimizer`'s optimizer.

    The LM ties its embedding and head (`lm_shared_weights`) and clips at global norm 1.0,
    unless `opts["tie_and_clip"]` is False (--peers, whose torch systems clip otherwise).
    `step(x, y)` runs `train_batch` on a (micro_batch_size * micro_batches, block) int64 batch
    and returns the loss; `phase_bytes()`, `counted_grad_bytes()`, `grad_norm()` and
    `buffers()` describe it.
    """

    def __init__(self, strategy, hcg, opts, vocab, device, ledger, recorder, tid):
        tie_and_clip = opts.get("tie_and_clip", True)
        self.strategy = strategy
        self.grad_clip = ClipGradByGlobalNorm(1.0) if tie_and_clip else None
        cls = (PipelineParallelWithInterleave
               if strategy.pp_configs.num_virtual_pipeline_stages > 1 else PipelineParallel)
        self.model = cls(lm_layers(vocab, opts, device), hcg, strategy, lm_loss,
                         shared_weights=lm_shared_weights(opts) if tie_and_clip else None)
        self.optimizer = build_optimizer(self.model, strategy, hcg, opts, self.grad_clip)
        self.probe = PipelineProbe(self.model, self.optimizer, ledger, recorder, tid)

    def step(self, x, y):
        """One `train_batch`; returns the loss (0-d fp32 tensor, mean over micro-batches)."""
        self.probe.start_step()
        sharded = self.strategy.sharding_degree > 1  # then the sharding optimizer clips
        return self.model.train_batch((x, y), self.optimizer,
                                      grad_clip=None if sharded else self.grad_clip)

    def eval(self, x, y):
        """Forward only, no grad (`eval_batch`), on a batch larger than a training one
        (`accumulate_steps` micro-batches of any equal size); returns the loss."""
        saved = self.model.micro_batch_size
        self.model.micro_batch_size = None  # batch / accumulate_steps per micro-batch
        self.model.eval()  # eval_batch leaves the modes as set, as torch's schedules do
        try:
            return self.model.eval_batch((x, y))
        finally:
            self.model.micro_batch_size = saved
            self.model.train()

    def grad_norm(self):
        """The global grad norm before clipping in the latest step (float; None: no clip)."""
        return None if self.grad_clip is None else float(self.grad_clip.global_norm)

    def phase_bytes(self):
        """This run's bytes at each of `phases.PHASES` in the latest step (None: no such)."""
        return self.probe.bytes

    def phase_marks(self):
        """(perf_counter ns, bytes) at each of `phases.PHASES` in the latest step, or None."""
        return [None if t is None else (t, b) for t, b in zip(self.probe.times,
                                                              self.probe.bytes)]

    def buffer_marks(self):
        """(perf_counter ns, bytes the fused grad buffers hold) at the latest step's start and
        at each change since (a buffer allocated or freed)."""
        return list(self.probe.buffer_log)

    def counted_grad_bytes(self):
        """Bytes of the grad storages alive now, by our count (`live_grad_bytes`)."""
        return live_grad_bytes(self.model, self.optimizer,
                               comm_buffers(self.model, self.optimizer))

    def params(self):
        """This stage's params (detached, not copied), in the layers' order."""
        return [p.detach() for p in self.model.parameters()]

    def buffers(self):
        """Each fused grad buffer: who built it, its collective, params and bytes (when
        allocated; with release they exist only from the first backward to the step's end)."""
        own = set(map(id, self.optimizer.comm_buffers
                      if hasattr(self.optimizer, "comm_buffers") else []))
        pipeline = {id(b) for bs in self.model._chunk_2_comm_buffers.values() for b in bs}
        out = []
        for b in comm_buffers(self.model, self.optimizer):
            dtype = torch.float32 if b.use_main_grad else b.params[0].dtype
            out.append({"owner": "pipeline" if id(b) in pipeline else
                        "sharding" if id(b) in own else "?",
                        "action": action_name(b), "params": len(b.params),
                        "bytes": b.buffer_size * dtype.itemsize})
        return out


def measure(builders, steps, batch, device, recorder, eval_batch=None, eval_every=0):
    """Build every run, then train them in turns for `steps` steps; return (runs, measures).

    With `eval_every` N > 0 and `eval_batch(step)` -> (x, y), after every N-th step each run
    also runs `eval(x, y)` (forward only, no grad, a larger batch, as the seed's "every
    forward, eval and checkpoint" puts it), measured as a step is: `eval_peak` (bytes, per
    eval) and `eval_idle` (bytes held right before it).

    `builders`: name -> `build(ledger, recorder, tid)` returning a run with `step(x, y)`
    (returns the loss), `params()`, and optionally `phase_bytes()`, `phase_marks()`,
    `counted_grad_bytes()`, `grad_norm()`.
    `batch(step)` -> (x, y), the same for every run. Measures per run: per step `losses`,
    `grad_norms` (before clipping, or None), `idle` (bytes held right after the step,
    garbage collected), `counted` (grad bytes by our count), `peak` (bytes), `time`
    (seconds); `phases` of the latest step; `built` (bytes after the build); `step_trace`,
    the last step's samples (`step_trace` below). Bytes are the run's own, above what was in
    use before its build.
    """
    runs, ledgers, out = {}, {}, {}
    for tid, (name, build) in enumerate(builders.items()):
        ledgers[name] = ledger = Ledger(device)
        ledger.begin()
        runs[name] = build(ledger, recorder, tid)
        out[name] = {"built": ledger.end(), "losses": [], "grad_norms": [], "idle": [],
                     "counted": [], "peak": [], "peak_phase": [], "peak_reserved": [],
                     "time": [], "phases": None, "eval_peak": [], "eval_idle": [],
                     "step_trace": None}
    names = list(runs)
    for step in range(steps):
        x, y = batch(step)
        for name in names if step % 2 == 0 else names[::-1]:  # A B, then B A
            run, ledger, m = runs[name], ledgers[name], out[name]
            ledger.begin()
            probe = getattr(run, "probe", None)
            phase_of = (lambda probe=probe: probe.phase) if probe is not None else None
            samples = [] if step == steps - 1 else None  # the last step's, for --plot
            with PeakSampler(ledger, recorder, phase_of, samples) as peak:
                t0 = time.perf_counter_ns()
                loss = float(run.step(x, y))  # float(): waits for the device
                t1 = time.perf_counter_ns()
            m["idle"].append(ledger.end())
            if samples is not None:
                samples.append((time.perf_counter_ns() - peak.t0, m["idle"][-1]))
                marks = run.phase_marks() if hasattr(run, "phase_marks") else None
                held = run.buffer_marks() if hasattr(run, "buffer_marks") else None
                if marks is not None and eval_batch is not None:  # the picture's eval phase
                    marks += _trace_eval(run, ledger, eval_batch(step), samples, peak.t0)
                m["step_trace"] = step_trace(samples, peak.t0, marks, held)
            recorder.counter(time.perf_counter_ns(), allocator_in_use_bytes(device) or 0)
            recorder.span(f"step {step + 1}", names.index(name), t0, t1)
            m["losses"].append(loss)
            m["grad_norms"].append(run.grad_norm() if hasattr(run, "grad_norm") else None)
            m["time"].append((t1 - t0) / 1e9)
            m["peak"].append(peak.peak)
            m["peak_phase"].append(peak.phase)
            m["peak_reserved"].append(peak.reserved_peak)
            m["counted"].append(run.counted_grad_bytes()
                                if hasattr(run, "counted_grad_bytes") else None)
            if hasattr(run, "phase_bytes"):
                m["phases"] = run.phase_bytes()
        if eval_every and step % eval_every == eval_every - 1:
            x, y = eval_batch(step)
            for name in names if step % 2 == 0 else names[::-1]:
                run, ledger, m = runs[name], ledgers[name], out[name]
                m["eval_idle"].append(ledger.held)
                ledger.begin()
                with PeakSampler(ledger) as peak:
                    float(run.eval(x, y))
                ledger.end()
                m["eval_peak"].append(peak.peak)
    return runs, out


def _trace_eval(run, ledger, batch, samples, t0):
    """After the last step, for the picture only (not in `eval_peak`): an eval pass sampled
    into `samples` (ns since `t0`); returns its two boundary marks (eval start, after eval)."""
    ledger.begin()
    more = []
    with PeakSampler(ledger, samples=more) as peak:
        float(run.eval(*batch))
    ledger.end()
    samples += [(t + peak.t0 - t0, b) for t, b in more]
    return [(peak.t0 + more[0][0], more[0][1]), (peak.t0 + more[-1][0], more[-1][1])]


def step_trace(samples, t0, marks=None, held=None):
    """One step's memory as `--plot` draws it and `--json` holds it: {"t_ms": [...], "bytes":
    [...], "phases": [[t_ms, bytes] or None per `phases.PHASES` (+ "eval start", "after
    eval")] or None, "buffer": [[t_ms, bytes]] or None}.

    `samples`: (ns since `t0`, bytes) from `PeakSampler`, the first as the step began, the
    next every 0.5 ms (CPU), then after the step, garbage collected (the bytes held between
    steps), then an eval pass's; `marks`: (perf_counter ns, bytes) per phase boundary, or
    None; each is also a sample (so a mark sits on the line); `held`: (perf_counter ns,
    bytes the fused grad buffers hold) at the step's start and at each change.
    """
    phases = None if marks is None else [
        None if mark is None else [(mark[0] - t0) / 1e6, mark[1]] for mark in marks]
    points = sorted(set([(t / 1e6, b) for t, b in samples]
                        + [tuple(p) for p in phases or () if p is not None]))
    return {"t_ms": [t for t, _ in points], "bytes": [b for _, b in points], "phases": phases,
            "buffer": None if held is None else [[(t - t0) / 1e6, b] for t, b in held]}


def warm_up_then_measure(builders, steps, batch, device, trace, eval_batch=None,
                         eval_every=0):
    """`measure` after two discarded one-step rounds of the same runs (each with an eval, if
    `eval_every`); returns the same.

    A process's first runs keep tens of MB for good (gloo pairs, autograd and kernel state)
    and its second some 30 KB more: the warm-up rounds keep that out of the measured runs.
    The objects alive before the warm-up, then those alive after it, are frozen out of the
    garbage collector, which each measurement runs (a full collection over torch's objects
    costs ~0.1 s; the frozen ones are not collected, the runs' own garbage still is).
    """
    import torch._dynamo  # noqa: F401 (torch.optim imports it at the first optimizer built;
    # imported here, its objects are frozen with torch's before the warm-up's collections)
    gc.collect()
    gc.freeze()
    try:
        for _ in range(2):
            measure(builders, 1, batch, device, Recorder(False), eval_batch, min(eval_every, 1))
        gc.collect()
        gc.freeze()
        recorder = Recorder(trace)
        runs, measures = measure(builders, steps, batch, device, recorder, eval_batch,
                                 eval_every)
    finally:
        gc.unfreeze()
    return runs, measures, recorder


def train_job(rank, world_size, opts):
    """Per-rank body of the main job: one PipelineRun per mode in `opts["modes"]`, measured.

    Returns this rank's {"rank", "stage", "runs": {mode: measures + "buffers" +
    "param_sha256"}, "equal": {mode: losses and final params bitwise equal to the
    baseline's}, "trace": Chrome events or None, "vocab", "stage_params" (elements, a tied
    weight's later copy left out),
    "optimizer" (its name)}.
    """
    device = torch.device(opts.get("device") or "cpu")
    corpus = Corpus(opts)
    hcg = HybridCommunicateGroup(make_strategy(opts))
    replicas = opts["dp"] * opts["sharding"]
    replica = hcg.get_data_parallel_rank() * opts["sharding"] + hcg.get_sharding_parallel_rank()
    builders = {mode: partial(PipelineRun, make_strategy(opts, mode), hcg, opts,
                              len(corpus.vocab), device) for mode in opts["modes"]}
    runs, measures, recorder = warm_up_then_measure(
        builders, opts["steps"], lambda step: corpus.batch(step, replica, replicas, device),
        device, opts.get("trace") is not None, partial(_eval_batch, corpus, replica, replicas,
                                                        device), opts.get("eval_every", 0))
    base = opts["modes"][0]
    equal = {mode: measures[mode]["losses"] == measures[base]["losses"]
             and measures[mode]["grad_norms"] == measures[base]["grad_norms"]
             and all(torch.equal(a, b) for a, b in zip(runs[mode].params(), runs[base].params()))
             for mode in runs}
    for mode, run in runs.items():
        measures[mode]["buffers"] = run.buffers()
        measures[mode]["param_sha256"] = params_sha256(run.params())
    stage, first = hcg.get_stage_id(), runs[base]
    trace = (recorder.chrome_events(rank, f"rank {rank} (stage {stage})",
                                    [f"release {m}" for m in runs]) if recorder.enabled else None)
    return {"rank": rank, "stage": stage, "runs": measures, "equal": equal, "trace": trace,
            "vocab": len(corpus.vocab),
            # a tied weight's later copies (is_firstly_shared False) are not counted: with
            # pp > 1 the first and last stage both hold the embedding / head tie
            "stage_params": sum(p.numel() for p in first.model.parameters()
                                if getattr(p, "is_firstly_shared", True)),
            "optimizer": optimizer_name(first.optimizer)}


def params_sha256(params):
    """Hex SHA-256 of the params' bytes in order: equal iff the params are bitwise equal."""
    digest = hashlib.sha256()
    for p in params:
        digest.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


EVAL_BATCHES = 4  # an eval batch is this many training batches


def _eval_batch(corpus, replica, replicas, device, step):
    """A held-out-seeded batch EVAL_BATCHES times a training batch: (x, y) int64."""
    parts = [corpus.batch(10**6 + step * EVAL_BATCHES + k, replica, replicas, device)
             for k in range(EVAL_BATCHES)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def optimizer_name(optimizer):
    """E.g. 'DygraphShardingOptimizer(AdamW)': the wrapper and the torch optimizer it steps."""
    inner = getattr(optimizer, "_inner_opt", None)
    while getattr(inner, "_inner_opt", None) is not None:  # v1 / v2 wrap MixPrecisionOptimizer
        inner = inner._inner_opt
    name = type(optimizer).__name__
    return name if inner is None else f"{name}({type(inner).__name__})"
