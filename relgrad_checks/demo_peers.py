"""Rank-side check of the demo's --peers: the same LM under sharding v2, DDP + ZeRO and FSDP2."""
import gc

import torch

from comm_buffer import FusedCommBuffer
from relgrad_demo import peers
from relgrad_demo.memory import allocator_in_use_bytes

# A tiny LM and few steps: the systems' agreement does not depend on size.
OPTS = {"data": None, "block": 16, "seed": 0, "micro_batch_size": 2, "micro_batches": 2,
        "d_model": 32, "layers": 1, "main_grad": False, "lr": 3e-3, "steps": 3,
        "overlap": True, "trace": None, "modes": ["off", "on"]}

# What the allocator may add to a freed block's bytes: glibc rounds an mmapped chunk up to
# whole 4 KiB pages, a heap chunk to 16 B plus torch's 64 B alignment; the storage's own
# bookkeeping (StorageImpl) is a few hundred bytes.
ROUNDING = 4096
# What other threads may allocate meanwhile: far below the buffer (82 KiB in OPTS' LM).
SLACK = 1024


def _measured_release(released):
    """A `_clear_grad_storage` recording (buffer bytes, bytes freed, by its storage)."""
    original = FusedCommBuffer._clear_grad_storage
    cpu = torch.device("cpu")

    def release(buffer):
        if buffer.grad_storage is None:
            return original(buffer)
        storage = buffer.grad_storage.untyped_storage()
        nbytes = storage.nbytes()
        gc.collect()
        before = allocator_in_use_bytes(cpu)
        original(buffer)
        gc.collect()
        held = allocator_in_use_bytes(cpu)
        del storage  # the last reference, if the release dropped every other one
        gc.collect()
        after = allocator_in_use_bytes(cpu)
        released.append((nbytes, before - after, held - after))
        return None

    return original, release


def peers_agree(rank: int, world: int) -> dict:
    """DDP + ZeRO bitwise v2, FSDP2 within 1e-6, each release returning the buffer's bytes."""
    released = []
    original, release = _measured_release(released)
    FusedCommBuffer._clear_grad_storage = release
    try:
        result = peers.peers_job(rank, world, dict(OPTS))
    finally:
        FusedCommBuffer._clear_grad_storage = original
    diff, runs = result["diff"], result["runs"]
    assert set(diff) == {"v2 release off", "v2 release on", "DDP + ZeRO", "FSDP2"}, diff
    assert diff["v2 release on"] == (0, 0) and diff["DDP + ZeRO"] == (0, 0), diff
    assert max(diff["FSDP2"]) <= 1e-6, diff
    assert len(runs["v2 release off"]["losses"]) == OPTS["steps"]
    # one buffer (the LM is far below the 256 MB bucket cap), released once per step: the two
    # warm-up rounds' single step and the measured steps
    assert len(released) == 2 + OPTS["steps"], released
    counted_off = runs["v2 release off"]["counted"]
    assert len(counted_off) == OPTS["steps"] and len(set(counted_off)) == 1, counted_off
    assert runs["v2 release on"]["counted"] == [0] * OPTS["steps"]
    grad_bytes = result["params"] * 4
    for nbytes, freed, storage_freed in released:
        # the buffer is the one "off" keeps: every param's fp32 grad, each padded to 256 B
        assert nbytes == counted_off[0] and grad_bytes <= nbytes < grad_bytes + 256 * 64
        # Less by at most SLACK: another thread of this process (gloo's, the memory sampler's)
        # may allocate a few bytes inside the window (32 B seen once on a loaded machine).
        assert nbytes - SLACK <= storage_freed <= nbytes + ROUNDING, (nbytes, storage_freed)
        assert storage_freed <= freed, (storage_freed, freed)  # + the views it dropped
    result["released"] = released
    return result
