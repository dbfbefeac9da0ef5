"""Clipping by the global grad norm of a model split over pipeline stages and sharding ranks.

Mirrors Paddle's `ClipGradByGlobalNorm` (python/paddle/nn/clip.py) as it runs inside
`HybridParallelClipGrad` (`fleet/meta_optimizers/dygraph_optimizer/hybrid_parallel_optimizer.py`):
the user hands `ClipGradByGlobalNorm(clip_norm)` to the optimizer (here: the sharding wrappers'
`grad_clip=` keyword, or `PipelineParallel.train_batch(..., grad_clip=)` beside a plain torch
optimizer), and it runs once per step on the *reduced* grads, after every collective and before
the inner optimizer step (and so before a released buffer is freed).

Each rank sums the squares of the grads its optimizer steps, in fp32 whatever the grad dtype:
under sharding that is what this rank owns (v1: whole params; v2: its slices, without their
padding), so every element is counted on exactly one sharding rank. A copy of a weight tied
across stages whose `is_firstly_shared` is False is scaled but not counted. The partial sums are
all-reduced over the sharding group, then over the pipe group (`norm_groups`); dp replicas hold
equal grads after the dp all-reduce, so dp is not summed. Every rank issues these all-reduces,
also with nothing to count (it adds 0). Phases: square and sum -> all-reduce -> scale.

Leaves out: mp-split ("distributed") params and their separate sum, `auto_skip_clip`,
`group_name`, SELECTED_ROWS grads.

References: Paddle's HybridParallelClipGrad; Pascanu et al., "On the difficulty of training
recurrent neural networks" (2013); torch's `torch.nn.utils.clip_grad_norm_`.
"""
import math

import torch
import torch.distributed as dist

EPS = 1e-6  # Paddle's (and torch's) epsilon in the coefficient's denominator


def norm_groups(hcg):
    """The groups whose all-reduce (SUM) turns a rank's squares into the model's: sharding (if
    sharding_degree > 1), then pipe (if pp_degree > 1), as in HybridParallelClipGrad.

    Reads `hcg.get_{sharding,pipe}_parallel_{world_size,group}()`. Returns a list of groups.
    """
    groups = []
    if hcg.get_sharding_parallel_world_size() > 1:
        groups.append(hcg.get_sharding_parallel_group())
    if hcg.get_pipe_parallel_world_size() > 1:
        groups.append(hcg.get_pipe_parallel_group())
    return groups


class ClipGradByGlobalNorm:
    """Scale grads in place by `clip_norm / (max(global_norm, clip_norm) + 1e-6)` (Paddle's).

    The coefficient is Paddle's, not torch's: with the norm below `clip_norm`, grads are still
    multiplied by `clip_norm / (clip_norm + 1e-6)` (torch's `clip_grad_norm_` clamps its
    coefficient to exactly 1 there). Above `clip_norm` the two agree:
    `clip_norm / (global_norm + 1e-6)`. Kept Paddle's so that a run ported from Paddle gives
    Paddle's numbers. Like Paddle, the coefficient is cast to a bf16 / fp16 grad's dtype
    before the multiply.

    Args:
        clip_norm: the max global L2 norm, a finite float > 0.
    Attributes:
        clip_norm: as given (float).
        global_norm: the norm before clipping of the last call, a 0-d fp32 tensor on the grads'
            device (None before the first call); equal on every rank of the job (torch's
            `clip_grad_norm_` returns it).
    Raises TypeError / ValueError for a clip_norm that is not a finite number > 0.
    """

    def __init__(self, clip_norm):
        if isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float)):
            raise TypeError(f"clip_norm must be a float, got {type(clip_norm).__name__}")
        if not (math.isfinite(clip_norm) and clip_norm > 0):
            raise ValueError(f"clip_norm must be a finite number > 0, got {clip_norm}; pass "
                             "e.g. ClipGradByGlobalNorm(1.0)")
        self.clip_norm = float(clip_norm)
        self.global_norm = None

    def __repr__(self):
        return f"ClipGradByGlobalNorm(clip_norm={self.clip_norm})"

    @torch.no_grad()
    def __call__(self, params_grads, groups=(), device=None):
        """Clip `params_grads` by the norm summed over `groups`; returns `params_grads`.

        Args:
            params_grads: list of `(param, grad)`; `grad` is the tensor the optimizer will
                read (any shape; fp32, bf16 or fp16; a view is scaled in place) or None
                (skipped). `param` carries the flags: `need_clip=False` leaves the pair out of
                the sum and unscaled (Paddle's), `is_firstly_shared=False` leaves it out of the
                sum only (a tied weight's later copy, counted by its first holder).
            groups: process groups to all-reduce (SUM) the fp32 sum of squares over, in order,
                e.g. `norm_groups(hcg)`. Every rank of each group must call with the same
                groups, also when it has nothing to count.
            device: where the sum lives when no grad is given (default: the first grad's
                device, else cpu); pass the collective's device under nccl.
        """
        pairs = [(p, g) for p, g in params_grads
                 if g is not None and getattr(p, "need_clip", True)]
        squares = [g.float().square().sum() for p, g in pairs  # fp32 whatever the grad dtype
                   if getattr(p, "is_firstly_shared", True)]
        if device is None:
            device = pairs[0][1].device if pairs else torch.device("cpu")
        total = (torch.stack(squares).sum() if squares
                 else torch.zeros((), dtype=torch.float32, device=device))
        for group in groups:
            dist.all_reduce(total, group=group)
        self.global_norm = total.sqrt()
        clip = torch.tensor(self.clip_norm, dtype=torch.float32, device=self.global_norm.device)
        coef = clip / (torch.maximum(self.global_norm, clip) + EPS)
        for _, g in pairs:
            g.mul_(coef.to(g.dtype))
        return params_grads
