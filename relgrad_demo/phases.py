"""Where a step's memory goes: the allocator's bytes at the phase boundaries of a pipeline step.

`PipelineProbe` watches a `PipelineParallel` and its optimizer from outside, without touching
the library: it wraps a few of their methods on the instance (`_forward_step`, `_backward_step`,
`_p2p`, `_optimizer_step`, each comm buffer's `_comm_grads` / `scale_grads` / `_complete_comm`,
the optimizer's `reduce_gradients` / `step`). At each boundary in `PHASES` it reads the run's
bytes from its `Ledger`; each wrapped call is also a span for the trace. With release on, the
picture is the feature: the grad buffer appears at the first backward and is gone after the step.
"""
import time

PHASES = (
    "step start",
    "before 1st backward",  # after the warm-up forwards (and the first steady forward)
    "after 1st backward",  # release on: the buffer was allocated at the first check-in
    "after last backward",  # with comm overlap, the hooks have issued the collectives
    "after collectives",  # waited and scaled (overlap), or the optimizer's reduce_gradients
    "after optimizer step",
    "after release",  # release off: after the grads were zeroed in place
)
_ACTIONS = {0: "all-reduce", 1: "reduce", 2: "reduce-scatter"}  # comm_buffer.HOOK_ACTION


def comm_buffers(model, optimizer):
    """Every FusedCommBuffer of the run: the pipeline's, then the sharding optimizer's own
    (v2's non-overlap buffers, or v1 / v2's under sharding_configs.comm_overlap)."""
    buffers = [b for bs in model._chunk_2_comm_buffers.values() for b in bs]
    own = optimizer.comm_buffers if hasattr(optimizer, "comm_buffers") else []
    return buffers + [b for b in own if b not in buffers]


def action_name(buffer):
    """'all-reduce', 'reduce' or 'reduce-scatter': the collective a buffer issues."""
    return _ACTIONS[buffer._act]


class PipelineProbe:
    """Phase bytes and spans of one pipeline run; `start_step()` right before `train_batch`.

    `bytes[i]` is the run's bytes (its `Ledger`) at `PHASES[i]` in the latest step, None for
    a boundary this layout does not have (no collective on grads, e.g. pp only); `times[i]`
    is when it was read (`time.perf_counter_ns()`), None likewise.
    """

    def __init__(self, model, optimizer, ledger, recorder, tid):
        self.model, self.optimizer, self.ledger = model, optimizer, ledger
        self.recorder, self.tid = recorder, tid
        self.bytes, self._backwards, self._watched = [None] * len(PHASES), 0, set()
        self.times = [None] * len(PHASES)
        self.buffer_log = []  # (perf_counter ns, bytes the fused grad buffers hold) per change
        self._release_name = "release" if model._release_gradients else "zero grads"
        self._step_end = 0
        self.phase = "forward"  # what the run is doing now, for the peak's phase
        if hasattr(model, "_backward_step_helper"):  # interleaved: (inputs, labels, k), (k,)
            self._wrap(model, "_forward_step_helper", lambda *a: f"F{a[2]}",
                       lambda *a: self._enter("forward"))
            self._wrap(model, "_backward_step_helper", lambda *a: f"B{a[0]}",
                       self._before_backward, self._after_backward)
            self._wrap(model, "_ring_p2p", "p2p")
        else:
            self._wrap(model, "_forward_step", lambda *a: f"F{a[2]}",  # (x, label, micro-batch)
                       lambda *a: self._enter("forward"))
            self._wrap(model, "_backward_step", lambda *a: f"B{a[3]}",  # (x, out, grad, mb)
                       self._before_backward, self._after_backward)
            self._wrap(model, "_p2p", "p2p")
        self._wrap(optimizer, "step", "optimizer step", lambda *a: self._enter("step"),
                   after=self._after_optimizer_step)
        self._wrap(model, "_optimizer_step", None, lambda *a: self._enter("step"),
                   after=self._after_release)
        if hasattr(optimizer, "reduce_gradients"):
            self._wrap(optimizer, "reduce_gradients", "reduce_gradients",
                       lambda *a: self._enter("comm"), after=self._after_reduce_gradients)

    def start_step(self):
        """Mark the step start; watch buffers built since (sharding's are built lazily)."""
        self.bytes, self.times = [None] * len(PHASES), [None] * len(PHASES)
        self._backwards = 0
        for buffer in comm_buffers(self.model, self.optimizer):
            if id(buffer) not in self._watched:
                self._watched.add(id(buffer))
                name = f"{action_name(buffer)} bucket {buffer._id}"
                if buffer._dst != -1:
                    name += f" to rank {buffer._dst}"
                self._wrap(buffer, "_comm_grads", f"issue {name}")
                self._wrap(buffer, "scale_grads", f"wait+scale {name}",
                           lambda *a: self._enter("comm"), after=lambda *a: self._mark(4))
                # free_grads_in_comm: a bucket may complete (scale, free) during backward
                self._wrap(buffer, "_complete_comm", f"complete {name}", after=self._log)
                self._wrap(buffer, "_copy_grad_to_buffer", None, after=self._log)  # allocates
                self._wrap(buffer, "_clear_grad_storage", None, after=self._log)  # frees
        self.phase = "forward"
        self._mark(0)
        self.buffer_log = [(self.times[0], self._buffer_bytes())]

    def _buffer_bytes(self):
        return sum(b.grad_storage.numel() * b.grad_storage.element_size()
                   for b in comm_buffers(self.model, self.optimizer) if b.grad_storage is not None)

    def _log(self, *args):  # the buffers' bytes, when they change
        held = self._buffer_bytes()
        if held != self.buffer_log[-1][1]:
            self.buffer_log.append((time.perf_counter_ns(), held))

    def _enter(self, phase):
        self.phase = phase

    def _mark(self, phase):
        self.bytes[phase] = self.ledger.now()
        self.times[phase] = time.perf_counter_ns()

    def _before_backward(self, *args):
        self.phase = "backward"
        if self._backwards == 0:
            self._mark(1)

    def _after_backward(self, *args):
        self._backwards += 1
        if self._backwards == 1:
            self._mark(2)
        self._mark(3)  # the step's last backward marks last

    def _after_optimizer_step(self, *args):
        self._step_end = time.perf_counter_ns()
        self._mark(5)

    def _after_release(self, *args):
        self.recorder.span(self._release_name, self.tid, self._step_end, time.perf_counter_ns())
        self._mark(6)

    def _after_reduce_gradients(self, *args):
        self.phase = "step"  # called from the optimizer's step
        if not self.optimizer.pp_overlap:  # under pipeline overlap it does nothing
            self._mark(4)

    def _wrap(self, obj, method, label, before=None, after=None):
        """Replace `obj.method` on the instance by a spy that calls `before` and `after` with
        the call's arguments and records a span (`label`: a name, a function of the
        arguments, or None for no span)."""
        original = getattr(obj, method)
        recorder, tid = self.recorder, self.tid

        def spy(*args, **kwargs):
            if before is not None:
                before(*args)
            t0 = time.perf_counter_ns()
            out = original(*args, **kwargs)
            t1 = time.perf_counter_ns()
            if recorder.enabled and label is not None:
                recorder.span(label(*args) if callable(label) else label, tid, t0, t1)
            if after is not None:
                after(*args)
            return out

        setattr(obj, method, spy)
