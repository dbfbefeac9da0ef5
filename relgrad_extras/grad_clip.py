"""Clipping by the global grad norm of a model split over pipeline stages and sharding ranks.

Mirrors Paddle's `ClipGradByGlobalNorm` (python/paddle/nn/clip.py) as it runs inside
`HybridParallelClipGrad` (`fleet/meta_optimizers/dygraph_optimizer/hybrid_parallel_optimizer.py`):
the user hands `ClipGradByGlobalNorm(clip_norm)` to the optimizer (here: the sharding wrappers'
`grad_clip=` keyword, or `PipelineParallel.train_batch(..., grad_clip=)` beside a plain torch
optimizer), and it runs once per step on the *reduced* grads, after every collective and before
the inner optimizer step (and so before a released buffer is freed).

The sum itself (fp32 squares of what each rank steps, all-reduced over sharding then pipe) is
the core's `sharding.clip_grads_by_global_norm`, which the wrappers' torch-shaped
`opt.clip_grad_norm_(max_norm)` also calls; this class only keeps Paddle's object and
coefficient. Copy this folder beside the card's modules to use it.

Leaves out: mp-split ("distributed") params and their separate sum, `auto_skip_clip`,
`group_name`, SELECTED_ROWS grads.

References: Paddle's HybridParallelClipGrad; Pascanu et al., "On the difficulty of training
recurrent neural networks" (2013); torch's `torch.nn.utils.clip_grad_norm_`.
"""
import math

from sharding import clip_grads_by_global_norm, norm_groups  # noqa: F401 (norm_groups: re-export)

EPS = 1e-6  # Paddle's (and torch's) epsilon in the coefficient's denominator


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
        `sharding.clip_grads_by_global_norm` for the flags and the collectives."""
        self.global_norm = clip_grads_by_global_norm(params_grads, self.clip_norm, groups,
                                                     device, coefficient="paddle")
        return params_grads
