"""relgrad: Paddle's `release_gradients` (PR #59739) in torch: config, topology, launcher, CLI.

Mirrors the `PpConfig` / `DygraphShardingConfig` messages of
`paddle/fluid/framework/distributed_strategy.proto` and `HybridCommunicateGroup` of
`python/paddle/distributed/fleet/base/topology.py` at commit 9b40c67f672f.

`python relgrad.py` is the main job: it starts pp x sharding x dp local processes that train a
small character-level LM on real text (this repo's own files) once per release mode, off and
on, same seed and data, and prints what each run held between steps and during one step, the
step times and whether the runs are bitwise equal (`--peers`: the same LM under torch's DDP +
ZeroRedundancyOptimizer and FSDP2 beside this repo's sharding v2; `--walkthrough`: the life of
the fused grad buffers on a tiny model, event by event). Under `torchrun` it joins
that job instead (nccl on GPUs, gloo otherwise). The job itself lives in `relgrad_demo/`; the
launcher here also serves the tests.

Leaves out: mp / sep axes.

References: Paddle PRs #59739, #64517; PaddleNLP PR #7594 (`enable_release_grads`).
"""
import argparse
import json
import os
import pickle
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# ---- config: field names as in Paddle's distributed_strategy.proto ----

def _require(ok, message):
    if not ok:
        raise ValueError(message)


@dataclass
class PpConfig:
    """Paddle's `PpConfig` message; the proto field numbers are in the comments."""

    dp_comm_overlap: bool = False  # 1: dp grads in fused buffers, all-reduced during backward
    delay_scale_loss: bool = False  # 2: scale grads by 1/micro-batches before the step
    enable_timer: bool = False  # 3: Paddle's pipeline timers; not implemented, must be False
    sharding_comm_overlap: bool = False  # 4: sharding reduce(-scatter) during backward
    profiling: bool = False  # 5: Paddle's profiler hooks; not implemented, must be False
    # Seed hunk: field 6. The fused grad buffers (the pipeline's with dp / sharding comm
    # overlap; without a pipeline, v1 / v2's own) are allocated at a step's first grad check-in
    # and freed after its optimizer step. The one switch under a pipeline; without one,
    # sharding_configs.release_gradients does the same (the two are ORed for the sharding
    # optimizers' own buffers; the pipeline's buffers read this flag alone).
    release_gradients: bool = False
    # Not a proto field: Paddle passes it to `PipelineLayer(num_virtual_pipeline_stages=V)`
    # (read back by `get_num_virtual_stages()`); our pipeline takes a plain layer list, so the
    # strategy carries it. V > 1: model chunks per rank, for PipelineParallelWithInterleave.
    num_virtual_pipeline_stages: int = 1

    def __post_init__(self):
        for name in ("enable_timer", "profiling"):
            _require(not getattr(self, name), f"pp_configs.{name} is not implemented in "
                     "relgrad; leave it False")
        v = self.num_virtual_pipeline_stages
        _require(isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                 f"pp_configs.num_virtual_pipeline_stages must be an int >= 1 (model chunks "
                 f"per pipeline rank; 1 = plain 1F1B), got {v!r}")


@dataclass
class DygraphShardingConfig:
    """Paddle's `DygraphShardingConfig` message (the fields this reference uses)."""

    split_param: bool = False  # sharding v2: flat param shards (DygraphShardingOptimizerV2)
    # Backward passes (micro-batches) per step for v1 / v2's own buffers with comm_overlap (no
    # pipeline): a bucket's collective fires at its params' last check-in. Not
    # HybridStrategy.accumulate_steps, which is the pipeline's micro-batch count.
    accumulate_steps: int = 1
    comm_overlap: bool = False  # sharding's own tensor-fusion overlap (hooks, no pipeline)
    # [later] field 8, PR #64517: ORed with pp_configs.release_gradients for the sharding
    # optimizers' own buffers; either one switches release on without a pipeline. Under
    # pp_configs.sharding_comm_overlap the buffers are the pipeline's and follow the PP flag.
    release_gradients: bool = False
    # [later] PaddleNLP #9081: free what a rank will not read once its bucket is reduced
    # (v2: all but its shard; v1: a non-owner's grads); needs release
    free_grads_in_comm: bool = False
    # [later] Paddle's field (proto default 256): MB per fused grad buffer (bucket) of
    # sharding, read where Paddle reads it (v2's _build_comm_buffers; here also v1's own
    # comm_overlap buffers). None = not set: sharding's own buffers take Paddle's 256 MB and
    # the pipeline's sharding buffers keep its fixed 128 MB (Paddle's pipeline does not read
    # the field; here it does when the field is set). The pipeline's dp buffers keep 128 MB.
    comm_buffer_size_MB: int = None

    def __post_init__(self):
        _require(self.accumulate_steps >= 1, "sharding_configs.accumulate_steps must be >= 1, "
                 f"got {self.accumulate_steps}")
        mb = self.comm_buffer_size_MB
        _require(mb is None or (isinstance(mb, int) and not isinstance(mb, bool) and mb > 0),
                 "sharding_configs.comm_buffer_size_MB must be a positive int (MB per fused "
                 f"grad buffer; Paddle's default 256), got {mb!r}; pass e.g. 256, or None "
                 "for the defaults")

    def comm_buffer_bytes(self, default_MB=256):
        """Bytes per fused grad buffer: `comm_buffer_size_MB` MB if set, else `default_MB` MB
        (256: sharding's own buffers, Paddle's default; the pipeline passes its 128)."""
        mb = default_MB if self.comm_buffer_size_MB is None else self.comm_buffer_size_MB
        return mb * 1024 * 1024


@dataclass
class HybridStrategy:
    """Paddle's `DistributedStrategy.hybrid_configs` plus `pipeline_configs`, flattened.

    Raises ValueError for a degree or accumulate_steps < 1, micro_batch_size < 1,
    sharding_configs.free_grads_in_comm without release, or sharding_configs.comm_overlap
    with a pipeline.
    """

    dp_degree: int = 1  # data-parallel replicas (outermost axis of the rank grid)
    pp_degree: int = 1  # pipeline stages
    sharding_degree: int = 1  # ZeRO-1 shards (innermost axis)
    # pipeline_configs.accumulate_steps: micro-batches per train_batch (the pipeline divides
    # each micro-batch's loss by it). Sharding's own overlap reads
    # sharding_configs.accumulate_steps instead.
    accumulate_steps: int = 1
    micro_batch_size: int = None  # pipeline_configs.micro_batch_size; None: batch / acc
    pp_configs: PpConfig = field(default_factory=PpConfig)
    sharding_configs: DygraphShardingConfig = field(default_factory=DygraphShardingConfig)

    def __post_init__(self):
        for name in ("dp_degree", "pp_degree", "sharding_degree", "accumulate_steps"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 1,
                     f"{name} must be an int >= 1, got {value!r}")
        _require(self.micro_batch_size is None or self.micro_batch_size >= 1,
                 f"micro_batch_size must be None or >= 1, got {self.micro_batch_size!r}")
        pp, sd = self.pp_configs, self.sharding_configs
        released = pp.release_gradients or (sd.release_gradients and not pp.sharding_comm_overlap)
        _require(released or not sd.free_grads_in_comm, "sharding_configs.free_grads_in_comm "
                 "needs release: turn on pp_configs.release_gradients (or, without "
                 "pp_configs.sharding_comm_overlap, sharding_configs.release_gradients)")
        _require(not (sd.comm_overlap and (pp.sharding_comm_overlap or self.pp_degree > 1)),
                 "sharding_configs.comm_overlap is sharding's own overlap without a pipeline; "
                 f"got pp_degree={self.pp_degree}, pp_configs.sharding_comm_overlap="
                 f"{pp.sharding_comm_overlap}: use pp_configs.sharding_comm_overlap instead")

    @property
    def hybrid_configs(self):
        """Dict view, so code reads as Paddle's: `strategy.hybrid_configs["pp_configs"]`."""
        return {"dp_degree": self.dp_degree, "pp_degree": self.pp_degree,
                "sharding_degree": self.sharding_degree, "pp_configs": self.pp_configs,
                "sharding_configs": self.sharding_configs}

    def check_world_size(self, world_size):
        """Raise ValueError unless the degrees multiply to `world_size` (ranks)."""
        product = self.dp_degree * self.pp_degree * self.sharding_degree
        _require(product == world_size, f"dp_degree * pp_degree * sharding_degree = {product} "
                 f"({self.dp_degree} * {self.pp_degree} * {self.sharding_degree}) must equal "
                 f"the world size {world_size}; change the degrees or the number of ranks")


# ---- topology ----

class HybridCommunicateGroup:
    """The dp x pp x sharding rank grid and its process groups (Paddle's HybridCommunicateGroup).

    Paddle's default axis order, dp outermost and sharding innermost (mp = sep = 1 here):
    `rank = (dp_index * pp_degree + stage) * sharding_degree + sharding_index`. dp 2, pp 2,
    sharding 2:

        rank       0 1 2 3 4 5 6 7      sharding groups {0,1} {2,3} {4,5} {6,7}
        dp index   0 0 0 0 1 1 1 1      pipe groups     {0,2} {1,3} {4,6} {5,7}
        stage      0 0 1 1 0 0 1 1      dp groups       {0,4} {1,5} {2,6} {3,7}
        sharding   0 1 0 1 0 1 0 1

    Needs an initialised default process group; every rank creates every group, in order.
    `timeout` (a timedelta) bounds each collective and p2p wait on the groups; None: the
    default group's (torch's `new_group` would otherwise give its own default, 30 min, so a
    stage waiting for a failed one would outlive the timeout the job was started with).
    Raises ValueError if the degrees do not multiply to the world size.
    """

    def __init__(self, strategy, timeout=None):
        world, rank = dist.get_world_size(), dist.get_rank()
        if timeout is None:
            timeout = _default_group_timeout()
        strategy.check_world_size(world)
        shape = (strategy.dp_degree, strategy.pp_degree, strategy.sharding_degree)
        grid = torch.arange(world).reshape(shape)
        self._rank = rank
        self._coord = [int(c) for c in (grid == rank).nonzero()[0]]
        self._groups = []  # (group, global ranks) of this rank along dp, pp, sharding
        for axis, size in enumerate(shape):
            for ranks in grid.movedim(axis, -1).reshape(-1, size).tolist():
                group = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    self._groups.append((group, ranks))

    def get_global_rank(self):
        """This rank in the default group."""
        return self._rank

    def get_data_parallel_rank(self):
        """This rank's index along dp."""
        return self._coord[0]

    def get_data_parallel_world_size(self):
        """dp_degree."""
        return len(self._groups[0][1])

    def get_data_parallel_group(self):
        """The process group of this rank's dp replicas."""
        return self._groups[0][0]

    def get_stage_id(self):
        """This rank's pipeline stage."""
        return self._coord[1]

    def get_pipe_parallel_world_size(self):
        """pp_degree."""
        return len(self._groups[1][1])

    def get_pipe_parallel_group(self):
        """The process group of this rank's pipe (one rank per stage)."""
        return self._groups[1][0]

    def get_rank_from_stage(self, stage_id):
        """Global rank of `stage_id` in this rank's pipe."""
        return self._groups[1][1][stage_id]

    def get_sharding_parallel_rank(self):
        """This rank's index in its sharding group."""
        return self._coord[2]

    def get_sharding_parallel_world_size(self):
        """sharding_degree."""
        return len(self._groups[2][1])

    def get_sharding_parallel_group(self):
        """The process group that shares one optimizer state."""
        return self._groups[2][0]


def _default_group_timeout():
    """The timeout the default group was initialised with, read for the device its backend
    serves (an NCCL-only group has no CPU backend), else torch's default for that backend."""
    from comm_buffer import group_timeout
    return group_timeout(None)


# ---- launcher ----

# On Linux, ranks fork from a server process that imports torch, and torch._dynamo (which
# torch.optim imports at the first optimizer built), once for all of them: each rank would
# otherwise spend ~2 s of CPU importing them. Elsewhere they are spawned, each importing them
# (Windows has no fork; on macOS a fork after system frameworks loaded is not safe).
_START_METHOD = "forkserver" if sys.platform.startswith("linux") else "spawn"
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]


def launch(fn, world_size, args=(), timeout=300.0):
    """Run `fn(rank, world_size, *args)` on `world_size` local gloo ranks; return their results.

    Ranks are started with torch.multiprocessing (`_START_METHOD`) and meet at a TCPStore
    that this process holds on 127.0.0.1, on a port the OS picks. `fn` must be importable and
    its results picklable; the list of results is indexed by rank. If a rank raises, torch
    terminates the others and raises ProcessRaisedException carrying that rank's traceback; if
    the ranks are not done after `timeout` seconds, all are killed and TimeoutError is raised.
    """
    if _START_METHOD == "forkserver":
        mp.set_forkserver_preload(_PRELOAD)  # no effect once this process's server runs
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _rank_entry, args=(fn, world_size, store.port, args, out_dir, timeout),
            nprocs=world_size, join=False, start_method=_START_METHOD)
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(0.05, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size} ranks of {fn.__name__} still running "
                                       f"after {timeout:.0f} s; killed them all")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        results = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results


def _quiet_flight_recorder():
    # c10d's flight recorder keeps ~1.4 KB for each of the last 2000 collectives: it would
    # show up in the allocator's figures as growth, so it is off unless asked for.
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "0")


def _rank_entry(rank, fn, world_size, port, args, out_dir, timeout):
    torch.set_num_threads(1)  # ranks share this machine's cores
    _quiet_flight_recorder()
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                          timeout=timedelta(seconds=timeout))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout))
    result = fn(rank, world_size, *args)
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    # Every rank done before any tears down: a rank that exits while a peer's gloo threads
    # still serve a subgroup's pairs can abort ("terminate called without an active
    # exception"), seen here about once in ten runs without this barrier.
    dist.barrier()
    dist.destroy_process_group()


# ---- the command line: the main job ----

_DESCRIPTION = """\
The main job: start pp x sharding x dp local processes (gloo ranks on 127.0.0.1; under torchrun,
join its job instead) that train a small character-level transformer LM on this repo's own
text, once per release mode (release_gradients off, on), the runs in turns step by step, same
seed and data. Prints each step's loss, what ran (strategy, fused grad buffers per rank),
per rank the bytes each run holds between steps and at its peak (from the allocator), where
the memory goes within one step, the step times (median and spread, off vs on), and whether
the runs are bitwise equal. --peers instead trains the same LM under this repo's sharding v2
and torch's DDP + ZeroRedundancyOptimizer and FSDP2 (2 processes) and compares them."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where there is none to show (None)."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action, argparse._AppendConstAction):
            return action.help  # an append_const's default is the list it appends to
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """argparse, with an error as one line (status 2) instead of the usage block and a line."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (relgrad.py --help lists the flags)\n")


def parse_args(argv=None):
    """Parse and check the flags (argparse errors exit with status 2); returns (args, opts).

    `opts` is the dict of flags the ranks read; `opts["modes"]` lists the release modes to
    run (demo.job.MODES), baseline first. A new mode takes one flag here, e.g.
    `p.add_argument("--x", dest="modes", action="append_const", const="x", help=...)`.
    """
    p = _Parser(prog="relgrad.py", description=_DESCRIPTION,
                formatter_class=_HelpFormatter)
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (pp_degree)")
    p.add_argument("--sharding", type=int, default=2, help="ZeRO-1 shards (sharding_degree)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas (dp_degree)")
    p.add_argument("--split-param", action="store_true",
                   help="sharding v2 (flat param shards, reduce-scatter) instead of v1")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="comm overlap where the layout allows it: the pipeline's sharding "
                   "overlap with sharding > 1 and pp > 1, its dp overlap with dp > 1, pp > 1, "
                   "sharding 1; sharding's own overlap with sharding > 1 and pp 1")
    p.add_argument("--vpp", type=int, default=1,
                   help="virtual pipeline stages per rank (interleaved 1F1B when > 1)")
    p.add_argument("--free-grads-in-comm", dest="modes", action="append_const", const="free",
                   help="also run release on + sharding_configs.free_grads_in_comm (a third "
                   "mode, and a fifth row of the peers table): what a rank will not read is "
                   "freed right after its bucket's collective, during backward")
    p.add_argument("--comm-buffer-mb", type=int, metavar="MB",
                   help="sharding_configs.comm_buffer_size_MB: MB per fused grad buffer "
                   "(bucket) of sharding (default: Paddle's 256 for sharding's own buffers, "
                   "128 for the pipeline's)")
    p.add_argument("--eval-every", type=int, default=5, metavar="N",
                   help="the main job: after every N-th step an eval pass (forward only, no "
                   "grad, a batch 4 times a training one); 0: none")
    p.add_argument("--main-grad", action="store_true", help="bf16 params, fp32 main grads")
    p.add_argument("--steps", type=int, default=30, help="training steps per run")
    p.add_argument("--micro-batches", type=int, default=4,
                   help="micro-batches per step (accumulate_steps)")
    p.add_argument("--micro-batch-size", type=int, default=4,
                   help="sequences per micro-batch and data replica")
    p.add_argument("--block", type=int, default=64, help="sequence length, characters")
    p.add_argument("--d-model", type=int, default=64, help="model width (4 attention heads)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    p.add_argument("--data", metavar="FILE",
                   help="a text file to train on (default: this repo's sources and README)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds before the local processes are killed; under torchrun, "
                        "the process group's timeout (each collective and p2p wait)")
    p.add_argument("--peers", action="store_true",
                   help="compare with torch's DDP + ZeroRedundancyOptimizer and FSDP2 instead: "
                   "sharding 2 without pipeline, 2 processes")
    p.add_argument("--walkthrough", nargs="?", const="all", choices=("all", "v2", "v1", "dp"),
                   help="instead, narrate the life of the fused grad buffers on a tiny model, "
                   "event by event, each tagged with the function that makes it happen: v2 "
                   "(sharding v2 alone, 2 processes), v1 (pipeline 2 x sharding 2, 4), dp "
                   "(pipeline 2 x dp 2, 4), or all three (no value)")
    p.add_argument("--trace", metavar="FILE",
                   help="also write a Chrome trace (Perfetto, chrome://tracing) of the runs")
    p.add_argument("--plot", metavar="FILE",
                   help="also draw one step's memory per rank (the last step; release off vs "
                   "on, or the --peers systems) into FILE, PNG or SVG by its suffix "
                   "(matplotlib); the values drawn are each run's step_trace in --json")
    p.add_argument("--quiet", action="store_true", help="no per-step lines")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object only (schema: relgrad_demo/report.py, "
                   "relgrad_demo/peers.py)")
    p.set_defaults(modes=["off", "on"])
    args = p.parse_args(argv)
    for flag in ("pp", "sharding", "dp", "steps", "micro_batches", "micro_batch_size", "layers"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not 1 <= args.block <= 1024:
        p.error(f"--block must be between 1 and 1024 characters, got {args.block}")
    if args.d_model < 4 or args.d_model % 4:
        p.error(f"--d-model must be a multiple of the 4 attention heads, got {args.d_model}")
    if args.comm_buffer_mb is not None and args.comm_buffer_mb < 1:
        p.error(f"--comm-buffer-mb must be >= 1 (MB per bucket), got {args.comm_buffer_mb}")
    if args.eval_every < 0:
        p.error(f"--eval-every must be >= 0 (0: no eval), got {args.eval_every}")
    if args.vpp < 1:
        p.error(f"--vpp must be >= 1, got {args.vpp}")
    if args.pp * args.vpp > args.layers + 2:
        p.error(f"--pp {args.pp} x --vpp {args.vpp} chunks exceed the {args.layers + 2} "
                "layers; add --layers")
    if args.vpp > 1 and (args.pp < 2 or args.micro_batches % args.pp):
        p.error(f"--vpp {args.vpp} needs --pp >= 2 and --micro-batches a multiple of --pp; "
                f"got --pp {args.pp} --micro-batches {args.micro_batches}")
    if "free" in args.modes and args.sharding < 2:
        p.error("--free-grads-in-comm frees what a sharding rank will not read: it needs "
                f"--sharding >= 2, got {args.sharding}")
    if args.peers:
        # only the flags that differ from what --peers runs (the defaults are not blamed)
        extra = [f"--{k} {v}" for k, v, ok in (("pp", args.pp, 2), ("sharding", args.sharding, 2),
                                                ("dp", args.dp, 1)) if v != ok]
        extra += ["--main-grad"] * args.main_grad + ["--split-param"] * args.split_param
        extra += [f"--vpp {args.vpp}"] * (args.vpp != 1)  # --free-grads-in-comm: a 5th row
        if extra:
            p.error("--peers runs one layout, sharding v2 without pipeline in fp32 on 2 "
                    f"processes; drop {' '.join(extra)}")
    if not (0 < args.lr < float("inf")):
        p.error(f"--lr must be a finite number > 0, got {args.lr}")
    if not (0 < args.timeout < float("inf")):
        p.error(f"--timeout must be a finite number of seconds > 0, got {args.timeout}")
    if args.trace is not None:
        folder = os.path.dirname(os.path.abspath(args.trace))
        if os.path.isdir(args.trace) or not os.path.isdir(folder) \
                or not os.access(folder, os.W_OK):
            p.error(f"--trace {args.trace}: cannot write a file there ("
                    + ("it is a folder" if os.path.isdir(args.trace) else
                       f"no folder {folder}" if not os.path.isdir(folder) else
                       f"{folder} is not writable") + "); pass a file path in a folder that exists")
    if args.plot is not None:
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not args.plot.lower().endswith((".png", ".svg")):
            p.error(f"--plot {args.plot}: the file must end in .png or .svg (its format)")
        if os.path.isdir(args.plot) or not os.path.isdir(folder) \
                or not os.access(folder, os.W_OK):
            p.error(f"--plot {args.plot}: cannot write a file there; pass a file path in a "
                    "writable folder that exists")
    if args.walkthrough and (args.peers or args.json or args.trace):
        p.error("--walkthrough runs on its own: drop --peers, --json and --trace")
    if args.walkthrough and args.plot:
        p.error("--walkthrough draws no plot: drop --plot (it plots the main job or --peers)")
    if args.walkthrough and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        p.error("--walkthrough starts its own local processes (2 and 4): run it without "
                "torchrun")
    from relgrad_demo.lm import load_text  # the demo imports this module: import it once we run
    try:
        if args.data is not None:
            _check_text(p, args.data)
        chars = len(load_text(args.data))
    except OSError as e:
        p.error(f"--data: cannot read {args.data!r}: {e.strerror}")
    if chars < args.block + 2:
        p.error(f"the text has {chars} characters; --block {args.block} needs at least "
                f"{args.block + 2}: pass a longer --data file or a smaller --block")
    opts = {k: v for k, v in vars(args).items()
            if k not in ("quiet", "json", "timeout", "peers", "walkthrough", "plot")}
    return args, opts


def _check_text(parser, path):
    """Exit 2 (parser.error) if `path` does not look like UTF-8 text: NUL bytes, or more than
    1% of its characters undecodable (the LM would learn replacement characters)."""
    with open(path, "rb") as f:
        raw = f.read()
    text = raw.decode("utf-8", errors="replace")
    bad = text.count("\ufffd") - raw.decode("utf-8", errors="ignore").count("\ufffd")
    if b"\0" in raw or bad > 0.01 * max(len(text), 1):
        parser.error(f"--data {path!r} does not look like UTF-8 text ({bad:,} of {len(text):,} "
                     "characters undecodable" + (", NUL bytes" if b"\0" in raw else "")
                     + "): pass a text file")


def main(argv=None):
    """Run the main job (or --peers) locally (own ranks) or inside torchrun; print the
    report; return the exit status."""
    args, opts = parse_args(argv)
    if args.walkthrough:
        from relgrad_demo import walkthrough
        return walkthrough.main(args.walkthrough, timeout=args.timeout)
    from relgrad_demo import job, peers, report, trace
    if args.peers:
        fn, world, shown = peers.peers_job, 2, peers
    else:
        fn, world, shown = job.train_job, args.pp * args.sharding * args.dp, report
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: join that job
        try:  # every rank checks before any of them starts a process group
            if not args.peers:
                job.make_strategy(opts).check_world_size(int(os.environ["WORLD_SIZE"]))
            elif int(os.environ["WORLD_SIZE"]) != world:
                raise ValueError(f"--peers runs on {world} processes; got WORLD_SIZE="
                                 f"{os.environ['WORLD_SIZE']}: start torchrun with "
                                 f"--nproc-per-node {world}")
        except ValueError as e:
            if os.environ["RANK"] == "0":
                print(f"relgrad.py: error: {e} (under torchrun: --nproc-per-node)",
                      file=sys.stderr)
            return 2
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local_rank)
            opts["device"] = f"cuda:{local_rank}"
        _quiet_flight_recorder()
        # --timeout bounds every collective and p2p wait (the groups inherit it)
        device_id = torch.device(opts["device"]) if backend == "nccl" else None
        dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout),
                                device_id=device_id)
        rank = dist.get_rank()
        result = fn(rank, dist.get_world_size(), opts)
        gathered = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        dist.barrier()  # as in _rank_entry: every rank done before any tears down
        dist.destroy_process_group()
        if rank != 0:
            return 0
        results = gathered
    else:
        try:
            if not args.peers:
                job.make_strategy(opts).check_world_size(world)
            results = launch(fn, world, (opts,), timeout=args.timeout)
        except mp.ProcessRaisedException as e:
            print(f"relgrad: a rank failed; its traceback:{e}", file=sys.stderr)
            return 1
        except TimeoutError as e:
            print(f"relgrad: {e} (--timeout {args.timeout:g}); rerun with a larger --timeout "
                  "(starting the processes alone takes seconds)", file=sys.stderr)
            return 1
    summary = shown.summarize(results, opts)
    if args.plot:
        from relgrad_demo import plot
        summary["plot"] = plot.draw_step(summary, args.plot, peers=args.peers)
    if args.trace:
        trace.write_chrome_trace(args.trace, [r["trace"] for r in results])
    if args.json:
        print(json.dumps(summary))
        return 0
    shown.print_report(summary, steps=not args.quiet)
    if args.trace:
        print(f"trace: {args.trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    if args.plot:
        print(f"plot: {args.plot} (one step's memory per rank)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
