"""Run under torchrun: a stage whose loss raises mid-schedule; torchrun must end the whole job.

`python -m torch.distributed.run --standalone --nproc-per-node N -m
relgrad_checks.torchrun_failure LAYOUT`, LAYOUT "pp2" (N 2) or "pp2-sharding2-v2" (N 4, the
pipeline's sharding overlap). The groups' timeout is 300 s: a job that ends within seconds was
ended by torchrun, not by a timeout.
"""
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeline import PipelineParallel
from relgrad import HybridCommunicateGroup
from relgrad_checks.common import _strategy
from sharding import DygraphShardingOptimizerV2


class _FailingLoss:
    """MSE, but the second call on global rank `rank` raises (micro-batch 1 of step 1)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.calls = rank, 0

    def __call__(self, out, y):
        self.calls += 1
        if dist.get_rank() == self.rank and self.calls == 2:
            print(f"failing at {time.time():.3f}", file=sys.stderr, flush=True)
            raise RuntimeError(f"injected loss failure on global rank {self.rank}")
        return F.mse_loss(out, y)


def main(layout: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    sharding = 2 if layout == "pp2-sharding2-v2" else 1
    st = _strategy(pp=2, sharding=sharding, acc=4, release=True, split_param=sharding > 1,
                   sharding_comm_overlap=sharding > 1)
    hcg = HybridCommunicateGroup(st)
    torch.manual_seed(0)
    model = PipelineParallel([nn.Linear(4, 4), nn.Linear(4, 4)], hcg, st,
                             _FailingLoss(dist.get_world_size() - 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if sharding > 1:
        opt = DygraphShardingOptimizerV2(opt, hcg, st)
    model.train_batch((torch.ones(8, 4), torch.zeros(8, 4)), opt)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
