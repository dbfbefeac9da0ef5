"""What the GPU tests run (skipped without CUDA): release off vs on measured with
`torch.cuda.memory_allocated`, for the data-parallel fused buffer and sharding v2.

    python -m relgrad_checks.gpu one-rank   # 1 process, a 1-rank nccl group on cuda:0
    python -m relgrad_checks.gpu shared     # 2 processes on one GPU over gloo, CUDA tensors

Each prints one JSON list, per rank and kind ("dp", "v2"), release off and on: the bytes held
between steps and the eval peak (above those in use before the build), the buffers' bytes,
and whether the params end bitwise equal. NCCL refuses two ranks on one GPU, hence gloo for
`shared`. `--cpu` runs the same on CPU over gloo (its bytes are the heap's: not asserted).
"""
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

from relgrad import HybridCommunicateGroup
from relgrad_checks.loops import hooked, own_strategy
from relgrad_demo.launch import launch
from relgrad_demo.memory import allocator_in_use_bytes
from sharding import DygraphShardingOptimizerV2

ACC, STEPS, WIDTH = 2, 3, 512  # micro-batches per step, steps, hidden width (~1 MiB of grads)


def _model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, WIDTH), torch.nn.GELU(),
                               torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(),
                               torch.nn.Linear(WIDTH, 64)).to(device)


def _batch(step, rows, device, rank, world):
    gen = torch.Generator().manual_seed(step)
    x, y = (torch.randn(world * rows, 64, generator=gen) for _ in range(2))
    return x.chunk(world)[rank].to(device), y.chunk(world)[rank].to(device)


def _in_use(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return allocator_in_use_bytes(device)


def _eval_peak(model, x, device):
    """The allocator's peak during a no-grad forward of `x` (None on CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with torch.no_grad():
        float(model(x).square().mean())
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _train(kind, release, device):
    """One run of `kind` ("dp": the bare buffer; "v2": own overlap), STEPS steps.
    -> ({bytes between steps, eval peaks, buffer bytes, buckets}, params)"""
    rank, world = dist.get_rank(), dist.get_world_size()
    start = _in_use(device)
    model = _model(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if kind == "dp":
        buffers = hooked(model.parameters(), None, ACC, release)
    else:
        strategy = own_strategy(world, 2, acc=ACC, release=release)
        opt = DygraphShardingOptimizerV2(opt, HybridCommunicateGroup(strategy), strategy)
        buffers = opt.comm_buffers
    between, eval_peak = [], []
    for step in range(STEPS):
        x, y = _batch(step, 8 * ACC, device, rank, world)
        for xm, ym in zip(x.chunk(ACC), y.chunk(ACC)):
            (F.mse_loss(model(xm), ym) / ACC).backward()
        for buffer in buffers if kind == "dp" else ():
            buffer.scale_grads()
        opt.step()
        opt.zero_grad(set_to_none=release)  # dp off: the grads stay views of the buffer
        for buffer in buffers if kind == "dp" and release else ():
            buffer._clear_grad_storage()
        between.append(_in_use(device) - start)
        peak = _eval_peak(model, _batch(10**6 + step, 64, device, rank, world)[0], device)
        eval_peak.append(None if peak is None else peak - start)
    nbytes = sum(b.buffer_size * torch.empty((), dtype=b._dtype).element_size() for b in buffers)
    return {"between": between, "eval_peak": eval_peak, "buffer_bytes": nbytes,
            "buckets": len(buffers)}, [p.detach().cpu() for p in model.parameters()]


def _off_and_on(device):
    """Per kind, after a warm-up: release off, then on, and whether params end equal."""
    out = {}
    for kind in ("dp", "v2"):
        _train(kind, True, device)  # warm-up: cuBLAS workspaces, kernels, the allocator
        runs, params = {}, {}
        for release in (False, True):
            runs[release], params[release] = _train(kind, release, device)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        assert len(params[False]) == len(params[True]) > 0
        equal = all(torch.equal(a, b) for a, b in zip(params[False], params[True]))
        out[kind] = {"off": runs[False], "on": runs[True], "equal": equal}
    return out


def _shared_rank(rank, world, device):
    """One of the 2 gloo ranks, both on `device` (the same GPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return _off_and_on(device)


def main(argv: list) -> int:
    """`one-rank` or `shared` [--cpu]: run, print the JSON list of per-rank results."""
    what, cpu = argv[0], "--cpu" in argv
    device = "cpu" if cpu else "cuda:0"
    if what == "shared":  # 2 gloo ranks (relgrad_demo.launch), both on cuda:0
        print(json.dumps(launch(_shared_rank, 2, (device,), timeout=110)))
        return 0
    if not cpu:
        torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as folder:  # a 1-rank group: nccl on cuda:0
        dist.init_process_group("gloo" if cpu else "nccl", rank=0, world_size=1,
                                init_method="file://" + os.path.join(folder, "store"))
        result = _off_and_on(torch.device(device))
        dist.destroy_process_group()
    print(json.dumps([result]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
