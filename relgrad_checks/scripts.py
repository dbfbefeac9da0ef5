"""Rank-side checks of what real training scripts bring (issue 25): `zero_grad()` while
sharding's own overlap has collectives in flight, sparse grads, a replica whose batch does
not split, an all-frozen stage, a weight tied across stages without `shared_weights=`, and
failures that every rank learns of at once."""
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeline import PipelineParallel
from relgrad import DygraphShardingConfig, HybridCommunicateGroup, HybridStrategy, PpConfig
from sharding import DygraphShardingOptimizer, DygraphShardingOptimizerV2
from relgrad_checks.loops import STEPS, _micro_batches, _oracle, _sharded

_CLASSES = {1: DygraphShardingOptimizer, 2: DygraphShardingOptimizerV2}


def _caught(fn, *args, **kwargs):
    """`(type name, message)` of what `fn(*args, **kwargs)` raised, or None if it returned."""
    try:
        fn(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 (the test compares what every rank saw)
        return type(error).__name__, str(error)
    return None


# ---------------------------------------------------------------- zero_grad while in flight

def zero_grad_in_flight(rank, world):
    """v1 / v2, own overlap, acc 1, release on / off: backward, zero_grad() (the collectives
    in flight), step(), then zero_grad(), backward, step() for STEPS steps. Returns
    ({(version, release): (what the first zero_grad raised, what step() raised, what the
    next zero_grad raised, params)}, the one-process params after STEPS steps)."""
    out = {}
    for version in (1, 2):
        for release in (True, False):
            model, opt = _sharded(world, version, True, 1, release=release)
            zero = {"set_to_none": release}  # release off: only in place is allowed
            for x, y in _micro_batches(rank, world, 0, 1):
                F.mse_loss(model(x), y).backward()
            first = _caught(opt.zero_grad, **zero)
            stepped = _caught(opt.step)
            again = _caught(opt.zero_grad, **zero)
            for step in range(STEPS):
                for x, y in _micro_batches(rank, world, step, 1):
                    F.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad(**zero)
            out[version, release] = (first, stepped, again,
                                     [p.detach().clone() for p in model.parameters()])
    return out, _oracle(STEPS)[0]
