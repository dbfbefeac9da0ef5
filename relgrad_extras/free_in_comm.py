"""[later] `free_grads_in_comm` (PaddleNLP #9081): free what a rank will not read as soon as its
bucket's collective has completed.

Paddle allows it only with release_grads, REDUCE_SCATTER and acc_steps == 1: the reduce-scatter
writes into a fresh tensor of one shard's size, and the full grad buffer is replaced by it, so
the rest is freed right after the collective. Here, with any acc_steps and for REDUCE too: v2
keeps its shard only, a v1 non-owner keeps nothing. Paddle frees at `scale_grads`; buffers that
share a `CommQueue` (`plug`, as the sharding optimizers and the pipeline call it for
`sharding_configs.free_grads_in_comm`) free during backward, bucket by bucket.

Differs from Paddle: the collective runs in place and the shard is copied out once it is done
(scaled in the same pass), so a bucket holds G bytes while filling and in flight, G + G/S for
the copy, then G/S (G: bucket bytes, S: ranks); Paddle's order holds G + G/S in flight.
Phases of a step: check in -> communicate -> complete (scale, free) -> step -> release.
"""
import torch
import torch.distributed as dist

from comm_buffer import HOOK_ACTION, FusedCommBuffer, _drop_aliasing_grads, sums_in_16_bits


class _Done:
    """A bucket's `_task` once the queue completed its collective (scale_grads resets it)."""

    def wait(self):
        return True

    def is_completed(self):
        return True


_DONE = _Done()


class CommQueue:
    """The buckets of one builder, hooked to one backward. At every check-in the queue
    completes (scales and frees) the buckets whose collective has already finished; it never
    waits for one inside backward, where another rank may not have issued it yet (a rank whose
    backward skipped a param issues its buckets only at step()). In flight means `_task` is
    set and not `_DONE`, so a settle, which resets `_task`, also empties the queue.
    """

    def __init__(self, buffers):
        self.buffers = list(buffers)

    def poll(self):
        for buffer in self.buffers:  # no local for the task: the work holds the buffer
            if buffer._task not in (None, _DONE) and buffer._task.is_completed():
                buffer._complete_comm()


def _check(buffer):
    if not buffer._release_grads:
        raise ValueError("free_grads_in_comm needs release_grads=True (as in Paddle): the buffer "
                         "it frees must be re-allocated at the next step's first check-in")
    if buffer._act == HOOK_ACTION.ALL_REDUCE:
        raise ValueError("free_grads_in_comm has nothing to free with act=ALL_REDUCE (every "
                         "rank reads the whole buffer); use it with REDUCE or REDUCE_SCATTER")


def plug(buffers):
    """Make `buffers` (built together, hooked to one backward) FreeInCommBuffers sharing one
    `CommQueue`: each bucket is completed and freed during backward, as soon as its collective
    is done. The same objects: the lists and hooks that hold them keep working."""
    queue = CommQueue(buffers)
    for buffer in buffers:
        _check(buffer)
        buffer.__class__ = FreeInCommBuffer
        buffer._comm_queue, buffer._freed_in_comm = queue, False


class FreeInCommBuffer(FusedCommBuffer):
    """A `FusedCommBuffer` that frees, once its collective has completed, what this rank will
    not read: REDUCE_SCATTER keeps only its shard (`grad_storage` becomes `buffer_size /
    nranks` elements, the slice grads view it, the params' grads are dropped); REDUCE drops the
    whole buffer and the grads on ranks other than `dst`. Built directly (not through `plug`),
    it frees at `scale_grads()`, as Paddle does. Needs release_grads; not ALL_REDUCE."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _check(self)
        self._comm_queue, self._freed_in_comm = None, False

    def add_grad(self, param, use_comm=True):
        if self._comm_queue is not None:  # complete the earlier buckets that are done
            self._comm_queue.poll()
        if self._freed_in_comm and self.fresh:
            raise ValueError(f"bucket {self._id}: a new step started while last step's grad "
                             "buffer (what free_grads_in_comm kept) is still allocated; after "
                             "the optimizer step drop the grads and call release()")
        super().add_grad(param, use_comm)

    def scale_grads(self, agree_in_flight=True):
        if self._task is _DONE:  # completed (and freed) by the queue during backward
            self._reset_params_checked_in()
        else:
            super().scale_grads(agree_in_flight)

    def changed_in_flight(self):
        return self._task is not _DONE and super().changed_in_flight()

    @torch.no_grad()
    def _complete_comm(self):
        """Wait, scale what this rank reads, free the rest."""
        self._task.wait()
        self._task = _DONE  # let go of the work: it holds the buffer
        scale = not sums_in_16_bits(self._dtype) and self.reads()
        if self._act == HOOK_ACTION.REDUCE_SCATTER:
            local = self._local_shard(self.grad_storage)
            shard = local * (1.0 / self._nranks) if scale else local.clone()
            del local
            _drop_aliasing_grads(self._params, self.use_main_grad, self._drop_grad_storage())
            self._point_slices_at(shard)
            self.grad_storage = shard
        elif not self.reads():  # REDUCE, not the owner: nothing to keep
            _drop_aliasing_grads(self._params, self.use_main_grad, self._drop_grad_storage())
        elif scale:
            self.grad_storage.mul_(1.0 / self._nranks)
        self._freed_in_comm = True

    def _point_slices_at(self, shard):
        """Paddle's `_reset_grad_buffer(slice_grad_buffer)`: each slice grad views `shard`."""
        begin = dist.get_rank(self._comm_group) * shard.numel()
        for view in self._sharding_param_grad_view.values():
            view._grad_buffer = shard
            if view._has_local:
                view._slice_grad = shard[view._param_begin - begin : view._param_end - begin]

    def _clear_grad_storage(self):
        super()._clear_grad_storage()
        self._freed_in_comm = False
