"""Rank-side checks of the loops people already run: recipe (a) against DDP, torch's clip and
GradScaler on ZeRO-1, train.py's order, zero_grad()'s default, the bare buffer's groups, the
pipeline's experts and modes, and the grads a step pre-hook sees."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from comm_buffer import HOOK_ACTION, FusedCommBuffer
from pipeline import PipelineParallel
from relgrad import HybridCommunicateGroup
from relgrad_checks.common import _data, _mlp, _mse, _strategy
from relgrad_checks.loops import (LR, SIZES, STEPS, backward, caught, cases, clear, hooked,
                                  micro_batches, oracle, params, sharded, train)
from relgrad_extras.checkpoint import local_slices

# ---------------------------------------------------------------- recipe (a) texts, against DDP

BN_MODEL = ("torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), "
            "torch.nn.GELU(), torch.nn.Linear(32, 4))")
_MLP = ("model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), "
        "torch.nn.Linear(32, 4))")
_END = "dist.barrier()  # every rank done before any tears down"
_TAIL = """# added by the test: the trained state, then an eval pass on rank-specific data
torch.save({{"params": [p.detach().clone() for p in model.parameters()],
            "buffers": [b.clone() for b in model.buffers()]}}, f"state_rank{{rank}}.pt")
{imports}model.eval()
x_eval = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 + rank))
with torch.no_grad():
    {sync}
    out = {forward}(x_eval)
torch.save(out, f"eval_rank{{rank}}.pt")
"""

DDP_BN = f"""import contextlib, torch, torch.distributed as dist, torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
rank, world, ACC = dist.get_rank(), dist.get_world_size(), 4
torch.manual_seed(rank)  # DDP broadcasts rank 0's params and buffers when built
model = {BN_MODEL}
ddp = DistributedDataParallel(model)  # broadcast_buffers=True, the default
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for step in range(6):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(world * 8, 16, generator=g), torch.randn(world * 8, 4, generator=g)
    pairs = list(zip(x.chunk(world)[rank].chunk(ACC), y.chunk(world)[rank].chunk(ACC)))
    for k, (xm, ym) in enumerate(pairs):  # no_sync on every micro-batch but the last
        with ddp.no_sync() if k < ACC - 1 else contextlib.nullcontext():
            (F.mse_loss(ddp(xm), ym) / ACC).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
{_TAIL.format(imports="", sync="pass  # DDP's forward broadcasts rank 0's buffers", forward="ddp")}
{_END}
dist.destroy_process_group()
"""


def _edit(source, *pairs):
    """`source` with each (old, new) replaced; each old occurs exactly once."""
    for old, new in pairs:
        assert source.count(old) == 1, (old, source)
        source = source.replace(old, new)
    return source


def bn_recipe(source: str, release: bool) -> str:
    """Recipe (a) with a BatchNorm1d model, RELEASE = `release`, saving its state and eval."""
    tail = _TAIL.format(imports="from comm_buffer import broadcast_buffers\n",
                        sync="broadcast_buffers(model, None)", forward="model")
    return _edit(source, (_MLP, "model = " + BN_MODEL), (", 4, True  #", f", 4, {release}  #"),
                 (_END, tail + _END))


def zero_grad_default_recipe(source: str) -> str:
    """Recipe (a) with release off and zero_grad() to None, saving VIEWS (grad is slot)."""
    check = ("    VIEWS.append([p.grad.data_ptr() == b.grad_storage[b.param2offset[p]:]"
             ".data_ptr() for b in buffers for p in b.params])\n")
    clip = "    torch.nn.utils.clip_grad_norm_("
    return _edit(source, (", 4, True  #", ", 4, False  #"),
                 ("opt.zero_grad(set_to_none=RELEASE)", "opt.zero_grad()"),
                 ("for step in range(6):", "VIEWS = []\nfor step in range(6):"),
                 (clip, check + clip),
                 (_END, 'torch.save(VIEWS, f"views_rank{rank}.pt")\n' + _END))


# ---------------------------------------------------------------- the sharding optimizers

def torch_clip_no_overlap(rank: int, world: int) -> tuple[dict, list]:
    """torch's clip on the model before step(), v1 / v2, no overlap; then opt's clip.
    -> ({case: (error, params unchanged, params)}, one process clipping with torch)"""
    out = {}
    for case, (version, release) in cases(("v", (1, 2)), ("release", (False, True))):
        model, opt = sharded(world, version, False, 1, release)
        start = params(model)
        backward(model, rank, world, 0)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        seen = caught(opt.step)
        unchanged = all(map(torch.equal, start, params(model)))
        clear(opt, release)
        train(model, opt, rank, world, range(STEPS), release, clip=1.0)
        out[case] = (seen, unchanged, params(model))
    return out, oracle(clip=1.0)[0]


def grad_scaler(rank: int, world: int) -> tuple[dict, list]:
    """GradScaler on v1 / v2, an inf on rank 1, unscale_ + clip or not; then STEPS steps
    without it. -> ({case: (error, params unchanged, later error, params)}, one process)"""
    out = {}
    for case, (version, overlap, release, unscale) in cases(
            ("v", (1, 2)), ("overlap", (False, True)), ("release", (False, True)),
            ("unscale_", (True, False))):
        model, opt = sharded(world, version, overlap, 2, release)
        scaler, start = torch.amp.GradScaler("cpu"), params(model)
        backward(model, rank, world, 0, 2, scaler.scale)
        if rank == 1:  # an overflow backward made (not a change in place: .data)
            next(model.parameters()).grad.data[0, 0] = float("inf")

        def amp_step():
            if unscale:
                scaler.unscale_(opt)
                opt.clip_grad_norm_(1.0)
            scaler.step(opt)
            scaler.update()

        seen = caught(amp_step)
        unchanged = all(map(torch.equal, start, params(model)))
        clear(opt, release)
        later = caught(train, model, opt, rank, world, range(1, STEPS + 1), release, 2)
        out[case] = (seen, unchanged, later, params(model))
    return out, oracle(range(1, STEPS + 1))[0]


def train_py_order(rank: int, world: int) -> tuple[dict, list]:
    """train.py's order (zero_grad after the forward), with or without one more after
    step(). -> ({case: ([(training, (buffer held, grad held))] per forward, buffers,
    params)}, one process)"""
    out = {}
    for case, (version, overlap, extra) in cases(("v", (1, 2)), ("overlap", (False, True)),
                                                  ("extra", (True, False))):
        model, opt = sharded(world, version, overlap, 1, True)
        seen = []

        def note(module, args):
            held = any(b.grad_storage is not None for b in opt.comm_buffers)
            grads = any(p.grad is not None for p in module.parameters())
            seen.append((module.training, (held, grads)))

        model.register_forward_pre_hook(note)
        x_eval = _data(100 + rank, 4, SIZES[0], SIZES[-1])[0]
        for step in range(STEPS):
            model.train()
            for x, y in micro_batches(rank, world, step, 1):
                loss = F.mse_loss(model(x), y)
                opt.zero_grad()  # train.py's: after the forward
                loss.backward()
            opt.step()
            if extra:
                opt.zero_grad()
            model.eval()
            with torch.no_grad():
                model(x_eval)
        out[case] = (seen, len(opt.comm_buffers), params(model))
    return out, oracle()[0]


def zero_grad_default(rank: int, world: int) -> tuple[dict, list]:
    """zero_grad() to None after each step: v1 trains (grads views again under overlap),
    v2 with release off refuses. -> ({case: (error, views, params)}, one process)"""
    out = {}
    for case, (version, overlap, release) in cases(("v", (1, 2)), ("overlap", (False, True)),
                                                    ("release", (False, True))):
        if version == 2 and release:
            continue  # v2 with release on: recipe (b)'s own loop
        model, opt = sharded(world, version, overlap, 1, release)
        views, seen = [], None
        for step in range(STEPS):
            backward(model, rank, world, step)
            views.append(_views(opt) if overlap and not release else None)
            opt.step()
            seen = seen or caught(opt.zero_grad)
            if seen:
                opt.zero_grad(set_to_none=False)
        out[case] = (seen, views, params(model))
    return out, oracle()[0]


def _views(opt):
    """Whether every grad of `opt`'s fused buffers is its slot's view."""
    return all(p.grad is not None and p.grad.data_ptr() == b._slot(p).data_ptr()
               for b in opt.comm_buffers for p in b.params)


def _grads_seen(model, opt):
    """[(param index, start, grad)] of what this rank steps: v1 whole grads, v2 its slices."""
    stepped = {id(p) for g in opt.param_groups for p in g["params"]}
    seen = []
    if not hasattr(opt, "_slice_params"):  # v1
        for i, p in enumerate(model.parameters()):
            if id(p) in stepped:
                seen.append((i, None, p.grad.clone()))
        return seen
    slices = local_slices(opt)  # per param: (start in it, length) or None
    for i, p in enumerate(model.parameters()):
        piece = opt._slice_params[p]
        if id(piece) in stepped and piece.grad is not None:
            start, length = slices[p]
            seen.append((i, start, piece.grad[:length].clone()))
    return seen


def grads_final(rank: int, world: int) -> tuple[dict, tuple]:
    """The grads a step pre-hook or finish_grad_sync() sees, own overlap. -> ({case: (per
    step _grads_seen, per step kept bitwise by step(), params)}, one process's (grads, params))"""
    out = {}
    for case, (version, release, acc, how) in cases(
            ("v", (1, 2)), ("release", (False, True)), ("acc", (1, 2)),
            ("how", ("hook", "finish"))):
        model, opt = sharded(world, version, True, acc, release)
        seen, kept = [], []
        if how == "hook":
            opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(
                _grads_seen(model, opt)))
        for step in range(STEPS):
            backward(model, rank, world, step, acc)
            if how == "finish":
                opt.finish_grad_sync()
                seen.append(_grads_seen(model, opt))
            opt.step()
            if how == "finish":
                after = _grads_seen(model, opt)
                kept.append(len(after) == len(seen[-1]) > 0 and all(
                    torch.equal(a[2], b[2]) for a, b in zip(after, seen[-1])))
            clear(opt, release)
        out[case] = (seen, kept, params(model))
    grads = []
    return out, (grads, oracle(grads=grads)[0])


# ---------------------------------------------------------------- the bare buffer

def wrong_group(rank: int, world: int) -> dict:
    """A bare buffer built with comm_group=None over stages of other shapes or dtype, then
    with each stage's group. -> {case: (error, params, one process's)}"""
    stage, out = rank // 2, {}
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    for case, (kind, release) in cases(("kind", ("shapes", "dtype")),
                                       ("release", (False, True))):
        shape = (8, 6) if stage == 1 and kind == "shapes" else (6, 8)
        dtype = torch.bfloat16 if stage == 1 and kind == "dtype" else torch.float32
        torch.manual_seed(0)
        layer = nn.Linear(*shape).to(dtype)
        seen = caught(FusedCommBuffer, 0, list(layer.parameters()), None, 1,
                      HOOK_ACTION.ALL_REDUCE, release_grads=release)
        buffers = hooked(layer.parameters(), groups[stage], 1, release)
        opt = torch.optim.SGD(layer.parameters(), lr=0.1)
        x, y = _data(stage, 8, *shape)
        F.mse_loss(layer(x.chunk(2)[rank % 2].to(dtype)).float(), y.chunk(2)[rank % 2]).backward()
        for buffer in buffers:
            buffer.scale_grads()
        opt.step()
        out[case] = (seen, params(layer), _mean_step(shape, dtype, x, y))
    return out


def _mean_step(shape, dtype, x, y):
    """One process: one SGD(0.1) step of Linear(*shape) on the two replicas' mean grad."""
    torch.manual_seed(0)
    one = nn.Linear(*shape).to(dtype)
    grads = []
    for xr, yr in zip(x.chunk(2), y.chunk(2)):
        loss = F.mse_loss(one(xr.to(dtype)).float(), yr)
        grads.append(torch.autograd.grad(loss, list(one.parameters())))
    with torch.no_grad():
        for p, a, b in zip(one.parameters(), *grads):
            if dtype == torch.float32:
                p.add_((a + b) * 0.5, alpha=-0.1)
            else:
                p.add_(a * 0.5 + b * 0.5, alpha=-0.1)
    return params(one)


def acc_steps_message(rank: int, world: int) -> dict:
    """A bare buffer with acc_steps=1 under 4 micro-batches. -> {release: error}"""
    out = {}
    for release in (False, True):
        model = _mlp(SIZES)
        buffers = hooked(model.parameters(), None, 1, release)
        out[release] = caught(backward, model, rank, world, 0, 4)
        for buffer in buffers:  # wait for the first micro-batch's all-reduce (and refuse)
            caught(buffer.scale_grads)
    return out


# ---------------------------------------------------------------- under the pipeline

class Expert(nn.Module):
    """`x + expert(x)` while `active` (some token routed to it), else `x`: no grad reaches it."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.expert, self.active = nn.Linear(d, d), True

    def forward(self, x):
        return x + self.expert(x) if self.active else x


def _moe_layers():
    torch.manual_seed(0)  # 4 layers: stage 0 [Linear, Tanh], stage 1 [Expert, Linear]
    return [nn.Linear(6, 8), nn.Tanh(), Expert(8), nn.Linear(8, 4)]


def _bn_layers():
    torch.manual_seed(0)  # 4 layers: stage 0 [Linear, BatchNorm1d], stage 1 [Tanh, Linear]
    return [nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 4)]


def _pipeline(world, release, layers, steps, make_opt, before_step=lambda step: None):
    """pp 2 (x dp 2 on 4 ranks), acc 2: `steps` train_batch calls. -> (model, batch, first index)"""
    st = _strategy(dp=world // 2, pp=2, acc=2, release=release)
    hcg = HybridCommunicateGroup(st)
    model = PipelineParallel(layers, hcg, st, _mse)
    opt, replica = make_opt(model.parameters()), hcg.get_data_parallel_rank()

    def batch(step):
        return [t.chunk(world // 2)[replica] for t in _data(step, world // 2 * 4, 6, 4)]

    for step in steps:
        before_step(step)
        model.train_batch(batch(step), opt)
    first = sum(len(list(m.parameters())) for m in layers[: 2 * model.stage_id])
    return model, batch, first


def _one_process(layers, steps, rows, make_opt, before_step=lambda step: None):
    model = nn.Sequential(*layers)
    opt = make_opt(model.parameters())
    for step in steps:
        before_step(step)
        x, y = _data(step, rows, 6, 4)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return params(model)


def _routed(layers):
    """`before_step` for _moe_layers: the expert gets tokens only when step % 2 == 0."""
    return lambda step: setattr(layers[2], "active", step % 2 == 0)


def moe_expert(rank: int, world: int) -> tuple[dict, list]:
    """pp 2 (x dp 2), AdamW: stage 1's expert gets tokens in even steps only.
    -> ({release: this stage's params}, one process's)"""
    adamw, out = (lambda ps: torch.optim.AdamW(ps, lr=LR)), {}
    for release in (False, True):
        layers = _moe_layers()
        model, _, first = _pipeline(world, release, layers, range(4), adamw, _routed(layers))
        out[release] = params(model)
    layers = _moe_layers()
    want = _one_process(layers, range(4), world // 2 * 4, adamw, _routed(layers))
    return out, want[first: first + len(out[True])]


def frozen_batchnorm(rank: int, world: int) -> tuple[dict, list]:
    """pp 2, SGD: a BatchNorm1d set to eval(), then train_batch and eval_batch.
    -> ({release: ([(training, bn.training)], stats changed, params)}, one process's)"""
    sgd, out = (lambda ps: torch.optim.SGD(ps, lr=0.1)), {}
    for release in (False, True):
        layers = _bn_layers()
        bn, stats = layers[1], [b.clone() for b in layers[1].buffers()]
        bn.eval()  # frozen statistics: what the pipeline must leave as set
        model, batch, first = _pipeline(world, release, layers, range(3), sgd)
        modes = [(model.training, bn.training)]
        for evaluate in (lambda: None, model.eval):
            evaluate()
            model.eval_batch(batch(3))
            modes.append((model.training, bn.training))
        out[release] = (modes, not all(map(torch.equal, stats, bn.buffers())), params(model))
    layers = _bn_layers()
    layers[1].eval()
    want = _one_process(layers, range(3), 4, sgd)
    return out, want[first: first + len(out[True][2])]
