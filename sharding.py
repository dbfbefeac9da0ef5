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
(`optim_wrappers.torch_face`).

Without a pipeline, `sharding_configs.comm_overlap` (sharding's own tensor-fusion overlap)
registers the buffers' hooks in the optimizer itself, so each bucket's reduce (v1, buckets
grouped by owner) or reduce-scatter (v2) overlaps the last backward; `free_grads_in_comm`
[later] frees what a rank will not read as soon as the collective is done.

Leaves out: v1's fused params and fused optimizer, offload, color sharding,
torch.amp.GradScaler (refused with a clear error).

References: Paddle PRs #59739, #58462, #58621, #64517 (sharding-side release flag);
Rajbhandari et al., "ZeRO" (2020); torch's ZeroRedundancyOptimizer.
"""
import inspect

import torch
import torch.distributed as dist

from comm_buffer import (HOOK_ACTION, FusedCommBuffer, _grad_of, _set_grad, _share_param_buffer,
                         all_reduce_mean, assign_group_by_size, global_rank,
                         main_grad_or_grad as _grad)
from grad_clip import ClipGradByGlobalNorm, norm_groups
from optim_wrappers.grad_agreement import agree, fill_missing_grads
from optim_wrappers.master_weights import (MixPrecisionOptimizer, carries_state,
                                           template_state_message)
from optim_wrappers.torch_face import _Wrapper, clear_grad_func as _clear
from checkpoint import ShardingCheckpoint, sharding_state
from own_comm_overlap import _OwnOverlap


_ERASE_MSG = ("should not erase grad buffer: with release_gradients off the grads are views of "
              "a fused buffer that must persist, so clear_grad(set_to_zero=False) / "
              "zero_grad(set_to_none=True) is not allowed. Use zero_grad(set_to_none=False), "
              "or turn pp_configs.release_gradients on.")

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
_NO_GRAD_MSG = ("no param has a grad on any rank at step(): did zero_grad() run between backward "
                "and step()? Clear grads after step(). Or were the model's params replaced "
                "after the optimizer was built (model.load_state_dict(..., assign=True), "
                "model.to_empty())? Build the optimizer after that, or load without assign.")


def _check_grad_clip(grad_clip):
    if grad_clip is not None and not isinstance(grad_clip, ClipGradByGlobalNorm):
        raise TypeError(f"grad_clip must be None or grad_clip.ClipGradByGlobalNorm, got "
                        f"{type(grad_clip).__name__}; torch's clip_grad_norm_ on a rank's own "
                        "grads would see only its shard, unreduced")
    return grad_clip


class _Sharding(_OwnOverlap, ShardingCheckpoint, _Wrapper):
    """What v1 and v2 share: flags, groups, whether to all-reduce over dp, and the agreement
    on grads and misuse that opens every `step()`."""

    def _setup(self, optimizer, hcg, strategy):
        pp_config = strategy.hybrid_configs["pp_configs"]
        sharding_config = strategy.hybrid_configs["sharding_configs"]
        self._hcg = hcg
        self._group = hcg.get_sharding_parallel_group()
        self._nranks = hcg.get_sharding_parallel_world_size()
        self._rank = hcg.get_sharding_parallel_rank()
        self._parameter_list = [p for g in optimizer.param_groups for p in g["params"]]
        # Setting pipeline parallelism overlap (grads then arrive reduced by the pipeline).
        self.pp_overlap = pp_config.sharding_comm_overlap
        # Seed hunk: `self.pp_release_grads = pp_config.release_gradients`. [later, PR #64517]
        # Paddle ORs a sharding-side `release_gradients` flag into it.
        self.pp_release_grads = (pp_config.release_gradients
                                 or sharding_config.release_gradients)
        # Under pipeline overlap the buffers are the pipeline's, built with the PP flag alone;
        # whether their grads may be dropped follows that flag, not the sharding-side one.
        self._buffers_released = (pp_config.release_gradients if self.pp_overlap
                                  else self.pp_release_grads)
        # HybridParallelOptimizer's dp all-reduce, unless the pipeline already overlapped it.
        self._dp_sync = (hcg.get_data_parallel_world_size() > 1
                         and not pp_config.dp_comm_overlap)
        self._reduced = False  # grads reduced by a step() and not cleared since
        self._check_template(optimizer)
        self._setup_own_overlap(strategy)

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

    def _begin_step(self):
        # Beyond Paddle: a second step() would reduce already reduced grads again.
        if self._reduced:
            raise RuntimeError("step() ran again without the optimizer's clear_grad() / "
                               "zero_grad() in between, so the grads may be already reduced. "
                               "Clear them after each step through the optimizer: "
                               "model.zero_grad() does not reset it")
        self._reduced = True

    def _agree_grads(self, has_grad, rules):
        """Beyond Paddle: agree on every rank of the sharding (and dp) group, in one small
        all-reduce per group, on the misuse `rules` (raised on every rank, see
        `grad_agreement.agree`) and on which params have a grad anywhere; give the others a
        zero grad here, so that every rank issues the same reduces. Returns the agreed flags,
        one per `_parameter_list` entry. Raises ValueError if no trainable param has a grad
        on any rank (Paddle's v2 fails there too; torch would silently step nothing)."""
        params = self._parameter_list
        anywhere = agree(has_grad, rules, self._flag_groups(), self._flags_device())
        if any(p.requires_grad for p in params) and not any(anywhere):
            raise ValueError(_NO_GRAD_MSG)
        if not (self.pp_overlap and self._free_grads_in_comm):  # else freed on purpose
            fill_missing_grads(params, anywhere)
        return anywhere


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
        grad_clip: None or a `grad_clip.ClipGradByGlobalNorm`, run in `step()` on the owned,
            reduced grads (Paddle passes it as the inner optimizer's `grad_clip`); then `hcg`
            also needs `get_pipe_parallel_{group,world_size}()`.
    `_param2rank` maps each param (by identity; Paddle: by name) to its owner's sharding rank.
    Call `step()` after backward, then `clear_grad()` / `zero_grad()` before the next step.
    With `sharding_configs.comm_overlap` (no pipeline), `_comm_buffers` holds one REDUCE
    buffer per owner and bucket, hooked to the params, so the reduce to the owner fires in the
    last of `accumulate_steps` backward passes (scale the loss by 1/accumulate_steps); without
    it, `step()` reduces grad by grad. With free_grads_in_comm, a rank drops the grads it does
    not own once they are reduced (their buffer, or the grads themselves).
    Raises ValueError for a param with no elements or an unsupported config (comm_overlap
    with a pipeline, free_grads_in_comm without release), at `step()` (on every rank) for no
    grad on any rank, a closure or a GradScaler, with comm_overlap for a bucket not reduced on
    every rank or a backward pass too many, and from `add_param_group` as it says;
    RuntimeError for a second `step()` without clearing the grads in between; TypeError for a
    grad_clip of another type.
    """

    def __init__(self, optimizer, hcg, strategy, grad_clip=None):
        self._setup(optimizer, hcg, strategy)
        self._grad_clip = _check_grad_clip(grad_clip)
        self._param2rank = self._partition_parameters()
        owned = [[p for p in g["params"] if self._param2rank[p] == self._rank]
                 for g in optimizer.param_groups]
        self._zeroed = {}  # param id -> (grad id, grad _version) right after clear_grad zeroed
        self._inner_opt = MixPrecisionOptimizer(optimizer, owned)
        self._expose(self._inner_opt)
        self._comm_buffers = []
        if self.comm_overlap:
            self._build_owner_buffers(
                strategy.hybrid_configs["sharding_configs"].accumulate_steps)

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
        Raises ValueError for a param already in the optimizer, or under the pipeline's
        sharding_comm_overlap (its buffers are laid out from the owners already).
        """
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        if self.pp_overlap:
            raise ValueError("add_param_group is not supported with pp_configs."
                             "sharding_comm_overlap: the pipeline's buffers are built from the "
                             "owners; build the torch optimizer with every group first")
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
        Raises ValueError as `_agree_grads` and `_check_step_args` say, on every rank."""
        self._check_step_args(closure)
        anywhere = self._agree_grads(self._has_grad(), [])
        for p, some_rank in zip(self._parameter_list, anywhere):
            if not some_rank:  # a zeroed grad nobody wrote: not stepped (torch: None)
                _clear(p, set_to_zero=False)
        self._begin_step()
        self.reduce_gradients(self._parameter_list, self._hcg)
        owned = [p for p in self._parameter_list if self._param2rank[p] == self._rank]
        if self._dp_sync:  # the same grads on every dp rank: agreed above
            all_reduce_mean([_grad(p) for p in owned if _grad(p) is not None],
                            self._hcg.get_data_parallel_group())
        # The owned grads are reduced and final here (where a grad clip reads them).
        self._clip_grads()
        self._inner_opt.step()
        # _sharding_sync_parameters: every param from its owner
        works = [dist.broadcast(p.detach(), src=global_rank(self._group, self._param2rank[p]),
                                group=self._group, async_op=True)
                 for p in self._parameter_list]
        for work in works:
            work.wait()

    @torch.no_grad()
    def clear_grad(self, set_to_zero=True):
        """Zero every grad / main_grad in place, or drop them (`set_to_zero=False`).

        Beyond Paddle's v1: while fused buffers (the pipeline's, or its own with comm_overlap)
        hold the grads and release is off, dropping them would detach them from the buffer, so
        `set_to_zero=False` raises ValueError as v2 does. With release and comm_overlap, its
        own buffers are freed here, as v2's are.
        """
        if (not set_to_zero and (self.pp_overlap or self.comm_overlap)
                and not self._buffers_released):
            raise ValueError(_ERASE_MSG)
        self._reduced = False
        for p in self._parameter_list:
            _clear(p, set_to_zero)
        if self.pp_release_grads:
            for comm_buffer in self._comm_buffers:
                comm_buffer._clear_grad_storage()
        # Beyond Paddle: a grad zeroed here and still untouched at step() is no grad (v2's
        # grads are buffer views, never None, and v2 must not step them: same rule here).
        self._zeroed = {id(p): (id(g), g._version) for p in self._parameter_list
                        if (g := _grad(p)) is not None}

    def _has_grad(self):
        """Per param: this rank has a grad that backward (or the user) wrote since the last
        clear_grad (in-place accumulation bumps the grad's `_version`)."""
        if self.pp_overlap and self._free_grads_in_comm:  # went with the freed buffers
            return [p.requires_grad for p in self._parameter_list]
        return [(g := _grad(p)) is not None and self._zeroed.get(id(p)) != (id(g), g._version)
                for p in self._parameter_list]

    def _clip_grads(self):
        """grad_clip on the grads this rank owns, reduced (Paddle: the inner optimizer's
        params_grads); a rank that owns nothing still joins the norm's all-reduces."""
        if self._grad_clip is None:
            return
        pairs = [(p, _grad(p)) for p in self._parameter_list if self._param2rank[p] == self._rank]
        self._grad_clip(pairs, norm_groups(self._hcg), self._parameter_list[0].device)


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
    only this rank's shard once reduced (see `FusedCommBuffer`); the params' grads are dropped.
    Raises ValueError for `clear_grad(set_to_zero=False)` with release off, at `step()` (on
    every rank) for no grad on any rank or state changed behind its back since it was built
    (`_misuse_rules`), and with comm_overlap as v1 does; RuntimeError if `step()` finds no
    buffers or runs twice without clearing the grads in between; TypeError for a
    grad_clip of another type. `grad_clip` clips the slice grads without their padding.
    """

    def __init__(self, optimizer, hcg, strategy, grad_clip=None):
        self._setup(optimizer, hcg, strategy)
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
        acc_steps = strategy.hybrid_configs["sharding_configs"].accumulate_steps
        self._build_comm_buffers(acc_steps)
        self._track_grads()

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
        # Seed hunk: the buffers get `release_grads=self.pp_release_grads`.
        # Differs from Paddle, which asserts every param is trainable: frozen params stay out.
        params = [p for p in self._parameter_list if p.requires_grad]
        for idx, bucket in assign_group_by_size(params, group_size).items():
            buffer = FusedCommBuffer(idx, bucket, self._group, acc_steps,
                                     act=HOOK_ACTION.REDUCE_SCATTER,
                                     release_grads=self.pp_release_grads,
                                     free_grads_in_comm=self._free_grads_in_comm)
            self._comm_buffer_list.append(buffer)
        if self.comm_overlap:  # Paddle's register_reduce_overlap_hook(use_comm=True)
            self._register_own_hooks(self._comm_buffer_list)

    def _own_buffers(self):
        return self._comm_buffer_list

    @torch.no_grad()
    def clear_grad(self, set_to_zero=True):
        """Zero or drop every grad; then, with release and no pipeline overlap, free buffers.

        With release off, `set_to_zero=False` raises ValueError ("should not erase grad
        buffer"). With release on, slice params' grads are dropped too: Paddle's
        `_clear_dataptr` on `_slice_grad` frees them; in torch a stale view would keep the
        freed buffer alive.
        """
        if not self._buffers_released and not set_to_zero:
            raise ValueError(_ERASE_MSG)
        self._reduced = False
        self._produced.clear()
        for p in self._parameter_list:
            _clear(p, set_to_zero)
        if self.pp_release_grads:
            for slice_param in self._slice_params.values():
                _clear(slice_param, set_to_zero=False)
        if self.pp_release_grads and not self.pp_overlap:
            for comm_buffer in self._comm_buffer_list:
                comm_buffer._clear_grad_storage()

    def _collect_comm_buffers(self):
        if self._comm_buffer_list:
            return
        for p in self._parameter_list:
            ref = getattr(p, "comm_buffer_ref", None)
            if ref is not None:
                del p.comm_buffer_ref
                if ref() is not None:
                    self._comm_buffer_list.append(ref())
        if not self._comm_buffer_list:
            raise RuntimeError("sharding v2 found no REDUCE_SCATTER buffers: with "
                               "pp_configs.sharding_comm_overlap the pipeline builds them in "
                               "its first train_batch; step() must run inside train_batch")
        sharding_state.apply_pending(self)  # a consolidated state loaded before the buffers

    @torch.no_grad()
    def reduce_gradients(self, parameter_list, hcg):
        """Reduce-scatter every buffer and scale by 1/nranks (no-op under pipeline overlap).

        Seed hunk: with release, a buffer that is still absent (no hook has checked grads in:
        the non-overlap path) first gets every param's grad copied in. Beyond Paddle, with
        release off a grad that is no longer its slot's view is put back (`_relink_grads`).
        """
        if self.pp_overlap:  # the pipeline's hooks reduce-scattered and scaled them
            return  # (Paddle: HybridParallelOptimizer does not call this then; see v1)
        if self.comm_overlap:  # the hooks issued the reduce-scatters during backward
            self._wait_own_buffers(self._comm_buffer_list)
            return
        for comm_buffer in self._comm_buffer_list:
            if self.pp_release_grads and comm_buffer.grad_storage is None:
                for param in comm_buffer.params:
                    comm_buffer._copy_grad_to_buffer(param)
            elif not self.pp_release_grads:
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
            if grad is None or grad.data_ptr() != slot.data_ptr():
                slot.zero_() if grad is None else slot.copy_(grad.reshape(-1))
                _set_grad(param, comm_buffer.use_main_grad, slot.view(param.shape))

    def _assign_slice_grad(self):
        for comm_buffer in self._comm_buffer_list:
            for param in comm_buffer.params:
                slice_param = self._slice_params[param]
                if self.pp_release_grads:
                    # Seed hunk: Paddle asserts the stale main_grad is uninitialized and deletes
                    # it; in torch it would still hold last step's buffer, so drop it outright.
                    # Beyond Paddle, a stale .grad goes too (its assert would trip on it).
                    if hasattr(slice_param, "main_grad"):
                        del slice_param.main_grad
                    slice_param.grad = None
                comm_buffer.assign_slice_grad(param, slice_param)

    @torch.no_grad()
    def step(self, closure=None):
        """Agree on grads and misuse -> reduce-scatter -> bind slices -> dp all-reduce of
        slice grads -> step -> all-gather. A param is stepped iff some rank produced a grad for
        it since the last clear_grad (backward reached it, or a grad was assigned)."""
        self._check_step_args(closure)
        self._collect_comm_buffers()
        rules = self._misuse_rules()
        anywhere = self._agree_grads(self._has_grad(), rules)
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
        # The slice grads are reduced and final here (where a grad clip reads them).
        self._clip_grads()
        self._inner_opt.step()
        for comm_buffer in self._comm_buffer_list:  # _sharding_sync_parameters
            comm_buffer.sync_params()

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
                if grad is not None and grad.data_ptr() == (storage.data_ptr()
                                                             + index * storage.element_size()):
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

    def _clip_grads(self):
        """grad_clip on this rank's slice grads, padding left out (it is zero, and not the
        model's): a slice may end in its param's padding (see ShardingGradView)."""
        if self._grad_clip is None:
            return
        pairs = []
        for comm_buffer in self._comm_buffer_list:
            for param, view in comm_buffer._sharding_param_grad_view.items():
                grad = _grad(self._slice_params[param])
                if grad is not None:
                    valid = min(view._param_end, view._index + param.numel()) - view._param_begin
                    pairs.append((param, grad[:valid]))  # param: need_clip, is_firstly_shared
        self._grad_clip(pairs, norm_groups(self._hcg), self._parameter_list[0].device)
