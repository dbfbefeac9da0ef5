"""Spans and in-use samples of each rank, written as a Chrome trace (`--trace FILE`).

The file is the Chrome trace event format that torch's profiler also writes: a JSON object whose
`traceEvents` hold complete events (`"ph": "X"`, times in microseconds), counter events
(`"ph": "C"`) and process / thread names (`"ph": "M"`). Open it in https://ui.perfetto.dev or
chrome://tracing: one process per rank, one thread per run (release off, on, ...), and a counter
track of the process's in-use bytes as the allocator reports them.
"""
import json
import time

_CAPACITY = 100_000  # spans, and counter samples, per rank: preallocated (see Recorder)
_MIN_STEP_BYTES = 4096  # a counter sample is kept when in-use moved this much since the last
_MIN_STEP_NS = 5_000_000  # ... or this long after the last kept sample


class _Slots:
    """A list allocated up front, filled in order; what does not fit is counted and dropped."""

    def __init__(self, capacity):
        self.items, self.n, self.dropped = [None] * capacity, 0, 0

    def add(self, item):
        if self.n < len(self.items):
            self.items[self.n] = item
            self.n += 1
        else:
            self.dropped += 1


class Recorder:
    """One rank's events; every call is a no-op when `enabled` is False.

    Events are small tuples in lists allocated up front (growing a list mid-step would move
    the allocator's figures). Spans come from the training thread, counter samples from the
    peak sampler's thread: each writes its own list. Times are `time.perf_counter_ns()`, a
    clock all processes of one machine share.
    """

    def __init__(self, enabled):
        self.enabled = enabled
        self._spans = _Slots(_CAPACITY if enabled else 0)
        self._counters = _Slots(_CAPACITY if enabled else 0)
        self._last_counter = (0, -_MIN_STEP_BYTES)

    def span(self, name, tid, t0_ns, t1_ns):
        """A span `name` on thread `tid` (a run's index) from `t0_ns` to `t1_ns`."""
        if self.enabled:
            self._spans.add((name, tid, t0_ns, t1_ns))

    def counter(self, t_ns, nbytes):
        """An in-use sample (bytes, whole process), kept if it moved or time passed."""
        last_t, last_bytes = self._last_counter
        if self.enabled and (abs(nbytes - last_bytes) >= _MIN_STEP_BYTES
                             or t_ns - last_t >= _MIN_STEP_NS):
            self._last_counter = (t_ns, nbytes)
            self._counters.add((t_ns, nbytes))

    def timed(self, name, tid):
        """Context manager: a span around a block."""
        return _Timed(self, name, tid)

    def chrome_events(self, pid, process_name, thread_names):
        """This rank's events as Chrome trace event dicts (times still absolute, in ns)."""
        out = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": process_name}},
               {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}}]
        out += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": n}}
                for tid, n in enumerate(thread_names)]
        for name, tid, t0, t1 in self._spans.items[: self._spans.n]:
            out.append({"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": t0,
                        "dur": t1 - t0})
        for t, nbytes in self._counters.items[: self._counters.n]:
            out.append({"ph": "C", "name": "in-use KiB", "pid": pid, "ts": t,
                        "args": {"in use": round(nbytes / 1024, 1)}})
        dropped = self._spans.dropped + self._counters.dropped
        if dropped:
            out.append({"ph": "M", "name": "dropped_events", "pid": pid,
                        "args": {"count": dropped}})
        return out


class _Timed:
    def __init__(self, recorder, name, tid):
        self.recorder, self.name, self.tid = recorder, name, tid

    def __enter__(self):
        self.t0 = time.perf_counter_ns()

    def __exit__(self, *exc):
        self.recorder.span(self.name, self.tid, self.t0, time.perf_counter_ns())


def write_chrome_trace(path, rank_events):
    """Write every rank's `chrome_events` to `path`, times in microseconds from the first."""
    events = [e for rank in rank_events for e in rank]
    t0 = min((e["ts"] for e in events if "ts" in e), default=0)
    for e in events:
        if "ts" in e:
            e["ts"] = (e["ts"] - t0) / 1000
        if "dur" in e:
            e["dur"] = e["dur"] / 1000
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
