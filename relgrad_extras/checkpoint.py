"""Consolidate and re-shard the optimizer state of sharding v1 / v2 (torch ZeRO's checkpoints).

Mirrors torch's `ZeroRedundancyOptimizer.consolidate_state_dict` / `load_state_dict` for the
optimizers of `sharding.py`; the wrappers (v1, v2, `MixPrecisionOptimizer`) import this module
at the call (`state_dict`, `consolidate_state_dict`, `load_state_dict`) and run torch's state
dict hooks here. A per-rank `state_dict()` of v1 / v2 is this rank's shard tagged with its
layout (`local_state_dict`), and loads only into the same layout. Paddle re-shards at the
trainer level instead (PaddleNLP's `trainer/utils/sharding_io.py` and `reshard/`:
`merge_opt_state` / `split_opt_state`, keyed by param name); here it lives on the optimizer,
as in torch, and params are keyed by index.

The consolidated state is torch's own `Optimizer.state_dict()` format for the whole optimizer,
as if one process had trained: `"state"` keyed by the param's index in the optimizer's param
list (group order), every per-element tensor (Adam's `exp_avg`, `exp_avg_sq`) of the param's
full shape and no padding, scalars (`step`) as they are; `"param_groups"` with the hyper-
parameters (lr, ...) and `"params"` index lists; and, beyond torch, `"master_weights"` {index:
fp32 tensor of the param's shape} for params with an fp32 master (bf16 params under
MixPrecisionOptimizer). A plain torch optimizer over the same params loads it (torch ignores
`"master_weights"`), and so does a v1 / v2 of any sharding degree, which keeps what it owns.

Worked example, v2 over fp32 params of 480, 24, 96 and 4 elements (unit 64 * degree elements):
on 2 ranks they pad to 512, 128, 128, 128 (shard 448), so rank 0 holds elements 0..447 of the
first and rank 1 holds 448..479 plus 32 padding elements; on 3 ranks they pad to 576, 192, 192,
192 (shard 384): rank 0 holds 0..383, rank 1 holds 384..479 plus 96 padding. Consolidating the
2-rank state concatenates 448 + 32 elements; loading it on 3 ranks cuts 384 and 96 and fills the
padding with zeros (what padding holds in training: its grads are always zero).

Phases: consolidate: collect this rank's pieces -> gather on rank `to` -> reassemble. Load:
agree on the param groups and on any problem (small all-gathers) -> cut this rank's pieces ->
copy them into the inner optimizer in place (its `param_groups` / `state` objects stay). Loading
allocates no grad or grad buffer. Leaves out: optimizers whose state tensors are neither scalars
nor param-shaped (e.g. Adafactor's factored moments) under v2 (v1 copies them whole); the saved
state of a param that was frozen when v2 was built (it has no slice; it is not loaded); changing
the pipeline degree (each stage's optimizer numbers its own params).
"""
import copy

import torch
import torch.distributed as dist

from comm_buffer import agree, global_rank

LAYOUT_KEY = "sharding_layout"  # tags a per-rank state_dict() with the layout it fits


# ---------------------------------------------------------------- what this rank holds

def _is_v2(opt):
    return opt._is_v2


def _targets(opt):
    """The tensors the inner optimizer steps, in its param order (v1 params, v2 slices)."""
    return opt._inner_opt._targets


def _masters(opt):
    """target -> fp32 master, for the targets that have one (MixPrecisionOptimizer's)."""
    return opt._inner_opt._masters


def _torch_opt(opt):
    """The torch optimizer that steps (over the masters or the fp32 targets)."""
    return opt._inner_opt._inner_opt


def _layout_known(opt):
    """v2 knows its slices once it has its buffers (under pp overlap: the pipeline's)."""
    return not opt._is_v2 or bool(opt._comm_buffer_list)


def _target_index(opt):
    """target -> index of its param in the optimizer's param list (for every target)."""
    index = {p: i for i, p in enumerate(opt._parameter_list)}
    return {opt._slice_params[p]: i for p, i in index.items()} if opt._is_v2 else index


def _local_pieces(opt):
    """{param index: (target, lo, real, view)} for each param this rank steps elements of:
    `lo` the target's first element in the flattened param, `real` how many of the target's
    elements are the param's (the rest, v2 only, is padding), `view` v2's ShardingGradView."""
    pieces = {}
    if opt._is_v2:
        views = {p: v for b in opt._comm_buffer_list
                 for p, v in b._sharding_param_grad_view.items()}
        for i, p in enumerate(opt._parameter_list):
            view = views.get(p)  # None: frozen at construction, never stepped
            if view is not None and view._has_local:
                real = view._local_end - view._param_begin
                pieces[i] = (opt._slice_params[p], view._param_begin - view._index, real, view)
    else:
        for i, p in enumerate(opt._parameter_list):
            if opt._param2rank[p] == opt._rank:
                pieces[i] = (p, 0, p.numel(), None)
    return pieces


def _local_groups(opt):
    """Per inner param group: the param indices of its targets (v1: owned only)."""
    index, targets, groups, start = _target_index(opt), _targets(opt), [], 0
    for group in _torch_opt(opt).param_groups:
        groups.append([index[t] for t in targets[start : start + len(group["params"])]])
        start += len(group["params"])
    return groups


def _full_groups(opt):
    """Per param group, all its param indices: the union over the sharding group (v1 ranks
    each know only their own params). A collective over the sharding group."""
    gathered = [None] * dist.get_world_size(opt._group)
    dist.all_gather_object(gathered, _local_groups(opt), group=opt._group)
    return [sorted(set().union(*(rank_groups[g] for rank_groups in gathered)))
            for g in range(len(gathered[0]))]

# ---------------------------------------------------------------- consolidate

def _trim(value, target, real):
    """A state value as sent to rank `to`: per-element tensors without padding, on CPU."""
    if isinstance(value, torch.Tensor):
        if value.dim() >= 1 and value.shape == target.shape:
            return ("elements", value.detach().reshape(-1)[:real].cpu().clone())
        return ("whole", value.detach().cpu().clone())
    return ("whole", copy.deepcopy(value))


def consolidate(opt, to):
    """`consolidate_state_dict`'s work; see `sharding._Sharding.consolidate_state_dict`."""
    if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < opt._nranks:
        raise ValueError(f"consolidate_state_dict(to={to!r}): `to` is the sharding rank that "
                         f"receives the state, an int in [0, {opt._nranks}); pass e.g. to=0")
    groups = _full_groups(opt)
    if getattr(opt, "_pending_state", None) is not None:  # loaded before v2's buffers
        return pending_full(opt) if opt._rank == to else None
    # collect this rank's pieces
    inner, masters = _torch_opt(opt), _masters(opt)
    state, master_pieces = {}, {}
    for i, (target, lo, real, _) in _local_pieces(opt).items():
        master = masters.get(target)
        entries = inner.state.get(target if master is None else master)
        if entries:
            state[i] = (lo, real, {k: _trim(v, target, real) for k, v in entries.items()})
        if master is not None and master.shape == target.shape:  # v2: filled at a step
            master_pieces[i] = (lo, real, _trim(master, target, real)[1])
    hyper = [{k: copy.deepcopy(v) for k, v in g.items() if k not in ("params", "param_names")}
             for g in inner.param_groups]
    # gather on rank `to`
    gathered = [None] * opt._nranks if opt._rank == to else None
    dist.gather_object((state, master_pieces), gathered, dst=global_rank(opt._group, to),
                       group=opt._group)
    if opt._rank != to:
        return None
    # reassemble
    params = opt._parameter_list
    full_state, full_masters, covered = {}, {}, {}
    for rank_state, rank_masters in gathered:
        for i, (lo, real, entries) in rank_state.items():
            slot = full_state.setdefault(i, {})
            for k, (kind, v) in entries.items():
                if kind == "elements":
                    _paste(slot, k, v, lo, real, params[i].numel())
                    covered[i, k] = covered.get((i, k), 0) + real
                else:
                    slot.setdefault(k, v)
        for i, (lo, real, v) in rank_masters.items():
            _paste(full_masters, i, v, lo, real, params[i].numel())
            covered[i, "master"] = covered.get((i, "master"), 0) + real
    for (i, _), n in covered.items():
        assert n == params[i].numel(), f"param #{i}: {n} of {params[i].numel()} elements"
    for i, slot in full_state.items():
        for k, v in slot.items():
            if covered.get((i, k)):
                slot[k] = v.view(params[i].shape)
    result = {"state": dict(sorted(full_state.items())),
              "param_groups": [{**h, "params": g} for h, g in zip(hyper, groups)]}
    if full_masters:
        result["master_weights"] = {i: full_masters[i].view(params[i].shape)
                                    for i in sorted(full_masters)}
    return result


def pending_full(opt):
    """The consolidated state loaded before the pipeline built v2's buffers (not stepped
    since), with the hyper-parameters as they are now: what `consolidate` returns then,
    and what `state_dict()` returns on every rank then (a per-rank state has no slices yet
    to hold it; this one loads into any layout)."""
    result = copy.deepcopy(opt._pending_state)
    for saved, group in zip(result["param_groups"], _torch_opt(opt).param_groups):
        saved.update({k: copy.deepcopy(v) for k, v in group.items()
                      if k not in ("params", "param_names")})
    return result


def _paste(slots, key, piece, lo, real, numel):
    if key not in slots:
        slots[key] = torch.empty(numel, dtype=piece.dtype)
    slots[key][lo : lo + real] = piece


# ---------------------------------------------------------------- load

def load(opt, state_dict):
    """`load_state_dict` of a consolidated (or plain torch) state: checked on every rank
    (the same ValueError everywhere if any rank's dict does not fit), then loaded."""
    groups = _full_groups(opt)
    try:
        problem = check_full(opt, state_dict, groups)
    except Exception as error:  # noqa: BLE001 (a malformed dict: raised on every rank)
        problem = f"could not read it ({type(error).__name__}: {error})"
    agree(opt._flag_groups(), [("load_state_dict refused a consolidated state", problem)],
          device=opt._flags_device())
    load_full(opt, state_dict, groups)


def load_full(opt, state_dict, groups):
    """Load a consolidated (or plain torch) state, checked on every rank by `check_full`.

    Cuts this rank's pieces now, or, for v2 under the pipeline's comm overlap before its first
    train_batch (no slices yet), keeps the dict and cuts it once the buffers exist
    (`apply_pending`). The hyper-parameters go into `param_groups` at once either way, so an
    LR scheduler built right after the load reads the saved lr and `initial_lr`.
    """
    if _layout_known(opt):
        _apply_full(opt, state_dict, groups)
    else:
        _apply_hyper(opt, state_dict)
        opt._pending_state = copy.deepcopy(state_dict)


def _apply_hyper(opt, state_dict):
    """Copy the saved hyper-parameters (all but the param lists) into the inner groups."""
    for group, saved in zip(_torch_opt(opt).param_groups, state_dict["param_groups"]):
        for k, v in saved.items():
            if k not in ("params", "param_names"):
                group[k] = copy.deepcopy(v)


def apply_pending(opt):
    """Cut a consolidated state loaded before v2's buffers existed (called once they do)."""
    pending = getattr(opt, "_pending_state", None)
    if pending is not None:
        opt._pending_state = None
        # the groups were checked against this optimizer at load; v2 knows them locally.
        # The hyper-parameters went in at load: what was set since (an LR scheduler built
        # or stepped before the first train_batch) stays.
        _apply_full(opt, pending, _local_groups(opt), hyper=False)


def check_full(opt, state_dict, groups):
    """The problem (a string) with loading a consolidated `state_dict` into `opt`, or None.
    `state_dict` has the keys "state" and "param_groups" (the core checked that)."""
    saved = state_dict["param_groups"]
    sizes, saved_sizes = [len(g) for g in groups], [len(g["params"]) for g in saved]
    if sizes != saved_sizes:
        return (f"load_state_dict: the consolidated state has param groups of {saved_sizes} "
                f"params, this optimizer {sizes}: it was saved from another model or "
                "optimizer; build the optimizer over the same params and groups")
    params, ids = opt._parameter_list, _id_map(state_dict, groups)
    for key in list(state_dict["state"]) + list(state_dict.get("master_weights", {})):
        if key not in ids:
            return (f"load_state_dict: the consolidated state has state for param id {key!r}, "
                    "which no param group lists; the dict is damaged")
    tensors = [(ids[k], name, v) for k, entries in state_dict["state"].items()
               for name, v in entries.items()]
    tensors += [(ids[k], "master_weights", v)
                for k, v in state_dict.get("master_weights", {}).items()]
    for i, name, v in tensors:
        if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape == params[i].shape:
            continue
        if _is_v2(opt) or name == "master_weights":
            return (f"load_state_dict: {name!r} of param #{i} has shape {tuple(v.shape)}, the "
                    f"param {tuple(params[i].shape)}: sharding v2 re-shards only scalars and "
                    "param-shaped state; it was saved from another model, or use v1")
    return None


def _id_map(state_dict, groups):
    """Saved param id -> param index, by position in the groups (as torch maps them)."""
    saved = [k for g in state_dict["param_groups"] for k in g["params"]]
    return dict(zip(saved, [i for g in groups for i in g]))


def _cut(value, lo, real, target):
    """This rank's piece of a param-shaped tensor: elements lo..lo+real, zero padding after."""
    flat = value.detach().reshape(-1)[lo : lo + real]
    if target.numel() > real:  # v2 padding
        flat = torch.cat([flat, flat.new_zeros(target.numel() - real)])
    return flat.view(target.shape)


def _is_param_shaped(value, piece):
    target, view = piece[0], piece[3]  # v2: the view knows the whole param; v1: the target
    return value.shape == (view._param.shape if view is not None else target.shape)


def _place(value, name, piece, key_param, group):
    """A saved state value as the inner optimizer holds it (torch's casting rules)."""
    target, lo, real, _ = piece
    if not isinstance(value, torch.Tensor):
        return copy.deepcopy(value)
    if name == "step":  # torch keeps `step` as saved, unless the group is fused / capturable
        if group.get("fused") or group.get("capturable"):
            return value.to(dtype=torch.float32, device=key_param.device, copy=True)
        return value.detach().clone()
    if value.dim() >= 1 and _is_param_shaped(value, piece):
        value = _cut(value, lo, real, target)
    dtype = key_param.dtype if key_param.is_floating_point() else value.dtype
    return value.to(dtype=dtype, device=key_param.device, copy=True)


def _apply_full(opt, state_dict, groups, hyper=True):
    ids = _id_map(state_dict, groups)
    by_index = {ids[k]: v for k, v in state_dict["state"].items()}
    saved_masters = {ids[k]: v for k, v in state_dict.get("master_weights", {}).items()}
    inner, masters, pieces = _torch_opt(opt), _masters(opt), _local_pieces(opt)
    index, targets, start = _target_index(opt), _targets(opt), 0
    inner.state.clear()
    if hyper:
        _apply_hyper(opt, state_dict)
    for group in inner.param_groups:
        for target in targets[start : start + len(group["params"])]:
            i = index[target]
            if i not in pieces:
                continue
            piece = pieces[i]
            if piece[3] is not None:  # v2: make the slice param its view (no allocation)
                piece[3].fill_slice_param(target)
            master = masters.get(target)
            if master is not None:
                saved_master = saved_masters.get(i)
                master.data = (target.detach().float() if saved_master is None else
                               _cut(saved_master, piece[1], piece[2], target).float().clone())
            key = target if master is None else master
            if by_index.get(i):
                inner.state[key] = {name: _place(v, name, piece, key, group)
                                    for name, v in by_index[i].items()}
        start += len(group["params"])


# ---------------------------------------------------------------- through torch's hooks

def state_dict(opt):
    """`opt.state_dict()` of a wrapper: v1 / v2's `local_state_dict`, MixPrecisionOptimizer's
    inner state and fp32 masters; torch's pre / post hooks around it."""
    for hook in opt._optimizer_state_dict_pre_hooks.values():
        hook(opt)
    if hasattr(opt, "_is_v2"):
        state = local_state_dict(opt)
    else:
        state = {"inner": opt._inner_opt.state_dict(),
                 "masters": [m.clone() for m in opt._masters.values()]}
    for hook in opt._optimizer_state_dict_post_hooks.values():
        state = hook(opt, state) or state
    return state


def load_state_dict(opt, state_dict):
    """`opt.load_state_dict(state_dict)` of a wrapper, through torch's hooks (v1 / v2:
    `load_state`, collective; MixPrecisionOptimizer: its own state or a plain torch one)."""
    sharded = hasattr(opt, "_is_v2")
    if sharded and not isinstance(state_dict, dict):  # None off rank `to`: every rank raises
        return load_state(opt, state_dict)
    state_dict = state_dict.copy()
    for hook in opt._optimizer_load_state_dict_pre_hooks.values():
        state_dict = hook(opt, state_dict) or state_dict
    if sharded:
        load_state(opt, state_dict)
    elif "inner" not in state_dict:  # a plain torch optimizer's state_dict(), same params
        opt._inner_opt.load_state_dict(state_dict)
    else:
        opt._inner_opt.load_state_dict(state_dict["inner"])
        for master, saved in zip(opt._masters.values(), state_dict["masters"]):
            master.data = saved.clone()
    for hook in opt._optimizer_load_state_dict_post_hooks.values():
        hook(opt)


def load_state(opt, state_dict):
    """`opt.load_state_dict`: this rank's `state_dict()` (the same layout only) or a
    consolidated / plain torch one; refused on every rank alike if it does not fit."""
    own = isinstance(state_dict, dict) and LAYOUT_KEY in state_dict
    problem = _load_problem(opt, state_dict, own)
    agree(opt._flag_groups(), [("load_state_dict refused", problem)],
          [("the kind of state dict (per-rank or consolidated)", int(own))],
          device=opt._flags_device())
    opt._pending_state = None
    if not own:
        load(opt, state_dict)  # checked on every rank there
        return
    inner = dict(state_dict)
    del inner[LAYOUT_KEY]
    opt._inner_opt.load_state_dict(inner)


def _load_problem(opt, state_dict, own):
    if own:
        return _layout_problem(opt, state_dict[LAYOUT_KEY])
    if state_dict is None:
        return ("load_state_dict got None: consolidate_state_dict(to) returns the state on "
                "sharding rank `to` only; pass that dict on every rank")
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        return ("load_state_dict takes this rank's state_dict() or a consolidated / plain "
                f"torch one (keys 'state', 'param_groups'); got {type(state_dict).__name__}")
    return None


def local_state_dict(opt):
    """`opt.state_dict()`: this rank's shard (the inner optimizer's state), tagged with its
    layout; a consolidated state loaded before v2's buffers is returned whole."""
    if getattr(opt, "_pending_state", None) is not None:
        return pending_full(opt)
    return {**opt._inner_opt.state_dict(), LAYOUT_KEY: layout(opt)}


def layout(opt):
    """What a per-rank state fits: the version, sharding degree and rank, the param shapes,
    and v1's owners or v2's slices (None before v2 has its buffers)."""
    found = {"version": 2 if opt._is_v2 else 1, "sharding_degree": opt._nranks,
             "sharding_rank": opt._rank, "shapes": [tuple(p.shape) for p in opt._parameter_list]}
    if not opt._is_v2:
        found["owners"] = [opt._param2rank[p] for p in opt._parameter_list]
    elif _layout_known(opt):
        pieces = local_slices(opt)
        found["slices"] = [pieces.get(p) for p in opt._parameter_list]
    else:
        found["slices"] = None  # under pipeline overlap, before the first train_batch
    return found


def local_slices(opt):
    """v2: param -> this rank's piece of it, `(offset, elements)` (None: none), every bucket."""
    pieces = {}
    for buffer in opt._comm_buffer_list:
        for param, view in buffer.grad_views.items():
            pieces[param] = view.piece()
    return pieces


def _layout_problem(opt, saved):
    diffs = []
    for key, here in layout(opt).items():
        unknown = key == "slices" and None in (saved.get(key), here)  # v2 before its buffers
        if saved.get(key) != here and not unknown:
            diffs.append(f"{key}: saved {str(saved.get(key))[:200]}, here {str(here)[:200]}")
    if not diffs:
        return None
    return ("a per-rank state_dict() loads only into the layout it was saved from; it "
            f"differs: {'; '.join(diffs)}. For another layout save "
            "opt.consolidate_state_dict(to=0) and load that dict on every rank")
