"""fp32 master weights for low-precision params: Paddle's `MixPrecisionOptimizer` in torch.

Mirrors `MixPrecisionOptimizer` in
`python/paddle/distributed/fleet/utils/mix_precision_utils.py` at commit 9b40c67f672f, plus the
fp32 master weights that Paddle's `multi_precision` optimizers keep (torch optimizers have none).
Sharding v1 / v2 step their owned params / slice params through it.
"""
import inspect

import torch

from comm_buffer import main_grad_or_grad as _grad
from optim_wrappers.torch_face import _Wrapper, clear_grad_func as _clear


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
    def _reload_if_changed(self, t, master):
        if master.shape != t.shape:  # a v2 slice was filled after construction
            master.data = t.detach().float()
        elif not torch.equal(master.to(t.dtype), t):
            # Beyond Paddle: written behind our back (e.g. model.load_state_dict after the
            # optimizer was built). Compared by value: `_version` misses writes through
            # another view of the same buffer into a v2 slice rebound with `.data =`.
            master.copy_(t)

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step on every target that has a main_grad or grad (others skipped)."""
        self._check_step_args(closure)
        self.check_template()
        bound = []
        for t in self._targets:
            main_grad, master = getattr(t, "main_grad", None), self._masters.get(t)
            if master is not None:
                grad = _grad(t)
                if grad is not None:
                    self._reload_if_changed(t, master)
                master.grad = None if grad is None else grad.float()  # no copy for fp32
                bound.append(master)
            elif main_grad is not None:  # fp32 param with an fp32 main_grad
                t.grad = main_grad
                bound.append(t)
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
