"""ZeRO-1 sharding optimizers with `release_gradients`: Paddle's DygraphShardingOptimizer v1 / v2.

Mirrors `dygraph_sharding_optimizer.py` (fleet/meta_optimizers/dygraph_optimizer) at commit
9b40c67f672f (PR #59739). v1 gives whole params to owners: grads are reduced to the owner, it
steps, the params are broadcast. v2 (`split_param`) makes each bucket one flat padded buffer
with a shard per rank: grads are reduce-scattered, the slices stepped, the buffer all-gathered.
With release the grad buffers live from a step's first grad to `clear_grad`. Phases of
`step()`: agree -> reduce -> dp all-reduce -> clip -> step -> broadcast / all-gather. Rules:
docs/contract.md. Leaves out: v1's fused params, offload, color sharding, GradScaler. Paddle
PRs #59739, #58462, #64517; Rajbhandari et al., "ZeRO" (2020).
"""
from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable

import torch
import torch.distributed as dist

from comm_buffer import (HOOK_ACTION, IN_FLIGHT_RULE, FusedCommBuffer, _fill_grad,
                         _share_param_buffer, agree, assign_group_by_size, broadcast_each,
                         comm_device, densify_grads, first_few, global_rank,
                         main_grad_or_grad as _grad, sums_in_16_bits, weak_hook)
from relgrad import (GradMarks, HybridCommunicateGroup, HybridStrategy, MixPrecisionOptimizer,
                     Phase, _hyper, _template_state_rule, _Wrapper, carries_state,
                     check_current_device, clear_grad_func, extras, sharding_config_problem)


# ---- Helpers: the dp sync, hyper-parameters, the extras folder's plug ----

@torch.no_grad()
def all_reduce_mean(grads: list, group: dist.ProcessGroup | None) -> None:
    """Paddle's `fused_allreduce_gradients`, unfused: the mean over `group`, in place."""
    scale, works = 1.0 / dist.get_world_size(group), []
    for g in grads:  # 16-bit sums scale first (no overflow), the others after (exact)
        if sums_in_16_bits(g.dtype):
            g.mul_(scale)
        works.append(dist.all_reduce(g, group=group, async_op=True))
    for work in works:
        work.wait()
    for g in grads:
        if not sums_in_16_bits(g.dtype):
            g.mul_(scale)


@torch.no_grad()
def agreed_all_reduce_mean(params: list, group: dist.ProcessGroup | None, device: torch.device,
                           param_groups: list, here: list, reduce: bool = True) -> list:
    """The dp sync, hyper-parameters agreed. `here`, per param: written on this rank (zeros
    where only others wrote, as DDP); `reduce=False`: agree only. Returns: written anywhere."""
    if not params:
        return []
    densify_grads(params)
    anywhere = agree([group], same=[("hyper", hyper_parameters(param_groups))], flags=here,
                     device=device, title="every rank that holds the same params must step "
                     "with the same hyper-parameters")
    if reduce:
        fill_missing_grads(params, anywhere, here)
        all_reduce_mean([_grad(p) for p, a in zip(params, anywhere) if a], group)
    return anywhere


def fill_missing_grads(params: list, anywhere: list, here: list) -> None:
    """Zeros for the grads that only other ranks wrote (the collectives then pair)."""
    for p, some_rank, mine in zip(params, anywhere, here):
        if some_rank and not mine:
            _fill_grad(p, hasattr(p, "main_grad"))


def hyper_parameters(param_groups: list) -> dict:
    """Each hyper-parameter of `param_groups` as text, by name (`agree`'s)."""
    found = {}
    for i, group in enumerate(param_groups):
        for key, value in sorted(_hyper(group).items()):
            found[f"param_groups[{i}][{key!r}]"] = repr(value)
    return found


def plug_free_in_comm(buffers: list, free_grads_in_comm: bool) -> None:
    """[later] With `free_grads_in_comm`, make `buffers` relgrad_extras' FreeInCommBuffers."""
    if free_grads_in_comm:
        extras("free_in_comm", "sharding_configs.free_grads_in_comm").plug(buffers)


# ---- The bucket scheduler: one firing order on every rank ----

INCOMPLETE_RULE = ("a bucket did not get accumulate_steps={acc} backward passes: each trainable "
                   "param needs a grad in each, no more, on every rank (an unused branch, or a "
                   "reentrant checkpoint: use_reentrant=False); clear this step")


class BucketScheduler:
    """Beyond Paddle: the buckets' collectives in one order on every rank (the build's, reversed),
    from the hooks with `fire_on_hook` (`held` ones wait for the tie sum), the rest by `fire()`."""

    def __init__(self, fire_on_hook: bool = True) -> None:
        self.buffers, self.fire_on_hook, self.held = [], fire_on_hook, []
        self.reset()

    def reset(self) -> None:
        self._next, self.extra = 0, Counter()

    def add(self, buffer: FusedCommBuffer) -> None:
        """Put `buffer` first in the order; its params' hooks check in here (weakly held)."""
        self.buffers.insert(0, buffer)
        for p in buffer.params:
            p.register_post_accumulate_grad_hook(weak_hook(type(self).check_in, self, buffer))

    def check_in(self, buffer: FusedCommBuffer, param: torch.Tensor) -> None:
        if not buffer.accepts(param):
            self.extra[id(param)] += 1  # a backward pass beyond acc_steps: agreed at the step
            return
        buffer.add_grad(param, use_comm=False)
        order = [b for b in self.buffers if b not in self.held]
        while self.fire_on_hook and self._next < len(order) and order[self._next].complete:
            if not order[self._next].in_flight:
                order[self._next].comm_grads()
            self._next += 1

    def fire(self, buffers: list | None = None) -> None:
        """Issue, in order, each of `buffers` (default all) not issued yet, with what it holds."""
        for buffer in self.buffers if buffers is None else buffers:
            if not buffer.in_flight:
                buffer.issue()

    def settle(self) -> None:
        """Issue the rest, wait for them all, reset the check-ins and the order."""
        self.fire()
        for buffer in self.buffers:
            buffer.settle()
        self.reset()

    def passes(self) -> tuple:
        """(most, fewest) check-ins of a param this step: its backward passes."""
        if not self.buffers:
            return None, None
        acc, counts, done = self.buffers[0].acc_steps, [], []
        for buffer in self.buffers:
            counts += buffer.check_ins().values()
            if len(buffer.check_ins()) < len(buffer.params):
                done.append(acc)  # some param of it checked in acc_steps times
        most = acc + max(self.extra.values()) if self.extra else max(done + counts, default=0)
        return most, min(counts or done or [0])

    def wait_and_agree(self, groups: list, device: torch.device) -> None:
        """After `fire()`: agree that every param checked in acc_steps times everywhere and no
        grad changed in flight, then wait and scale; else every rank settles and raises."""
        acc = self.buffers[0].acc_steps if self.buffers else None
        most, fewest = self.passes()
        changed = [b.id for b in self.buffers if b.changed_in_flight()]
        flying = f"buckets {changed}" if changed else None
        short = []  # the params that checked in fewer than acc_steps times
        for buffer in self.buffers:
            for param, count in buffer.check_ins().items():
                short.append(f"{buffer.name(param)}: {count} of {buffer.acc_steps}")
        missing = None
        if most != acc or fewest != acc:
            missing = f"{most} backward passes, the fewest for a param {fewest}"
            missing += f"; short: {first_few(short)}" if short else ""
        passes = (most, fewest) if self.buffers else None  # None: no opinion (no buckets)
        try:
            agree(groups, [(INCOMPLETE_RULE.format(acc=acc), missing), (IN_FLIGHT_RULE, flying)],
                  [("backward passes (most, fewest for a param)", passes)], device=device)
        except ValueError:
            self.settle()
            raise
        self.reset()
        for buffer in self.buffers:
            buffer.scale_grads(agree_in_flight=False)  # agreed above


# ---- What v1 and v2 share: flags, agreements, the step's state, per-rank checkpoints ----

_CLIP_RULES = 3  # clip_grad_norm_'s rules (relgrad_extras.grad_clip): every rank sends as many
_ERASE_MSG = ("should not erase grad buffer: release off, the grads are views of a persistent "
              "fused buffer; use zero_grad(set_to_none=False) or turn release_gradients on")
UNSLOTTED_RULE = ("a param frozen when the fused buffers were built requires grad now: it has no "
                  "slot, so its grad would not be reduced; refreeze it, or build the optimizer "
                  "(and the pipeline) after unfreezing; clear this step")
IN_PLACE_RULE = ("a grad changed in place between backward and step(), before step() reduces it "
                 "(torch's clip_grad_norm_ on local grads): use opt.clip_grad_norm_(max_norm), "
                 "or change grads after opt.finish_grad_sync(); clear this step")
_DROPPED_RULE = ("did zero_grad() run between backward and step() on some rank, with no "
                 "backward after it? Its grads would count as zeros: clear grads after step()")


class _Sharding(_Wrapper):
    """What v1 and v2 share: a torch `optimizer` (a template), `hcg`, `strategy`, and
    `grad_clip`, a Paddle-style clip (relgrad_extras.grad_clip) on the reduced grads."""

    def _setup(self, optimizer, hcg, strategy, grad_clip) -> None:
        pp_config = strategy.hybrid_configs["pp_configs"]
        sharding_config = strategy.hybrid_configs["sharding_configs"]
        self._hcg, self._group = hcg, hcg.get_sharding_parallel_group()
        self._nranks = hcg.get_sharding_parallel_world_size()
        self._rank = hcg.get_sharding_parallel_rank()
        self._parameter_list = [p for g in optimizer.param_groups for p in g["params"]]
        # Setting pipeline parallelism overlap (grads then arrive reduced by the pipeline).
        self.pp_overlap = pp_config.sharding_comm_overlap
        # Seed hunk: `self.pp_release_grads = pp_config.release_gradients`
        self.pp_release_grads = pp_config.release_gradients

        # [later, #64517] Paddle's later name: the own buffers' flag, ORed with sharding's
        self.sd_release_grads = self.pp_release_grads or sharding_config.release_gradients
        self._dp_sync = (hcg.get_data_parallel_world_size() > 1
                         and not pp_config.dp_comm_overlap)  # HybridParallelOptimizer's
        self._init_beyond_paddle(optimizer, strategy, grad_clip)  # skippable: see there

    def _init_beyond_paddle(self, optimizer, strategy, grad_clip) -> None:
        """Beyond Paddle: device, build agreed; params broadcast; the step's state."""
        sharding_config = strategy.hybrid_configs["sharding_configs"]
        check_current_device(self._parameter_list, self._flag_groups(), type(self).__name__)
        self._agree_on_setup(optimizer, strategy, grad_clip)
        for group in self._flag_groups()[self._nranks == 1 :]:  # as DDP: from the first rank
            broadcast_each(self._parameter_list, group)
        self.comm_overlap, self._overlap = sharding_config.comm_overlap, None
        if self.comm_overlap:  # [later] its own hooked buffers
            self._overlap = extras("own_overlap", "sharding_configs.comm_overlap").OwnOverlap(self)
        self._free_grads_in_comm = sharding_config.free_grads_in_comm
        problem = sharding_config_problem(strategy)  # again: a strategy is mutable
        if problem:
            raise ValueError(problem)
        if grad_clip is not None:  # TypeError unless a Paddle-style clip
            extras("grad_clip", "grad_clip=").check(grad_clip)
        self._grad_clip = grad_clip
        self._phase, self._marks = Phase.IDLE, GradMarks(self._parameter_list)

    def _wrap(self, optimizer, targets: dict) -> None:
        """The inner optimizer, over what this rank steps of each param (`targets`), per group."""
        groups = []
        for group in optimizer.param_groups:
            groups.append([targets[p] for p in group["params"] if p in targets])
        self._inner_opt = MixPrecisionOptimizer(optimizer, groups)
        self._expose(self._inner_opt)

    def _flag_groups(self) -> list:  # the ranks that hold the same params
        if self._hcg.get_data_parallel_world_size() > 1:
            return [self._group, self._hcg.get_data_parallel_group()]
        return [self._group]

    def _flags_device(self):
        return comm_device(self._parameter_list, self._group)

    def _agree_on_setup(self, optimizer, strategy, grad_clip) -> None:
        """Every rank builds alike: class, config, torch optimizer, hyper-parameters, params."""
        sc, pc = strategy.hybrid_configs["sharding_configs"], strategy.hybrid_configs["pp_configs"]
        name, wrong_class, stateful = type(self).__name__, None, None
        if bool(sc.split_param) != self._is_v2:
            use = "DygraphShardingOptimizerV2" if sc.split_param else "DygraphShardingOptimizer"
            wrong_class = f"split_param={sc.split_param} selects {use}, {name} was built"
        if carries_state(optimizer):
            stateful = f"{len(optimizer.state)} param(s) with state"
        same = [("class", name), ("sharding_configs", vars(sc)), ("pp_configs", vars(pc)),
                ("torch optimizer", type(optimizer).__name__),
                ("grad_clip", (type(grad_clip).__name__, getattr(grad_clip, "clip_norm", None))),
                ("hyper-parameters", hyper_parameters(optimizer.param_groups)),
                ("the number of params", len(self._parameter_list))]
        for i, p in enumerate(self._parameter_list):
            same.append((f"params (shape, dtype, requires_grad) #{i}",
                         (tuple(p.shape), str(p.dtype), p.requires_grad)))
        agree(self._flag_groups(), [
            ("sharding_configs.split_param selects the class (as in Paddle): build that class, "
             "or set split_param", wrong_class), (_template_state_rule(name), stateful)], same,
            via_store=True, title="every rank of the sharding (and dp) group must build the "
            "optimizer alike (class, config, torch optimizer, hyper-parameters, model)")

    # ---- a step's state: one phase, and the grads written since the last clear ----

    def _finish_clear(self, error=None) -> None:
        """At a clear: nothing written since; `error` raised."""
        self._marks.clear()
        if error is not None:
            raise error

    def _agree_at_step(self, opened: tuple, rules=()) -> list:
        """Open a step alike everywhere (one all-reduce); per param: did some rank write it."""
        if self._phase == Phase.STEPPED:  # (REDUCED: _first_half raised)
            raise RuntimeError("step() ran again without the optimizer's clear_grad() / "
                               "zero_grad() in between; clear the grads after each step")
        written = self._marks.written()
        if self._overlap is not None:  # before the agreement: match every rank's buckets
            self._overlap.before_agreement()
        dropped = self._phase == Phase.DROPPED and not any(written)
        problems = list(rules) + [(None, None)] * (_CLIP_RULES - len(rules))  # one width
        problems += self._misuse_rules()
        changed = []  # in flight: the buffers' rule; under a pipeline: reduced there
        pp = self._hcg.get_pipe_parallel_world_size()
        if not (self.comm_overlap or self.pp_overlap or pp > 1):  # step() reduces local grads
            changed = self._marks.changed_in_place()
        problems.append((IN_PLACE_RULE, first_few(self._named(changed))))
        problems.append((_DROPPED_RULE, "grads dropped" if dropped else None))
        same = [("how the step was opened (the call; clip_grad_norm_'s max_norm, norm_type, "
                 "error_if_nonfinite)", opened),
                ("the hyper-parameters", hyper_parameters(self.param_groups)),
                ("grad_clip's clip_norm", getattr(self._grad_clip, "clip_norm", None))]
        anywhere = agree(self._flag_groups(), problems, same, written, self._flags_device(),
                         title="every rank of the sharding (and dp) group must open a step alike "
                         "(opt.clip_grad_norm_'s arguments) and with the same hyper-parameters")
        if any(p.requires_grad for p in self._parameter_list) and not any(anywhere):
            raise ValueError("no param has a grad on any rank at step(): zero_grad() before "
                             "step()? params replaced after building (assign=True)?")
        fill_missing_grads(self._parameter_list, anywhere, written)
        return anywhere

    def _named(self, params: list) -> list:
        index = {id(p): i for i, p in enumerate(self._parameter_list)}
        return [f"param #{index[id(p)]} (shape {tuple(p.shape)}, {p.dtype})" for p in params]

    def _misuse_rules(self) -> list:
        """Beyond Paddle: a param trainable now without a slot (v2, sharding's own overlap)."""
        slotted = {id(p) for buffer in self.comm_buffers for p in buffer.params}
        unslotted = []
        for p in self._parameter_list if self._overlap is not None or self._is_v2 else ():
            if p.requires_grad and id(p) not in slotted:
                unslotted.append(p)
        return [(UNSLOTTED_RULE, first_few(self._named(unslotted)))]

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> None:
        """Agree, reduce, dp all-reduce (unless finish_grad_sync ran), clip, step, broadcast."""
        try:
            self._check_step_args(closure)
        except ValueError:
            if self._phase != Phase.REDUCED:
                self._phase = Phase.FAILED  # the clear then settles quietly
            raise
        if self._phase != Phase.REDUCED:
            self._first_half()
        self._update()

    step.hooked = True  # torch would run the step hooks before the reduce: `_update` runs them

    @torch.optim.Optimizer.profile_hook_step
    def _update(self) -> None:
        """torch's step pre-hooks (seeing the reduced grads), clip, step, broadcast, post-hooks."""
        if self._grad_clip is not None:  # Paddle's: on the reduced grads this rank steps
            clip = extras("grad_clip", "grad_clip=")
            groups = clip.norm_groups(self._hcg)
            self._grad_clip(clip.clip_pairs(self), groups, self._flags_device())
        self._inner_opt.step()
        self._phase = Phase.STEPPED  # until zero_grad() (own overlap: a GAN's backward raises)
        self._sync_params()

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        """step()'s first half (Megatron's name): agree, reduce, scale; step() does not again."""
        self._first_half(("finish_grad_sync",))

    def _first_half(self, opened=("step",), rules=()) -> None:
        if self._phase == Phase.REDUCED:
            raise RuntimeError(f"{opened[0]} ran twice before step(): the grads are reduced "
                               "once per step, between backward and step()")
        try:
            self._reduce_for_step(opened, rules)
        except ValueError:
            self._phase = Phase.FAILED  # the buckets stay for a retried step
            raise
        self._phase = Phase.REDUCED

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, foreach: bool | None = None
                        ) -> torch.Tensor:
        """FSDP's: step()'s first half, then clip by the global norm (relgrad_extras.grad_clip)."""
        clip = extras("grad_clip", "opt.clip_grad_norm_")
        return clip.clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite)

    def _settle_for_clear(self):
        """Beyond Paddle: own overlap settles (its error returned); the step's phase."""
        error = None
        if self._overlap is not None:  # FAILED on error: the next clear needs no store round
            error = self._overlap.settle_for_clear()
        if error is None:
            dropped = self._phase in (Phase.IDLE, Phase.DROPPED) and any(self._marks.written())
            self._phase = Phase.DROPPED if dropped else Phase.IDLE
        return error

    def consolidate_state_dict(self, to: int = 0) -> dict | None:
        """torch ZeRO's: the whole state, one process's format, on rank `to` (relgrad_extras)."""
        return extras("checkpoint", "consolidate_state_dict").consolidate(self, to)


def _comm_buffer_bytes(sharding_config, default_mb: int = 256) -> int:
    """Bytes per bucket: [later] `sharding_configs.comm_buffer_size_MB`, else `default_mb`."""
    return (getattr(sharding_config, "comm_buffer_size_MB", None) or default_mb) * 1024 * 1024


# ---- Sharding v1: whole params per owner ----

class DygraphShardingOptimizer(_Sharding):
    """Sharding v1: whole params, greedy owners (`_param2rank`), reduce -> step -> broadcast."""

    _is_v2 = False
    comm_buffers = property(lambda self: list(self._comm_buffers))  # own overlap's (REDUCE)

    def __init__(self, optimizer: torch.optim.Optimizer, hcg: HybridCommunicateGroup,
                 strategy: HybridStrategy, grad_clip: Callable | None = None) -> None:
        self._setup(optimizer, hcg, strategy, grad_clip)
        self._param2rank = self._partition_parameters()
        self._wrap(optimizer, {p: p for p, r in self._param2rank.items() if r == self._rank})
        self._comm_buffers = []
        if self._overlap is not None:
            config = strategy.hybrid_configs["sharding_configs"]
            self._build_owner_buffers(config.accumulate_steps, _comm_buffer_bytes(config))
        self._finish_clear()  # the state as built: nothing written yet

    def _partition_parameters(self, params=None) -> dict:
        """Largest first, to the least loaded rank (develop's FLAGS_sharding_sort_parameters)."""
        sizes, param2rank = [0] * self._nranks, {}
        for p, rank in getattr(self, "_param2rank", {}).items():  # add_param_group: go on
            sizes[rank] += p.numel()
        for p in sorted(params or self._parameter_list, key=lambda p: -p.numel()):
            if p.numel() == 0:
                raise ValueError(f"a param of shape {tuple(p.shape)} has no elements; leave "
                                 "it out of the optimizer")
            rank = sizes.index(min(sizes))
            param2rank[p] = rank
            sizes[rank] += p.numel()
        return param2rank

    def _build_owner_buffers(self, acc_steps: int, group_size: int) -> None:
        """[later] comm_overlap: its REDUCE buffers per owner, hooked (relgrad_extras)."""
        self._comm_buffers = self._overlap.owner_buffers(acc_steps, group_size)

    @torch.no_grad()
    def reduce_gradients(self, parameter_list: list, hcg: HybridCommunicateGroup) -> None:
        """Each grad (1/nranks) to its owner; nothing under pipeline overlap (as new_frl)."""
        if self.pp_overlap:
            return
        if self._overlap is not None:  # [later] the hooks issued the reduces
            return self._overlap.wait_and_agree()
        densify_grads(parameter_list)  # c10d has no sparse reduce
        works = []
        for p in parameter_list:
            if _grad(p) is not None:  # the same params on every rank: agreed first
                _grad(p).mul_(1.0 / self._nranks)
                dst = global_rank(self._group, self._param2rank[p])
                works.append(dist.reduce(_grad(p), dst=dst, group=self._group, async_op=True))
        for work in works:
            work.wait()
        for p in parameter_list if self._free_grads_in_comm else ():  # [later]: not read
            if self._param2rank[p] != self._rank:
                clear_grad_func(p, set_to_zero=False)

    def _reduce_for_step(self, opened: tuple, rules=()) -> None:
        """step()'s first half: agree, reduce to the owners, dp all-reduce of owned grads."""
        anywhere = self._agree_at_step(opened, rules)
        for p, some_rank in zip(self._parameter_list, anywhere):
            if not some_rank:  # a zeroed grad nobody wrote: not stepped (torch: None)
                clear_grad_func(p, set_to_zero=False)
        self.reduce_gradients(self._parameter_list, self._hcg)
        if self._dp_sync:  # the owned grads
            owned = [_grad(p) for p in self._parameter_list if self._param2rank[p] == self._rank]
            owned = [g for g in owned if g is not None]
            all_reduce_mean(owned, self._hcg.get_data_parallel_group())

    def _sync_params(self) -> None:
        """Paddle's `_sharding_sync_parameters`: every param from its owner."""
        owners = [global_rank(self._group, self._param2rank[p]) for p in self._parameter_list]
        broadcast_each(self._parameter_list, self._group, owners)

    @torch.no_grad()
    def clear_grad(self, set_to_zero: bool = True) -> None:
        """Zero or drop every grad, then free its own buffers (release, comm_overlap)."""
        error = self._settle_for_clear()  # beyond Paddle (skippable): own overlap in flight
        for p in self._parameter_list:
            clear_grad_func(p, set_to_zero)
        for comm_buffer in self._comm_buffers if self.sd_release_grads else ():
            comm_buffer._clear_grad_storage()
        self._finish_clear(error)  # beyond Paddle (skippable): the next step's state


# ---- Sharding v2 (split_param): flat shards of every bucket ----

# Each element's update reads only its grad and state, so v2 may step flat slices (Adagrad is
# too, but builds its state over v2's empty placeholders).
_ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adadelta,
                torch.optim.Adamax, torch.optim.ASGD, torch.optim.NAdam, torch.optim.RAdam,
                torch.optim.RMSprop, torch.optim.Rprop)


class DygraphShardingOptimizerV2(_Sharding):
    """Sharding v2 (split_param): flat shards, reduce-scatter -> step slices -> all-gather. The
    inner optimizer steps `_slice_params[param]`, this rank's 1-D piece of the param's bucket."""

    _is_v2 = True
    comm_buffers = property(lambda self: list(self._comm_buffer_list))  # (pp overlap) pipeline's

    def __init__(self, optimizer: torch.optim.Optimizer, hcg: HybridCommunicateGroup,
                 strategy: HybridStrategy, grad_clip: Callable | None = None) -> None:
        self._setup(optimizer, hcg, strategy, grad_clip)
        _check_elementwise(optimizer)  # beyond Paddle: slices need an element-wise update
        self._slice_params = {p: torch.nn.Parameter(p.new_empty(0), p.requires_grad)
                              for p in self._parameter_list}
        self._wrap(optimizer, self._slice_params)
        self._comm_buffer_list = []
        config = strategy.hybrid_configs["sharding_configs"]
        self._build_comm_buffers(config.accumulate_steps, _comm_buffer_bytes(config))
        self._finish_clear()  # the state as built (release off: the buffer's views)

    def _build_comm_buffers(self, acc_steps: int, group_size: int = 256 * 1024 * 1024) -> None:
        if self.pp_overlap:
            return  # the pipeline builds and fills the buffers
        # Differs from Paddle, which asserts every param is trainable: frozen params stay out.
        params = [p for p in self._parameter_list if p.requires_grad]
        for idx, bucket in assign_group_by_size(params, group_size).items():
            # Seed hunk: the buffers get `release_grads=self.pp_release_grads` (here sd_, #64517)
            buffer = FusedCommBuffer(idx, bucket, self._group, acc_steps,
                                     act=HOOK_ACTION.REDUCE_SCATTER,
                                     release_grads=self.sd_release_grads)
            self._comm_buffer_list.append(buffer)

        if self._overlap is not None:  # [later] Paddle's register_reduce_overlap_hook
            self._overlap.hook(self._comm_buffer_list)
        else:
            plug_free_in_comm(self._comm_buffer_list, self._free_grads_in_comm)  # [later]

    @torch.no_grad()
    def clear_grad(self, set_to_zero: bool = True) -> None:
        """Zero or drop every grad; with release and no pipeline overlap, free the buffers."""
        error = self._settle_for_clear()  # beyond Paddle (skippable): own overlap, every rank
        set_to_zero = set_to_zero or error is not None  # an error: zero, raise it below
        # Seed hunk: the "should not erase grad buffer" assert holds only with release off
        if not self.sd_release_grads:
            _require_zero(set_to_zero)

        if self.pp_overlap and not self.pp_release_grads:  # [later, #64517] the pipeline's persist
            _require_zero(set_to_zero)
        for p in self._parameter_list:
            clear_grad_func(p, set_to_zero)
        for slice_param in self._slice_params.values() if self.sd_release_grads else ():
            clear_grad_func(slice_param, set_to_zero=False)  # beyond Paddle: would pin it

        # Seed hunk: with release and no pipeline overlap, free v2's own grad buffers
        if self.sd_release_grads and not self.pp_overlap:
            for comm_buffer in self._comm_buffer_list:
                comm_buffer._clear_grad_storage()

        self._finish_clear(error)  # beyond Paddle (skippable): the next step's state

    def _collect_comm_buffers(self) -> None:
        """Find the pipeline's buffers through `param.comm_buffer_ref`, once (Paddle's)."""
        if self._comm_buffer_list:
            return
        for p in self._parameter_list:
            ref = vars(p).pop("comm_buffer_ref", None)  # read once, as Paddle deletes it
            if ref is not None and ref() is not None:
                self._comm_buffer_list.append(ref())
        trainable = any(p.requires_grad for p in self._parameter_list)
        if not self._comm_buffer_list and self.pp_overlap and trainable:
            raise RuntimeError("sharding v2 found no buffers: under pp sharding_comm_overlap "
                               "the pipeline builds them; step() must run in train_batch")
        if getattr(self, "_pending_state", None) is not None:  # loaded before the buffers
            extras("checkpoint", "a consolidated state").apply_pending(self)

    @torch.no_grad()
    def reduce_gradients(self, parameter_list: list, hcg: HybridCommunicateGroup) -> None:
        """Reduce-scatter and scale every buffer (nothing under pipeline overlap: its hooks did)."""
        if self.pp_overlap:
            return
        if self._overlap is not None:  # [later] the hooks issued the reduce-scatters
            return self._overlap.wait_and_agree()
        for comm_buffer in self._comm_buffer_list:
            for param in comm_buffer.params if not self.sd_release_grads else ():
                comm_buffer.relink_grad(param)  # beyond Paddle (skippable): zero_grad() to None
            # Seed hunk: with release and no buffer yet, copy every param's grad in first
            if self.sd_release_grads and comm_buffer.grad_storage is None:
                for param in comm_buffer.params:
                    comm_buffer._copy_grad_to_buffer(param)

            comm_buffer._comm_grads()
            comm_buffer.scale_grads(agree_in_flight=False)  # nothing ran while in flight

    def _assign_slice_grad(self) -> None:
        for comm_buffer in self._comm_buffer_list:
            for param in comm_buffer.params:
                slice_param = self._slice_params[param]
                if self.sd_release_grads:  # beyond Paddle: a stale .grad too
                    slice_param.grad = None
                # Seed hunk: under release, drop the slice param's stale main_grad
                if self.sd_release_grads and hasattr(slice_param, "main_grad"):
                    del slice_param.main_grad  # (Paddle also asserts it is uninitialized)
                comm_buffer.assign_slice_grad(param, slice_param)

    def _reduce_for_step(self, opened: tuple, rules=()) -> None:
        """step()'s first half: agree, reduce-scatter, bind the slices, dp all-reduce."""
        self._collect_comm_buffers()
        anywhere = self._agree_at_step(opened, rules)
        self.reduce_gradients(self._parameter_list, self._hcg)
        self._assign_slice_grad()
        # Differs from Paddle, which steps every slice: as torch and v1, a param no rank has
        # a grad for is not stepped (Adam and AdamW would move its zero slot).
        for p, some_rank in zip(self._parameter_list, anywhere):
            if not some_rank:
                clear_grad_func(self._slice_params[p], set_to_zero=False)
        if self._dp_sync:  # after the slices are bound (Paddle's misses them then)
            grads = [_grad(s) for s in self._slice_params.values() if _grad(s) is not None]
            all_reduce_mean(grads, self._hcg.get_data_parallel_group())

    def _sync_params(self) -> None:
        for comm_buffer in self._comm_buffer_list:  # _sharding_sync_parameters
            comm_buffer.sync_params()

    def _misuse_rules(self) -> list:
        """Beyond Paddle: also what changed behind v2's back (a param only re-homed is put back)."""
        moved, main_grad = [], []
        for buf in self._comm_buffer_list:
            storage = buf.param_storage
            for p in buf.params:
                index = buf.grad_views[p]._index
                if p.data_ptr() != storage.data_ptr() + index * storage.element_size():
                    if p.dtype == storage.dtype and p.device == storage.device:
                        _share_param_buffer(p, storage, index)
                    else:
                        moved.append(p)
                if buf.use_main_grad != hasattr(p, "main_grad"):
                    main_grad.append(p)
        return super()._misuse_rules() + [
            ("a param moved to another dtype or device since v2 was built: build the optimizer "
             "after model.to(...)", first_few(self._named(moved))),
            ("a param's main_grad does not match its bucket: register_main_grad_hooks first",
             first_few(self._named(main_grad)))]


def _require_zero(set_to_zero: bool) -> None:
    if not set_to_zero:
        raise ValueError(_ERASE_MSG)


def _check_elementwise(optimizer) -> None:
    step = inspect.unwrap(type(optimizer).step)
    for cls in _ELEMENTWISE:
        if isinstance(optimizer, cls) and step is inspect.unwrap(cls.step):
            return
    names = ", ".join(c.__name__ for c in _ELEMENTWISE)
    raise ValueError(f"sharding v2 steps flat slices, so it needs an element-wise optimizer "
                     f"({names}); got {type(optimizer).__name__}: use v1")
