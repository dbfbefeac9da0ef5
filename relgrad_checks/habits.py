"""Rank-side checks of habits DDP users bring: a skipped backward, an lr set per rank, a GAN's
two models, the bare buffer's in-flight grads and its comm_group. Each returns what every rank
saw (the error's type and text) and the params after training on, for the test to compare."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from comm_buffer import HOOK_ACTION, FusedCommBuffer, assign_group_by_size, bw_hook_func
from relgrad import DygraphShardingConfig, HybridCommunicateGroup, HybridStrategy
from relgrad_checks.loops import _CLASSES, STEPS, _micro_batches, _oracle, _sharded


def _error(call):
    """(type name, text) of what `call()` raised, or None."""
    try:
        call()
    except (ValueError, RuntimeError) as error:
        return type(error).__name__, str(error)
    return None


def _train(model, opt, rank, world, steps):
    for step in steps:
        for x, y in _micro_batches(rank, world, step, 1):
            F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=opt.sd_release_grads)


def _oracle_from(first, steps):
    """One process, AdamW(1e-2), the whole batch of steps `first` .. `steps - 1` only."""
    from relgrad_checks.common import _data, _mlp
    from relgrad_checks.loops import BATCH, SIZES
    model = _mlp(SIZES)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(first, steps):
        x, y = _data(step, BATCH, SIZES[0], SIZES[-1])
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def skipped_backward(rank, world):
    """Sharding's own overlap, v1 / v2, release on / off, step 0 goes wrong on rank 1: "skip"
    (it skips backward, every rank calls zero_grad()) or "alone" (every rank runs backward,
    rank 1 calls zero_grad() while the others call step()); then every rank clears and trains
    STEPS good steps. Returns ({case: (error, params)}, one process over steps 1 .. STEPS)."""
    out = {}
    for version in (1, 2):
        for release in (True, False):
            for how in ("skip", "alone"):
                model, opt = _sharded(world, version, True, 1, release)
                if rank != 1 or how == "alone":
                    for x, y in _micro_batches(rank, world, 0, 1):
                        F.mse_loss(model(x), y).backward()
                call = opt.step if how == "alone" and rank != 1 else lambda: opt.zero_grad(
                    set_to_none=release)
                seen = _error(call)
                if how == "alone":
                    opt.zero_grad(set_to_none=release)  # clear the grads and go on
                _train(model, opt, rank, world, range(1, STEPS + 1))
                out[version, release, how] = (seen,
                                              [p.detach().clone() for p in model.parameters()])
    return out, _oracle_from(1, STEPS + 1)


def lr_per_rank(rank, world):
    """v1 / v2 (own overlap off and on): rank 1 sets another lr by hand; step() raises on every
    rank; the same lr set back, zero_grad() and training on match one process."""
    out = {}
    for version in (1, 2):
        for overlap in (False, True):
            model, opt = _sharded(world, version, overlap, 1)
            for group in opt.param_groups:
                group["lr"] = 0.02 if rank == 1 else 0.01
            for x, y in _micro_batches(rank, world, 0, 1):
                F.mse_loss(model(x), y).backward()
            seen = _error(opt.step)
            opt.zero_grad()
            for group in opt.param_groups:
                group["lr"] = 1e-2
            _train(model, opt, rank, world, range(STEPS))
            out[version, overlap] = (seen, [p.detach().clone() for p in model.parameters()])
    return out, _oracle(STEPS)[0]


def _gan(seed=0):
    torch.manual_seed(seed)
    gen = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 6))
    disc = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return gen, disc


def _gan_steps(gen, disc, opt_g, opt_d, rows, freeze, steps=2):
    """DCGAN's loop order: D on real and detached fake, then G through D (D frozen if asked)."""
    bce = torch.nn.BCEWithLogitsLoss()
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        real, noise = torch.randn(8, 6, generator=g)[rows], torch.randn(8, 4, generator=g)[rows]
        fake = gen(noise)
        opt_d.zero_grad(set_to_none=getattr(opt_d, "sd_release_grads", True))
        (bce(disc(real), torch.ones(len(real), 1))
         + bce(disc(fake.detach()), torch.zeros(len(real), 1))).backward()
        opt_d.step()
        opt_g.zero_grad(set_to_none=getattr(opt_g, "sd_release_grads", True))
        disc.requires_grad_(not freeze)
        bce(disc(fake), torch.ones(len(real), 1)).backward()  # reaches D unless frozen
        disc.requires_grad_(True)
        opt_g.step()


def gan(rank, world):
    """Two sharding optimizers (own overlap, v1 release on, v2 release off) in DCGAN's loop:
    G's loss reaching D raises the same error on every rank; with D frozen for G's step it
    trains as one process does. Returns ({version: (error, G and D params)}, one process)."""
    out = {}
    rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
    for version, release in ((1, True), (2, False)):
        strategy = HybridStrategy(sharding_degree=world, sharding_configs=DygraphShardingConfig(
            split_param=version == 2, comm_overlap=True, release_gradients=release))
        hcg = HybridCommunicateGroup(strategy)
        gen, disc = _gan()
        opt_g = _CLASSES[version](torch.optim.Adam(gen.parameters(), lr=1e-2), hcg, strategy)
        opt_d = _CLASSES[version](torch.optim.Adam(disc.parameters(), lr=1e-2), hcg, strategy)
        seen = _error(lambda: _gan_steps(gen, disc, opt_g, opt_d, rows, freeze=False))
        gen, disc = _gan()  # the fix, from the start
        opt_g = _CLASSES[version](torch.optim.Adam(gen.parameters(), lr=1e-2), hcg, strategy)
        opt_d = _CLASSES[version](torch.optim.Adam(disc.parameters(), lr=1e-2), hcg, strategy)
        _gan_steps(gen, disc, opt_g, opt_d, rows, freeze=True)
        out[version] = (seen, [p.detach().clone() for m in (gen, disc) for p in m.parameters()])
    gen, disc = _gan()
    _gan_steps(gen, disc, torch.optim.Adam(gen.parameters(), lr=1e-2),
               torch.optim.Adam(disc.parameters(), lr=1e-2), slice(0, 8), freeze=True)
    return out, [p.detach().clone() for m in (gen, disc) for p in m.parameters()]


def bare_buffer(rank, world):
    """The bare FusedCommBuffer (release on): a grad scaled in flight (rank 0 only) raises the
    same error at scale_grads() on every rank, then zero_grad() and release() and training on
    match one process over the later steps; a comm_group whose ranks hold other buckets raises
    at build on every rank. Returns (in-flight error, params, one process, build error)."""
    from relgrad_checks.common import _mlp
    from relgrad_checks.loops import SIZES
    model = _mlp(SIZES)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    buffers = [FusedCommBuffer(i, b, None, 1, HOOK_ACTION.ALL_REDUCE, release_grads=True)
               for i, b in assign_group_by_size(list(model.parameters())).items()]
    assert len(buffers) == 1
    for buffer in buffers:
        for p in buffer.params:
            p.register_post_accumulate_grad_hook(bw_hook_func(buffer, p))

    def step(k, change=False):
        for x, y in _micro_batches(rank, world, k, 1):
            F.mse_loss(model(x), y).backward()
        if change:
            next(model.parameters()).grad.mul_(0.5)  # nanoGPT's clip before the wait
        for buffer in buffers:
            buffer.scale_grads()
        opt.step()

    seen = _error(lambda: step(0, change=rank == 0))
    opt.zero_grad()
    for buffer in buffers:
        buffer.release()
    for k in range(1, STEPS + 1):
        step(k)
        opt.zero_grad()
        for buffer in buffers:
            buffer.release()
    params = [p.detach().clone() for p in model.parameters()]
    other = [torch.nn.Parameter(torch.ones(100 + 100 * rank))]  # rank 1's: another size
    built = _error(lambda: FusedCommBuffer(0, other, None, 1, HOOK_ACTION.ALL_REDUCE))
    dist.barrier()
    return seen, params, _oracle_from(1, STEPS + 1), built
