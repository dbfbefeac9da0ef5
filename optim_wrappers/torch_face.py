"""The torch optimizer face of the wrappers (`MixPrecisionOptimizer`, sharding v1 / v2).

Paddle's wrappers forward to the inner optimizer by `__getattr__`; a torch user instead reaches
for `torch.optim.Optimizer`'s own API (LR schedulers read `param_groups`, checkpoints call
`state_dict`, libraries register hooks). `_Wrapper` keeps that API: each public method of
`torch.optim.Optimizer` (torch 2.13) works through the wrapper or raises naming the alternative.
`param_groups` and `state` are read from the inner optimizer on every access, never cached:
torch's `load_state_dict` replaces both objects, and a cached reference would leave an LR
scheduler driving a dead dict.
"""
from collections import OrderedDict

import torch

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
