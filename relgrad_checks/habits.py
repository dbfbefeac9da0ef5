"""Rank-side checks of habits DDP users bring: a skipped backward, an lr set per rank, a GAN's
two models, the bare buffer's in-flight grads and its comm_group."""
from itertools import product

import torch
import torch.distributed as dist

from comm_buffer import HOOK_ACTION, FusedCommBuffer
from relgrad import HybridCommunicateGroup
from relgrad_checks.common import _mlp
from relgrad_checks.loops import (CLASSES, SIZES, STEPS, backward, caught, clear, hooked, oracle,
                                  own_strategy, params, sharded, train)


def skipped_backward(rank: int, world: int) -> tuple[dict, list]:
    """Own overlap: in step 0 rank 1 skips backward or clears alone; then STEPS steps.
    -> ({case: (error, params)}, one process over those steps)"""
    out = {}
    for version, release, how in product((1, 2), (True, False), ("skip", "alone")):
        model, opt = sharded(world, version, True, 1, release)
        if rank != 1 or how == "alone":
            backward(model, rank, world, 0)
        if how == "alone" and rank != 1:
            seen = caught(opt.step)
        else:
            seen = caught(clear, opt, release)
        if how == "alone":
            clear(opt, release)  # clear the grads and go on
        train(model, opt, rank, world, range(1, STEPS + 1), release)
        out[version, release, how] = (seen, params(model))
    return out, oracle(range(1, STEPS + 1))[0]


def lr_per_rank(rank: int, world: int) -> tuple[dict, list]:
    """Rank 1 sets another lr by hand; set back, cleared, trained on.
    -> ({case: (error, params)}, one process)"""
    out = {}
    for version, overlap in product((1, 2), (False, True)):
        model, opt = sharded(world, version, overlap, 1)
        for group in opt.param_groups:
            group["lr"] = 0.02 if rank == 1 else 0.01
        backward(model, rank, world, 0)
        seen = caught(opt.step)
        opt.zero_grad()
        for group in opt.param_groups:
            group["lr"] = 1e-2
        train(model, opt, rank, world, range(STEPS))
        out[version, overlap] = (seen, params(model))
    return out, oracle()[0]


def _gan(version, hcg, strategy):
    """A generator and a discriminator with their optimizers (v`version`, or plain Adam)."""
    torch.manual_seed(0)
    gen = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 6))
    disc = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opts = []
    for model in (gen, disc):
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        if version:
            opt = CLASSES[version](opt, hcg, strategy)
        opts.append(opt)
    return gen, disc, *opts


def _gan_steps(gen, disc, opt_g, opt_d, rows, freeze, steps=2):
    """DCGAN's loop order (D, then G through D, frozen if asked). -> G's and D's params"""
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
    return params(gen) + params(disc)


def gan(rank: int, world: int) -> tuple[dict, list]:
    """Two sharding optimizers in DCGAN's loop, D frozen for G's step or not.
    -> ({version: (error, params)}, one process)"""
    out = {}
    rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
    for version, release in ((1, True), (2, False)):
        strategy = own_strategy(world, version, release=release)
        hcg = HybridCommunicateGroup(strategy)
        seen = caught(_gan_steps, *_gan(version, hcg, strategy), rows, freeze=False)
        out[version] = (seen, _gan_steps(*_gan(version, hcg, strategy), rows, freeze=True))
    return out, _gan_steps(*_gan(None, None, None), slice(0, 8), freeze=True)


def bare_buffer(rank: int, world: int) -> tuple:
    """The bare buffer: a grad scaled in flight on rank 0, then training on; a comm_group
    whose ranks hold other buckets. -> (error, params, one process, build error)"""
    model = _mlp(SIZES)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    buffers = hooked(model.parameters(), None, 1, True)
    assert len(buffers) == 1

    def step(k, change=False):
        backward(model, rank, world, k)
        if change:
            next(model.parameters()).grad.mul_(0.5)  # nanoGPT's clip before the wait
        for buffer in buffers:
            buffer.scale_grads()
        opt.step()

    def clear_and_release():
        opt.zero_grad()
        for buffer in buffers:
            buffer.release()

    seen = caught(step, 0, change=rank == 0)
    clear_and_release()
    for k in range(1, STEPS + 1):
        step(k)
        clear_and_release()
    other = [torch.nn.Parameter(torch.ones(100 + 100 * rank))]  # rank 1's: another size
    built = caught(FusedCommBuffer, 0, other, None, 1, HOOK_ACTION.ALL_REDUCE)
    dist.barrier()
    return seen, params(model), oracle(range(1, STEPS + 1))[0], built
