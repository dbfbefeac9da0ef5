"""Memory figures of the demo: the allocator's in-use bytes, a run's share of them, and our count.

A process may hold several runs at once (release off and on, or several systems, trained in
turns). The allocator only knows the process total, so each run's share is kept by difference
(`Ledger`): right before one of its steps, everything that is not the run's is the total minus
what the run held after its previous step; right after, the run holds the total minus that.
Between its steps the other runs sit idle, so their bytes do not move. `live_grad_bytes` is an
independent count of the grad storages alone, from the tensors themselves.

On GPU, `torch.cuda.memory_allocated` counts the tensors' bytes; the caching allocator reserves
more (`memory_reserved`: freed blocks kept for reuse, rounding), process-wide and not split by
run. Neither counts what NCCL allocates itself (its communicators' channel and proxy buffers,
per communicator: each process group, and each 2-rank pair of unbatched p2p) nor the CUDA
context: `nvidia-smi` shows all of these, so it reads above both figures.
"""
import ctypes
import gc
import threading
import time

import torch


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


_MALLINFO2 = getattr(ctypes.CDLL(None), "mallinfo2", None)
if _MALLINFO2 is not None:
    _MALLINFO2.restype = _Mallinfo2


def allocator_in_use_bytes(device):
    """Bytes in use: `torch.cuda.memory_allocated` on GPU; glibc `mallinfo2` on CPU (heap
    chunks in use + mmapped chunks: torch's CPU tensors come from malloc). None elsewhere."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd


class Ledger:
    """The bytes one run holds, from the allocator, while other runs live in the same process.

    `begin()` before the run's build or step; `now()` during it (this run's bytes at that
    moment); `end()` after it: collects garbage and returns the bytes the run now holds. All
    bytes are above what was in use before the run was built; None without an allocator figure.
    """

    def __init__(self, device):
        self.device, self.held, self._others = device, 0, None

    def begin(self):
        total = allocator_in_use_bytes(self.device)
        self._others = None if total is None else total - self.held

    def now(self):
        total = allocator_in_use_bytes(self.device)
        return None if total is None or self._others is None else total - self._others

    def end(self):
        gc.collect()  # what stays alive is what the run holds on to
        self.held = self.now()
        for _ in range(3) if self.held is not None else ():
            # a collective's worker thread (gloo's) may drop its reference to a buffer the run
            # released a moment after the wait returned: give it the core, keep the lowest
            time.sleep(0.002)
            self.held = min(self.held, self.now())
        return self.held


class PeakSampler:
    """The highest bytes of `ledger`'s run during a block: the CUDA allocator's peak, or on CPU
    the highest in-use bytes seen by a thread sampling every 0.5 ms. With a `recorder`, the CPU
    samples also go to its counter track (process-wide in-use bytes). With `phase_of` (a
    function returning the phase the run is in: "forward", "backward", "comm", "step"), the
    CPU sampler also keeps `phase`, the phase of the peak (None on GPU or if unknown). On GPU
    it also keeps `reserved_peak`, the caching allocator's highest reserved bytes during the
    block for the whole process (every run's blocks; not above the start); None on CPU.

    With `samples` (a list), every sample is also appended to it as `(ns since the block
    began, the run's bytes)`, the first taken as the block begins, the last as it ends (on
    GPU only those two): what `--plot` draws. The list's own growth, about 8 bytes per
    sample, is in the figures (both runs' alike)."""

    def __init__(self, ledger, recorder=None, phase_of=None, samples=None):
        self.ledger, self.recorder, self.peak = ledger, recorder, None
        self.reserved_peak = None
        self.phase_of, self.phase = phase_of, None
        self.samples = samples

    def __enter__(self):
        device = self.ledger.device
        self.t0 = time.perf_counter_ns()
        self._keep(self.ledger.now())
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            return self
        self._stop = threading.Event()
        self._total = allocator_in_use_bytes(device)
        if self._total is not None:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _keep(self, nbytes):
        if self.samples is not None and nbytes is not None:
            self.samples.append((time.perf_counter_ns() - self.t0, nbytes))

    def _sample(self):
        device, recorder, others = self.ledger.device, self.recorder, self.ledger._others
        while not self._stop.wait(0.0005):
            total = allocator_in_use_bytes(device)
            if total > self._total:
                self._total = total
                self.phase = self.phase_of() if self.phase_of is not None else None
            if recorder is not None:
                recorder.counter(time.perf_counter_ns(), total)
            if others is not None:
                self._keep(total - others)

    def __exit__(self, *exc):
        device, others = self.ledger.device, self.ledger._others
        if device.type == "cuda":
            self._total = torch.cuda.max_memory_allocated(device)
            self.reserved_peak = torch.cuda.max_memory_reserved(device)
        elif self._total is not None:
            self._stop.set()
            self._thread.join()
        self._keep(self.ledger.now())
        if self._total is not None and others is not None:
            self.peak = self._total - others


def live_grad_bytes(model, optimizer, buffers):
    """Bytes of the distinct storages behind every grad, main_grad, slice grad and buffer."""
    tensors = []
    params = list(model.parameters()) + [p for g in optimizer.param_groups for p in g["params"]]
    params += list(getattr(optimizer, "_slice_params", {}).values())
    for p in params:
        tensors += [p.grad, getattr(p, "main_grad", None)]
    for buffer in buffers:
        tensors.append(buffer.grad_storage)
        for view in getattr(buffer, "_sharding_param_grad_view", {}).values():
            tensors += [view._slice_grad, view._grad_buffer]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors if t is not None}
    return sum(storages.values())
