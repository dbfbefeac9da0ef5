"""Clipping by the global grad norm of a model split over pipeline stages and sharding ranks.

Mirrors Paddle's `ClipGradByGlobalNorm` (python/paddle/nn/clip.py) as it runs inside
`HybridParallelClipGrad` (`fleet/meta_optimizers/dygraph_optimizer/hybrid_parallel_optimizer.py`):
the user hands `ClipGradByGlobalNorm(clip_norm)` to the optimizer (here: the sharding wrappers'
`grad_clip=` keyword, or `PipelineParallel.train_batch(..., grad_clip=)` beside a plain torch
optimizer), and it runs once per step on the *reduced* grads, after every collective and before
the inner optimizer step (and so before a released buffer is freed).

The sum itself (fp32 squares of what each rank steps, all-reduced over sharding then pipe) is
`clip_grads_by_global_norm` below, which the wrappers' torch-shaped
`opt.clip_grad_norm_(max_norm)` also calls; this class only keeps Paddle's object and
coefficient. Copy this folder beside the four core modules to use it.

Leaves out: mp-split ("distributed") params and their separate sum, `auto_skip_clip`,
`group_name`, SELECTED_ROWS grads.

References: Paddle's HybridParallelClipGrad; Pascanu et al., "On the difficulty of training
recurrent neural networks" (2013); torch's `torch.nn.utils.clip_grad_norm_`.
"""
import math

import torch
import torch.distributed as dist

from comm_buffer import main_grad_or_grad as _grad
from relgrad_extras.checkpoint import local_slices

CLIP_EPS = 1e-6  # Paddle's (and torch's) epsilon in the coefficient's denominator
EPS = CLIP_EPS


class ClipGradByGlobalNorm:
    """Scale grads in place by `clip_norm / (max(global_norm, clip_norm) + 1e-6)` (Paddle's).

    The coefficient is Paddle's, not torch's: with the norm below `clip_norm`, grads are still
    multiplied by `clip_norm / (clip_norm + 1e-6)` (torch's `clip_grad_norm_`, and the
    wrappers' `opt.clip_grad_norm_`, clamp it to exactly 1 there). Above `clip_norm` the two
    agree: `clip_norm / (global_norm + 1e-6)`. Kept Paddle's so that a run ported from Paddle
    gives Paddle's numbers. Like Paddle, the coefficient is cast to a bf16 / fp16 grad's dtype
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

    def __call__(self, params_grads, groups=(), device=None):
        """Clip `params_grads` (list of `(param, grad)`) by the norm summed over `groups`
        (e.g. `norm_groups(hcg)`); returns `params_grads`. See
        `clip_grads_by_global_norm` for the flags and the collectives."""
        self.global_norm = clip_grads_by_global_norm(params_grads, self.clip_norm, groups,
                                                     device, coefficient="paddle")
        return params_grads


def norm_groups(hcg):
    """The groups that sum a rank's squares into the model's norm: sharding, then pipe."""
    groups = []
    if hcg.get_sharding_parallel_world_size() > 1:
        groups.append(hcg.get_sharding_parallel_group())
    if hcg.get_pipe_parallel_world_size() > 1:
        groups.append(hcg.get_pipe_parallel_group())
    return groups


def check(grad_clip):
    """TypeError unless `grad_clip` is a Paddle-style clip: `clip_norm`, and
    `grad_clip(params_grads, groups, device)` (the sharding optimizers' and train_batch's)."""
    if not (callable(grad_clip) and hasattr(grad_clip, "clip_norm")):
        raise TypeError(f"grad_clip must be None or a Paddle-style clip (relgrad_extras.grad_clip"
                        f"), got {type(grad_clip).__name__}; torch's: opt.clip_grad_norm_(c)")


@torch.no_grad()
def clip_grads_by_global_norm(params_grads, max_norm, groups=(), device=None, coefficient="paddle"):
    """Scale `params_grads` (what this rank steps) in place by the L2 norm over `groups` (fp32;
    `need_clip=False`: out, `is_firstly_shared=False`: uncounted) by "paddle": `max_norm /
    (max(norm, max_norm) + 1e-6)` or "torch": `min(max_norm / (norm + 1e-6), 1)`. Returns it."""
    pairs = [(p, g) for p, g in params_grads if g is not None and getattr(p, "need_clip", True)]
    squares = []  # in fp32 on every rank, whatever the grads' dtype (torch: the grads' own)
    for p, g in pairs:
        if getattr(p, "is_firstly_shared", True):
            squares.append(g.float().square().sum())
    device = device or (pairs[0][1].device if pairs else torch.device("cpu"))
    total = (torch.stack(squares).sum() if squares
             else torch.zeros((), dtype=torch.float32, device=device))
    for group in groups:
        dist.all_reduce(total, group=group)
    norm = total.sqrt()
    clip = torch.tensor(float(max_norm), dtype=torch.float32, device=norm.device)
    coef = (clip / (torch.maximum(norm, clip) + CLIP_EPS) if coefficient == "paddle"
            else torch.clamp(clip / (norm + CLIP_EPS), max=1.0))
    for _, g in pairs:
        g.mul_(coef.to(g.dtype))
    return norm


def clip_rules(args=None, grad_clip=None):
    """clip_grad_norm_'s argument checks as `(rule, detail)` for `agree` (None: unseen)."""
    max_norm, norm_type = args or (1.0, 2.0)
    number = isinstance(max_norm, (int, float)) and not isinstance(max_norm, bool)
    good = number and math.isfinite(max_norm) and max_norm > 0
    return [("clip_grad_norm_: max_norm must be a finite number > 0; pass e.g. 1.0",
             None if good else f"max_norm={max_norm!r}"),
            ("clip_grad_norm_: only norm_type=2 (the L2 norm) is supported over sharded grads",
             None if str(norm_type) in ("2", "2.0") else f"norm_type={norm_type!r}"),
            ("clip_grad_norm_ on an optimizer built with grad_clip= would clip twice; use one",
             f"grad_clip={grad_clip!r}" if args and grad_clip is not None else None)]


def clip_pairs(opt):
    """What a clip reads on v1 / v2: `(param, reduced grad)` for what this rank steps (v1: the
    params it owns; v2: its slice of each param, without padding)."""
    if not opt._is_v2:
        return [(p, _grad(p)) for p in opt._parameter_list if opt._param2rank[p] == opt._rank]
    pairs = []
    for param, piece in local_slices(opt).items():
        grad = _grad(opt._slice_params[param])
        if grad is not None:
            pairs.append((param, grad[: piece[1]]))
    return pairs


@torch.no_grad()
def clip_grad_norm_(opt, max_norm, norm_type=2.0, error_if_nonfinite=False):
    """The sharding optimizers' `clip_grad_norm_` (torch's, as FSDP's): step()'s first half on
    every rank, then this rank's reduced grads clipped by the global L2 norm; returns it."""
    opt._first_half(("clip_grad_norm_", max_norm, norm_type, error_if_nonfinite),
                    clip_rules((max_norm, norm_type), opt._grad_clip))
    norm = clip_grads_by_global_norm(clip_pairs(opt), max_norm, norm_groups(opt._hcg),
                                     opt._flags_device(), coefficient="torch")
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(f"clip_grad_norm_: the total norm of the grads is {norm.item()}, "
                           "non-finite; pass error_if_nonfinite=False to clip anyway")
    return norm
