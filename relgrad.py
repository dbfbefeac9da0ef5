"""relgrad: Paddle's `release_gradients` (PR #59739) in torch: config, topology, launcher, demo.

Mirrors the `PpConfig` / `DygraphShardingConfig` messages of
`paddle/fluid/framework/distributed_strategy.proto` and `HybridCommunicateGroup` of
`python/paddle/distributed/fleet/base/topology.py` at commit 9b40c67f672f.

`python relgrad.py` trains a small character-level language model on real text (this repo's own
files) with pipeline parallel x sharding on 4 local ranks, once with `release_gradients` off and
once on, same seed and data. It prints both runs' loss per step, then per rank: the grad bytes
held between steps (from the allocator, cross-checked with a count of live grad storages), peak
bytes, step time, and whether the two runs are bitwise equal. Under `torchrun` it joins that job
instead (nccl on GPUs, gloo otherwise). The launcher here also serves the tests.

Leaves out: mp / sep axes, the interleaved schedule, checkpointing.

References: Paddle PRs #59739, #64517; PaddleNLP PR #7594 (`enable_release_grads`).
"""
import argparse
import ctypes
import gc
import json
import os
import pickle
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from comm_buffer import register_main_grad_hooks
from grad_clip import ClipGradByGlobalNorm
from pipeline import PipelineParallel
from sharding import (DygraphShardingOptimizer, DygraphShardingOptimizerV2,
                      MixPrecisionOptimizer)

HERE = Path(__file__).resolve().parent


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
    release_gradients: bool = False  # 6, the seed's new field: free grad buffers after a step
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
    accumulate_steps: int = 1  # check-ins per step for v1/v2's own buffers (no pipeline)
    comm_overlap: bool = False  # sharding's own tensor-fusion overlap (hooks, no pipeline)
    release_gradients: bool = False  # [later] field 8, PR #64517: ORed with pp_configs' flag
    # [later] PaddleNLP #9081: free what a rank will not read once its bucket is reduced
    # (v2: all but its shard; v1: a non-owner's grads); needs release
    free_grads_in_comm: bool = False

    def __post_init__(self):
        _require(self.accumulate_steps >= 1, "sharding_configs.accumulate_steps must be >= 1, "
                 f"got {self.accumulate_steps}")


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
    accumulate_steps: int = 1  # pipeline_configs.accumulate_steps: micro-batches per step
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
    Raises ValueError if the degrees do not multiply to the world size.
    """

    def __init__(self, strategy):
        world, rank = dist.get_world_size(), dist.get_rank()
        strategy.check_world_size(world)
        shape = (strategy.dp_degree, strategy.pp_degree, strategy.sharding_degree)
        grid = torch.arange(world).reshape(shape)
        self._rank = rank
        self._coord = [int(c) for c in (grid == rank).nonzero()[0]]
        self._groups = []  # (group, global ranks) of this rank along dp, pp, sharding
        for axis, size in enumerate(shape):
            for ranks in grid.movedim(axis, -1).reshape(-1, size).tolist():
                group = dist.new_group(ranks)
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


# ---- launcher ----

def launch(fn, world_size, args=(), timeout=300.0):
    """Run `fn(rank, world_size, *args)` on `world_size` local gloo ranks; return their results.

    Ranks are spawned with torch.multiprocessing and meet at a TCPStore that this process
    holds on 127.0.0.1, on a port the OS picks. `fn` must be importable and its results
    picklable; the list of results is indexed by rank. If a rank raises, torch terminates the
    others and raises ProcessRaisedException carrying that rank's traceback; if the ranks are
    not done after `timeout` seconds, all are killed and TimeoutError is raised.
    """
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _rank_entry, args=(fn, world_size, store.port, args, out_dir, timeout),
            nprocs=world_size, join=False, start_method="spawn")
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
    dist.destroy_process_group()


# ---- memory, measured by the allocator and counted by us ----

class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def allocator_in_use_bytes(device):
    """Bytes in use: `torch.cuda.memory_allocated` on GPU; glibc `mallinfo2` on CPU (heap
    chunks in use + mmapped chunks: torch's CPU tensors come from malloc). None elsewhere."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    mallinfo2 = getattr(ctypes.CDLL(None), "mallinfo2", None)
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _Mallinfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd


class _PeakSampler:
    """Peak bytes during a block: the CUDA allocator's peak, or on CPU the highest
    `allocator_in_use_bytes` seen by a thread sampling every 0.5 ms."""

    def __init__(self, device):
        self.device, self.peak = device, None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        self._stop = threading.Event()
        self.peak = allocator_in_use_bytes(self.device) or 0
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.0005):
            self.peak = max(self.peak, allocator_in_use_bytes(self.device))

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            self._thread.join()


def live_grad_bytes(model, optimizer, buffers):
    """Bytes of the distinct storages behind every grad, main_grad, slice grad and buffer."""
    tensors = []
    params = list(model.parameters()) + [p for g in optimizer.param_groups for p in g["params"]]
    params += list(getattr(optimizer, "_slice_params", {}).values())
    for p in params:
        tensors += [p.grad, getattr(p, "main_grad", None)]
    for buffer in buffers:
        tensors.append(buffer.grad_storage)
        for view in getattr(buffer, "_sharding_param_grad_view", {}).values():
            tensors += [view._slice_grad, view._grad_buffer]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors if t is not None}
    return sum(storages.values())


# ---- the demo model: a decoder-only character-level LM, as a list of pipeline layers ----

class Embedding(nn.Module):
    """Token plus learned position embeddings: the first pipeline layer."""

    def __init__(self, vocab, d_model, block_size):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d_model), nn.Embedding(block_size, d_model)
        nn.init.normal_(self.tok.weight, std=0.02)  # tied to the head: GPT-2's scale, not N(0, 1)

    def forward(self, idx):  # (B, T) int64 -> (B, T, d_model)
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class Block(nn.Module):
    """A pre-norm transformer block with a causal mask (torch's TransformerEncoderLayer)."""

    def __init__(self, d_model, n_head):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d_model, n_head, 4 * d_model, dropout=0.0,
                                                batch_first=True, norm_first=True)

    def forward(self, x):  # (B, T, d_model) -> same, each position sees only its past
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], x.device, x.dtype)
        return self.layer(x, src_mask=mask, is_causal=True)


class Head(nn.Module):
    """Final layer norm and projection to vocabulary logits: the last pipeline layer."""

    def __init__(self, d_model, vocab):
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(d_model), nn.Linear(d_model, vocab)

    def forward(self, x):  # (B, T, d_model) -> logits (B, T, vocab)
        return self.proj(self.norm(x))


def lm_loss(logits, targets):
    """Mean cross entropy of (B, T, vocab) logits against (B, T) int64 targets, in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _seeded_layer(seed, main_grad, device, cls, *args):
    """Build one layer from its own seed (same weights on any stage), on its device and, for
    --main-grad, in bf16 with fp32 main grads: all before the pipeline builds grad buffers
    (moving a module afterwards would move its grads out of their buffer)."""
    torch.manual_seed(seed)
    layer = cls(*args).to(device)
    if main_grad:
        layer.to(torch.bfloat16)
        register_main_grad_hooks(layer.parameters())
    return layer


def lm_layers(vocab, opts, device):
    """The LM as a list of layer builders for PipelineParallel (each stage builds its own)."""
    d, seed, main_grad = opts["d_model"], opts["seed"], opts["main_grad"]
    specs = ([(Embedding, vocab, d, opts["block"])] + [(Block, d, 4)] * opts["layers"]
             + [(Head, d, vocab)])
    return [partial(_seeded_layer, seed + i, main_grad, device, *spec)
            for i, spec in enumerate(specs)]


def lm_shared_weights(opts):
    """The LM's tie: token embedding (first layer) and head projection (last), both
    (vocab, d_model); across stages with pp > 1, one Parameter with pp 1."""
    return [("0.tok.weight", f"{opts['layers'] + 1}.proj.weight")]


def load_text(path=None):
    """Real text on this machine: `path`, or this repo's own sources and README."""
    paths = [Path(path)] if path else sorted(HERE.glob("*.py")) + sorted(HERE.glob("*.md"))
    return "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in paths)


# ---- the job: each rank trains twice, release off then on ----

def train_job(rank, world_size, opts):
    """Per-rank body of the demo: a short warm-up run, then one run per release mode; returns
    this rank's measurements and its stage's final params, per mode."""
    device = torch.device(opts.get("device") or "cpu")
    text = load_text(opts["data"])
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)
    hcg = HybridCommunicateGroup(make_strategy(opts, release=False))
    out = {"rank": rank, "stage": hcg.get_stage_id(), "modes": {}, "params": {}}
    # A process's first run keeps tens of MB for good (gloo pairs, autograd and kernel
    # state) and its second some 30 KB more; two discarded one-step runs keep that out of
    # both measured runs, whose order then no longer matters.
    for _ in range(2):
        _train_once({**opts, "steps": 1}, make_strategy(opts, False), hcg, ids, len(vocab),
                    device)
    for mode in ("off", "on"):
        strategy = make_strategy(opts, release=mode == "on")
        out["modes"][mode], out["params"][mode] = _train_once(opts, strategy, hcg, ids,
                                                              len(vocab), device)
    return out


def make_strategy(opts, release):
    """The demo's HybridStrategy: overlap where Paddle allows it, and the given release flag."""
    sharding = opts["sharding"]
    return HybridStrategy(
        dp_degree=opts["dp"], pp_degree=opts["pp"], sharding_degree=sharding,
        accumulate_steps=opts["micro_batches"], micro_batch_size=opts["micro_batch_size"],
        pp_configs=PpConfig(
            release_gradients=release,
            sharding_comm_overlap=opts["overlap"] and sharding > 1 and opts["pp"] > 1,
            dp_comm_overlap=opts["overlap"] and sharding == 1 and opts["dp"] > 1
            and opts["pp"] > 1),
        sharding_configs=DygraphShardingConfig(split_param=opts["split_param"]))


def _train_once(opts, strategy, hcg, ids, vocab, device):
    gc.collect()
    start_bytes = allocator_in_use_bytes(device)  # idle bytes are counted from here
    model = PipelineParallel(lm_layers(vocab, opts, device), hcg, strategy, lm_loss,
                             shared_weights=lm_shared_weights(opts))
    optimizer = torch.optim.AdamW(model.parameters(), lr=opts["lr"], weight_decay=0.01)
    grad_clip = ClipGradByGlobalNorm(1.0)
    if strategy.sharding_degree > 1:
        cls = DygraphShardingOptimizerV2 if opts["split_param"] else DygraphShardingOptimizer
        optimizer = cls(optimizer, hcg, strategy, grad_clip=grad_clip)
    elif opts["main_grad"]:
        optimizer = MixPrecisionOptimizer(optimizer)
    replicas = strategy.dp_degree * strategy.sharding_degree
    replica = hcg.get_data_parallel_rank() * strategy.sharding_degree \
        + hcg.get_sharding_parallel_rank()
    local = opts["micro_batch_size"] * opts["micro_batches"]
    m = {"losses": [], "idle_alloc": [], "idle_counted": [], "peak": [], "step_time": [],
         "grad_norms": []}
    for step in range(opts["steps"]):
        gen = torch.Generator().manual_seed(opts["seed"] * 1000 + step)  # same data every run
        starts = torch.randint(0, len(ids) - opts["block"] - 1, (replicas * local,),
                               generator=gen)[replica * local : (replica + 1) * local]
        x = torch.stack([ids[s : s + opts["block"]] for s in starts.tolist()]).to(device)
        y = torch.stack([ids[s + 1 : s + 1 + opts["block"]] for s in starts.tolist()]).to(device)
        with _PeakSampler(device) as peak:
            start = time.perf_counter()
            loss = model.train_batch((x, y), optimizer, grad_clip=None
                                     if strategy.sharding_degree > 1 else grad_clip)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            m["step_time"].append(time.perf_counter() - start)
        gc.collect()  # between steps: what stays alive is what the run holds on to
        buffers = [b for bs in model._chunk_2_comm_buffers.values() for b in bs]
        buffers += getattr(optimizer, "_comm_buffer_list", [])
        m["losses"].append(float(loss))
        m["grad_norms"].append(float(grad_clip.global_norm))  # before clipping, any rank
        in_use = allocator_in_use_bytes(device)
        m["idle_alloc"].append(None if in_use is None else in_use - start_bytes)
        m["idle_counted"].append(live_grad_bytes(model, optimizer, buffers))
        m["peak"].append(None if in_use is None else peak.peak - start_bytes)
    return m, [p.detach().cpu().clone() for p in model.parameters()]


# ---- report ----

def summarize(results, opts):
    """Fold the ranks' measurements into the JSON object that `--json` prints."""
    ranks = sorted(results, key=lambda r: r["rank"])
    modes = {}
    for mode in ("off", "on"):
        ms = [r["modes"][mode] for r in ranks]
        steps = range(opts["steps"])
        after1 = slice(1, None) if opts["steps"] > 1 else slice(None)
        modes[mode] = {
            "losses": [statistics.fmean(m["losses"][s] for m in ms) for s in steps],
            "grad_norms": ms[0]["grad_norms"],  # global norm before clipping, equal on all
            "idle_grad_bytes_counted": [max(m["idle_counted"][after1]) for m in ms],
            "idle_grad_bytes_allocator": [_median_or_none(m["idle_alloc"][after1]) for m in ms],
            "peak_bytes": [_max_or_none(m["peak"]) for m in ms],
            "step_time_s": statistics.median(max(m["step_time"][s] for m in ms)
                                             for s in list(steps)[after1]),
        }
    equal = all(r["modes"]["off"]["losses"] == r["modes"]["on"]["losses"]
                and r["modes"]["off"]["grad_norms"] == r["modes"]["on"]["grad_norms"]
                and all(torch.equal(a, b) for a, b in zip(r["params"]["off"], r["params"]["on"]))
                for r in ranks)
    config = {k: v for k, v in opts.items() if k != "device"}
    return {"config": config, "stages": [r["stage"] for r in ranks], "modes": modes,
            "bitwise_equal": equal}


def _median_or_none(values):
    return None if None in values else int(statistics.median(values))


def _max_or_none(values):
    return None if None in values else max(values)


def _kib(n):
    return "n/a" if n is None else f"{n / 1024:,.1f}"


def print_report(summary):
    """Print the per-rank table, step times and the bitwise verdict of `summarize`'s output."""
    off, on = summary["modes"]["off"], summary["modes"]["on"]
    print("\nper rank, KiB above each run's start (idle: between steps after step 1, "
          "median; allocator: in-use bytes)")
    print(f"{'rank':>4} {'stage':>5} | {'idle alloc off':>14} {'on':>10} {'off-on':>10} | "
          f"{'counted off':>11} {'on':>6} | {'peak off':>10} {'on':>10}")
    for r, stage in enumerate(summary["stages"]):
        a_off, a_on = off["idle_grad_bytes_allocator"][r], on["idle_grad_bytes_allocator"][r]
        diff = None if None in (a_off, a_on) else a_off - a_on
        print(f"{r:>4} {stage:>5} | {_kib(a_off):>14} {_kib(a_on):>10} {_kib(diff):>10} | "
              f"{_kib(off['idle_grad_bytes_counted'][r]):>11} "
              f"{_kib(on['idle_grad_bytes_counted'][r]):>6} | "
              f"{_kib(off['peak_bytes'][r]):>10} {_kib(on['peak_bytes'][r]):>10}")
    t_off, t_on = off["step_time_s"], on["step_time_s"]
    print(f"median step time: off {t_off * 1e3:.1f} ms, on {t_on * 1e3:.1f} ms, "
          f"on/off {t_on / t_off:.3f}")
    print(f"loss: {off['losses'][0]:.4f} -> {off['losses'][-1]:.4f}; release off vs on "
          f"bitwise equal (losses and final params): {summary['bitwise_equal']}")


def parse_args(argv=None):
    """Parse and check the flags (argparse errors exit with status 2); returns (args, opts)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=2, help="pipeline stages")
    p.add_argument("--sharding", type=int, default=2, help="sharding degree")
    p.add_argument("--dp", type=int, default=1, help="data-parallel degree")
    p.add_argument("--split-param", action="store_true", help="sharding v2 (default v1)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="pipeline comm overlap (sharding, or dp without sharding)")
    p.add_argument("--main-grad", action="store_true", help="bf16 params, fp32 main grads")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--micro-batch-size", type=int, default=4, help="sequences")
    p.add_argument("--block", type=int, default=64, help="sequence length, characters")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", help="a text file (default: this repo's sources and README)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds, local launch")
    p.add_argument("--quiet", action="store_true", help="no per-step lines")
    p.add_argument("--json", action="store_true", help="print one JSON object only")
    args = p.parse_args(argv)
    for flag in ("pp", "sharding", "dp", "steps", "micro_batches", "micro_batch_size", "layers"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not 1 <= args.block <= 1024:
        p.error(f"--block must be between 1 and 1024 characters, got {args.block}")
    if args.d_model < 4 or args.d_model % 4:
        p.error(f"--d-model must be a multiple of the 4 attention heads, got {args.d_model}")
    if args.pp > args.layers + 2:
        p.error(f"--pp {args.pp} exceeds the {args.layers + 2} layers; add --layers")
    try:
        chars = len(load_text(args.data))
    except OSError as e:
        p.error(f"--data: cannot read {args.data!r}: {e.strerror}")
    if chars < args.block + 2:
        p.error(f"the text has {chars} characters; --block {args.block} needs at least "
                f"{args.block + 2}: pass a longer --data file or a smaller --block")
    opts = {k: v for k, v in vars(args).items() if k not in ("quiet", "json", "timeout")}
    return args, opts


def main(argv=None):
    """Run the demo locally (own ranks) or inside torchrun; print the report; return the
    exit status."""
    args, opts = parse_args(argv)
    world = args.pp * args.sharding * args.dp
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: join that job
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local_rank)
            opts["device"] = f"cuda:{local_rank}"
        _quiet_flight_recorder()
        dist.init_process_group(backend)
        rank = dist.get_rank()
        result = train_job(rank, dist.get_world_size(), opts)
        gathered = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        dist.destroy_process_group()
        if rank != 0:
            return 0
        results = gathered
    else:
        try:
            make_strategy(opts, release=False).check_world_size(world)
            results = launch(train_job, world, (opts,), timeout=args.timeout)
        except mp.ProcessRaisedException as e:
            print(f"relgrad: a rank failed; its traceback:{e}", file=sys.stderr)
            return 1
    summary = summarize(results, opts)
    if args.json:
        print(json.dumps(summary))
        return 0
    if not args.quiet:
        for s, (a, b) in enumerate(zip(summary["modes"]["off"]["losses"],
                                       summary["modes"]["on"]["losses"])):
            print(f"step {s + 1:3d}  loss release off {a:.6f}  on {b:.6f}")
    print_report(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
