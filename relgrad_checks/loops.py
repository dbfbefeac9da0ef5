"""Rank-side checks of the torch loop around the sharding optimizers: both loop orders
(`zero_grad` after `step()` or at the top) and the torch-shaped `clip_grad_norm_`."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from relgrad import DygraphShardingConfig, HybridCommunicateGroup, HybridStrategy
from sharding import DygraphShardingOptimizer, DygraphShardingOptimizerV2
from relgrad_checks.common import _data, _mlp

SIZES, BATCH, STEPS = [6, 16, 16, 4], 16, 3
_CLASSES = {1: DygraphShardingOptimizer, 2: DygraphShardingOptimizerV2}


def _sharded(world, version, overlap, acc, release=True):
    strategy = HybridStrategy(sharding_degree=world, sharding_configs=DygraphShardingConfig(
        split_param=version == 2, comm_overlap=overlap, accumulate_steps=acc,
        release_gradients=release))
    hcg = HybridCommunicateGroup(strategy)
    model = _mlp(SIZES)
    # Small buckets (v2: several per model) so that "every buffer" means more than one.
    opt = _CLASSES[version](torch.optim.AdamW(model.parameters(), lr=1e-2), hcg, strategy)
    return model, opt


def _buffers(opt):
    return opt.comm_buffers  # the public view the README points users to


def _micro_batches(rank, world, step, acc):
    x, y = _data(step, BATCH, SIZES[0], SIZES[-1])
    return list(zip(x.chunk(world)[rank].chunk(acc), y.chunk(world)[rank].chunk(acc)))


def _oracle(steps, clip=None):
    """One process, the whole batch, AdamW(1e-2); torch's clip_grad_norm_(clip) if given.
    Returns (params after the last step, the norms clip_grad_norm_ returned)."""
    model = _mlp(SIZES)
    opt, norms = torch.optim.AdamW(model.parameters(), lr=1e-2), []
    for step in range(steps):
        x, y = _data(step, BATCH, SIZES[0], SIZES[-1])
        F.mse_loss(model(x), y).backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], norms


def loop_orders(rank, world):
    """Both loop orders, v1 / v2, own overlap on / off, acc 1 / 4: what holds storage when each
    step's forward starts, and between step() and the next zero_grad (torch's contract: the
    grads stay readable until zero_grad). Returns {case: (storage at forward starts (bools),
    grads present at forward starts, grads present right after step, params)}."""
    out = {}
    for version in (1, 2):
        for overlap in (False, True):
            for acc in (1, 4):
                for order in ("step_then_zero", "zero_at_top"):
                    model, opt = _sharded(world, version, overlap, acc)
                    held, grads_at_forward, after_step = [], [], []
                    for step in range(STEPS):
                        if order == "zero_at_top":
                            opt.zero_grad()
                        held.append([b.grad_storage is not None for b in _buffers(opt)])
                        grads_at_forward.append(any(p.grad is not None
                                                    for p in model.parameters()))
                        for x, y in _micro_batches(rank, world, step, acc):
                            (F.mse_loss(model(x), y) / acc).backward()
                        opt.step()
                        after_step.append(all(p.grad is not None
                                              for p in model.parameters()))
                        if order == "step_then_zero":
                            opt.zero_grad()
                    out[version, overlap, acc, order] = (
                        held, grads_at_forward, after_step,
                        [p.detach().clone() for p in model.parameters()],
                        len(_buffers(opt)))
    return out, _oracle(STEPS)[0]


def clip_grad_norm(rank, world):
    """opt.clip_grad_norm_(c) between backward and step(), v1 / v2, overlap on / off, acc 1 /
    4, c below and above the norm. Returns ({case: (params, norms)}, {c: oracle (params,
    norms)})."""
    out, oracles = {}, {}
    for clip in (0.05, 100.0):
        oracles[clip] = _oracle(STEPS, clip)
        for version in (1, 2):
            for overlap in (False, True):
                for acc in (1, 4):
                    model, opt = _sharded(world, version, overlap, acc)
                    norms = []
                    for step in range(STEPS):
                        for x, y in _micro_batches(rank, world, step, acc):
                            (F.mse_loss(model(x), y) / acc).backward()
                        norms.append(opt.clip_grad_norm_(clip))
                        opt.step()
                        opt.zero_grad()
                    out[clip, version, overlap, acc] = (
                        [p.detach().clone() for p in model.parameters()], norms)
    return out, oracles


def clip_grad_norm_misuse(rank, world):
    """clip_grad_norm_ twice, with a bad max_norm, with grad_clip= too, norm_type=1: each raises
    on every rank, and the optimizer still steps right afterwards."""
    from relgrad_extras.grad_clip import ClipGradByGlobalNorm
    import pytest
    model, opt = _sharded(world, 2, True, 1)
    for x, y in _micro_batches(rank, world, 0, 1):
        F.mse_loss(model(x), y).backward()
    for bad, match in ((0.0, "finite number > 0"), (float("inf"), "finite number > 0")):
        with pytest.raises(ValueError, match=match):
            opt.clip_grad_norm_(bad)
    with pytest.raises(ValueError, match="norm_type=2"):
        opt.clip_grad_norm_(1.0, norm_type=1)
    opt.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match="ran twice"):
        opt.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
    strategy = HybridStrategy(sharding_degree=world)
    clipped = DygraphShardingOptimizer(torch.optim.SGD(_mlp(SIZES).parameters(), lr=0.1),
                                       HybridCommunicateGroup(strategy), strategy,
                                       grad_clip=ClipGradByGlobalNorm(1.0))
    with pytest.raises(ValueError, match="clip twice"):
        clipped.clip_grad_norm_(1.0)
    dist.barrier()
    return True


def setup_mismatch(rank, world):
    """Ranks that build the optimizer differently (lr, torch optimizer, split_param, comm
    overlap, model width) each raise the same ValueError on every rank; models seeded apart
    start from sharding rank 0's params; add_param_group under comm_overlap raises."""
    import pytest
    messages = []
    cases = {
        "lr": lambda: (1e-2 if rank == 0 else 2e-2, torch.optim.AdamW, 2, True, SIZES),
        "optimizer": lambda: (1e-2, torch.optim.AdamW if rank == 0 else torch.optim.Adam, 2,
                              True, SIZES),
        "split_param": lambda: (1e-2, torch.optim.AdamW, (2, 2) if rank == 0 else (1, 2), True,
                                SIZES),
        "overlap": lambda: (1e-2, torch.optim.AdamW, 1, rank == 0, SIZES),
        "width": lambda: (1e-2, torch.optim.AdamW, 2, True, SIZES if rank == 0 else [6, 8, 4]),
    }
    for name, case in cases.items():
        lr, cls, version, overlap, sizes = case()
        version, config = version if isinstance(version, tuple) else (version, version)
        strategy = HybridStrategy(sharding_degree=world, sharding_configs=DygraphShardingConfig(
            split_param=config == 2, comm_overlap=overlap, accumulate_steps=1,
            release_gradients=True))
        hcg = HybridCommunicateGroup(strategy)
        with pytest.raises(ValueError, match="must build the optimizer alike") as info:
            _CLASSES[version](cls(_mlp(sizes).parameters(), lr=lr), hcg, strategy)
        messages.append((name, str(info.value)))
    # models seeded apart: every rank starts from sharding rank 0's params
    strategy = HybridStrategy(sharding_degree=world, sharding_configs=DygraphShardingConfig(
        comm_overlap=True, release_gradients=True))
    hcg = HybridCommunicateGroup(strategy)
    model = _mlp(SIZES, seed=rank)
    opt = DygraphShardingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), hcg, strategy)
    start = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="add_param_group is not supported with sharding_"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))]})
    dist.barrier()
    return messages, start


def torch_clip_in_flight(rank, world):
    """torch.nn.utils.clip_grad_norm_ between backward and step() under sharding's own overlap
    (the grads are being reduced then): every rank raises at step(); after zero_grad() the
    same optimizer trains on to the one-process result. Returns {version: (message, params)}."""
    import pytest
    out = {}
    for version in (1, 2):
        model, opt = _sharded(world, version, True, 1)
        for x, y in _micro_batches(rank, world, 0, 1):
            F.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        with pytest.raises(ValueError, match="changed in place while its bucket") as info:
            opt.step()
        opt.zero_grad()
        for step in range(STEPS):
            for x, y in _micro_batches(rank, world, step, 1):
                F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        out[version] = (str(info.value), [p.detach().clone() for p in model.parameters()])
    return out, _oracle(STEPS)[0]


def unused_on_one_rank(rank, world):
    """Under sharding's own overlap with several buckets, rank 1's backward skips the branch
    whose buckets fire first on rank 0: every rank raises the same ValueError at step() (no
    hang, no mixed buckets); after zero_grad() both ranks train on together. Returns
    {version: (message, params after one good step)}."""
    import pytest
    out = {}
    for version in (1, 2):
        strategy = HybridStrategy(sharding_degree=world, sharding_configs=DygraphShardingConfig(
            split_param=version == 2, comm_overlap=True, accumulate_steps=1,
            release_gradients=True, comm_buffer_size_MB=1))
        hcg = HybridCommunicateGroup(strategy)
        torch.manual_seed(0)
        # one bucket each (>= 1 MB), of different sizes: a bucket issued out of turn would
        # meet another size on the other rank (gloo: a crash or a hang)
        a = torch.nn.Linear(500, 600, bias=False)
        b, head = torch.nn.Linear(600, 600, bias=False), torch.nn.Linear(600, 600, bias=False)
        model = torch.nn.ModuleList([a, b, head])
        opt = _CLASSES[version](torch.optim.SGD(model.parameters(), lr=0.1), hcg, strategy)
        assert len(opt.comm_buffers) == 3
        x = torch.randn(4, 500)
        h = a(x)
        h = h + b(h) if rank == 0 else h  # rank 1 leaves b out: its bucket never completes
        head(h).square().mean().backward()
        with pytest.raises(ValueError, match="did not get accumulate_steps") as info:
            opt.step()
        opt.zero_grad()
        h = a(x)
        head(h + b(h)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        out[version] = (str(info.value).split(" On this rank:")[0],
                        [p.detach().clone() for p in model.parameters()])
    return out
