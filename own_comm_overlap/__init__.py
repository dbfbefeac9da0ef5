"""Sharding's own comm overlap (`sharding_configs.comm_overlap`, no pipeline): hooks, checks.

What `sharding._Sharding` (v1 and v2) mixes in to hook its own `FusedCommBuffer`s to the params
and to wait for them at `step()`, as Paddle's `DygraphShardingOptimizerV2` does with
`register_reduce_overlap_hook(use_comm=True)` and `scale_grads()` in `reduce_gradients`
(`dygraph_sharding_optimizer.py`; v1's counterpart is its tensor fusion). Beyond Paddle, the
ranks agree before waiting that every bucket's collective was issued everywhere, and a backward
pass too many raises, on every rank, instead of hanging or failing an assert on one rank.
"""
import weakref

import torch
import torch.distributed as dist

from comm_buffer import (HOOK_ACTION, FusedCommBuffer, assign_group_by_size, bw_hook_func,
                         global_rank)


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
        release works, and only the owner scales, after the reduce.
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

    def _too_many_micro_batches(self, buffers):
        # Beyond Paddle (whose add_grad asserts): finish what is in flight on every rank (the
        # same collectives were issued everywhere), reset the check-ins, then raise.
        for buffer in buffers:
            if buffer._task is not None:
                buffer._task.wait()
            buffer._reset_params_checked_in()
        raise ValueError(f"sharding_configs.accumulate_steps={buffers[0]._acc_steps}, but a "
                         "backward pass ran after every param had checked in that many times "
                         "and the collectives had been issued: call step() after exactly "
                         "accumulate_steps backward passes, or set accumulate_steps to the "
                         "number of backward passes per step")

    def _wait_own_buffers(self, buffers):
        """comm_overlap: at step(), wait for and scale every bucket the hooks reduced.

        Paddle calls `scale_grads()` on each buffer. Beyond Paddle, the ranks first agree (one
        all-reduce of one int per bucket) that every bucket's collective was issued on every
        rank: a param that got no grad, or fewer backward passes than accumulate_steps, leaves
        a bucket unissued, and waiting for it would block. Then each rank raises ValueError
        (after waiting for the buckets that were issued everywhere, so nothing is left in
        flight). A param used on some ranks only cannot be caught so: its bucket's collective
        is already unmatched (DDP's find_unused_parameters walks the graph for that).
        """
        if not buffers:
            return
        device = buffers[0].params[0].device
        issued = torch.tensor([b._task is not None for b in buffers], dtype=torch.int32,
                              device=device)
        dist.all_reduce(issued, group=self._group)
        issued = issued.tolist()
        if all(n == self._nranks for n in issued):
            for buffer in buffers:
                buffer.scale_grads()
            return
        missing = [f"bucket {b._id} ({b._check_in_status()})"
                   for b, n in zip(buffers, issued) if n < self._nranks]
        for buffer, n in zip(buffers, issued):
            if n == self._nranks:
                buffer._task.wait()
            if n in (0, self._nranks):
                buffer._reset_params_checked_in()
        raise ValueError(
            "sharding_configs.comm_overlap: step() found buckets whose collective was not "
            f"issued on every rank: {'; '.join(missing)}. Every trainable param must get a grad "
            f"in each of accumulate_steps={buffers[0]._acc_steps} backward passes before "
            "step(): leave unused params out of the optimizer (or set requires_grad=False "
            "before building it), run exactly accumulate_steps backwards per step, and "
            "clear grads only after step() (with release, zero_grad() between the backwards "
            "of a step drops the half-accumulated buffer and its check-ins)")


def _own_overlap_hook(optimizer, buffer, param):
    """`bw_hook_func(buffer, param)` that first raises (via the optimizer, on every rank)
    when a bucket whose collective is already in flight checks in again."""
    check_in = bw_hook_func(buffer, param)
    optimizer_ref, buffer_ref = weakref.ref(optimizer), weakref.ref(buffer)

    def hook(param):
        optimizer, buffer = optimizer_ref(), buffer_ref()
        if optimizer is not None and buffer is not None and buffer._task is not None:
            optimizer._too_many_micro_batches(optimizer._own_buffers())
        check_in(param)

    return hook


def _remove_hooks(handles):
    for handle in handles:
        handle.remove()
