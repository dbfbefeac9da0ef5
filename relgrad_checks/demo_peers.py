"""Rank-side check of the demo's --peers: the same LM under sharding v2, DDP + ZeRO and FSDP2."""
from relgrad_demo import peers

# A tiny LM and few steps: the systems' agreement does not depend on size.
OPTS = {"data": None, "block": 16, "seed": 0, "micro_batch_size": 2, "micro_batches": 2,
        "d_model": 32, "layers": 1, "main_grad": False, "lr": 3e-3, "steps": 3,
        "overlap": True, "trace": None, "modes": ["off", "on"]}


def peers_agree(rank, world):
    """torch's DDP + ZeRO ends bitwise equal to v2 (same sums in the same order), FSDP2 within
    1e-6; v2 with release holds less between steps than without (allocator)."""
    result = peers.peers_job(rank, world, dict(OPTS))
    diff, runs = result["diff"], result["runs"]
    assert set(diff) == {"v2 release off", "v2 release on", "DDP + ZeRO", "FSDP2"}, diff
    assert diff["v2 release on"] == (0, 0) and diff["DDP + ZeRO"] == (0, 0), diff
    assert max(diff["FSDP2"]) <= 1e-6, diff
    assert len(runs["v2 release off"]["losses"]) == OPTS["steps"]
    grad_bytes = result["params"] * 4
    off, on = (runs[f"v2 release {m}"]["idle"][-1] for m in ("off", "on"))
    assert 0.8 * grad_bytes < off - on < 1.3 * grad_bytes, (off - on, grad_bytes)
    return result
