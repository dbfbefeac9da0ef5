"""Checks of `--plan` (relgrad_demo/plan.py): its plain-Python layout against the core's torch code
(`flatten_dense_tensors`, `build_reduce_scatter_buffer`, `assign_group_by_size`, v1's
`_partition_parameters`), in one process."""
import types

import torch

from comm_buffer import assign_group_by_size, build_reduce_scatter_buffer, flatten_dense_tensors
from relgrad_demo import plan
from sharding import DygraphShardingOptimizer

# Sizes that meet every rule: a whole 256-byte slot and one element past it, odd sizes,
# params smaller than a rank's shard and ones that straddle several ranks.
SIZES = [1000, 300, 20, 4096, 1, 129, 12288, 64, 65, 70001, 7, 511, 512, 513, 128, 3]


def layout_mismatches() -> list:
    """Where the plan's arithmetic and the core's layout disagree (fp32, bf16, 1-8 ranks)."""
    problems = []
    for dtype in (torch.float32, torch.bfloat16):
        elem = dtype.itemsize
        params = [torch.empty(n, dtype=dtype) for n in SIZES]
        _, _, total, offsets = flatten_dense_tensors(params, release_grad=True)
        slots = [plan.slot(n, elem) for n in SIZES]
        if [offsets[p] for p in params] != [sum(slots[:i]) for i in range(len(SIZES))] \
                or total != sum(slots):
            problems.append(f"{dtype} slots: plan {slots}, flatten_dense_tensors {offsets}")
        for degree in (1, 2, 3, 8):
            for rank in range(degree):
                views, total, _, _ = build_reduce_scatter_buffer(
                    [torch.empty(n, dtype=dtype) for n in SIZES], degree, rank,
                    release_grad=True)
                got = (total, [v._param_end - v._param_begin if v._has_local else 0
                               for v in views.values()])
                if got != plan.rs_layout(SIZES, elem, degree, rank):
                    problems.append(f"{dtype} reduce-scatter on rank {rank} of {degree}: plan "
                                    f"{plan.rs_layout(SIZES, elem, degree, rank)}, core {got}")
        index = {id(p): i for i, p in enumerate(params)}
        for size in (1, 4096, 65536, 2**30):
            got = [[index[id(p)] for p in bucket]
                   for bucket in assign_group_by_size(params, size).values()]
            if got != plan.buckets(SIZES, size, elem):
                problems.append(f"{dtype} buckets of {size} B: plan "
                                f"{plan.buckets(SIZES, size, elem)}, core {got}")
        for degree in (2, 3, 8):
            stand_in = types.SimpleNamespace(_nranks=degree, _parameter_list=params,
                                             _param2rank={})
            owners = DygraphShardingOptimizer._partition_parameters(stand_in)
            if [owners[p] for p in params] != plan.partition(SIZES, degree):
                problems.append(f"v1 owners on {degree} ranks: plan "
                                f"{plan.partition(SIZES, degree)}, core "
                                f"{[owners[p] for p in params]}")
    return problems


def main_job_opts(config: dict, trace: str | None) -> dict:
    """The main job's cli opts from its --json `config`; `trace`: the path it wrote, if any."""
    from relgrad_demo import cli
    argv = ["--pp", config["pp_degree"], "--sharding", config["sharding_degree"], "--dp",
            config["dp_degree"], "--micro-batches", config["accumulate_steps"],
            "--micro-batch-size", config["micro_batch_size"], "--steps", config["steps"],
            "--d-model", config["model"]["d_model"], "--layers", config["model"]["blocks"],
            "--block", config["model"]["block_chars"], "--vpp",
            config["pp_configs"]["num_virtual_pipeline_stages"]]
    argv += ["--split-param"] * config["sharding_configs"]["split_param"]
    argv += ["--main-grad"] * (config["model"]["dtype"] != "float32")
    argv += ["--free-grads-in-comm"] * ("free" in config["modes"])
    argv += ["--trace", trace] * (trace is not None)
    return cli.parse_args([str(a) for a in argv])[1]
