"""Agree across ranks, before any grad collective, on which params have a grad and on misuse.

Not in Paddle: its sharding and dp syncs skip a param whose grad is None on *this* rank, so a
param that one rank's loss left out makes the ranks issue different collectives (a hang), and a
misuse seen by one rank (a model moved behind the optimizer's back) raises on that rank alone
while the others block in the next collective. Here every rank first sums a few int flags over
its groups in one small all-reduce per group: one flag per misuse rule, one per param "this
rank has a grad". A rule seen anywhere raises on every rank; a param is stepped iff some rank
produced a grad for it, the ranks without one contributing zeros (torch's semantics for a
single process; DDP does the same for unused params).

Used by `sharding.py` (v1 / v2 `step()`) and `pipeline.py` (`_optimizer_step`'s dp all-reduce).
"""
import torch
import torch.distributed as dist

from comm_buffer import all_reduce_mean, main_grad_or_grad as _grad


def agree(has_grad, rules, groups, device):
    """Sum `[rule flags..., has_grad flags...]` (1-D int32, len(rules) + len(has_grad)
    elements, 0 / 1 each) over each of `groups` in turn: one small all-reduce per group.
    Not in Paddle (see the module docstring).

    Args:
        has_grad: list of bool, one per param (this rank holds a grad for it).
        rules: list of `(rule, detail)`: `rule` the error text (same on every rank), `detail`
            what this rank saw (str) or None if it saw nothing wrong.
        groups: process groups to sum over, in order (e.g. sharding, then dp); None = WORLD.
        device: where the flags tensor lives (the params' device: nccl needs cuda).
    Returns a list of bool, one per param: some rank of `groups` has a grad for it.
    Raises ValueError on every rank of `groups` for the first rule any rank saw, with this
    rank's detail when it saw it.
    """
    local = [int(detail is not None) for _, detail in rules] + [int(h) for h in has_grad]
    flags = torch.tensor(local, dtype=torch.int32, device=device)
    for group in groups:
        dist.all_reduce(flags, group=group)
    counts = flags.tolist()
    for (rule, detail), count in zip(rules, counts):
        if count:
            here = f"; on this rank: {detail}" if detail is not None else ""
            raise ValueError(f"{rule} (seen on {count} rank(s) of the group{here})")
    return [c > 0 for c in counts[len(rules):]]


@torch.no_grad()
def fill_missing_grads(params, anywhere):
    """Give each param that some rank has a grad for, and this rank not, a zero grad.

    The zero goes where the optimizer reads: fp32 `main_grad` for a param that keeps one
    (`register_main_grad_hooks`), else `grad` in the param's dtype. Returns the filled params.
    """
    filled = []
    for p, some_rank in zip(params, anywhere):
        if some_rank and _grad(p) is None:
            if hasattr(p, "main_grad"):
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            else:
                p.grad = torch.zeros_like(p)
            filled.append(p)
    return filled


@torch.no_grad()
def agreed_all_reduce_mean(params, group):
    """dp sync of `params`' grads (Paddle's HybridParallelOptimizer `_hybrid_sync_grad` ->
    `fused_allreduce_gradients`, unfused) with the same collectives on every rank of
    `group`: agree which params have a grad anywhere, fill zeros, all-reduce the mean in
    place (grads keep their dtype; fp32 `main_grad` where set). A param without a grad on
    every rank keeps None (not stepped)."""
    params = list(params)
    if not params:
        return
    anywhere = agree([_grad(p) is not None for p in params], [], [group], params[0].device)
    fill_missing_grads(params, anywhere)
    all_reduce_mean([_grad(p) for p, a in zip(params, anywhere) if a], group)
