"""relgrad: Paddle's `release_gradients` (PR #59739) in torch: what fleet provides around it.

Mirrors, at commit 9b40c67f672f, `PpConfig` / `DygraphShardingConfig` (distributed_strategy.proto),
`HybridCommunicateGroup` (fleet/base/topology.py) and `MixPrecisionOptimizer`
(fleet/utils/mix_precision_utils.py), plus process-group helpers (timeouts, the current device).
`python relgrad.py` runs the main job (relgrad_demo/cli.py). Leaves out: mp / sep axes.
"""
import datetime
import enum
import importlib
import inspect
import sys
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from comm_buffer import _backend_for, agree, main_grad_or_grad as _grad, weak_hook


# ---- config (Paddle's distributed_strategy.proto field names) and topology ----

def _require(ok, message):
    if not ok:
        raise ValueError(message)


def _require_count(name, value, none_ok=False):  # an int >= 1 (or None, if `none_ok`)
    is_count = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    ok = is_count or (none_ok and value is None)
    _require(ok, f"{name} must be an int >= 1{' or None' * none_ok}, got {value!r}")


@dataclass
class PpConfig:
    """Paddle's `PpConfig` message; the proto field numbers are in the comments."""

    dp_comm_overlap: bool = False  # 1: dp grads in fused buffers, all-reduced during backward
    delay_scale_loss: bool = False  # 2: scale grads by 1/micro-batches before the step
    enable_timer: bool = False  # 3: Paddle's pipeline timers; not implemented, must be False
    sharding_comm_overlap: bool = False  # 4: sharding reduce(-scatter) during backward
    profiling: bool = False  # 5: Paddle's profiler hooks; not implemented, must be False
    # Seed hunk: field 6. Fused grad buffers are allocated when a step's first grad is checked
    # in (v2 without overlap: at step()) and freed after its optimizer step.
    release_gradients: bool = False
    # Not a proto field: PipelineLayer's model chunks per rank (> 1: interleave, extras)
    num_virtual_pipeline_stages: int = 1

    def __post_init__(self) -> None:
        for name in ("enable_timer", "profiling"):
            _require(not getattr(self, name), f"pp_configs.{name} is not implemented; unset it")
        _require_count("pp_configs.num_virtual_pipeline_stages", self.num_virtual_pipeline_stages)


@dataclass
class DygraphShardingConfig:
    """Paddle's `DygraphShardingConfig` message (the fields this reference uses)."""

    split_param: bool = False  # sharding v2: flat param shards (DygraphShardingOptimizerV2)
    accumulate_steps: int = 1  # backward passes per step of comm_overlap's own buffers
    comm_overlap: bool = False  # sharding's own tensor-fusion overlap (hooks, no pipeline)
    # [later] field 8, PR #64517: ORed with pp_configs' for the optimizers' own buffers
    release_gradients: bool = False
    # [later] PaddleNLP #9081: free what a rank will not read once its bucket is reduced
    free_grads_in_comm: bool = False
    comm_buffer_size_MB: int = None  # [later] MB per bucket; None: 256 own, 128 pipeline

    def __post_init__(self) -> None:
        _require_count("sharding_configs.accumulate_steps", self.accumulate_steps)
        _require_count("sharding_configs.comm_buffer_size_MB", self.comm_buffer_size_MB, True)


@dataclass
class HybridStrategy:
    """Paddle's `DistributedStrategy.hybrid_configs` plus `pipeline_configs`, flattened."""

    dp_degree: int = 1  # data-parallel replicas (outermost axis of the rank grid)
    pp_degree: int = 1  # pipeline stages
    sharding_degree: int = 1  # ZeRO-1 shards (innermost axis)
    accumulate_steps: int = 1  # pipeline_configs': micro-batches per train_batch
    micro_batch_size: int = None  # pipeline_configs.micro_batch_size; None: batch / acc
    pp_configs: PpConfig = field(default_factory=PpConfig)
    sharding_configs: DygraphShardingConfig = field(default_factory=DygraphShardingConfig)

    def __post_init__(self) -> None:
        for name in ("dp_degree", "pp_degree", "sharding_degree", "accumulate_steps"):
            _require_count(name, getattr(self, name))
        _require_count("micro_batch_size", self.micro_batch_size, none_ok=True)
        problem = sharding_config_problem(self)
        _require(problem is None, problem)

    @property
    def hybrid_configs(self) -> dict:
        """Dict view, so code reads as Paddle's: `strategy.hybrid_configs["pp_configs"]`."""
        names = ("dp_degree", "pp_degree", "sharding_degree", "pp_configs", "sharding_configs")
        return {name: getattr(self, name) for name in names}

    def check_world_size(self, world_size: int) -> None:
        """Raise ValueError unless the degrees multiply to `world_size` (ranks)."""
        product = self.dp_degree * self.pp_degree * self.sharding_degree
        _require(product == world_size, f"dp_degree * pp_degree * sharding_degree = {product} ("
                 f"{self.dp_degree} * {self.pp_degree} * {self.sharding_degree}) must equal the "
                 f"world size {world_size}; change the degrees or the number of ranks")


def sharding_config_problem(strategy: HybridStrategy) -> str | None:
    """What breaks the sharding configs' rules in `strategy` (Paddle's hybrid_configs), or None."""
    pp, sd, pp_degree = strategy.pp_configs, strategy.sharding_configs, strategy.pp_degree
    released = pp.release_gradients or (sd.release_gradients and not pp.sharding_comm_overlap)
    if sd.comm_overlap and (pp.sharding_comm_overlap or pp_degree > 1):
        return ("sharding_configs.comm_overlap is sharding's own overlap without a pipeline: it "
                "needs pp_degree 1 and pp_configs.sharding_comm_overlap off (they cannot both be "
                f"on), got {pp_degree} and {pp.sharding_comm_overlap}")
    if sd.free_grads_in_comm and not released:
        return ("sharding_configs.free_grads_in_comm needs release: turn on "
                "pp_configs.release_gradients (or sharding_configs')")
    if sd.free_grads_in_comm and pp.delay_scale_loss and sd.split_param:
        return ("sharding_configs.free_grads_in_comm with split_param: delay_scale_loss would "
                "miss the freed shards")
    return None


class HybridCommunicateGroup:
    """The dp x pp x sharding rank grid and its process groups (Paddle's HybridCommunicateGroup).

    `rank = (dp_index * pp_degree + stage) * sharding_degree + sharding_index`; every degree 2:

        rank       0 1 2 3 4 5 6 7      sharding groups {0,1} {2,3} {4,5} {6,7}
        dp index   0 0 0 0 1 1 1 1      pipe groups     {0,2} {1,3} {4,6} {5,7}
        stage      0 0 1 1 0 0 1 1      dp groups       {0,4} {1,5} {2,6} {3,7}
        sharding   0 1 0 1 0 1 0 1

    `timeout` bounds each collective and p2p wait on them (None: the default group's).
    """

    def __init__(self, strategy: HybridStrategy, timeout: datetime.timedelta | None = None) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        timeout = timeout or group_timeout(None)
        strategy.check_world_size(world)
        shape = (strategy.dp_degree, strategy.pp_degree, strategy.sharding_degree)
        grid = torch.arange(world).reshape(shape)
        self._coord = [int(c) for c in (grid == rank).nonzero()[0]]
        self._groups = []  # (group, global ranks) of this rank along dp, pp, sharding
        for axis, size in enumerate(shape):
            for ranks in grid.movedim(axis, -1).reshape(-1, size).tolist():
                group = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    self._groups.append((group, ranks))

    # Paddle's getters: ranks, sizes and groups along dp (axis 0), pipe (1), sharding (2).
    def get_data_parallel_rank(self) -> int: return self._coord[0]
    def get_data_parallel_world_size(self) -> int: return len(self._groups[0][1])
    def get_data_parallel_group(self) -> dist.ProcessGroup: return self._groups[0][0]
    def get_stage_id(self) -> int: return self._coord[1]
    def get_pipe_parallel_world_size(self) -> int: return len(self._groups[1][1])
    def get_pipe_parallel_group(self) -> dist.ProcessGroup: return self._groups[1][0]
    def get_rank_from_stage(self, stage_id: int) -> int: return self._groups[1][1][stage_id]
    def get_sharding_parallel_rank(self) -> int: return self._coord[2]
    def get_sharding_parallel_world_size(self) -> int: return len(self._groups[2][1])
    def get_sharding_parallel_group(self) -> dist.ProcessGroup: return self._groups[2][0]


# ---- process groups on any backend: timeouts, the current device ----

def group_timeout(group: dist.ProcessGroup | None) -> datetime.timedelta:
    """The timeout `group` (None: the default) was created with, else torch's default for it."""
    group = group or dist.distributed_c10d._get_default_group()
    for device in getattr(group, "_device_types", ()):  # private API: its backends' devices
        try:
            return group._get_backend(device).options._timeout
        except Exception:  # noqa: BLE001 (private API: try the next device, then the default)
            continue
    if "nccl" in str(dist.get_backend(group)) and dist.constants.default_pg_nccl_timeout:
        return dist.constants.default_pg_nccl_timeout
    return dist.constants.default_pg_timeout


SET_DEVICE_FIX = ("add `torch.cuda.set_device(local_rank)` (local_rank = int(os.environ["
                  "'LOCAL_RANK']) under torchrun) before `dist.init_process_group(\"nccl\")`, "
                  "or pass `device_id=torch.device(\"cuda\", local_rank)` to it")


def device_problem(backend: str, param_devices: list, current_device: int | None) -> str | None:
    """Why params on `param_devices` cannot run NCCL on `current_device`, or None. Pure."""
    others = sorted({str(d) for d in param_devices if torch.device(d).type == "cuda"
                     and (torch.device(d).index or 0) != current_device})
    if _backend_for(backend, "cuda") != "nccl" or not others:
        return None
    return (f"params on {', '.join(others)} but the current CUDA device is "
            f"cuda:{current_device} (torch.cuda.current_device()), where NCCL runs")


def check_current_device(params: list, groups: list, what: str) -> None:
    """Beyond Paddle: ValueError on every rank if, under NCCL, params are off the current GPU."""
    if any(_backend_for(dist.get_backend(g), "cuda") == "nccl" for g in groups):
        current = torch.cuda.current_device() if torch.cuda.is_available() else None
        problem = device_problem("nccl", [p.device for p in params], current)
        agree(groups, [(f"{what}: {SET_DEVICE_FIX}", problem)], via_store=True)


# ---- a step's state: one phase, and the grads written since the last clear ----

class Phase(enum.Enum):
    """Where an optimizer (or the pipeline) is between two clears of the grads."""

    IDLE = "idle"  # cleared: backward may run
    DROPPED = "dropped"  # zero_grad() ran between backward and step()
    SCHEDULED = "scheduled"  # the pipeline: a schedule ran, its grads wait for the step
    FAILED = "failed"  # the step was refused: its grads stay for a retry or the clear
    REDUCED = "reduced"  # step()'s first half ran (clip_grad_norm_, finish_grad_sync)
    STEPPED = "stepped"  # stepped: the grads stay readable until the clear


class GradMarks:
    """Beyond Paddle: which params got a grad since `clear()`, and which changed in place since."""

    def __init__(self, params: list) -> None:
        self.params, self._hooks = params, {}
        self.clear()
        weakref.finalize(self, _remove_hooks, self._hooks)

    def clear(self) -> None:
        """Forget what was written; hook every trainable param (one unfrozen since, too)."""
        self._written, self._cleared, self._hooks_run = {}, {}, 0
        for p in self.params:
            if _grad(p) is not None:
                self._cleared[id(p)] = id(_grad(p))
            if p.requires_grad and id(p) not in self._hooks:
                hook = weak_hook(GradMarks._mark, self)  # holds the marks weakly
                self._hooks[id(p)] = p.register_post_accumulate_grad_hook(hook)

    def _mark(self, param):  # param's grad hook: note (version, hook number, id) of its grad
        self._written[id(param)] = (_grad(param)._version, self._hooks_run, id(_grad(param)))
        self._hooks_run += 1

    def written(self) -> list:
        """Per param: a grad written since the last clear (by backward, or assigned by hand)."""
        flags = []
        for p in self.params:
            by_hand = _grad(p) is not None and self._cleared.get(id(p)) != id(_grad(p))
            flags.append(id(p) in self._written or by_hand)
        return flags

    def changed_in_place(self) -> list:
        """Params whose grad's version moved more than the later backwards' adds explain."""
        changed = []
        for p in self.params:
            grad, seen = _grad(p), self._written.get(id(p))
            if grad is not None and seen is not None and seen[2] == id(grad):
                if grad._version - seen[0] > self._hooks_run - 1 - seen[1]:
                    changed.append(p)
        return changed


def _remove_hooks(hooks):
    for handle in hooks.values():
        handle.remove()


# ---- the torch optimizer surface and fp32 masters (Paddle's mix_precision_utils.py) ----

def register_main_grad_hooks(params: Iterable) -> list:
    """fp32 `param.main_grad` hooks (Paddle's MixPrecisionLayer), before the buffers'."""
    handles = []
    for p in params:
        if p.requires_grad:
            if not hasattr(p, "main_grad"):
                p.main_grad = None
            handles.append(p.register_post_accumulate_grad_hook(_update_main_grad))
    return handles


@torch.no_grad()
def _update_main_grad(param):
    if param.main_grad is None:
        param.main_grad = param.grad.float()
    else:
        param.main_grad.add_(param.grad)  # fp32 += bf16 is computed in fp32
    param.grad = None


def clear_grad_func(p: torch.Tensor, set_to_zero: bool) -> None:
    """Zero `p`'s main_grad / grad in place, or drop them (Paddle's clear_grad_func)."""
    for name in ("main_grad", "grad"):
        grad = getattr(p, name, None)
        if grad is not None and set_to_zero:
            grad.zero_()
        elif grad is not None:
            setattr(p, name, None)


class _Wrapper(torch.optim.Optimizer):
    """The wrappers' torch `Optimizer` face: the inner's `param_groups` / `state`, torch's hooks."""

    _step_supports_amp_scaling = True  # GradScaler hands its scale to step(), which refuses
    param_groups = property(lambda self: self._inner_opt.param_groups)  # live: LRs reach it
    state = property(lambda self: self._inner_opt.state)  # keys: owned / slice params, masters

    def _expose(self, inner):
        self.defaults = inner.defaults
        for kind in ("step", "state_dict", "load_state_dict"):  # what Optimizer.__init__ makes
            setattr(self, f"_optimizer_{kind}_pre_hooks", OrderedDict())
            setattr(self, f"_optimizer_{kind}_post_hooks", OrderedDict())
        self._patch_step_function()  # torch's step pre / post hooks around our step()

    def __getstate__(self):
        raise TypeError(f"{type(self).__name__} cannot be pickled or deep-copied; use state_dict()")

    def _check_step_args(self, closure):
        if closure is not None:
            raise ValueError("closure is not supported by the sharding wrappers; call the "
                             "model yourself and then step()")
        if hasattr(self, "grad_scale"):  # set by GradScaler.step(), None after unscale_()
            del self.grad_scale, self.found_inf  # GradScaler deletes them only after a step
            raise ValueError("torch.amp.GradScaler cannot drive this optimizer (it checks each "
                             "rank's grads before the reduce): clear the grads; under bf16 "
                             "autocast drop the scaler (bf16 params: fp32 main grads)")
        (getattr(self, "check_template", None) or self._inner_opt.check_template)()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.clear_grad(set_to_zero=not set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        """torch's: v1 gives the new params owners, MixPrecision masters (relgrad_extras)."""
        extras("param_groups", "add_param_group").add_param_group(self, param_group)

    def state_dict(self) -> dict:
        """This rank's state, through torch's hooks (relgrad_extras/checkpoint.py)."""
        return extras("checkpoint", "state_dict()").state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """A saved state, through torch's hooks; collective under sharding (relgrad_extras)."""
        extras("checkpoint", "load_state_dict").load_state_dict(self, state_dict)


def new_params(params: torch.Tensor | Iterable, known: list) -> list:
    """`params` (a tensor or an iterable) as a list; ValueError if one is `known` or repeated."""
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    ids = [id(p) for p in params]
    if len(set(ids)) < len(ids) or set(ids) & {id(p) for p in known}:
        raise ValueError("some params are already in the optimizer (or repeated)")
    return params


def _hyper(group): return {k: v for k, v in group.items() if k != "params"}


class MixPrecisionOptimizer(_Wrapper):
    """Paddle's: `optimizer`'s class steps fp32 masters of 16-bit targets (`params` per group)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list | None = None) -> None:
        if carries_state(optimizer):  # the sharding wrappers agree on this first
            raise ValueError(f"{_template_state_rule(type(self).__name__)}; it holds state "
                             f"for {len(optimizer.state)} param(s)")
        self._targets, self._masters = [], {}
        targets = params or [g["params"] for g in optimizer.param_groups]
        groups = [self._master_group(g, t) for g, t in zip(optimizer.param_groups, targets)]
        self._inner_opt = _rebuilt(optimizer, groups)
        self._expose(self._inner_opt)
        self._template, self._built = optimizer, [_hyper(g) for g in optimizer.param_groups]

    def _master_group(self, group, targets):
        targets = new_params(targets, self._targets)
        self._targets += targets
        self._masters.update({t: t.detach().float() for t in targets
                              if t.is_floating_point() and t.element_size() < 4})
        return {**_hyper(group), "params": [self._masters.get(t, t) for t in targets]}

    def check_template(self) -> None:
        """ValueError if the wrapped optimizer changed since (an LR scheduler built on it)."""
        for i, (group, built) in enumerate(zip(self._template.param_groups, self._built)):
            changed = {k: (built.get(k), v) for k, v in _hyper(group).items()
                       if built.get(k) != v and k != "initial_lr"}
            if changed:
                raise ValueError(f"the torch optimizer changed after wrapping (group {i}, (built, "
                                 f"now): {changed}). Build the scheduler on the wrapper")

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> None:
        """One optimizer step on every target that has a main_grad or grad (others skipped)."""
        self._check_step_args(closure)  # and check_template
        bound, with_grad = [], []
        for t in self._targets:
            master, grad = self._masters.get(t), _grad(t)
            if master is not None:
                if grad is not None and master.shape != t.shape:  # a v2 slice filled late
                    master.data = t.detach().float()
                elif grad is not None:
                    with_grad.append((t, master))
                master.grad = None if grad is None else grad.float()  # no copy for fp32
                bound.append(master)
            elif getattr(t, "main_grad", None) is not None:  # fp32 param, fp32 main_grad
                t.grad = t.main_grad
                bound.append(t)
        if with_grad:  # targets written behind our back reload their masters (one sync)
            differs = torch.stack([(m.to(t.dtype) != t).any() for t, m in with_grad]).tolist()
            for (t, master), changed in zip(with_grad, differs):
                if changed:
                    master.copy_(t)
        self._inner_opt.step()
        for t, master in self._masters.items():
            if master.grad is not None:
                t.copy_(master)
        for p in bound:
            p.grad = None

    @torch.no_grad()
    def clear_grad(self, set_to_zero: bool = True) -> None:
        for t in self._targets:  # Paddle's clear_grad
            clear_grad_func(t, set_to_zero)


def _rebuilt(optimizer, groups):
    """A new optimizer of `optimizer`'s class and hyper-parameters over `groups`."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return type(optimizer)(groups, **defaults)


def carries_state(optimizer: torch.optim.Optimizer) -> bool:
    """True if `optimizer` holds state a fresh one would not (stepped or loaded)."""
    if not optimizer.state:
        return False
    fresh = _rebuilt(optimizer, [dict(g) for g in optimizer.param_groups])  # torch edits them
    for p, state in optimizer.state.items():
        new = fresh.state.get(p, {})
        if set(state) != set(new):
            return True
        for k, v in state.items():
            if not torch.equal(torch.as_tensor(v), torch.as_tensor(new[k])):
                return True
    return False


def extras(module: str, what: str) -> types.ModuleType:
    """`relgrad_extras.<module>`, for `what`; ImportError naming the folder if absent."""
    try:
        return importlib.import_module(f"relgrad_extras.{module}")
    except ModuleNotFoundError as error:
        if error.name not in ("relgrad_extras", f"relgrad_extras.{module}"):
            raise
        raise ImportError(f"{what} lives in relgrad_extras/{module}.py: copy the folder "
                          "relgrad_extras/ beside the four core modules") from error


def _template_state_rule(wrapper):
    return (f"the torch optimizer handed to {wrapper} already has state (stepped or loaded); "
            "the wrapper uses it only as a template and would drop it. Wrap a fresh optimizer, "
            "then load the saved state into the wrapper")


if __name__ == "__main__":
    from relgrad_demo.cli import main  # the command line lives beside the demo it runs
    sys.exit(main())
