"""Weights tied across pipeline stages: Paddle's SharedLayerDesc for `PipelineParallel`.

Mirrors `SharedLayerDesc`, `_construct_shared_comm`, `_synchronize_shared_weights` and
`allreduce_shared_weight_gradients` of `PipelineLayer`
(`python/paddle/distributed/fleet/meta_parallel/parallel_layers/pp_layers.py`) and their call
at the end of `PipelineParallel.forward_backward_pipeline` (`pipeline_parallel.py`).

A tied weight (typically the token embedding on the first stage and the LM head on the last)
is one param per holding stage. At build, a process group per tie joins the ranks of its
stages at each dp / sharding position (every rank creates every group, in one order), and the
weight is broadcast from its first holder, so the copies start equal. After the schedule the
copies' grads are all-reduced (SUM) over that group, so each copy steps on the full grad, and
the copies stay equal. Later copies get `is_firstly_shared = False` (Paddle's flag), so the
global-norm clip counts the weight once.

Order with comm overlap (the hazard): the overlap hooks fire a bucket's dp all-reduce or
sharding reduce / reduce-scatter during the last backward. If a tied copy's bucket fired
before the pipe sum, each stage would reduce only its own part, and (with v1 owners or v2
offsets that differ between the stages) the later sum would mix reduced and unreduced pieces.
So a bucket holding a tied copy only checks in from backward (`add_grad(use_comm=False)`);
after the schedule the copies are summed over their groups, then the held buckets fire, then
every bucket is waited and scaled. Without overlap the sum runs before the optimizer's own
reduce. Both orders put the full grad in front of the sharding / dp collective.
Phases: build (groups, broadcast) -> backward (held check-ins) -> sum -> fire held -> scale.

With virtual stages (`pipeline_schedules/interleave.py`) a rank's layers are not one range:
the pipeline passes a `placement` (layer -> holding stage and index), the rest is the same.

Leaves out: Paddle's `forward_func` (a holder's own forward: here each layer is a module whose
forward is its own), shared layers (here: shared params).

References: Paddle's pp_layers.py (`SharedLayerDesc`); Press & Wolf, "Using the Output
Embedding to Improve Language Models" (2017).
"""

import torch
import torch.distributed as dist

from comm_buffer import agree, main_grad_or_grad as _grad



def _split_name(name, n_layers):
    index, _, rest = name.partition(".")
    if not (index.isdigit() and int(index) < n_layers and rest):
        raise ValueError(f"a shared_weights name is '<layer index>.<param name>' as in "
                         f"nn.Sequential(*layers).named_parameters(), index < {n_layers}; "
                         f"got {name!r}, e.g. '0.weight'")
    return int(index), rest


class SharedWeights:
    """The ties of one `PipelineParallel` stage: groups, broadcast at build, grad sum.

    Args:
        layers: this stage's nn.Sequential (a same-stage tie rebinds its later names to the
            first name's Parameter).
        hcg: the topology; read: `get_stage_id()`, `get_pipe_parallel_{group,world_size}()`,
            `get_rank_from_stage(s)`.
        shared_weights: None or a list of ties; a tie is a tuple of >= 2 names
            `'<layer index>.<param name>'` in the whole layer list, as
            `nn.Sequential(*layers).named_parameters()` spells them (e.g.
            `("0.tok.weight", "5.proj.weight")`), each a trainable param of the same shape and
            dtype. Names on one stage become one Parameter (the first's); names on several
            stages are summed over those stages' ranks.
        bounds: the stage boundaries in the layer list (stage s holds `[b[s], b[s+1])`).
        device: the device of the collectives.
        placement: None, or `placement(i) -> (stage, index in layers)` for layer i of the whole
            list, where the stages do not hold contiguous ranges (virtual stages:
            `layers` is then all of this rank's chunks in one nn.Sequential).
    Raises ValueError (on every rank, before the groups are built) for a malformed tie, a
    name that is no trainable param of its layer, or copies of different shape / dtype;
    TypeError for a tie that is not a tuple / list of str.
    """

    def __init__(self, layers, hcg, shared_weights, bounds, device, placement=None):
        self._comm = []  # (param, group) of the ties this stage holds across stages
        self._tied = set()  # this stage's tied params, by identity
        if placement is None:
            def placement(i):
                s = max(s for s in range(len(bounds) - 1) if bounds[s] <= i)
                return s, i - bounds[s]
        ties = self._parse(shared_weights or [], bounds[-1], placement)
        # Rank-independent (from the argument and the layout): some tie spans stages, so
        # every stage's schedule ends with a pipe sum, whether or not it holds a copy.
        self.across_stages = any(len({s for _, _, s in names}) > 1 for names in ties)
        if not ties:
            return
        stage = hcg.get_stage_id()
        local = {}  # tie index -> this stage's param
        for t, names in enumerate(ties):
            mine = [(i, rest) for i, rest, s in names if s == stage]
            params = [self._lookup(layers, placement(i)[1], rest) for i, rest in mine]
            if params and all(p is not None for p in params):
                for i, rest in mine[1:]:  # same stage: one Parameter
                    self._set(layers[placement(i)[1]], rest, params[0])
                local[t] = params[0]
            elif params:
                local[t] = None  # reported below, on every rank
        self._check_agreed(ties, local, hcg, device)
        self._build_groups(ties, local, hcg, stage, device)

    @staticmethod
    def _parse(shared_weights, n_layers, placement):
        if isinstance(shared_weights, (str, tuple)) or not isinstance(shared_weights, list):
            raise TypeError("shared_weights must be a list of ties, each a tuple of names, e.g. "
                            f"[('0.weight', '5.weight')]; got {shared_weights!r}")
        ties, seen = [], set()
        for tie in shared_weights:
            if not isinstance(tie, (tuple, list)) or not all(isinstance(n, str) for n in tie):
                raise TypeError(f"a tie is a tuple of names (str); got {tie!r}")
            if len(tie) < 2 or len(set(tie)) != len(tie) or seen & set(tie):
                raise ValueError(f"a tie names >= 2 distinct params, each in one tie only; got "
                                 f"{tie!r}")
            seen |= set(tie)
            names = []
            for name in tie:
                i, rest = _split_name(name, n_layers)
                names.append((i, rest, placement(i)[0]))
            ties.append(sorted(names, key=lambda n: n[2]))  # first holder first
        return ties

    @staticmethod
    def _lookup(layers, index, name):
        try:
            p = layers[index].get_parameter(name)
        except AttributeError:
            return None
        return p if p.requires_grad else None

    @staticmethod
    def _set(layer, name, param):
        module_name, _, attr = name.rpartition(".")
        setattr(layer.get_submodule(module_name) if module_name else layer, attr, param)

    def _check_agreed(self, ties, local, hcg, device):
        """Agree over the pipe (`comm_buffer.agree`): the same error everywhere for a missing
        param or copies that differ in dtype (an itemsize and float flag) or shape."""
        problems, same = [], []
        for t, names in enumerate(ties):
            spelled = [f"{i}.{rest}" for i, rest, _ in names]
            p = local.get(t)
            problems.append((f"shared_weights {spelled}: a name is not a trainable param of "
                             "its layer; spell it as nn.Sequential(*layers).named_parameters() "
                             "does", "not found" if t in local and p is None else None))
            meta = None if p is None else (p.dtype.itemsize, p.dtype.is_floating_point, *p.shape)
            same.append((f"shared_weights {spelled}: the copies' (itemsize, float, shape)", meta))
        agree([hcg.get_pipe_parallel_group()], problems, same, device=device)

    def _build_groups(self, ties, local, hcg, stage, device):
        """One group per tie spanning stages, per pipe, created by every rank in one order;
        then the broadcast from the first holder."""
        if all(len({s for _, _, s in names}) < 2 for names in ties):
            return
        pp = hcg.get_pipe_parallel_world_size()
        mine = torch.tensor([hcg.get_rank_from_stage(s) for s in range(pp)], device=device)
        pipes = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(pipes, mine)  # every pipe of the job, the same list on every rank
        pipes = sorted({tuple(p.tolist()) for p in pipes})
        me = dist.get_rank()
        for t, names in enumerate(ties):
            stages = sorted({s for _, _, s in names})
            if len(stages) < 2:
                continue  # one stage: one Parameter already, nothing to sum
            for pipe in pipes:
                ranks = [pipe[s] for s in stages]
                group = dist.new_group(ranks)
                if me in ranks:
                    param = local[t]
                    with torch.no_grad():
                        dist.broadcast(param.detach(), src=ranks[0], group=group)
                    if stage != stages[0]:
                        param.is_firstly_shared = False  # the clip counts the first copy only
                    self._comm.append((param, group))
                    self._tied.add(param)

    def __bool__(self):
        """True if this stage holds a copy of a weight tied across stages."""
        return bool(self._comm)

    def holds(self, bucket):
        """True if `bucket` (a list of params) holds a copy tied across stages: its bucket's
        collective waits for the tie sum (the pipeline's scheduler holds it back)."""
        return bool(self._comm) and any(p in self._tied for p in bucket)

    @torch.no_grad()
    def allreduce_shared_weight_gradients(self):
        """Sum each tied copy's grad (main_grad if set) over its group. A copy without a grad
        (unused on this stage) joins with zeros and then steps on the others' grad. The
        pipeline then fires the held buckets."""
        for param, group in self._comm:
            grad = _grad(param)
            if grad is None:
                main = hasattr(param, "main_grad")
                grad = torch.zeros_like(param, dtype=torch.float32 if main else param.dtype)
                setattr(param, "main_grad" if main else "grad", grad)
            dist.all_reduce(grad, group=group)
