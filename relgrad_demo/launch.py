"""The local launcher of the demo and the tests: `launch(fn, world)` runs gloo ranks here.

Under torchrun (several machines, GPUs) the job needs none of it: torchrun starts the ranks and
ends the job when one fails, as `launch` (torch.multiprocessing) does here.
"""
import os
import pickle
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# On Linux, ranks fork from a server process that imports torch, and torch._dynamo (which
# torch.optim imports at the first optimizer built), once for all of them: each rank would
# otherwise spend ~2 s of CPU importing them. Elsewhere they are spawned, each importing them
# (Windows has no fork; on macOS a fork after system frameworks loaded is not safe).
_START_METHOD = "forkserver" if sys.platform.startswith("linux") else "spawn"
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]


def launch(fn, world_size, args=(), timeout=300.0):
    """Run `fn(rank, world_size, *args)` on `world_size` local gloo ranks; return their results.

    Ranks are started with torch.multiprocessing (`_START_METHOD`) and meet at a TCPStore
    that this process holds on 127.0.0.1, on a port the OS picks. `fn` must be importable and
    its results picklable; the list of results is indexed by rank. If a rank raises, torch
    terminates the others; ProcessRaisedException then carries the traceback of the rank that
    raised first (as torchrun reports its first failure: a peer's broken connection may be
    seen first); if the ranks are not done after `timeout` seconds, all are killed and
    TimeoutError is raised.
    """
    if _START_METHOD == "forkserver":
        mp.set_forkserver_preload(_PRELOAD)  # no effect once this process's server runs
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _rank_entry, args=(fn, world_size, store.port, args, out_dir, timeout),
            nprocs=world_size, join=False, start_method=_START_METHOD)
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(0.05, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size} ranks of {fn.__name__} still running "
                                       f"after {timeout:.0f} s; killed them all")
        except mp.ProcessRaisedException as error:
            raise _first_failure(out_dir, world_size) or error from None
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        results = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results


def _first_failure(out_dir, world_size):
    """The ProcessRaisedException of the rank that raised first (its error file), or None."""
    failures = []
    for rank in range(world_size):
        path = os.path.join(out_dir, f"rank{rank}.err")
        if os.path.exists(path):
            with open(path, "rb") as f:
                failures.append((*pickle.load(f), rank))
    if not failures:
        return None
    _, text, rank = min(failures)
    return mp.ProcessRaisedException(f"\n\n-- Process {rank} terminated with the following "
                                     f"error:\n{text}", rank, 0)


def _quiet_flight_recorder():
    # c10d's flight recorder keeps ~1.4 KB for each of the last 2000 collectives: it would
    # show up in the allocator's figures as growth, so it is off unless asked for.
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "0")


def _rank_entry(rank, fn, world_size, port, args, out_dir, timeout):
    torch.set_num_threads(1)  # ranks share this machine's cores
    _quiet_flight_recorder()
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                          timeout=timedelta(seconds=timeout))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout))
    try:
        result = fn(rank, world_size, *args)
    except BaseException:
        path = os.path.join(out_dir, f"rank{rank}.err")
        with open(path + ".tmp", "wb") as f:
            pickle.dump((time.time(), traceback.format_exc()), f)
        os.replace(path + ".tmp", path)  # whole, or not there: launch may read it meanwhile
        raise
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    # Every rank done before any tears down: a rank that exits while a peer's gloo threads
    # still serve a subgroup's pairs can abort ("terminate called without an active
    # exception"), seen here about once in ten runs without this barrier.
    dist.barrier()
    dist.destroy_process_group()
