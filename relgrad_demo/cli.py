"""The command line of `python relgrad.py`: the main job, --peers, --walkthrough, --plot, --trace.

`relgrad.py` hands its argv here. `parse_args` checks every flag before any process starts (a
bad flag ends in one line, status 2); `main` runs the job locally (`relgrad_demo.launch`) or joins a
torchrun job, then prints the report.
"""
import argparse
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from relgrad_demo import launch as launcher

_DESCRIPTION = """\
The main job: start pp x sharding x dp local processes (gloo ranks on 127.0.0.1; under torchrun,
join its job instead) that train a small character-level transformer LM on this repo's own
text, once per release mode (release_gradients off, on), the runs in turns step by step, same
seed and data. Prints each step's loss, what ran (strategy, fused grad buffers per rank),
per rank the bytes each run holds between steps and at its peak (from the allocator), where
the memory goes within one step, the step times (median and spread, off vs on), and whether
the runs are bitwise equal. --peers instead trains the same LM under this repo's sharding v2
and torch's DDP + ZeroRedundancyOptimizer and FSDP2 (2 processes) and compares them;
--peers --dp compares the README's recipe (a) (release off, on) with torch's DDP."""


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


def layout_problem(pp, vpp, layers, micro_batches, sharding, free):
    """The layout rules the main job and --plan share, as one line, or None."""
    if pp * vpp > layers + 2:
        return (f"--pp {pp} x --vpp {vpp} chunks exceed the {layers + 2} layers (embedding, "
                "blocks, head): every chunk needs one; add --layers")
    if vpp > 1 and (pp < 2 or micro_batches % pp):
        return (f"--vpp {vpp} (interleaved 1F1B) needs --pp >= 2 and --micro-batches a "
                f"multiple of --pp; got --pp {pp} --micro-batches {micro_batches}")
    if free and sharding < 2:
        return ("--free-grads-in-comm frees what a sharding rank will not read: it needs "
                f"release and --sharding >= 2, got --sharding {sharding}")
    return None


def parse_args(argv=None):
    """Parse and check the flags (argparse errors exit with status 2); returns (args, opts).

    `opts` is the dict of flags the ranks read; `opts["modes"]` lists the release modes to
    run (demo.job.MODES), baseline first. A new mode takes one flag here, e.g.
    `p.add_argument("--x", dest="modes", action="append_const", const="x", help=...)`.
    """
    p = _Parser(prog="relgrad.py", description=_DESCRIPTION,
                formatter_class=_HelpFormatter)
    p.add_argument("--plan", action="store_true", help="instead, plan what release saves on "
                   "a model and layout at any size, before it runs (its flags: --plan --help)")
    p.add_argument("--plan-check", action="store_true", help="instead, compare the demo LM's "
                   "plan with what the main job measures, at three sizes (minutes)")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (pp_degree)")
    p.add_argument("--sharding", type=int, default=2, help="ZeRO-1 shards (sharding_degree)")
    p.add_argument("--dp", type=int, nargs="?", default=1,
                   help="data-parallel replicas (dp_degree); --peers --dp (no value, or 2): "
                   "data parallel 2 instead, the README's recipe (a) (FusedCommBuffer "
                   "all-reduce, release off and on) against torch's DDP")
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
    p.add_argument("--walkthrough", nargs="?", const="all",
                   choices=("all", "v2", "v1", "dp", "v2-overlap"),
                   help="instead, narrate the life of the fused grad buffers on a tiny model, "
                   "event by event, rank 0, release off and on merged: v2 (sharding v2 alone as "
                   "the seed runs it, 2 processes), v1 (pipeline 2 x sharding 2, 4), dp "
                   "(pipeline 2 x dp 2, 4), v2-overlap (v2 with its own overlap), or v2, v1 "
                   "and dp (no value)")
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
    if args.dp is None and not args.peers:
        p.error("--dp without a value is --peers --dp (recipe (a) against DDP): add --peers, "
                "or give the main job's degree, e.g. --dp 2")
    dp_peers = args.peers and args.dp in (None, 2)
    args.dp = 2 if args.dp is None else args.dp
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
    if problem := layout_problem(args.pp, args.vpp, args.layers, args.micro_batches,
                                 args.sharding, "free" in args.modes):
        p.error(problem)
    if args.peers:
        # only the flags that differ from what --peers runs (the defaults are not blamed)
        extra = [f"--{k} {v}" for k, v, ok in (("pp", args.pp, 2), ("sharding", args.sharding, 2),
                                                ("dp", args.dp, 1 + dp_peers)) if v != ok]
        extra += ["--main-grad"] * args.main_grad + ["--split-param"] * args.split_param
        extra += [f"--vpp {args.vpp}"] * (args.vpp != 1)  # --free-grads-in-comm: a 5th row
        if dp_peers:  # no sharding: nothing to free in comm, no bucket size; always overlapped
            extra += ["--free-grads-in-comm"] * ("free" in args.modes)
            extra += ["--no-overlap"] * (not args.overlap)
            extra += [f"--comm-buffer-mb {args.comm_buffer_mb}"] * (args.comm_buffer_mb is not None)
        if extra:
            layout = "data parallel 2" if dp_peers else "sharding v2 without pipeline"
            p.error(f"--peers{' --dp' * dp_peers} runs one layout, {layout} in fp32 on 2 "
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
    report; return the exit status. `--plan` / `--plan-check`: relgrad_demo/plan.py."""
    given = sys.argv[1:] if argv is None else argv
    if "--plan" in given or "--plan-check" in given:
        from relgrad_demo import plan
        return plan.main(given)
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
        launcher._quiet_flight_recorder()
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
            results = launcher.launch(fn, world, (opts,), timeout=args.timeout)
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
