"""Rank-side checks of the interleaved schedule (relgrad_extras/interleave.py): its order by hand,
training equal to plain 1F1B and to one process, per-chunk buffers released, errors everywhere."""
import copy

import pytest
import torch
import torch.distributed as dist

from relgrad_extras.grad_clip import ClipGradByGlobalNorm
from pipeline import PipelineParallel
from relgrad_extras.interleave import PipelineParallelWithInterleave
from relgrad import HybridCommunicateGroup
from relgrad_checks.common import (OPTIMIZERS, PIPE_SIZES, _assert_bitwise, _assert_close_each,
                                   _assert_same_state, _data, _mse, _pipe_layers, _releases,
                                   _replica_batch, _same_on_all, _shard, _strategy)
from relgrad_checks.clipping import _clipped_oracle, _tied_layers, _tied_oracle
from relgrad_checks.pipe import _V1, _V2, _assert_like, _reference, _release_probe, _spy_collectives

# ---- the interleaved order for pp 2 x 2 virtual stages, written out by hand ----
# Read off the paper's Figure 4 rule (Narayanan et al. 2021): micro-batches go through chunk 0
# in groups of P=2, then the same group through chunk 1; backwards take the chunks in reverse.
# Warm-up: 2(P-s-1) + (V-1)P forwards, i.e. 4 on rank 0 and 2 on rank 1; then one forward,
# one backward; then the remaining backwards.
def _order(text):
    """[(F | B, micro-batch, virtual stage)] of "F0.0 F1.0 | ... | B3.0" (| between phases)."""
    entries = []
    for entry in text.split():
        if entry != "|":
            micro_batch, chunk = entry[1:].split(".")
            entries.append((entry[0], int(micro_batch), int(chunk)))
    return entries


ORDER = {  # accumulate_steps: [rank 0's, rank 1's], warm-up | steady 1F1B | cool-down
    4: [_order("F0.0 F1.0 F0.1 F1.1 | F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 |"
               " B2.1 B3.1 B2.0 B3.0"),
        _order("F0.0 F1.0 | F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 |"
               " B2.0 B3.0")],
    8: [_order("F0.0 F1.0 F0.1 F1.1 | F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 F4.0 B2.1"
               " F5.0 B3.1 F4.1 B2.0 F5.1 B3.0 F6.0 B4.1 F7.0 B5.1 F6.1 B4.0 F7.1 B5.0 |"
               " B6.1 B7.1 B6.0 B7.0"),
        _order("F0.0 F1.0 | F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1"
               " F4.0 B2.0 F5.0 B3.0 F4.1 B4.1 F5.1 B5.1 F6.0 B4.0 F7.0 B5.0 F6.1 B6.1"
               " F7.1 B7.1 | B6.0 B7.0")],
}
# Where each chunk's collective is issued (acc 4), by Paddle's rule: over the last P*V = 4
# backwards, count 1..4; chunk V-m fires at count m*P + stage, chunk 0 of stage 1 at count 4.
# Rank 0's last backwards B2.1 B3.1 B2.0 B3.0: chunk 1 at B3.1, chunk 0 at B3.0.
# Rank 1's last backwards B3.1 B2.0 B3.0 (count 2, 3, 4): chunk 1 at B2.0, chunk 0 at B3.0.
FIRES_AT = [{1: ("B", 3, 1), 0: ("B", 3, 0)}, {1: ("B", 2, 0), 0: ("B", 3, 0)}]


def _interleaved(strategy, hcg, layers=None, vpp=2, bounds=None):
    strategy = copy.deepcopy(strategy)
    strategy.pp_configs.num_virtual_pipeline_stages = vpp
    return PipelineParallelWithInterleave(layers or _pipe_layers(), hcg, strategy, _mse,
                                          bounds)


def schedule_and_errors(rank: int, world: int) -> None:
    """pp 2, 2 virtual stages: the order is the table, chunks and eval right; misuse."""
    torch.manual_seed(0)
    for acc in (4, 8):
        strategy = _strategy(pp=2, acc=acc)
        hcg = HybridCommunicateGroup(strategy)
        layers = _pipe_layers()
        model = _interleaved(strategy, hcg, layers)
        # 7 layers in 4 chunks: [0,1) [1,3) [3,5) [5,7); rank 0: chunks 0, 2; rank 1: 1, 3
        held = [[0], [3, 4]] if rank == 0 else [[1, 2], [5, 6]]
        assert [list(chunk) for chunk in model._layers] == [[layers[i] for i in c] for c in held]
        x, y = _data(0, 2 * acc, PIPE_SIZES[0], PIPE_SIZES[-1])
        model.forward_backward_pipeline((x, y))
        assert model.schedule_trace == ORDER[acc][rank], model.schedule_trace
        want = _mse(torch.nn.Sequential(*_pipe_layers())(x), y)
        torch.testing.assert_close(model.eval_batch((x, y)), want, rtol=1e-5, atol=1e-6)
        out = model.eval_batch((x, y), compute_loss=False)
        if rank == 1:
            torch.testing.assert_close(out, torch.nn.Sequential(*_pipe_layers())(x))
        else:
            assert out is None

    # accumulate_steps not a multiple of pp_degree: every rank raises before communicating
    hcg = HybridCommunicateGroup(_strategy(pp=2, acc=4))
    with pytest.raises(ValueError, match=r"multiple of pp_degree .* accumulate_steps=3, "
                                         r"pp_degree=2; use accumulate_steps=2 or 4"):
        _interleaved(_strategy(pp=2, acc=3), hcg)
    with pytest.raises(ValueError, match="num_virtual_pipeline_stages >= 2, got 1"):
        _interleaved(_strategy(pp=2, acc=4), hcg, vpp=1)
    with pytest.raises(ValueError,
                       match="num_virtual_pipeline_stages=2: build PipelineParallelWithInterleave"):
        PipelineParallel(_pipe_layers(), hcg, _strategy(pp=2, acc=4,
                                                        num_virtual_pipeline_stages=2), _mse)
    dist.barrier()  # both ranks got here: nobody is left in a receive


# ---- training: interleaved == plain 1F1B (bitwise) == one process; release on == off ----

def _tag_layers(dtype, main_grad):
    """The demo layers, each param tagged with its index in the whole model."""
    layers = _pipe_layers(dtype, main_grad)
    for i, p in enumerate(p for layer in layers for p in layer.parameters()):
        p.whole_model_index = i
    return layers


def _whole_model(model, hcg):
    """Every stage's params, gathered over the pipe and put in whole-model order."""
    mine = {p.whole_model_index: p.detach().clone() for p in model.parameters()}
    parts = [None] * hcg.get_pipe_parallel_world_size()
    dist.all_gather_object(parts, mine, group=hcg.get_pipe_parallel_group())
    merged = {k: v for part in parts for k, v in part.items()}
    return [merged[k] for k in sorted(merged)]


def _train(hcg, strategy, vpp, wrap, opt_name, dtype, main_grad, steps, mbs, probe=None,
           bounds=None, clip=None, keep=None):
    """Losses and whole-model params per step with `vpp` virtual stages; `keep` gets model, opt."""
    layers = _tag_layers(dtype, main_grad)
    if vpp == 1:
        model = PipelineParallel(layers, hcg, strategy, _mse)
    else:
        model = _interleaved(strategy, hcg, layers, vpp, bounds)
    opt = OPTIMIZERS[opt_name](model.parameters())
    if wrap:
        opt = wrap(opt, hcg, strategy)
    if keep is not None:
        keep.update(model=model, opt=opt)
    losses, traj = [], []
    for step in range(steps):
        x, y = _replica_batch(hcg, strategy, step, mbs, dtype)
        if probe:
            losses.append(probe(model, opt, (x, y)))
        else:
            losses.append(model.train_batch((x, y), opt, grad_clip=clip))
        traj.append(_whole_model(model, hcg))
    return losses, traj


def _check_case(hcg, base, wrap, opt_name="adam", dtype=torch.float32, main_grad=False,
                steps=2, mbs=2, bounds=None):
    """Release off and on: bitwise equal to plain 1F1B and per step like one process."""
    reference = _reference(hcg, base, opt_name, dtype, main_grad, steps, mbs)
    args = (wrap, opt_name, dtype, main_grad, steps, mbs)
    plain = _train(hcg, base, 1, *args)
    # the overlap cases are pp 2 x 4 micro-batches, whose firing table is FIRES_AT
    fires_at = FIRES_AT[hcg.get_stage_id()] if base.pp_degree == 2 else None
    overlap = base.pp_configs.sharding_comm_overlap or base.pp_configs.dp_comm_overlap
    runs = {}
    with _spy_collectives() as seen:
        for release, strategy in _releases(base):
            keep = {}
            runs[release] = _train(hcg, strategy, 2, *args, bounds=bounds, keep=keep,
                                   probe=_release_probe(seen, release, overlap, fires_at))
            if main_grad:  # this rank's fp32 masters and Adam's state too
                _assert_same_state(keep["opt"], reference[2],
                                   [p.whole_model_index for p in keep["model"].parameters()])
    assert sorted(runs) == [False, True] and len(plain[0]) == len(plain[1]) == steps
    for release, (losses, traj) in runs.items():
        _assert_bitwise(losses, plain[0], release)
        _assert_bitwise(traj, plain[1])
        _assert_like(reference, losses, traj, what=release)


def pp_only(rank: int, world: int) -> None:
    """pp 2, 2 virtual stages, 4 and 2 micro-batches, release off / on; then clipped."""
    for acc, opt_name, delay in ((4, "sgd", False), (4, "adam", False), (4, "sgd", True),
                                 (2, "sgd", False)):
        strategy = _strategy(pp=2, acc=acc, delay_scale_loss=delay)
        _check_case(HybridCommunicateGroup(strategy), strategy, None, opt_name)
    # the norm stays above clip_norm, where Paddle's coefficient clip / (norm + 1e-6) is
    # torch's; vpp 1 and 2 close, not bitwise: the norm's per-rank partial sums differ
    steps, clip = 3, 0.05
    want_norms, want = _clipped_oracle(torch.nn.Sequential(*_pipe_layers()), steps, clip,
                                       lambda step: _data(step, 4 * 2, 6, 4))
    assert len(want_norms) == steps and min(want_norms) > clip  # the clip is active
    strategy = _strategy(pp=2, acc=4)
    hcg = HybridCommunicateGroup(strategy)
    runs = []
    for vpp in (1, 2):
        grad_clip = _RecordingClip(clip)
        runs.append(_train(hcg, strategy, vpp, None, "sgd", torch.float32, False, steps, 2,
                           clip=grad_clip))
        _assert_close_each(grad_clip.norms, want_norms, rtol=1e-5, atol=0)
        _assert_close_each(runs[-1][1], want)
    (l1, t1), (l2, t2) = runs
    torch.testing.assert_close(l1, l2, rtol=1e-6, atol=0)
    _assert_close_each(t1, t2, rtol=1e-6, atol=1e-7)


class _RecordingClip(ClipGradByGlobalNorm):
    """ClipGradByGlobalNorm that keeps each call's global norm."""

    def __init__(self, clip_norm: float) -> None:
        super().__init__(clip_norm)
        self.norms = []

    def __call__(self, *args, **kwargs):
        out = super().__call__(*args, **kwargs)
        self.norms.append(self.global_norm.detach().clone())
        return out


def with_sharding_and_dp(rank: int, world: int) -> None:
    """2 virtual stages beside sharding v1 / v2 (main grads), dp 2, and on pp 4."""
    for version, overlap, main_grad in ((1, True, False), (1, False, False), (2, True, False),
                                        (2, False, False), (2, True, True)):
        strategy = _strategy(pp=2, sharding=2, acc=4, sharding_comm_overlap=overlap,
                             split_param=version == 2)
        hcg = HybridCommunicateGroup(strategy)
        _check_case(hcg, strategy, _V2 if version == 2 else _V1, "adam",
                    torch.bfloat16 if main_grad else torch.float32, main_grad)
    strategy = _strategy(dp=2, pp=2, acc=4, dp_comm_overlap=True)
    _check_case(HybridCommunicateGroup(strategy), strategy, None, "adam")
    # pp 4: distinct neighbours round the ring. The 4 Linears go one per rank in the first
    # lap; the second lap's chunks are empty (the identity), so activations still go round
    # twice, rank 3 -> rank 0 in between.
    for acc in (4, 8):
        strategy = _strategy(pp=4, acc=acc)
        _check_case(HybridCommunicateGroup(strategy), strategy, None, "sgd",
                    bounds=[0, 1, 3, 5, 7, 7, 7, 7, 7])


def tied_weights(rank: int, world: int, steps: int = 3, clip: float = 0.05) -> None:
    """pp 2 x sharding 2, 2 virtual stages: a tie of chunks 0 and 3 trains as one weight."""
    batch = 2 * 2 * 2  # replicas x micro-batches x samples
    oracle_norms, oracle = _tied_oracle(steps, clip, batch)
    for version, overlap in ((1, True), (2, True), (1, False)):
        strategy = _strategy(pp=2, sharding=2, acc=2, release=True, split_param=version == 2,
                             sharding_comm_overlap=overlap, num_virtual_pipeline_stages=2)
        hcg = HybridCommunicateGroup(strategy)
        stage, replica = hcg.get_stage_id(), hcg.get_sharding_parallel_rank()
        # 6 layers in 4 chunks [T] [tanh A] [B] [tanh T']: rank 0 holds T, B; rank 1 A, T'
        model = PipelineParallelWithInterleave(_tied_layers(), hcg, strategy, _mse,
                                               shared_weights=[("0.weight", "5.weight")])
        tied = model._layers[0][0].weight if stage == 0 else model._layers[1][1].weight
        assert getattr(tied, "is_firstly_shared", True) == (stage == 0)
        grad_clip = ClipGradByGlobalNorm(clip)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        opt = _shard(version, opt, hcg, strategy, grad_clip=grad_clip)
        for step in range(steps):
            x, y = (t.chunk(2)[replica] for t in _data(step, batch, 8, 8))
            model.train_batch((x, y), opt)
            assert _same_on_all([tied]), (version, overlap, step)
            torch.testing.assert_close(grad_clip.global_norm, oracle_norms[step],
                                       rtol=1e-5, atol=0)
            want = [oracle[step][i] for i in ((0, 3) if stage == 0 else (2, 5))]
            for got, w in zip(model.parameters(), want):
                torch.testing.assert_close(got.detach(), w, rtol=1e-5, atol=1e-6)
