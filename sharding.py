"""ZeRO-1 sharding optimizers with `release_gradients`: Paddle's DygraphShardingOptimizer v1 / v2.

Mirrors `DygraphShardingOptimizer` (v1) and `DygraphShardingOptimizerV2` (v2, `split_param`) in
`python/paddle/distributed/fleet/meta_optimizers/dygraph_optimizer/dygraph_sharding_optimizer.py`
at commit 9b40c67f672f, with the seed diff's hunks (PR #59739).

Both split the optimizer state over the sharding group (ZeRO stage 1): every rank keeps the full
params and computes full grads on its own data. v1 gives each *whole* param to one owner rank
(greedy, largest first): grads are reduced to the owner, the owner steps, and every param is
broadcast from its owner. v2 lays each bucket's params into one *flat padded buffer* and gives
each rank a contiguous shard of it: grads are reduce-scattered in place, each rank steps 1-D
slice params over its shard, and the param buffer is all-gathered back. With release the grad
buffers (v2's own, or the pipeline's) live from the first grad of a step to `clear_grad`.
Phases of `step()`: agree (one small all-reduce of flags: which params have a grad on some
rank, misuse seen anywhere) -> reduce -> dp all-reduce (dp > 1) -> clip (`grad_clip`) -> step
owned params / slices -> broadcast / all-gather. Both keep torch's optimizer contract
(the torch optimizer surface section).

Without a pipeline, `sharding_configs.comm_overlap` (sharding's own tensor-fusion overlap)
registers the buffers' hooks in the optimizer itself, so each bucket's reduce (v1, buckets
grouped by owner) or reduce-scatter (v2) overlaps the last backward; `free_grads_in_comm`
[later] frees what a rank will not read as soon as the collective is done, bucket by bucket
during that backward (`comm_buffer.share_comm_queue`). Bucket size: [later]
`sharding_configs.comm_buffer_size_MB` (256 MB if unset, Paddle's default).

Leaves out: v1's fused params and fused optimizer, offload, color sharding,
torch.amp.GradScaler (refused with a clear error).

References: Paddle PRs #59739, #58462, #58621, #64517 (sharding-side release flag);
Rajbhandari et al., "ZeRO" (2020); torch's ZeroRedundancyOptimizer.
"""
import importlib
import inspect
import math
import weakref
import zlib
from collections import OrderedDict

import torch
import torch.distributed as dist

from comm_buffer import (HOOK_ACTION, FusedCommBuffer, _grad_of, _set_grad, _share_param_buffer,
                         all_reduce_mean, assign_group_by_size, bw_hook_func,
                         check_current_device, densify_grads, global_rank,
                         main_grad_or_grad as _grad, share_comm_queue)


# ============================================================================================
# The torch optimizer surface (param_groups / state live, hooks, state_dict)
# ============================================================================================

# The torch optimizer face of the wrappers (`MixPrecisionOptimizer`, sharding v1 / v2).
#
# Paddle's wrappers forward to the inner optimizer by `__getattr__`; a torch user instead reaches
# for `torch.optim.Optimizer`'s own API (LR schedulers read `param_groups`, checkpoints call
# `state_dict`, libraries register hooks). `_Wrapper` keeps that API: each public method of
# `torch.optim.Optimizer` (torch 2.13) works through the wrapper or raises naming the alternative.
# `param_groups` and `state` are read from the inner optimizer on every access, never cached:
# torch's `load_state_dict` replaces both objects, and a cached reference would leave an LR
# scheduler driving a dead dict.

# The registries torch.optim.Optimizer.__init__ creates (torch 2.13); ours start empty.
_HOOK_REGISTRIES = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                    "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                    "_optimizer_load_state_dict_pre_hooks",
                    "_optimizer_load_state_dict_post_hooks")

GRAD_SCALER_MSG = (
    "torch.amp.GradScaler cannot drive this optimizer: its unscale_ and inf check read each "
    "rank's own grads before the sharding reduce (and v2's slice grads are bound only inside "
    "step()), so ranks would step on partly scaled grads or skip the step apart. Train without "
    "loss scaling: bf16 params with fp32 main grads (comm_buffer.register_main_grad_hooks) "
    "need none.")


def clear_grad_func(p, set_to_zero):
    """Zero `p`'s main_grad / grad in place, or drop them (Paddle's clear_grad_func)."""
    for name in ("main_grad", "grad"):
        g = getattr(p, name, None)
        if g is not None:
            if set_to_zero:
                g.zero_()
            else:
                setattr(p, name, None)


class _Wrapper(torch.optim.Optimizer):
    """Common torch face of the wrappers; subclasses set `self._inner_opt` and call `_expose`.

    - `param_groups`, `state`: the inner optimizer's, re-read on each access (so LR schedulers
      keep working after `load_state_dict`). For v1 they hold this rank's owned params, for v2
      its slice params, and fp32 masters stand in for low-precision params.
    - `zero_grad(set_to_none)` is `clear_grad(set_to_zero=not set_to_none)`.
    - `state_dict()` / `load_state_dict()`: this rank's state, through torch's state-dict
      pre / post hooks registered on the wrapper.
    - `register_step_pre_hook` / `register_step_post_hook`: torch's own, around the wrapper's
      `step()` (global hooks from `register_optimizer_step_*_hook` also see the inner step).
    - `add_param_group`: raises ValueError unless the subclass implements it.
    - `step(closure)` with a closure, or driven by `torch.amp.GradScaler`, raises ValueError.
    - pickling / `copy.deepcopy` raise TypeError (copy `state_dict()` instead).
    """

    # GradScaler then hands the scale to step() (as `grad_scale` / `found_inf` attributes)
    # instead of unscaling param_groups' grads itself; step() refuses it (GRAD_SCALER_MSG).
    _step_supports_amp_scaling = True

    def _expose(self, inner):
        # What torch.optim.Optimizer.__init__ sets up, minus its param_groups / state lists.
        self.defaults = inner.defaults
        for name in _HOOK_REGISTRIES:
            setattr(self, name, OrderedDict())
        self._patch_step_function()  # torch's step pre / post hooks around our step()

    @property
    def param_groups(self):
        """The inner optimizer's param groups (a live view: LR changes reach the step)."""
        return self._inner_opt.param_groups

    @property
    def state(self):
        """The inner optimizer's per-param state (keys: owned / slice params or masters)."""
        return self._inner_opt.state

    def __getstate__(self):
        # torch's pickles param_groups / state as plain attributes, which would shadow ours.
        raise TypeError(f"{type(self).__name__} cannot be pickled or deep-copied (its "
                        "param_groups and state are the inner optimizer's; the sharding "
                        "wrappers also hold process groups); save or copy state_dict() instead")

    def _check_step_args(self, closure):
        """Raise ValueError, on every rank alike, for a closure or a driving GradScaler."""
        if closure is not None:
            raise ValueError("closure is not supported by the sharding wrappers; call the "
                             "model yourself and then step()")
        if getattr(self, "grad_scale", None) is not None:
            raise ValueError(GRAD_SCALER_MSG)
        if hasattr(self._inner_opt, "check_template"):  # v1 / v2: before any collective
            self._inner_opt.check_template()

    def zero_grad(self, set_to_none=True):
        """torch's spelling of `clear_grad(set_to_zero=not set_to_none)`, same rules."""
        self.clear_grad(set_to_zero=not set_to_none)

    def add_param_group(self, param_group):
        """Not supported by this wrapper: raises ValueError naming the alternative."""
        raise ValueError(f"{type(self).__name__} cannot add a param group after it was built "
                         "(the new params would need their own slots in the flat buffers); "
                         "build the torch optimizer with every group first, e.g. "
                         "SGD([{'params': a}, {'params': b, 'lr': ...}]), then wrap it")

    def state_dict(self):
        """This rank's optimizer state (its shard of it, for v1 and v2), through torch's
        state_dict pre-hooks (`hook(opt)`) and post-hooks (`hook(opt, sd) -> sd or None`)."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        state_dict = self._local_state_dict()
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict):
        """Load what this rank's `state_dict()` returned, through torch's load_state_dict
        pre-hooks (`hook(opt, sd) -> sd or None`, on a shallow copy) and post-hooks."""
        state_dict = state_dict.copy()
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._load_local_state_dict(state_dict)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _local_state_dict(self):
        return self._inner_opt.state_dict()

    def _load_local_state_dict(self, state_dict):
        self._inner_opt.load_state_dict(state_dict)


_clear = clear_grad_func


# ============================================================================================
# Agreement across ranks on grads and misuse (one small all-reduce of flags)
# ============================================================================================

# Agree across ranks, before any grad collective, on which params have a grad and on misuse.
#
# Not in Paddle: its sharding and dp syncs skip a param whose grad is None on *this* rank, so a
# param that one rank's loss left out makes the ranks issue different collectives (a hang), and a
# misuse seen by one rank (a model moved behind the optimizer's back) raises on that rank alone
# while the others block in the next collective. Here every rank first sums a few int flags over
# its groups in one small all-reduce per group: one flag per misuse rule, one per param "this
# rank has a grad". A rule seen anywhere raises on every rank; a param is stepped iff some rank
# produced a grad for it, the ranks without one contributing zeros (torch's semantics for a
# single process; DDP does the same for unused params).
#
# Used by `sharding.py` (v1 / v2 `step()`) and `pipeline.py` (`_optimizer_step`'s dp all-reduce).

def agree(has_grad, rules, groups, device, same=None):
    """Sum `[rule flags..., has_grad flags...]` (1-D int32, len(rules) + len(has_grad)
    elements, 0 / 1 each; with `same`, 3 more) over each of `groups` in turn: one small
    all-reduce per group. Not in Paddle (see the module docstring).

    Args:
        has_grad: list of bool, one per param (this rank holds a grad for it).
        rules: list of `(rule, detail)`: `rule` the error text (same on every rank), `detail`
            what this rank saw (str) or None if it saw nothing wrong.
        groups: process groups to sum over, in order (e.g. sharding, then dp); None = WORLD.
        device: where the flags tensor lives (the params' device: nccl needs cuda).
        same: None, or `(rule, code, detail)`: `code` an int in [0, 4096) that must be the
            same on every rank (e.g. which call opened the step, with which arguments);
            `detail` what this rank's code stands for. Summed as code, code^2 and 1: all
            codes are equal iff (sum code)^2 == ranks * sum code^2.
    Returns a list of bool, one per param: some rank of `groups` has a grad for it.
    Raises ValueError on every rank of `groups` for the first rule any rank saw, with this
    rank's detail when it saw it, then for codes that differ.
    """
    local = [int(detail is not None) for _, detail in rules] + [int(h) for h in has_grad]
    if same is not None:
        assert 0 <= same[1] < 4096, same  # the square sum stays within int32
        local += [same[1], same[1] * same[1], 1]
    flags = torch.tensor(local, dtype=torch.int32, device=device)
    for group in groups:
        dist.all_reduce(flags, group=group)
    counts = flags.tolist()
    for (rule, detail), count in zip(rules, counts):
        if count:
            here = f"; on this rank: {detail}" if detail is not None else ""
            raise ValueError(f"{rule} (seen on {count} rank(s) of the group{here})")
    if same is not None:
        (total, squares, n), counts = counts[-3:], counts[:-3]
        if total * total != squares * n:
            raise ValueError(f"{same[0]} (here: {same[2]})")
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
    densify_grads(params)  # sparse grads: dense sums, as a dense grad would hold
    anywhere = agree([_grad(p) is not None for p in params], [], [group], params[0].device)
    fill_missing_grads(params, anywhere)
    all_reduce_mean([_grad(p) for p, a in zip(params, anywhere) if a], group)


# ============================================================================================
# fp32 master weights: MixPrecisionOptimizer
# ============================================================================================

# fp32 master weights for low-precision params: Paddle's `MixPrecisionOptimizer` in torch.
#
# Mirrors `MixPrecisionOptimizer` in
# `python/paddle/distributed/fleet/utils/mix_precision_utils.py` at commit 9b40c67f672f, plus the
# fp32 master weights that Paddle's `multi_precision` optimizers keep (torch optimizers have none).
# Sharding v1 / v2 step their owned params / slice params through it.

def _hyper(group):
    return {k: v for k, v in group.items() if k != "params"}


def _needs_master(t):
    # bf16 / fp16 only: an fp64 param steps in fp64 (an fp32 master would round it).
    return t.is_floating_point() and t.element_size() < 4


class MixPrecisionOptimizer(_Wrapper):
    """Step `optimizer`'s class and hyper-parameters on fp32 masters, reading `main_grad`.

    Each *target* (a model param, or a v2 slice param) of dtype bf16 / fp16 gets an fp32
    master; `step()` feeds it `main_grad` (fp32) or the grad, steps, copies the master back
    into the target and drops the master's grad, so no reference outlives the step (a released
    buffer must be freeable). fp32 / fp64 targets are stepped directly (a pass-through). A
    target written since the last copy-back (the model's weights loaded or changed after the
    optimizer was built) has its master reloaded from it at the next `step()`, as Megatron
    reloads model params into its masters: the loaded value is what trains.

    Args:
        optimizer: a torch optimizer; used as a template (class, groups, hyper-parameters).
        params: one list of targets per param group of `optimizer`; default its own params.
            Targets may be empty placeholders filled later (v2 slices); masters follow them.
    `param_groups` / `state` hold the masters in place of low-precision targets.
    Raises ValueError for a param given twice, and if `step()` gets a closure or is driven
    by `torch.amp.GradScaler`.
    """

    def __init__(self, optimizer, params=None):
        if carries_state(optimizer):  # the sharding wrappers agree on this first
            raise ValueError(f"{template_state_message(type(self).__name__, optimizer)}; "
                             f"it holds state for {len(optimizer.state)} param(s)")
        if params is None:
            params = [g["params"] for g in optimizer.param_groups]
        self._targets, self._masters = [], {}
        groups = [self._master_group(group, targets)
                  for group, targets in zip(optimizer.param_groups, params)]
        self._inner_opt = _rebuilt(optimizer, groups)
        self._expose(self._inner_opt)
        # The template's hyper-parameters as built: an LR scheduler built on the template
        # (before wrapping) would change them there, where nothing steps (check_template).
        self._template = optimizer
        self._template_hyper = [_hyper(g) for g in optimizer.param_groups]

    def _master_group(self, group, targets):
        """`group`'s hyper-parameters over `targets`, masters in place of bf16 / fp16 ones."""
        targets = [targets] if isinstance(targets, torch.Tensor) else list(targets)
        known = {id(t) for t in self._targets}
        if any(id(t) in known for t in targets) or len({id(t) for t in targets}) < len(targets):
            raise ValueError("some params are already in the optimizer (or repeated); a param "
                             "belongs to one group")
        self._targets += targets
        self._masters.update({t: t.detach().float() for t in targets if _needs_master(t)})
        return {**_hyper(group), "params": [self._masters.get(t, t) for t in targets]}

    def check_template(self):
        """Raise ValueError if the torch optimizer passed in had its hyper-parameters changed
        since (e.g. by an LR scheduler built on it before wrapping): they never reach the
        steps, which read `self.param_groups`. Rank-independent (every rank runs the same
        scheduler), so the sharding wrappers call it before any collective."""
        for i, (group, built) in enumerate(zip(self._template.param_groups,
                                               self._template_hyper)):
            changed = {k: (built.get(k), v) for k, v in _hyper(group).items()
                       if built.get(k) != v and k != "initial_lr"}
            if changed:
                raise ValueError(f"the torch optimizer that was wrapped changed after wrapping "
                                 f"(group {i}, (built, now): {changed}), e.g. by an LR scheduler "
                                 "built on it; the wrapper steps with its own param_groups. "
                                 "Build the scheduler on the wrapper, set the values there")

    def add_param_group(self, param_group):
        """torch's `add_param_group`: the new targets get masters as at construction."""
        self._inner_opt.add_param_group(self._master_group(param_group, param_group["params"]))

    @torch.no_grad()
    def _reload_changed(self, pairs):
        """Reload each master of `pairs` ((target, master), with a grad this step) whose
        target no longer equals it: written behind our back (e.g. model.load_state_dict
        after the optimizer was built). Beyond Paddle. Compared by value: `_version` misses
        writes through another view of the same buffer into a v2 slice rebound with
        `.data =`. One host sync per step (one batched `tolist()`), not one per param."""
        if not pairs:
            return
        differs = torch.stack([(master.to(t.dtype) != t).any() for t, master in pairs]).tolist()
        for (t, master), changed in zip(pairs, differs):
            if changed:
                master.copy_(t)

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step on every target that has a main_grad or grad (others skipped)."""
        self._check_step_args(closure)
        self.check_template()
        bound, with_grad = [], []
        for t in self._targets:
            main_grad, master = getattr(t, "main_grad", None), self._masters.get(t)
            if master is not None:
                grad = _grad(t)
                if grad is not None and master.shape != t.shape:  # a v2 slice filled late
                    master.data = t.detach().float()
                elif grad is not None:
                    with_grad.append((t, master))
                master.grad = None if grad is None else grad.float()  # no copy for fp32
                bound.append(master)
            elif main_grad is not None:  # fp32 param with an fp32 main_grad
                t.grad = main_grad
                bound.append(t)
        self._reload_changed(with_grad)
        self._inner_opt.step()
        for t, master in self._masters.items():
            if master.grad is not None:
                t.copy_(master)
        for p in bound:
            p.grad = None

    @torch.no_grad()
    def clear_grad(self, set_to_zero=True):
        """Zero every target's main_grad / grad in place, or drop them (Paddle's clear_grad)."""
        for t in self._targets:
            _clear(t, set_to_zero)

    def _local_state_dict(self):
        """The inner optimizer's state plus the fp32 masters (in target order)."""
        return {"inner": self._inner_opt.state_dict(),
                "masters": [m.clone() for m in self._masters.values()]}

    def _load_local_state_dict(self, state_dict):
        """Load what `state_dict()` returned, masters included; a target that differs from
        its loaded master at the next step (the model not loaded alike) reloads it."""
        if "inner" not in state_dict:  # a plain torch optimizer's state_dict(), same params
            self._inner_opt.load_state_dict(state_dict)  # masters stay the targets' values
            return
        self._inner_opt.load_state_dict(state_dict["inner"])
        for m, saved in zip(self._masters.values(), state_dict["masters"]):
            m.data = saved.clone()


def _rebuilt(optimizer, groups):
    """A new optimizer of `optimizer`'s class and hyper-parameters over `groups`."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return type(optimizer)(groups, **kwargs)  # AdamW's defaults hold extra keys


def carries_state(optimizer):
    """True if `optimizer` holds state that a new one over the same params would not have
    (it was stepped or loaded). Some optimizers (Adagrad) create their state when built:
    that initial state is compared with a fresh optimizer's, not counted."""
    if not optimizer.state:
        return False
    fresh = _rebuilt(optimizer, [{**_hyper(g), "params": g["params"]}
                                 for g in optimizer.param_groups])
    for p, state in optimizer.state.items():
        new = fresh.state.get(p, {})
        if set(state) != set(new) or not all(
                torch.equal(torch.as_tensor(v), torch.as_tensor(new[k]))
                for k, v in state.items()):
            return True
    return False


def template_state_message(wrapper, optimizer):
    """The error for a torch optimizer that already has state when it is wrapped."""
    return (f"the torch optimizer handed to {wrapper} ({type(optimizer).__name__}) already has "
            "state (it was stepped or loaded); the "
            "wrapper uses it only as a template (class, groups, hyper-parameters) and would "
            "drop that state. Wrap a fresh optimizer, then call "
            "wrapper.load_state_dict(saved_optimizer_state_dict) (a plain torch state_dict "
            "is accepted)")


# ============================================================================================
# Clipping by the global norm (the torch-shaped clip_grad_norm_)
# ============================================================================================

# Clipping by the global grad norm of a model split over sharding ranks and pipeline stages, as
# Paddle's HybridParallelClipGrad runs it: each rank sums the squares of the grads its optimizer
# steps (what it owns; v2: its slices without padding), in fp32 whatever the grad dtype, so that
# every element is counted on exactly one sharding rank; the partial sums are all-reduced over
# the sharding group, then the pipe group (`norm_groups`); dp replicas hold equal grads after the
# dp all-reduce, so dp is not summed. A tied copy with `is_firstly_shared=False` is scaled but not
# counted; `need_clip=False` leaves a param out of both. Every rank issues the all-reduces, also
# with nothing to count (it adds 0). Phases: square and sum -> all-reduce -> scale.
# The wrappers' torch-shaped `clip_grad_norm_` and `relgrad_extras.grad_clip`'s
# ClipGradByGlobalNorm (Paddle's class, passed as `grad_clip=`) both call
# `clip_grads_by_global_norm`; they differ only in the coefficient (see there).

CLIP_EPS = 1e-6  # Paddle's (and torch's) epsilon in the coefficient's denominator


def norm_groups(hcg):
    """The groups whose all-reduce (SUM) turns a rank's squares into the model's: sharding (if
    sharding_degree > 1), then pipe (if pp_degree > 1), as in Paddle's HybridParallelClipGrad.

    Reads `hcg.get_{sharding,pipe}_parallel_{world_size,group}()`. Returns a list of groups.
    """
    groups = []
    if hcg.get_sharding_parallel_world_size() > 1:
        groups.append(hcg.get_sharding_parallel_group())
    if hcg.get_pipe_parallel_world_size() > 1:
        groups.append(hcg.get_pipe_parallel_group())
    return groups


@torch.no_grad()
def clip_grads_by_global_norm(params_grads, max_norm, groups=(), device=None,
                              coefficient="paddle"):
    """Scale grads in place by the global L2 norm summed over `groups`; return that norm.

    Args:
        params_grads: list of `(param, grad)`; `grad` is the tensor the optimizer will read
            (any shape; fp32, bf16 or fp16; a view is scaled in place) or None (skipped).
            `param` carries the flags `need_clip` (False: out of the sum, unscaled; Paddle's)
            and `is_firstly_shared` (False: out of the sum only; a tied weight's later copy).
        max_norm: float > 0.
        groups: process groups to all-reduce (SUM) the fp32 sum of squares over, in order,
            e.g. `norm_groups(hcg)`. Every rank of each group must call with the same groups.
        device: where the sum lives when no grad is given (default: the first grad's device,
            else cpu); pass the collective's device under nccl.
        coefficient: "paddle": `max_norm / (max(norm, max_norm) + 1e-6)`, also applied when
            the norm is below max_norm (Paddle's ClipGradByGlobalNorm); "torch":
            `min(max_norm / (norm + 1e-6), 1)` (torch's `clip_grad_norm_`). Above max_norm
            the two agree. The coefficient is cast to a bf16 / fp16 grad's dtype, as both do.
    Returns the norm before clipping, a 0-d fp32 tensor, equal on every rank of `groups`.
    Mirrors Paddle's `HybridParallelClipGrad._dygraph_clip` (no mp-split params).
    """
    pairs = [(p, g) for p, g in params_grads if g is not None and getattr(p, "need_clip", True)]
    squares = [g.float().square().sum() for p, g in pairs  # fp32 whatever the grad dtype
               if getattr(p, "is_firstly_shared", True)]
    if device is None:
        device = pairs[0][1].device if pairs else torch.device("cpu")
    total = (torch.stack(squares).sum() if squares
             else torch.zeros((), dtype=torch.float32, device=device))
    for group in groups:
        dist.all_reduce(total, group=group)
    norm = total.sqrt()
    clip = torch.tensor(float(max_norm), dtype=torch.float32, device=norm.device)
    if coefficient == "paddle":
        coef = clip / (torch.maximum(norm, clip) + CLIP_EPS)
    else:
        coef = torch.clamp(clip / (norm + CLIP_EPS), max=1.0)
    for _, g in pairs:
        g.mul_(coef.to(g.dtype))
    return norm


# ============================================================================================
# Per-rank checkpoints (consolidated ones: relgrad_extras/checkpoint.py)
# ============================================================================================

LAYOUT_KEY = "sharding_layout"  # tags a per-rank state_dict() with the layout it fits
_FIX = ("save the dict that opt.consolidate_state_dict(to=0) returns on rank 0 (every rank "
        "calls it) and pass that dict to load_state_dict on every rank: it loads into any "
        "sharding degree")


# ---------------------------------------------------------------- what this rank holds

def _is_v2(opt):
    return hasattr(opt, "_slice_params")


def _targets(opt):
    """The tensors the inner optimizer steps, in its param order (v1 params, v2 slices)."""
    return opt._inner_opt._targets


def _masters(opt):
    """target -> fp32 master, for the targets that have one (MixPrecisionOptimizer's)."""
    return opt._inner_opt._masters


def _torch_opt(opt):
    """The torch optimizer that steps (over the masters or the fp32 targets)."""
    return opt._inner_opt._inner_opt


def _layout_known(opt):
    """v2 knows its slices once it has its buffers (under pp overlap: the pipeline's)."""
    return not _is_v2(opt) or bool(opt._comm_buffer_list)


def _target_index(opt):
    """target -> index of its param in the optimizer's param list (for every target)."""
    index = {p: i for i, p in enumerate(opt._parameter_list)}
    if _is_v2(opt):
        return {opt._slice_params[p]: i for p, i in index.items()}
    return index


def _local_pieces(opt):
    """{param index: (target, lo, real, view)} for each param this rank steps elements of.

    `lo`: offset of the target's first element in the flattened param; `real`: how many of
    the target's elements are the param's (the rest, v2 only, is padding); `view`: v2's
    ShardingGradView (None for v1). Empty for v2 before its buffers exist.
    """
    pieces = {}
    if _is_v2(opt):
        views = {}
        for buffer in opt._comm_buffer_list:
            views.update(buffer._sharding_param_grad_view)
        for i, p in enumerate(opt._parameter_list):
            view = views.get(p)  # None: frozen at construction, so never stepped
            if view is not None and view._has_local:
                real = min(view._param_end, view._index + p.numel()) - view._param_begin
                lo = view._param_begin - view._index
                pieces[i] = (opt._slice_params[p], lo, real, view)
    else:
        for i, p in enumerate(opt._parameter_list):
            if opt._param2rank[p] == opt._rank:
                pieces[i] = (p, 0, p.numel(), None)
    return pieces


def _local_groups(opt):
    """Per inner param group: the param indices of its targets (v1: owned only)."""
    index, targets, groups, start = _target_index(opt), _targets(opt), [], 0
    for group in _torch_opt(opt).param_groups:
        groups.append([index[t] for t in targets[start : start + len(group["params"])]])
        start += len(group["params"])
    return groups


def layout(opt):
    """What a per-rank state fits: version, degree, rank, param shapes, owners / slices."""
    params = opt._parameter_list
    result = {"version": 2 if _is_v2(opt) else 1, "sharding_degree": opt._nranks,
              "sharding_rank": opt._rank, "shapes": [tuple(p.shape) for p in params]}
    if not _is_v2(opt):
        result["owners"] = [opt._param2rank[p] for p in params]
    elif _layout_known(opt):
        pieces = _local_pieces(opt)
        result["slices"] = [pieces[i][1:3] if i in pieces else None for i in range(len(params))]
    else:
        result["slices"] = None  # unknown until the pipeline has built the buffers
    return result


# ---------------------------------------------------------------- collectives

def _all_gather(obj, group):
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _full_groups(opt):
    """Per param group, all its param indices: the union over the sharding group (v1 ranks
    each know only their own params). A collective over the sharding group."""
    gathered = _all_gather(_local_groups(opt), opt._group)
    return [sorted(set().union(*(rank_groups[g] for rank_groups in gathered)))
            for g in range(len(gathered[0]))]


def _agree_on_problem(opt, problem):
    """Raise ValueError on every rank of the sharding and dp groups if any rank has a problem."""
    problems = _all_gather(problem and (dist.get_rank(), problem), opt._group)
    if opt._hcg.get_data_parallel_world_size() > 1:
        problems = [p for ps in _all_gather(problems, opt._hcg.get_data_parallel_group())
                    for p in ps]
    texts = {}
    for found in filter(None, problems):
        texts.setdefault(found[1], []).append(found[0])
    if texts:
        raise ValueError("\n".join(f"{text} [seen on global rank(s) {sorted(set(ranks))}]"
                                   for text, ranks in texts.items()))


# ---------------------------------------------------------------- consolidate


def _check_own(opt, saved):
    here = layout(opt)
    diffs = [f"{k}: saved {saved.get(k)!r}, here {here[k]!r}" for k in here
             if saved.get(k) != here[k] and not (k == "slices" and None in (saved.get(k),
                                                                               here[k]))]
    if not diffs:
        return None
    shown = "; ".join(d if len(d) < 200 else d[:200] + "..." for d in diffs)
    return ("load_state_dict: a per-rank state_dict() loads only into the layout it was saved "
            "from (same sharding version, sharding degree, sharding rank, param shapes and "
            f"owners / slices); on global rank {dist.get_rank()} it differs: {shown}. To load "
            f"into another layout, {_FIX}")


EXTRAS_FOLDER = "relgrad_extras"  # beyond-seed features; the core imports them at the call


def _extras(module, what):
    """Import `relgrad_extras.<module>` for `what`; ImportError naming the folder to copy."""
    try:
        return importlib.import_module(f"{EXTRAS_FOLDER}.{module}")
    except ModuleNotFoundError as error:
        if error.name not in (EXTRAS_FOLDER, f"{EXTRAS_FOLDER}.{module}"):
            raise
        raise ImportError(f"{what} lives in {EXTRAS_FOLDER}/{module}.py, which is not on the "
                          f"path: copy the folder {EXTRAS_FOLDER}/ beside sharding.py (the "
                          "card's modules alone load only this rank's own state_dict())"
                          ) from error


def _check_loadable(state_dict):
    """The problem with a state that is neither per-rank nor consolidated, or None."""
    if state_dict is None:
        return ("load_state_dict got None: consolidate_state_dict(to) returns the state on "
                f"sharding rank `to` only, None elsewhere. {_FIX[0].upper() + _FIX[1:]}")
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
        seen = (f"keys {sorted(map(str, state_dict))}" if isinstance(state_dict, dict)
                else f"a {type(state_dict).__name__}")
        return ("load_state_dict takes this rank's state_dict() (it has the key "
                f"'{LAYOUT_KEY}') or a consolidated / plain torch one (keys 'state' and "
                f"'param_groups'); got {seen}. To move between world sizes, {_FIX}")
    return None


def _load(opt, state_dict, load_own):
    """`load_state_dict`'s work: a per-rank state goes to `load_own` after its layout is
    checked; a consolidated (or plain torch) state is cut into this rank's pieces by
    `relgrad_extras.checkpoint`. Every rank issues the same collectives, whatever it was
    given, and raises the same error if any rank's dict is wrong."""
    groups = _full_groups(opt)
    own = isinstance(state_dict, dict) and LAYOUT_KEY in state_dict
    ckpt, missing = None, None
    try:  # a malformed dict must not leave the other ranks waiting in _agree
        problem = _check_own(opt, state_dict[LAYOUT_KEY]) if own else _check_loadable(state_dict)
        if problem is None and not own:
            try:
                ckpt = _extras("checkpoint", "Loading a consolidated (or plain torch) state")
            except ImportError as error:
                missing = problem = str(error)
            else:
                problem = ckpt.check_full(opt, state_dict, groups)
    except Exception as error:  # noqa: BLE001 (reported on every rank below)
        problem = (f"load_state_dict could not read the state dict ({type(error).__name__}: "
                   f"{error}); pass this rank's state_dict() or a consolidated one")
    try:
        _agree_on_problem(opt, problem)
    except ValueError as error:
        if missing is not None:
            raise ImportError(str(error)) from None
        raise
    opt._pending_state = None
    if own:
        load_own({k: v for k, v in state_dict.items() if k != LAYOUT_KEY})
    else:
        ckpt.load_full(opt, state_dict, groups)


class _ShardingCheckpoint:
    """The checkpoint methods of sharding v1 / v2 (mixed into `_Sharding` before `_Wrapper`,
    whose `state_dict` / `load_state_dict` run torch's hooks around these)."""

    def _local_state_dict(self):
        """This rank's shard of the state (fast; loads only into the same layout).

        The inner state plus `"sharding_layout"`: version, sharding degree and rank, param
        shapes and owners (v1) / slices (v2), so that `load_state_dict` can refuse another
        layout. `state_dict()` returns it through torch's hooks. For a checkpoint that loads
        into any sharding degree (or a plain torch optimizer), use `consolidate_state_dict`.
        Beyond that: v2 holding a consolidated state loaded before the pipeline built its
        buffers (no slices yet) returns that consolidated state, which loads anywhere,
        instead of an empty shard.
        """
        if getattr(self, "_pending_state", None) is not None:
            return _extras("checkpoint", "state_dict() of a pending state").pending_full(self)
        return {**super()._local_state_dict(), LAYOUT_KEY: layout(self)}

    def consolidate_state_dict(self, to=0):
        """Gather the whole optimizer state, in torch's one-process format, on sharding rank `to`.

        Collective over the sharding group: call it on every rank. Returns on rank `to` a dict
        like `torch.optim.Optimizer.state_dict()` of one optimizer over all params (v2's slices
        joined, padding dropped; `"master_weights"` beside it for fp32 masters), None on the
        others; see `relgrad_extras.checkpoint.consolidate`. Mirrors torch's
        `ZeroRedundancyOptimizer.consolidate_state_dict` (Paddle merges shards in its trainer:
        PaddleNLP `sharding_io.py`). Raises ValueError (on every rank) for a `to` outside
        [0, sharding degree); ImportError naming `relgrad_extras/` if that folder was not
        copied (the same on every rank, before any communication).
        """
        return _extras("checkpoint", "consolidate_state_dict").consolidate(self, to)

    def load_state_dict(self, state_dict):
        """Load this rank's `state_dict()`, or a consolidated / plain torch one re-sharded.

        A per-rank dict loads only into the layout it was saved from. A consolidated dict (from
        `consolidate_state_dict` on any sharding degree, or a plain torch optimizer over the
        same params and groups) is passed on every rank and cut by `relgrad_extras.checkpoint`:
        each rank keeps its own params (v1) or cuts its slices (v2), the hyper-parameters
        (lr, `initial_lr`, ...) are visible in `param_groups` at once, and the fp32 masters
        load if present. Collective over the sharding (and dp) group: call it on every rank.
        Allocates no grad and no grad buffer. Raises ValueError on every rank if any rank got a
        per-rank state of another layout, None, or a state of another model (nothing is loaded
        then); ImportError on every rank for a consolidated state without `relgrad_extras/`.
        """
        if not isinstance(state_dict, dict):  # e.g. None off rank `to`: torch's hooks would
            _load(self, state_dict, None)  # fail here alone; this raises everywhere
        super().load_state_dict(state_dict)  # torch's hooks, then _load_local_state_dict

    def _load_local_state_dict(self, state_dict):
        """What `load_state_dict` does after torch's pre-hooks (see there)."""
        _load(self, state_dict, super()._load_local_state_dict)

    def _apply_pending_state(self):
        """Cut a consolidated state loaded before v2's buffers existed (once they do)."""
        if getattr(self, "_pending_state", None) is not None:
            _extras("checkpoint", "a consolidated state").apply_pending(self)


# ============================================================================================
# Sharding's own comm overlap (sharding_configs.comm_overlap, no pipeline)
# ============================================================================================

# Sharding's own comm overlap (`sharding_configs.comm_overlap`, no pipeline): hooks, checks.
#
# What `sharding._Sharding` (v1 and v2) mixes in to hook its own `FusedCommBuffer`s to the params
# and to wait for them at `step()`, as Paddle's `DygraphShardingOptimizerV2` does with
# `register_reduce_overlap_hook(use_comm=True)` and `scale_grads()` in `reduce_gradients`
# (`dygraph_sharding_optimizer.py`; v1's counterpart is its tensor fusion). Beyond Paddle, the
# ranks agree before waiting that every bucket's collective was issued everywhere, and a backward
# pass too many or too few raises at step(), on every rank, instead of hanging or failing an
# assert on one rank.

class _OwnOverlap:
    """Mixed into the sharding optimizers; expects `pp_overlap`, `pp_release_grads`,
    `_buffers_released`, `_group`, `_nranks`, `_parameter_list` set by `_setup`, and
    `_own_buffers()` (v1 also `_param2rank` and `_comm_buffers`)."""

    def _setup_own_overlap(self, strategy):
        """Read and check `sharding_configs.comm_overlap` and `free_grads_in_comm`."""
        sharding_config = strategy.hybrid_configs["sharding_configs"]
        self.comm_overlap = sharding_config.comm_overlap
        self._free_grads_in_comm = sharding_config.free_grads_in_comm
        if self.comm_overlap and self.pp_overlap:  # Paddle asserts this for v1 and v2
            raise ValueError("sharding_configs.comm_overlap and pp_configs.sharding_comm_overlap "
                             "cannot both be on: under the pipeline its own hooks reduce the "
                             "grads; turn sharding_configs.comm_overlap off")
        pp_degree = strategy.hybrid_configs["pp_degree"]
        if self.comm_overlap and pp_degree > 1:  # Paddle asserts this for v2; here for v1 too
            raise ValueError(f"sharding_configs.comm_overlap needs pp_degree 1, got {pp_degree}: "
                             "with a pipeline use pp_configs.sharding_comm_overlap instead")
        self._reset_check_in_order()
        if self._free_grads_in_comm and not self._buffers_released:
            raise ValueError("sharding_configs.free_grads_in_comm needs release: turn on "
                             "pp_configs.release_gradients (the pipeline's buffers under "
                             "pp_configs.sharding_comm_overlap follow that flag alone) or, "
                             "without pipeline overlap, sharding_configs.release_gradients")

    def _build_owner_buffers(self, acc_steps, group_size=256 * 1024 * 1024):
        """v1 with comm_overlap: fill `_comm_buffers` with REDUCE buffers grouped by owner
        (each owner's trainable params, in model order) and hook them to the params.

        Differs from Paddle's v1 tensor fusion (`fused_parameters`), which also fuses the params
        and the optimizer into flat tensors (fuse_param, which Paddle does not allow with
        release) and scales before the reduce on every rank; here the params stay as they are,
        release works, and only the owner scales, after the reduce (bf16 / fp16 buckets: every
        rank, before, so that the sum cannot overflow: `comm_buffer.sums_in_16_bits`).
        """
        for rank in range(self._nranks):
            params = [p for p in self._parameter_list
                      if p.requires_grad and self._param2rank[p] == rank]
            dst = global_rank(self._group, rank)
            for bucket in assign_group_by_size(params, group_size).values():
                self._comm_buffers.append(FusedCommBuffer(
                    len(self._comm_buffers), bucket, self._group, acc_steps, HOOK_ACTION.REDUCE,
                    dst, release_grads=self.pp_release_grads,
                    free_grads_in_comm=self._free_grads_in_comm))
        share_comm_queue(self._comm_buffers)  # free_grads_in_comm: free during backward
        self._register_own_hooks(self._comm_buffers)

    def _register_own_hooks(self, buffers):
        """comm_overlap: check every bucket param in to its buffer after each backward.

        Registered at construction, so after any `register_main_grad_hooks` (torch runs them
        in registration order; the other order raises at the first check-in). Hooks hold the
        optimizer and buffers weakly and are removed when the optimizer is collected.
        """
        handles = [p.register_post_accumulate_grad_hook(_own_overlap_hook(self, b, p))
                   for b in buffers for p in b.params]
        weakref.finalize(self, _remove_hooks, handles)

    def _note_extra_pass(self, param):
        """A check-in after the bucket's collective was issued: a backward pass beyond
        accumulate_steps on this rank. Beyond Paddle (whose add_grad asserts, on this rank
        alone, while the others wait in step()): the pass is counted, not checked in, and
        `_wait_own_buffers` raises at step() on every rank, naming the counts."""
        self._extra_passes[id(param)] = self._extra_passes.get(id(param), 0) + 1

    def _reset_check_in_order(self):
        """Forget this step's bucket order (`_issue_late_buckets`); at construction, after
        step() and at clear_grad."""
        self._next_fire = 0  # index into _fire_in_order's order of the next bucket to fire
        self._extra_passes = {}  # param id -> backward passes after its bucket was issued

    def _fire_in_order(self):
        """Issue the collectives of the complete buckets in one fixed order, the same on every
        rank: reverse bucket order (backward reaches the last params first), each only once
        the buckets before it have fired. Beyond Paddle, whose hooks fire each bucket as it
        completes: a param that one rank's backward skips (or reaches in another order) would
        make the ranks issue different collectives, a hang or a mix of buckets; held in this
        order, a bucket that cannot complete holds the later ones back, and `step()` issues
        them all in the same order (`_issue_late_buckets`)."""
        order = self._own_buffers()[::-1]
        while self._next_fire < len(order):
            buffer = order[self._next_fire]
            if buffer._task is None:
                if not buffer._all_params_checked_in:
                    return
                buffer.comm_grads()
            self._next_fire += 1

    def _issue_late_buckets(self):
        """comm_overlap, at the start of step(), before any other collective of it: issue,
        with what it holds, the collective of every bucket this rank has not issued (it ran
        fewer backward passes than accumulate_steps, or a param got no grad), in the fixed
        order of `_fire_in_order`, so that every rank has issued every bucket's collective
        once, in the same order; `_wait_own_buffers` then raises on every rank. Beyond Paddle
        (where the others would wait for ever)."""
        for buffer in self._own_buffers()[::-1]:
            if buffer._task is not None:
                continue
            for p in buffer.params:  # release: allocate, move in a grad not checked in
                if buffer._release_grads and buffer._params_step_dict.get(p) == 0:
                    buffer._copy_grad_to_buffer(p)
            buffer._comm_grads()

    def _in_flight(self):
        """comm_overlap: True if this step's bucket collectives have started on this rank (a
        bucket issued, done or not): backward ran its last pass and step() has not yet
        waited for them."""
        return self.comm_overlap and any(b._task is not None for b in self._own_buffers())

    def _settle_own_buffers(self):
        """comm_overlap: issue the buckets this rank has not issued (`_issue_late_buckets`,
        so that the peers' collectives are matched), wait for every collective in flight,
        and reset the check-ins and the firing order: the buffers are as a fresh step needs
        them (their values are this step's, to be cleared). Beyond Paddle."""
        if not self.comm_overlap:
            return
        self._issue_late_buckets()
        for buffer in self._own_buffers():
            buffer._task.wait()
            buffer._reset_params_checked_in()
        self._reset_check_in_order()

    def _wait_own_buffers(self, buffers):
        """comm_overlap: at step(), wait for and scale every bucket the hooks reduced.

        Paddle calls `scale_grads()` on each buffer. Beyond Paddle: `_issue_late_buckets` has
        issued every bucket this rank had not; the ranks then gather each rank's backward
        passes (the most check-ins of any param) and the fewest check-ins of any param. If
        any rank has fewer than accumulate_steps, every rank waits for its collectives,
        resets the check-ins and raises the same ValueError naming the counts per rank.
        A param used on some ranks only is caught too when the bucket order allows; a
        different order of buckets across ranks (a graph that differs per rank) cannot be
        (DDP's find_unused_parameters walks the graph for that).
        """
        if not buffers:
            return
        acc = buffers[0]._acc_steps
        most, fewest = acc + max(self._extra_passes.values(), default=0), acc
        if most == acc:
            most = 0
            for b in buffers:
                left = list(b._params_step_dict.values())
                most = max(most, acc if b._params_checked_in else max(left, default=0))
        for b in buffers:
            fewest = min(fewest, min(b._params_step_dict.values(), default=acc))
        changed = [b._id for b in buffers if b._changed_in_flight()]
        device = buffers[0].params[0].device
        mine = torch.tensor([most, fewest, len(changed)], dtype=torch.int64, device=device)
        counts = [torch.empty_like(mine) for _ in range(self._nranks)]
        dist.all_gather(counts, mine, group=self._group)
        counts = [c.tolist() for c in counts]
        touched = [n for _, _, n in counts]
        counts = [(high, low) for high, low, _ in counts]
        complete = all(high == low == acc for high, low in counts)
        if complete and any(touched):  # beyond Paddle: a grad changed while in flight
            for buffer in buffers:
                buffer._task.wait()
                buffer._reset_params_checked_in()
            self._reset_check_in_order()
            ranks = [global_rank(self._group, r) for r, n in enumerate(touched) if n]
            raise ValueError(
                "sharding_configs.comm_overlap: a grad was changed in place while its bucket's "
                f"collective was in flight (on global rank(s) {ranks}; here buckets "
                f"{changed or 'none'}), e.g. by torch.nn.utils.clip_grad_norm_(model."
                "parameters()) or grad.mul_() between backward and step(): the reduce would "
                "mix old and new values. Clip with opt.clip_grad_norm_(max_norm), which waits "
                "for the collectives first; change grads only after step(). The grads of this "
                "step are not usable: clear them")
        if complete:
            self._reset_check_in_order()
            for buffer in buffers:
                buffer.scale_grads()
            return
        missing = [f"bucket {b._id} ({b._check_in_status()})"
                   for b in buffers if not b._all_params_checked_in]
        for buffer in buffers:
            buffer._task.wait()
            buffer._reset_params_checked_in()
        self._reset_check_in_order()
        per_rank = ", ".join(f"sharding rank {r} (global rank {global_rank(self._group, r)}): "
                             f"{hi} (fewest for a param: {low})"
                             for r, (hi, low) in enumerate(counts))
        raise ValueError(
            "sharding_configs.comm_overlap: step() found buckets whose collective was not "
            f"issued on every rank after accumulate_steps={acc} backward passes. Backward "
            f"passes per rank: {per_rank}. On this rank: {'; '.join(missing) or 'complete'}. "
            f"Every trainable param must get a grad in each of accumulate_steps={acc} "
            "backward passes before step(), on every rank: leave unused params out of the "
            "optimizer (or set requires_grad=False before building it), run exactly "
            "accumulate_steps backwards per step, and clear grads only after step() (with "
            "release, zero_grad() between the backwards of a step drops the "
            "half-accumulated buffer and its check-ins). The grads of this step are not "
            "usable: clear them")


def _own_overlap_hook(optimizer, buffer, param):
    """`bw_hook_func(buffer, param, use_comm=False)`: checks `param` in, then fires the
    buckets that are complete in the optimizer's fixed order (`_fire_in_order`). A check-in
    past accumulate_steps (the bucket in flight, or this param already in acc_steps times)
    counts a backward pass too many instead (raised at step(), on every rank, by
    `_wait_own_buffers`)."""
    check_in = bw_hook_func(buffer, param, use_comm=False)
    plain = bw_hook_func(buffer, param)  # both hold the buffer weakly
    optimizer_ref, buffer_ref = weakref.ref(optimizer), weakref.ref(buffer)

    def hook(param):
        optimizer, buffer = optimizer_ref(), buffer_ref()
        if optimizer is None or buffer is None:  # raises for a dead buffer, as bw_hook_func
            plain(param)
            return
        if buffer._task is not None or param not in buffer._params_step_dict:
            optimizer._note_extra_pass(param)  # a backward pass too many on this rank
            return
        check_in(param)
        if buffer._all_params_checked_in:
            optimizer._fire_in_order()

    return hook


def _remove_hooks(handles):
    for handle in handles:
        handle.remove()


# ============================================================================================
# Sharding v1 and v2
# ============================================================================================

_ERASE_MSG = ("should not erase grad buffer: with release_gradients off the grads are views of "
              "a fused buffer that must persist, so clear_grad(set_to_zero=False) / "
              "zero_grad(set_to_none=True) is not allowed. Use zero_grad(set_to_none=False), "
              "or turn release on: pp_configs.release_gradients (or, without a pipeline, "
              "sharding_configs.release_gradients).")

_MOVED_MSG = ("a param is no longer a view of sharding v2's flat param buffer and has another "
              "dtype or device (e.g. model.to(torch.float64) after DygraphShardingOptimizerV2 "
              "was built); steps would not reach it. Build the optimizer after moving the model")
_UNFROZEN_MSG = ("a param frozen when DygraphShardingOptimizerV2 was built requires grad now; it "
                 "has no slot in the grad buffers, so it would never train. Build the optimizer "
                 "after unfreezing it (or with it trainable)")
_MAIN_GRAD_MSG = ("a param's main_grad does not match its bucket (which reads main_grad iff its "
                  "params had one when DygraphShardingOptimizerV2 was built): "
                  "register_main_grad_hooks ran on some params only, or after the optimizer was "
                  "built. Register them on every param, before building the optimizer")
_IN_FLIGHT_MSG = (
    "zero_grad() / clear_grad() ran between backward and step() while "
    "sharding_configs.comm_overlap's collectives of this step were in flight: it waited for "
    "them and cleared this step's grads and check-ins, so this step is lost (nothing is "
    "stepped). Clear grads after step() (or before backward); the optimizer is ready for the "
    "next backward and step()")
_NO_GRAD_MSG = ("no param has a grad on any rank at step(): did zero_grad() run between backward "
                "and step()? Clear grads after step(). Or were the model's params replaced "
                "after the optimizer was built (model.load_state_dict(..., assign=True), "
                "model.to_empty())? Build the optimizer after that, or load without assign.")


# A rank that dropped its grads between backward and step() would give zeros to the mean (the
# rule for a param some rank has no grad for), silently: raised on every rank instead.
_DROPPED_RULE = ("did zero_grad() run between backward and step() on some rank, with no "
                 "backward after it? Its grads were dropped and would count as zeros in the "
                 "mean. Clear grads after step(), or run backward again on every rank")


def _comm_buffer_bytes(sharding_config):
    """Bytes per bucket of sharding's own buffers: `sharding_configs.comm_buffer_size_MB`
    ([later] Paddle's field), 256 MB if unset (Paddle's default). Duck-typed configs
    without the field get the default."""
    mb = getattr(sharding_config, "comm_buffer_size_MB", None)
    return (256 if mb is None else mb) * 1024 * 1024


def _check_grad_clip(grad_clip):
    """`grad_clip` as Paddle passes it to an optimizer: None, or an object in the shape of
    Paddle's ClipGradByGlobalNorm (`relgrad_extras.grad_clip`): a `clip_norm` attribute and
    `grad_clip(params_grads, groups, device)`. Raises TypeError for anything else (torch's
    `clip_grad_norm_` on a rank's own grads would see only its shard, unreduced)."""
    if grad_clip is not None and not (callable(grad_clip) and hasattr(grad_clip, "clip_norm")):
        raise TypeError(f"grad_clip must be None or a Paddle-style clip such as "
                        f"relgrad_extras.grad_clip.ClipGradByGlobalNorm, got "
                        f"{type(grad_clip).__name__}; for torch's clip_grad_norm_ call "
                        "opt.clip_grad_norm_(max_norm) between backward and opt.step()")
    return grad_clip


_ENTRY_MSG = ("the sharding optimizer: every rank of the sharding (and dp) group must open "
              "a step alike, all with opt.clip_grad_norm_(...) with the same arguments, or all "
              "with step() without it; the ranks differ")


def _entry_code(entry):
    """`agree`'s `same` for how a rank opened the step: `entry` None (step()) or the
    arguments of clip_grad_norm_, hashed into [1, 4096)."""
    if entry is None:
        return _ENTRY_MSG, 0, "step() without clip_grad_norm_"
    name, *args = entry
    text = f"{name}({', '.join(map(repr, args))})"
    return _ENTRY_MSG, 1 + zlib.crc32(text.encode()) % 4095, text


def _clip_rules(args=None, grad_clip=None):
    """clip_grad_norm_'s argument checks as `(rule, detail)` pairs for `agree`, on
    `args = (max_norm, norm_type)`; None (step() without it): the same rules, unseen. Every
    step passes them, so that the flags have one length on every rank."""
    bad_norm = bad_type = False
    if args is not None:
        max_norm, norm_type = args
        bad_norm = isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or (
            not (math.isfinite(max_norm) and max_norm > 0))
        try:
            bad_type = float(norm_type) != 2.0
        except (TypeError, ValueError):
            bad_type = True
    return [("clip_grad_norm_: max_norm must be a finite number > 0; pass e.g. "
             "opt.clip_grad_norm_(1.0)", f"max_norm={args[0]!r}" if bad_norm else None),
            ("clip_grad_norm_: only norm_type=2 (the L2 norm) is supported over sharded grads",
             f"norm_type={args[1]!r}" if bad_type else None),
            ("clip_grad_norm_ on an optimizer built with grad_clip= would clip twice; use "
             "one of them",
             f"grad_clip={grad_clip!r}" if args is not None and grad_clip is not None
             else None)]


def _first_difference(a, b):
    """reprs of the first differing entries of two equal-length lists (recursively; a tuple,
    such as a (name, value) pair, is shown whole) or dicts, else of the whole values: what a
    setup mismatch message shows."""
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        for k in a:
            if a[k] != b[k]:
                x, y = _first_difference(a[k], b[k])
                return f"{k}={x}", f"{k}={y}"
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for x, y in zip(a, b):
            if x != y:
                return _first_difference(x, y)
    return repr(a), repr(b)


class _Sharding(_OwnOverlap, _ShardingCheckpoint, _Wrapper):
    """What v1 and v2 share: flags, groups, whether to all-reduce over dp, and the agreement
    on grads and misuse that opens every `step()`."""

    def _setup(self, optimizer, hcg, strategy, grad_clip=None):
        pp_config = strategy.hybrid_configs["pp_configs"]
        sharding_config = strategy.hybrid_configs["sharding_configs"]
        self._hcg = hcg
        self._group = hcg.get_sharding_parallel_group()
        self._nranks = hcg.get_sharding_parallel_world_size()
        self._rank = hcg.get_sharding_parallel_rank()
        self._parameter_list = [p for g in optimizer.param_groups for p in g["params"]]
        # Beyond Paddle: under nccl, params on a GPU other than the current one (no
        # torch.cuda.set_device) raise here on every rank, before the first collective.
        check_current_device(self._parameter_list, self._flag_groups(), type(self).__name__)
        # Setting pipeline parallelism overlap (grads then arrive reduced by the pipeline).
        self.pp_overlap = pp_config.sharding_comm_overlap
        # Seed hunk: `self.pp_release_grads = pp_config.release_gradients`. [later, PR #64517]
        # Paddle ORs a sharding-side `release_gradients` flag into it.
        self.pp_release_grads = (pp_config.release_gradients
                                 or sharding_config.release_gradients)
        # Beyond Paddle (for the later sharding-side flag; skip when reading the seed): under
        # pipeline overlap the buffers are the pipeline's, built with the PP flag alone;
        # whether their grads may be dropped follows that flag, not the sharding-side one.
        self._buffers_released = (pp_config.release_gradients if self.pp_overlap
                                  else self.pp_release_grads)
        # HybridParallelOptimizer's dp all-reduce, unless the pipeline already overlapped it.
        self._dp_sync = (hcg.get_data_parallel_world_size() > 1
                         and not pp_config.dp_comm_overlap)
        # Beyond Paddle, the rest of _setup (skip when reading the seed): misuse flags for
        # step(); every rank built alike (one all-gather); the same start params, as
        # fleet.distributed_model broadcasts them; a template without state; then
        # sharding_configs.comm_overlap / free_grads_in_comm, later Paddle features.
        self._reduced = False  # grads reduced by a step() and not cleared since
        self._dropped_mid_step = False  # zero_grad() dropped a backward's grads before step()
        self._agreement_failed = False  # step()'s agreement raised since the last clear_grad
        self._grads_ready = False  # clip_grad_norm_ ran step()'s first half; step() next
        self._agree_on_setup(optimizer, strategy, grad_clip)
        self._broadcast_params()
        self._check_template(optimizer)
        self._setup_own_overlap(strategy)

    @property
    def comm_buffers(self):
        """The `FusedCommBuffer`s whose grads this optimizer reduces (a new list): v1 / v2's own
        with `sharding_configs.comm_overlap`, v2's own without it, v2's view of the pipeline's
        under `pp_configs.sharding_comm_overlap` (after the first train_batch); empty for v1
        without overlap (it reduces grad by grad) and v1 under the pipeline's overlap (see the
        pipeline's `_chunk_2_comm_buffers`). With release, `grad_storage is None` on each of
        them from `zero_grad()` to the next step's first grad check-in."""
        return list(self._own_buffers())

    def _split_param_problem(self, sharding_config):
        split = isinstance(self, DygraphShardingOptimizerV2)
        if bool(sharding_config.split_param) == split:
            return None
        use = "DygraphShardingOptimizerV2" if sharding_config.split_param else (
            "DygraphShardingOptimizer")
        return (f"sharding_configs.split_param={sharding_config.split_param} selects {use} "
                f"(Paddle picks the class from this field), but {type(self).__name__} was "
                f"built; build {use}, or set split_param={split}")

    def _agree_on_setup(self, optimizer, strategy, grad_clip=None):
        """Beyond Paddle: every rank of the sharding (and dp) group must build the optimizer
        alike, or the ranks would issue different collectives (a hang) or train different
        models silently. One all-gather of a small description per group (class, config,
        torch optimizer and its hyper-parameters, `grad_clip`'s type and clip_norm, param
        shapes / dtypes / requires_grad);
        any difference, or a class that does not fit split_param, raises ValueError on every
        rank, naming the ranks and the values."""
        sharding_config = strategy.hybrid_configs["sharding_configs"]
        pp_config = strategy.hybrid_configs["pp_configs"]
        fields = ("split_param", "comm_overlap", "accumulate_steps", "release_gradients",
                  "free_grads_in_comm", "comm_buffer_size_MB")
        mine = {
            "class": type(self).__name__,
            "sharding_configs": {f: getattr(sharding_config, f, None) for f in fields},
            "pp_configs": (pp_config.release_gradients, pp_config.sharding_comm_overlap,
                           pp_config.dp_comm_overlap, pp_config.delay_scale_loss),
            "torch optimizer": type(optimizer).__name__,
            "grad_clip": None if grad_clip is None else (
                type(grad_clip).__name__, repr(getattr(grad_clip, "clip_norm", None))),
            "hyper-parameters": [sorted((k, repr(v)) for k, v in g.items() if k != "params")
                                 for g in optimizer.param_groups],
            "params (shape, dtype, requires_grad)": [
                (tuple(p.shape), str(p.dtype), p.requires_grad) for p in self._parameter_list],
        }
        problem = self._split_param_problem(sharding_config)
        groups = [self._group]
        if self._hcg.get_data_parallel_world_size() > 1:
            groups.append(self._hcg.get_data_parallel_group())
        texts = []
        for group in groups:
            seen = _all_gather((dist.get_rank(), mine, problem), group)
            texts += [text for _, _, text in seen if text]
            first_rank, first, _ = seen[0]
            for rank, desc, _ in seen[1:]:
                for key in first:
                    if desc[key] != first[key]:
                        a, b = _first_difference(first[key], desc[key])
                        texts.append(f"{key}: global rank {first_rank} has {a[:160]}, global "
                                     f"rank {rank} has {b[:160]}")
        if texts:
            raise ValueError("the sharding optimizer: every rank of the sharding (and dp) group "
                             "must build it alike (same class, config, torch optimizer, "
                             "hyper-parameters and model); " + "; ".join(dict.fromkeys(texts)))

    @torch.no_grad()
    def _broadcast_params(self):
        """Start every rank from the same params, as DDP does and Paddle's
        `fleet.distributed_model` does (`broadcast_sharding_parameters` /
        `broadcast_dp_parameters`): each param from sharding rank 0, then from dp rank 0.
        A no-op in value when every rank seeded its model alike."""
        groups = [self._group] if self._nranks > 1 else []
        if self._hcg.get_data_parallel_world_size() > 1:
            groups.append(self._hcg.get_data_parallel_group())
        for group in groups:
            works = [dist.broadcast(p.detach(), src=global_rank(group, 0), group=group,
                                    async_op=True) for p in self._parameter_list]
            for work in works:
                work.wait()

    def _check_template(self, optimizer):
        """Beyond Paddle: refuse, on every rank, a template optimizer that already has state
        (its moments would be dropped silently: the inner optimizer is built anew from it).
        One small all-reduce, since a checkpoint may have been loaded on some ranks only."""
        detail = (f"{len(optimizer.state)} param(s) with state" if carries_state(optimizer)
                  else None)
        agree([], [(template_state_message(type(self).__name__, optimizer), detail)],
              self._flag_groups(), self._flags_device())

    def _flag_groups(self):
        groups = [self._group]
        if self._hcg.get_data_parallel_world_size() > 1:
            groups.append(self._hcg.get_data_parallel_group())
        return groups

    def _flags_device(self):
        params = self._parameter_list
        if params:
            return params[0].device
        # a stage without params: nccl still needs the flags on the GPU
        nccl = dist.get_backend(self._group) == "nccl"
        return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    @property
    def _grads_freed_in_backward(self):
        """free_grads_in_comm on buffers hooked to backward (the pipeline's, or the own
        comm_overlap ones): the grads a rank does not read may be gone before `step()`, every
        trainable param having checked in (else the buckets' agreement raises)."""
        return self._free_grads_in_comm and (self.pp_overlap or self.comm_overlap)

    def _begin_step(self):
        # Beyond Paddle: a second step() would reduce already reduced grads again.
        if self._reduced:
            raise RuntimeError("step() ran again without the optimizer's clear_grad() / "
                               "zero_grad() in between, so the grads may be already reduced. "
                               "Clear them after each step through the optimizer: "
                               "model.zero_grad() does not reset it")
        self._reduced = True

    def _clip_grads(self):
        """`grad_clip` (Paddle's: the constructor's) on `_clip_pairs()`, reduced and final."""
        if self._grad_clip is not None:
            self._grad_clip(self._clip_pairs(), norm_groups(self._hcg), self._flags_device())

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        """torch's `clip_grad_norm_`, called on the optimizer (as FSDP's `clip_grad_norm_`).

        Call it after backward and before `step()`, on every rank of the sharding (and pipe)
        group, with the same `max_norm`: it runs the first half of `step()` now (agree on the
        grads, reduce / reduce-scatter, dp all-reduce), so that what each rank steps is
        reduced; clips that by the global L2 norm over every rank (each element counted once,
        fp32 squares, see `clip_grads_by_global_norm`) with torch's coefficient
        `min(max_norm / (norm + 1e-6), 1)` (not Paddle's: a norm below `max_norm` leaves the
        grads exactly as they are); and returns the norm. `step()` then goes straight to the
        optimizer step: it does not reduce again. Beyond Paddle, which clips only through the
        optimizer's `grad_clip`. Where the grads were read before the reduce (the habit
        `torch.nn.utils.clip_grad_norm_(model.parameters())`), each rank would clip its own
        un-reduced grads: use this instead.

        Args:
            max_norm: float > 0. norm_type: 2 only (the L2 norm). error_if_nonfinite: raise
                if the norm is nan / inf. foreach: accepted for torch's signature, unused.
        Returns the norm before clipping: a 0-d fp32 tensor on the grads' device, equal on
        every rank.
        Raises ValueError for a `max_norm` that is not a finite number > 0, `norm_type` other
        than 2, or a `grad_clip` given to the constructor too (it would clip twice);
        RuntimeError (on every rank: the norm is the same everywhere) for a non-finite norm
        with `error_if_nonfinite`; and what `step()` raises for the grads (on every rank).
        """
        if self._grads_ready:
            raise RuntimeError("clip_grad_norm_ ran twice before step(); call it once per "
                               "step, between backward and step()")
        # Beyond torch: the checks join step()'s agreement, so that a rank with other
        # arguments raises with the others instead of leaving them in that agreement.
        self._reduce_for_step(("clip_grad_norm_", max_norm, norm_type, error_if_nonfinite),
                              _clip_rules((max_norm, norm_type), self._grad_clip))
        self._grads_ready = True
        norm = clip_grads_by_global_norm(self._clip_pairs(), max_norm, norm_groups(self._hcg),
                                         self._flags_device(), coefficient="torch")
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"clip_grad_norm_: the total norm of the grads is {norm.item()}"
                               ", non-finite; pass error_if_nonfinite=False to clip anyway")
        return norm

    def _agree_grads(self, has_grad, rules, entry=None):
        """Beyond Paddle: agree on every rank of the sharding (and dp) group, in one small
        all-reduce per group, on the misuse `rules` (raised on every rank, see
        `agree`) and on which params have a grad anywhere; give the others a
        zero grad here, so that every rank issues the same reduces. Returns the agreed flags,
        one per `_parameter_list` entry. Raises ValueError if no trainable param has a grad
        on any rank (Paddle's v2 fails there too; torch would silently step nothing), and if
        the ranks opened the step differently (`entry`: None for step(), the arguments of
        clip_grad_norm_ for it; `_entry_code`)."""
        params = self._parameter_list
        dropped = self._dropped_mid_step and not any(has_grad)
        rules = list(rules) + [(_DROPPED_RULE, "zero_grad() dropped this rank's grads after "
                                "backward, and no backward ran since" if dropped else None)]
        try:
            anywhere = agree(has_grad, rules, self._flag_groups(), self._flags_device(),
                             _entry_code(entry))
            if any(p.requires_grad for p in params) and not any(anywhere):
                raise ValueError(_NO_GRAD_MSG)
        except ValueError:  # raised on every rank; the buckets stay as they are, so that
            self._agreement_failed = True  # a step() retried after a fix can still use them
            raise
        self._dropped_mid_step = False
        if not self._grads_freed_in_backward:  # else freed on purpose
            fill_missing_grads(params, anywhere)
        return anywhere

    def _settle_for_clear(self):
        """Beyond Paddle, first in `clear_grad` (v1, v2): wait for this step's own-overlap
        collectives in flight (`_settle_own_buffers`), then forget the step's misuse flags and
        comm_overlap's bucket order. Returns True if clear_grad must raise `_IN_FLIGHT_MSG`
        once it has cleared: collectives were in flight and step() had not already raised for
        this step (then clearing is what its error asked for)."""
        in_flight = self._in_flight() and not self._agreement_failed
        # grads that backward produced and no step() took: dropped here (`_DROPPED_RULE`)
        self._dropped_mid_step = (not self._in_flight() and not self._reduced
                                  and any(self._has_grad()))
        if self._in_flight():
            self._settle_own_buffers()
        self._agreement_failed = False
        self._reduced = self._grads_ready = False
        self._reset_check_in_order()
        return in_flight


class DygraphShardingOptimizer(_Sharding):
    """Sharding v1: whole params, greedy owners, reduce -> step owned -> broadcast.

    Args:
        optimizer: a torch optimizer over the model (or this pipeline stage); used as a template.
        hcg: the topology, e.g. `relgrad.HybridCommunicateGroup`; any object with
            `get_sharding_parallel_{group,rank,world_size}()` and
            `get_data_parallel_{group,world_size}()` will do.
        strategy: e.g. `relgrad.HybridStrategy` (Paddle reads it from fleet); read here:
            `strategy.hybrid_configs["pp_configs"]`'s `sharding_comm_overlap`,
            `dp_comm_overlap`, `release_gradients`, and `...["sharding_configs"]`'s
            `comm_overlap`, `accumulate_steps`, `release_gradients`, `free_grads_in_comm`, and
            `strategy.hybrid_configs["pp_degree"]`.
        grad_clip: None or a `relgrad_extras.grad_clip.ClipGradByGlobalNorm`, run in `step()`
            on the owned, reduced grads (Paddle passes it as the inner optimizer's
            `grad_clip`); then `hcg` also needs `get_pipe_parallel_{group,world_size}()`.
    `_param2rank` maps each param (by identity; Paddle: by name) to its owner's sharding rank.
    Call `step()` after backward, then `clear_grad()` / `zero_grad()` before the next step.
    With `sharding_configs.comm_overlap` (no pipeline), `_comm_buffers` holds one REDUCE
    buffer per owner and bucket, hooked to the params, so the reduce to the owner fires in the
    last of `accumulate_steps` backward passes (scale the loss by 1/accumulate_steps); without
    it, `step()` reduces grad by grad. With free_grads_in_comm, a rank drops the grads it does
    not own once they are reduced (their buffer, or the grads themselves).
    Raises ValueError for a param with no elements or an unsupported config (comm_overlap
    with a pipeline, free_grads_in_comm without release), under nccl (on every rank) for
    params on a GPU other than the current one (no `torch.cuda.set_device`), at `step()` (on
    every rank) for no grad on any rank, a closure or a GradScaler, with comm_overlap for a
    bucket not reduced on every rank or a backward pass too many, and from `add_param_group`
    as it says;
    RuntimeError for a second `step()` without clearing the grads in between; TypeError for a
    grad_clip of another type.
    """

    def __init__(self, optimizer, hcg, strategy, grad_clip=None):
        self._setup(optimizer, hcg, strategy, grad_clip)
        self._grad_clip = _check_grad_clip(grad_clip)
        self._param2rank = self._partition_parameters()
        owned = [[p for p in g["params"] if self._param2rank[p] == self._rank]
                 for g in optimizer.param_groups]
        self._zeroed = {}  # param id -> (grad id, grad _version) right after clear_grad zeroed
        self._inner_opt = MixPrecisionOptimizer(optimizer, owned)
        self._expose(self._inner_opt)
        self._comm_buffers = []
        if self.comm_overlap:
            sharding_config = strategy.hybrid_configs["sharding_configs"]
            self._build_owner_buffers(sharding_config.accumulate_steps,
                                      _comm_buffer_bytes(sharding_config))

    def _own_buffers(self):
        return self._comm_buffers

    def _partition_parameters(self, params=None):
        """Largest first, each to the rank with the fewest elements so far (ties: lowest).

        Sorting by size is develop's `FLAGS_sharding_sort_parameters` (default on); whether the
        seed commit sorted already is uncertain.
        """
        sizes, param2rank = [0] * self._nranks, {}
        if params is None:
            params = self._parameter_list
        else:  # add_param_group: go on from the loads so far
            for p, rank in self._param2rank.items():
                sizes[rank] += p.numel()
        for p in sorted(params, key=lambda p: -p.numel()):
            if p.numel() == 0:
                raise ValueError(f"a param of shape {tuple(p.shape)} has no elements; "
                                 "leave it out of the optimizer")
            rank = sizes.index(min(sizes))
            param2rank[p] = rank
            sizes[rank] += p.numel()
        return param2rank

    @torch.no_grad()
    def reduce_gradients(self, parameter_list, hcg):
        """Reduce each grad (scaled by 1/nranks) to its owner over the sharding group.

        Does nothing when the pipeline's sharding_comm_overlap has already reduced the grads.
        Paddle's v1 has no such guard at the seed commit (the incubate/new_frl branch returns
        early, as we do): there, fleet turns HybridParallelOptimizer's sharding sync off under
        sharding_comm_overlap, so this is never called. Without that wrapper, the guard is here.
        """
        if self.pp_overlap:
            return
        if self.comm_overlap:  # the hooks issued the reduces during backward
            self._wait_own_buffers(self._comm_buffers)
            return
        works = []
        densify_grads(parameter_list)  # sparse grads: c10d has no sparse reduce
        for p in parameter_list:
            g = _grad(p)
            if g is not None:  # the same params on every rank: step() agreed on them first
                g.mul_(1.0 / self._nranks)
                dst = global_rank(self._group, self._param2rank[p])
                works.append(dist.reduce(g, dst=dst, group=self._group, async_op=True))
        for work in works:
            work.wait()
        if self._free_grads_in_comm:  # [later]: what this rank does not own is not read
            for p in parameter_list:
                if self._param2rank[p] != self._rank:
                    _clear(p, set_to_zero=False)

    def add_param_group(self, param_group):
        """torch's `add_param_group` through sharding: the new params get owners (largest
        first, to the least loaded rank), this rank's inner optimizer a group of those it owns
        (maybe empty, so group indices match on every rank). Call it alike on every rank.
        Raises ValueError for a param already in the optimizer, or under a comm overlap
        (the pipeline's sharding_comm_overlap, or sharding_configs.comm_overlap): the fused
        buffers are laid out from the owners already, and a new param's grad would never
        be reduced.
        """
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        if self.pp_overlap or self.comm_overlap:
            which = ("pp_configs.sharding_comm_overlap" if self.pp_overlap
                     else "sharding_configs.comm_overlap")
            raise ValueError(f"add_param_group is not supported with {which}: the fused "
                             "buffers are built from the owners at construction, so a new "
                             "param's grad would never be reduced; build the torch optimizer "
                             "with every group first")
        known = {id(p) for p in self._parameter_list}
        if any(id(p) in known for p in params) or len({id(p) for p in params}) < len(params):
            raise ValueError("add_param_group: some params are already in the optimizer (or "
                             "repeated); a param belongs to one group")
        self._param2rank.update(self._partition_parameters(params))
        self._parameter_list += params
        owned = [p for p in params if self._param2rank[p] == self._rank]
        self._inner_opt.add_param_group({**param_group, "params": owned})

    @torch.no_grad()
    def step(self, closure=None):
        """Agree on grads -> reduce to owners -> dp all-reduce of owned grads -> step owned ->
        broadcast all. A param is stepped iff some rank has a grad for it (torch's rule).
        After `clip_grad_norm_` the grads are reduced already: step() starts at the step.
        Raises ValueError as `_agree_grads` and `_check_step_args` say, on every rank."""
        self._check_step_args(closure)
        if not self._grads_ready:
            self._reduce_for_step()
            self._clip_grads()
        self._grads_ready = False
        self._inner_opt.step()
        # _sharding_sync_parameters: every param from its owner
        works = [dist.broadcast(p.detach(), src=global_rank(self._group, self._param2rank[p]),
                                group=self._group, async_op=True)
                 for p in self._parameter_list]
        for work in works:
            work.wait()

    def _reduce_for_step(self, entry=None, rules=None):
        """The first half of `step()` (also run by `clip_grad_norm_`, with its arguments as
        `entry` and its argument checks as `rules`, `_clip_rules`): agree, reduce to the
        owners, dp all-reduce. The owned grads are reduced and final afterwards."""
        if self.comm_overlap:  # before any collective of step(): match every rank's buckets
            self._issue_late_buckets()
        anywhere = self._agree_grads(self._has_grad(), rules or _clip_rules(), entry)
        for p, some_rank in zip(self._parameter_list, anywhere):
            if not some_rank:  # a zeroed grad nobody wrote: not stepped (torch: None)
                _clear(p, set_to_zero=False)
        self._begin_step()
        self.reduce_gradients(self._parameter_list, self._hcg)
        owned = [p for p in self._parameter_list if self._param2rank[p] == self._rank]
        if self._dp_sync:  # the same grads on every dp rank: agreed above
            all_reduce_mean([_grad(p) for p in owned if _grad(p) is not None],
                            self._hcg.get_data_parallel_group())

    @torch.no_grad()
    def clear_grad(self, set_to_zero=True):
        """Zero every grad / main_grad in place, or drop them (`set_to_zero=False`).

        Beyond Paddle's v1: while fused buffers (the pipeline's, or its own with comm_overlap)
        hold the grads and release is off, dropping them would detach them from the buffer, so
        `set_to_zero=False` raises ValueError as v2 does. With release and comm_overlap, its
        own buffers are freed here, as v2's are. Between backward and step() under
        comm_overlap (collectives in flight) it waits, clears and raises ValueError, as v2.
        """
        if (not set_to_zero and (self.pp_overlap or self.comm_overlap)
                and not self._buffers_released):
            raise ValueError(_ERASE_MSG)
        in_flight = self._settle_for_clear()  # beyond Paddle (skip when reading the seed)
        for p in self._parameter_list:
            _clear(p, set_to_zero)
        if self.pp_release_grads:
            for comm_buffer in self._comm_buffers:
                comm_buffer._clear_grad_storage()
        # Beyond Paddle: a grad zeroed here and still untouched at step() is no grad (v2's
        # grads are buffer views, never None, and v2 must not step them: same rule here).
        self._zeroed = {id(p): (id(g), g._version) for p in self._parameter_list
                        if (g := _grad(p)) is not None}
        if in_flight:
            raise ValueError(_IN_FLIGHT_MSG)

    def _has_grad(self):
        """Per param: this rank has a grad that backward (or the user) wrote since the last
        clear_grad (in-place accumulation bumps the grad's `_version`)."""
        if self._grads_freed_in_backward:  # went with the freed buffers
            return [p.requires_grad for p in self._parameter_list]
        return [(g := _grad(p)) is not None and self._zeroed.get(id(p)) != (id(g), g._version)
                for p in self._parameter_list]

    def _clip_pairs(self):
        """What a clip reads: the grads this rank owns, reduced (Paddle: the inner optimizer's
        params_grads); a rank that owns nothing still joins the norm's all-reduces."""
        return [(p, _grad(p)) for p in self._parameter_list if self._param2rank[p] == self._rank]


# Optimizers whose update of an element reads only that element's grad and state: the same
# on a flat 1-D slice as on the whole param, so v2 may step slices with them.
# (Adagrad is element-wise too, but builds its state when constructed, over v2's empty slice
# placeholders.) A subclass that overrides `step` may read whole tensors (LAMB, LARS): refused.
_ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adadelta,
                torch.optim.Adamax, torch.optim.ASGD, torch.optim.NAdam, torch.optim.RAdam,
                torch.optim.RMSprop, torch.optim.Rprop)


def _is_elementwise(optimizer):
    step = inspect.unwrap(type(optimizer).step)  # torch wraps step with its hooks
    return any(isinstance(optimizer, c) and step is inspect.unwrap(c.step) for c in _ELEMENTWISE)


def _check_elementwise(optimizer):
    """v2 steps 1-D slices: refuse an optimizer whose update depends on the param's shape."""
    if not _is_elementwise(optimizer):
        raise ValueError(
            f"sharding v2 (split_param) steps flat 1-D slices of the params, so it needs an "
            f"element-wise optimizer ({', '.join(c.__name__ for c in _ELEMENTWISE)} or a "
            f"subclass that keeps their step); got {type(optimizer).__name__}, whose update "
            "may depend on the "
            "param's shape or on whole-tensor norms (e.g. Adafactor's factored moments, "
            "Muon's 2-D orthogonalisation). Use sharding v1 (DygraphShardingOptimizer, whole "
            "params) instead")


class DygraphShardingOptimizerV2(_Sharding):
    """Sharding v2 (split_param): flat shards, reduce-scatter -> step slices -> all-gather.

    Same args and use as v1. Each model param becomes a view of a flat padded param buffer
    (at construction); the inner optimizer steps `_slice_params[param]`, a 1-D view of this
    rank's piece of it (empty until the first step). The REDUCE_SCATTER buffers are its own
    (`_build_comm_buffers`) or, with pp_configs.sharding_comm_overlap, the pipeline's (found
    through `param.comm_buffer_ref`). With `sharding_configs.comm_overlap` (no pipeline) its
    own buffers are hooked to the params, so grads land in the buffer at their first check-in
    and the reduce-scatter fires in the last of `accumulate_steps` backward passes. Without
    hooks, backward accumulates straight into their views (release off) or `reduce_gradients`
    copies the grads in at `step()` (release on). With free_grads_in_comm each buffer keeps
    only this rank's shard once reduced (see `FusedCommBuffer`; with hooks, during backward);
    the params' grads are dropped. Buckets hold `sharding_configs.comm_buffer_size_MB` MB
    (256 if unset) of params.
    Raises ValueError for `clear_grad(set_to_zero=False)` with release off, under nccl (on
    every rank) for params on a GPU other than the current one (as v1), at `step()` (on
    every rank) for no grad on any rank or state changed behind its back since it was built
    (`_misuse_rules`), and with comm_overlap as v1 does; RuntimeError if `step()` finds no
    buffers or runs twice without clearing the grads in between; TypeError for a
    grad_clip of another type. `grad_clip` clips the slice grads without their padding.
    """

    def __init__(self, optimizer, hcg, strategy, grad_clip=None):
        self._setup(optimizer, hcg, strategy, grad_clip)
        # Beyond Paddle, the checks and _track_grads below (skip when reading the seed): a
        # [later] free_grads_in_comm conflict, the grad_clip type, an elementwise optimizer.
        if self._free_grads_in_comm and strategy.hybrid_configs["pp_configs"].delay_scale_loss:
            raise ValueError("sharding_configs.free_grads_in_comm with split_param drops the "
                             "params' grads after the reduce-scatter, so the pipeline's "
                             "delay_scale_loss (which scales them) would miss the shards the "
                             "optimizer reads; turn one of them off")
        self._grad_clip = _check_grad_clip(grad_clip)
        _check_elementwise(optimizer)
        self._slice_params = {p: torch.nn.Parameter(p.new_empty(0), p.requires_grad)
                              for p in self._parameter_list}
        slices = [[self._slice_params[p] for p in g["params"]] for g in optimizer.param_groups]
        self._inner_opt = MixPrecisionOptimizer(optimizer, slices)
        self._expose(self._inner_opt)
        self._comm_buffer_list = []
        sharding_config = strategy.hybrid_configs["sharding_configs"]
        # [later] Paddle reads comm_buffer_size_MB here: `_build_comm_buffers(acc_steps,
        # comm_buffer_size_MB * 1024 * 1024)`.
        self._build_comm_buffers(sharding_config.accumulate_steps,
                                 _comm_buffer_bytes(sharding_config))
        self._track_grads()  # beyond Paddle: which params backward reached, for step()

    def _track_grads(self):
        """Beyond Paddle: note (by id) each param that backward reaches until clear_grad.
        With release off its grad is a view of the buffer, never None, so None cannot tell
        torch's "no grad this step" apart; this hook can. It holds only the set of ids."""
        self._produced = set()
        if self.pp_overlap:  # the pipeline's buffers make every param check in each step
            return
        mark = self._produced.add
        self._track_handles = [
            p.register_post_accumulate_grad_hook(lambda param: mark(id(param)))
            for p in self._parameter_list if p.requires_grad]

    def _build_comm_buffers(self, acc_steps, group_size=256 * 1024 * 1024):
        if self.pp_overlap:
            return  # the pipeline builds and fills the buffers
        # Differs from Paddle, which asserts every param is trainable: frozen params stay out.
        params = [p for p in self._parameter_list if p.requires_grad]
        for idx, bucket in assign_group_by_size(params, group_size).items():
            # Seed hunk: the buffers get `release_grads=self.pp_release_grads`.
            buffer = FusedCommBuffer(idx, bucket, self._group, acc_steps,
                                     act=HOOK_ACTION.REDUCE_SCATTER,
                                     release_grads=self.pp_release_grads,
                                     free_grads_in_comm=self._free_grads_in_comm)  # [later]
            self._comm_buffer_list.append(buffer)
        # [later] sharding_configs.comm_overlap (Paddle's register_reduce_overlap_hook(
        # use_comm=True)): hooks that fill and reduce the buffers during backward; the seed's
        # path has it off (skip when reading the seed).
        if self.comm_overlap:
            share_comm_queue(self._comm_buffer_list)  # free_grads_in_comm: during backward
            self._register_own_hooks(self._comm_buffer_list)

    def _own_buffers(self):
        return self._comm_buffer_list

    @torch.no_grad()
    def clear_grad(self, set_to_zero=True):
        """Zero or drop every grad; then, with release and no pipeline overlap, free buffers.

        With release off, `set_to_zero=False` raises ValueError ("should not erase grad
        buffer"). With release on, slice params' grads are dropped too: Paddle's
        `_clear_dataptr` on `_slice_grad` frees them; in torch a stale view would keep the
        freed buffer alive. Beyond Paddle, with comm_overlap between backward and step()
        (collectives in flight): waits for them, clears as above with the check-ins reset,
        then raises ValueError (`_IN_FLIGHT_MSG`, on every rank that ran the backward).
        """
        # Seed hunk: the "should not erase grad buffer" assert holds only with release off.
        # (Under pipeline overlap the pipeline's buffers follow the PP flag alone.)
        if not self._buffers_released and not set_to_zero:
            raise ValueError(_ERASE_MSG)
        in_flight = self._settle_for_clear()  # beyond Paddle (skip when reading the seed)
        self._produced.clear()  # beyond Paddle: the params backward reached this step
        for p in self._parameter_list:
            _clear(p, set_to_zero)  # Paddle's clear_grad_func
        if self.pp_release_grads:  # beyond Paddle: a stale slice grad would pin the buffer
            for slice_param in self._slice_params.values():
                _clear(slice_param, set_to_zero=False)
        # Seed hunk: with release and no pipeline overlap, free v2's own grad buffers here
        # (under overlap the pipeline's _optimizer_step frees its buffers).
        if self.pp_release_grads and not self.pp_overlap:
            for comm_buffer in self._comm_buffer_list:
                comm_buffer._clear_grad_storage()
        if in_flight:
            raise ValueError(_IN_FLIGHT_MSG)

    def _collect_comm_buffers(self):
        if self._comm_buffer_list:
            return
        for p in self._parameter_list:
            ref = getattr(p, "comm_buffer_ref", None)
            if ref is not None:
                del p.comm_buffer_ref
                if ref() is not None:
                    self._comm_buffer_list.append(ref())
        # No buffers without pipeline overlap: no param was trainable at construction
        # (`_misuse_rules` names one unfrozen since). None under it for a stage whose params
        # are all frozen: nothing to step. Either way step() goes on and steps nothing.
        trainable = any(p.requires_grad for p in self._parameter_list)
        if not self._comm_buffer_list and self.pp_overlap and trainable:
            raise RuntimeError("sharding v2 found no REDUCE_SCATTER buffers: with "
                               "pp_configs.sharding_comm_overlap the pipeline builds them in "
                               "its first train_batch; step() must run inside train_batch")
        self._apply_pending_state()  # a consolidated state loaded before the buffers

    @torch.no_grad()
    def reduce_gradients(self, parameter_list, hcg):
        """Reduce-scatter every buffer and scale by 1/nranks (no-op under pipeline overlap).

        With release, a buffer that is still absent (no hook has checked grads in: the
        non-overlap path) first gets every param's grad copied in. Beyond Paddle, with
        release off a grad that is no longer its slot's view is put back (`_relink_grads`).
        """
        if self.pp_overlap:  # the pipeline's hooks reduce-scattered and scaled them
            return  # (Paddle: HybridParallelOptimizer does not call this then; see v1)
        if self.comm_overlap:  # [later] the hooks issued the reduce-scatters during backward;
            # waits and checks them (skip when reading the seed: comm_overlap is off there)
            self._wait_own_buffers(self._comm_buffer_list)
            return
        for comm_buffer in self._comm_buffer_list:
            # Seed hunk: with release and no buffer yet, copy every param's grad in first.
            if self.pp_release_grads and comm_buffer.grad_storage is None:
                for param in comm_buffer.params:
                    comm_buffer._copy_grad_to_buffer(param)
            elif not self.pp_release_grads:  # beyond Paddle: re-link rebound grads (skip)
                self._relink_grads(comm_buffer)
            comm_buffer._comm_grads()
            comm_buffer.scale_grads()

    @torch.no_grad()
    def _relink_grads(self, comm_buffer):
        """Beyond Paddle: with release off, v2 reduces the buffer, not the grads. A grad
        rebound since it was linked (model.zero_grad(), `p.grad = t`, model.to(...)) would be
        left out silently; copy it into its slot (zeros for None) and re-point it, as release
        does every step."""
        for param in comm_buffer.params:
            slot = comm_buffer._sharding_param_grad_view[param]._slice_grad_from_buffer()
            grad = _grad_of(param, comm_buffer.use_main_grad)
            if grad is not None and grad.layout != torch.strided:  # sparse: into the slot
                slot.zero_().view(param.shape).add_(grad)
                _set_grad(param, comm_buffer.use_main_grad, slot.view(param.shape))
            elif grad is None or grad.data_ptr() != slot.data_ptr():
                slot.zero_() if grad is None else slot.copy_(grad.reshape(-1))
                _set_grad(param, comm_buffer.use_main_grad, slot.view(param.shape))

    def _assign_slice_grad(self):
        for comm_buffer in self._comm_buffer_list:
            for param in comm_buffer.params:
                slice_param = self._slice_params[param]
                # Seed hunk: Paddle asserts the stale main_grad is uninitialized and deletes
                # it; in torch it would still hold last step's buffer, so drop it outright.
                # Beyond Paddle, a stale .grad goes too (its assert would trip on it).
                if self.pp_release_grads:
                    if hasattr(slice_param, "main_grad"):
                        del slice_param.main_grad
                    slice_param.grad = None
                comm_buffer.assign_slice_grad(param, slice_param)

    @torch.no_grad()
    def step(self, closure=None):
        """Agree on grads and misuse -> reduce-scatter -> bind slices -> dp all-reduce of
        slice grads -> step -> all-gather. A param is stepped iff some rank produced a grad for
        it since the last clear_grad (backward reached it, or a grad was assigned). After
        `clip_grad_norm_` the grads are reduced already: step() starts at the step."""
        self._check_step_args(closure)
        if not self._grads_ready:
            self._reduce_for_step()
            self._clip_grads()
        self._grads_ready = False
        self._inner_opt.step()
        for comm_buffer in self._comm_buffer_list:  # _sharding_sync_parameters
            comm_buffer.sync_params()

    def _reduce_for_step(self, entry=None, rules=None):
        """The first half of `step()` (also run by `clip_grad_norm_`, with `entry` and
        `rules` as v1's): agree, reduce-scatter, bind the slices, dp all-reduce. The slice
        grads are reduced and final afterwards."""
        self._collect_comm_buffers()
        if self.comm_overlap:  # before any collective of step(): match every rank's buckets
            self._issue_late_buckets()
        rules = (rules or _clip_rules()) + self._misuse_rules()
        anywhere = self._agree_grads(self._has_grad(), rules, entry)
        self._begin_step()
        self.reduce_gradients(self._parameter_list, self._hcg)
        self._assign_slice_grad()
        # Differs from Paddle's v2, which steps every slice, a param without a grad included
        # (its zero slot): Adam's moments and AdamW's decay would move it. As in torch and v1,
        # a param no rank has a grad for is not stepped; release on and off alike.
        for p, some_rank in zip(self._parameter_list, anywhere):
            if not some_rank:
                _clear(self._slice_params[p], set_to_zero=False)
        # Differs from Paddle, whose HybridParallelOptimizer all-reduces over dp before the
        # slices are bound (so it misses them on the first step and after a release).
        if self._dp_sync:
            grads = [_grad(s) for s in self._slice_params.values()]
            all_reduce_mean([g for g in grads if g is not None],
                            self._hcg.get_data_parallel_group())

    def _has_grad(self):
        """Per param: this rank produced a grad since the last clear_grad."""
        if self.pp_overlap and self._free_grads_in_comm:  # every param checked in, and
            return [p.requires_grad for p in self._parameter_list]  # its grad went after
        if self.pp_overlap:
            return [_grad(p) is not None for p in self._parameter_list]
        linked = set()  # ids of params whose grad is still its slot's view (release off)
        for buf in self._comm_buffer_list:
            storage = buf.grad_storage
            for p in buf.params if storage is not None else ():
                index = buf._sharding_param_grad_view[p]._index
                grad = _grad_of(p, buf.use_main_grad)
                if grad is not None and grad.layout == torch.strided and grad.data_ptr() == (
                        storage.data_ptr() + index * storage.element_size()):
                    linked.add(id(p))
        return [id(p) in self._produced or (_grad(p) is not None and id(p) not in linked)
                for p in self._parameter_list]

    def _misuse_rules(self):
        """Beyond Paddle: state changed behind v2's back since it was built, as `(rule,
        detail)` pairs for `_agree_grads`, which raises them on every rank. A param that only
        stopped being a view of its slot in the flat param buffer (model.to(float64).to(
        float32)) is put back into it with its current value, which is exact."""
        moved, unfrozen, main_grad, in_buffer = [], [], [], set()
        name = {id(p): f"param #{i} (shape {tuple(p.shape)}, {p.dtype})"
                for i, p in enumerate(self._parameter_list)}
        for buf in self._comm_buffer_list:
            storage = buf.param_storage
            for p in buf.params:
                in_buffer.add(id(p))
                index = buf._sharding_param_grad_view[p]._index
                if p.data_ptr() != storage.data_ptr() + index * storage.element_size():
                    if p.dtype == storage.dtype and p.device == storage.device:
                        _share_param_buffer(p, storage, index)
                    else:
                        moved.append(name[id(p)])
                if (buf.use_main_grad and not hasattr(p, "main_grad")) or (
                        not buf.use_main_grad and getattr(p, "main_grad", None) is not None):
                    main_grad.append(name[id(p)])
        unfrozen = [name[id(p)] for p in self._parameter_list
                    if p.requires_grad and id(p) not in in_buffer]
        return [(_MOVED_MSG, ", ".join(moved) or None),
                (_UNFROZEN_MSG, ", ".join(unfrozen) or None),
                (_MAIN_GRAD_MSG, ", ".join(main_grad) or None)]

    def _clip_pairs(self):
        """What a clip reads: this rank's slice grads, padding left out (it is zero, and not
        the model's): a slice may end in its param's padding (see ShardingGradView)."""
        pairs = []
        for comm_buffer in self._comm_buffer_list:
            for param, view in comm_buffer._sharding_param_grad_view.items():
                grad = _grad(self._slice_params[param])
                if grad is not None:
                    valid = min(view._param_end, view._index + param.numel()) - view._param_begin
                    pairs.append((param, grad[:valid]))  # param: need_clip, is_firstly_shared
        return pairs
