"""relgrad: Paddle's `release_gradients` (PR #59739) in torch: config, topology, process groups.

Mirrors the `PpConfig` / `DygraphShardingConfig` messages of
`paddle/fluid/framework/distributed_strategy.proto` and `HybridCommunicateGroup` of
`python/paddle/distributed/fleet/base/topology.py` at commit 9b40c67f672f, with the process-group
helpers the core shares (timeouts, the current-device check). `python relgrad.py` is the main
job: the command line of `relgrad_demo/cli.py`. Leaves out: mp / sep axes.
References: Paddle PRs #59739, #64517; PaddleNLP PR #7594 (`enable_release_grads`).
"""
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from comm_buffer import _backend_for, agree


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
    # Seed hunk: field 6. The fused grad buffers are allocated at a step's first grad
    # check-in and freed after its optimizer step (the pipeline's read this flag alone;
    # the sharding optimizers' own buffers also sharding_configs.release_gradients).
    release_gradients: bool = False
    # Not a proto field: Paddle's `PipelineLayer(num_virtual_pipeline_stages=V)`; V > 1:
    # model chunks per rank, for PipelineParallelWithInterleave.
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
    # Backward passes per step for v1 / v2's own buffers with comm_overlap (no pipeline); not
    # HybridStrategy.accumulate_steps, the pipeline's micro-batch count.
    accumulate_steps: int = 1
    comm_overlap: bool = False  # sharding's own tensor-fusion overlap (hooks, no pipeline)
    # [later] field 8, PR #64517: ORed with pp_configs.release_gradients for the sharding
    # optimizers' own buffers (under pipeline overlap the buffers follow the PP flag)
    release_gradients: bool = False
    # [later] PaddleNLP #9081: free what a rank will not read once its bucket is reduced
    free_grads_in_comm: bool = False
    # [later] MB per fused grad buffer of sharding; None: Paddle's 256 for sharding's own
    # buffers, the pipeline's fixed 128 for its own
    comm_buffer_size_MB: int = None

    def __post_init__(self):
        _require(self.accumulate_steps >= 1, "sharding_configs.accumulate_steps must be >= 1, "
                 f"got {self.accumulate_steps}")
        mb = self.comm_buffer_size_MB
        _require(mb is None or (isinstance(mb, int) and not isinstance(mb, bool) and mb > 0),
                 "sharding_configs.comm_buffer_size_MB must be a positive int (MB per fused "
                 f"grad buffer), got {mb!r}; pass e.g. 256, or None for the defaults")


@dataclass
class HybridStrategy:
    """Paddle's `DistributedStrategy.hybrid_configs` plus `pipeline_configs`, flattened."""

    dp_degree: int = 1  # data-parallel replicas (outermost axis of the rank grid)
    pp_degree: int = 1  # pipeline stages
    sharding_degree: int = 1  # ZeRO-1 shards (innermost axis)
    accumulate_steps: int = 1  # pipeline_configs': micro-batches per train_batch
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
        _require(not (problem := sharding_config_problem(self)), problem)

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


def sharding_config_problem(strategy, split_param=None):
    """What breaks the sharding configs' rules in `strategy` (any object with Paddle's
    `hybrid_configs`), or None: checked at build and by the sharding optimizers."""
    configs = strategy.hybrid_configs
    pp, sd, pp_degree = configs["pp_configs"], configs["sharding_configs"], configs["pp_degree"]
    split_param = sd.split_param if split_param is None else split_param
    released = pp.release_gradients or (sd.release_gradients and not pp.sharding_comm_overlap)
    return next((text for bad, text in [
        (sd.comm_overlap and (pp.sharding_comm_overlap or pp_degree > 1), "sharding_configs."
         "comm_overlap is sharding's own overlap without a pipeline: it needs pp_degree 1 and "
         f"pp_configs.sharding_comm_overlap off (they cannot both be on), got {pp_degree} and "
         f"{pp.sharding_comm_overlap}; under a pipeline use the latter"),
        (sd.free_grads_in_comm and not released, "sharding_configs.free_grads_in_comm needs "
         "release: turn on pp_configs.release_gradients (or, without pipeline overlap, "
         "sharding_configs.release_gradients)"),
        (sd.free_grads_in_comm and pp.delay_scale_loss and split_param, "sharding_"
         "configs.free_grads_in_comm with split_param drops the grads after the reduce-scatter,"
         " so delay_scale_loss (it scales them) would miss the shards")] if bad), None)


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

    Every rank creates every group, in order. `timeout` bounds each collective and p2p wait on
    them (None: the default group's; torch's `new_group` would give its own 30 min).
    """

    def __init__(self, strategy, timeout=None):
        world, rank = dist.get_world_size(), dist.get_rank()
        timeout = timeout or group_timeout(None)
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

    # Paddle's getters: the ranks, sizes and groups along dp (axis 0), pipe (1), sharding (2).
    def get_global_rank(self):
        return self._rank

    def get_data_parallel_rank(self):
        return self._coord[0]

    def get_data_parallel_world_size(self):
        return len(self._groups[0][1])

    def get_data_parallel_group(self):
        return self._groups[0][0]

    def get_stage_id(self):
        return self._coord[1]

    def get_pipe_parallel_world_size(self):
        return len(self._groups[1][1])

    def get_pipe_parallel_group(self):
        return self._groups[1][0]

    def get_rank_from_stage(self, stage_id):  # global rank of `stage_id` in this rank's pipe
        return self._groups[1][1][stage_id]

    def get_sharding_parallel_rank(self):
        return self._coord[2]

    def get_sharding_parallel_world_size(self):
        return len(self._groups[2][1])

    def get_sharding_parallel_group(self):
        return self._groups[2][0]


# ---- process groups on any backend: timeouts, the current device ----

def group_timeout(group):
    """The timeout (timedelta) `group` was created with (None = the default group), read from
    its backend for a device it serves; else torch's default for that backend."""
    group = group or dist.distributed_c10d._get_default_group()
    for device in getattr(group, "_device_types", ()):  # private API: its backends' devices
        try:
            return group._get_backend(device).options._timeout
        except Exception:  # noqa: BLE001 (private API: try the next device, then the default)
            continue
    from torch.distributed import constants
    nccl = "nccl" in str(dist.get_backend(group))
    return (constants.default_pg_nccl_timeout if nccl and constants.default_pg_nccl_timeout
            else constants.default_pg_timeout)


SET_DEVICE_FIX = ("add `torch.cuda.set_device(local_rank)` (local_rank = int(os.environ["
                  "'LOCAL_RANK']) under torchrun) before `dist.init_process_group(\"nccl\")`, "
                  "or pass `device_id=torch.device(\"cuda\", local_rank)` to it")


def device_problem(backend, param_devices, current_device):
    """What is wrong, or None, with params on `param_devices` under a group of `backend` while
    the current CUDA device is `current_device` (None without CUDA): NCCL runs on the current
    device, so a CUDA param on another one means set_device was not called. Pure."""
    others = sorted({str(d) for d in param_devices if torch.device(d).type == "cuda"
                     and (torch.device(d).index or 0) != current_device})
    if _backend_for(backend, "cuda") != "nccl" or not others:
        return None
    return (f"params on {', '.join(others)} but the current CUDA device is "
            f"cuda:{current_device} (torch.cuda.current_device()), where NCCL runs")


def check_current_device(params, groups, what):
    """ValueError on every rank of `groups` if, under NCCL, some rank's params are on a GPU
    other than its current one; agreed through the store (a collective would need the very
    device that is wrong). Beyond Paddle (its launcher gives each process its GPU)."""
    if any(_backend_for(dist.get_backend(g), "cuda") == "nccl" for g in groups):
        current = torch.cuda.current_device() if torch.cuda.is_available() else None
        agree_on_devices(device_problem("nccl", [p.device for p in params], current), groups,
                         what)


def agree_on_devices(problem, groups, what):
    """`comm_buffer.agree` through the store on a `device_problem` text (or None)."""
    agree(groups, [(f"{what}: {SET_DEVICE_FIX}", problem)], via_store=True)


if __name__ == "__main__":
    from relgrad_demo.cli import main  # the command line lives beside the demo it runs
    sys.exit(main())
