"""World-size independent checkpoints of the sharding optimizers (sharding v1 / v2).

`sharding_state` gathers a sharded optimizer state into torch's one-process format and cuts
such a state into any sharding degree's shards; `ShardingCheckpoint` holds the methods sharding
v1 / v2 expose (`consolidate_state_dict`, `load_state_dict`, the per-rank `state_dict()`).
"""
from checkpoint import sharding_state


class ShardingCheckpoint:
    """The checkpoint methods of sharding v1 / v2 (mixed into `sharding._Sharding`, before
    `_Wrapper`, whose `state_dict` / `load_state_dict` run torch's hooks around these)."""

    def _local_state_dict(self):
        """This rank's shard of the state (fast; loads only into the same layout).

        The inner state plus `"sharding_layout"`: version, sharding degree and rank, param
        shapes and owners (v1) / slices (v2), so that `load_state_dict` can refuse another
        layout. `state_dict()` returns it through torch's hooks. For a checkpoint that loads
        into any sharding degree (or a plain torch optimizer), use `consolidate_state_dict`.
        """
        return {**super()._local_state_dict(),
                sharding_state.LAYOUT_KEY: sharding_state.layout(self)}

    def consolidate_state_dict(self, to=0):
        """Gather the whole optimizer state, in torch's one-process format, on sharding rank `to`.

        Collective over the sharding group: call it on every rank. Returns on rank `to` a dict
        like `torch.optim.Optimizer.state_dict()` of one optimizer over all params: `"state"`
        keyed by the param's index in the optimizer's param list, per-element tensors of the
        param's full shape (v2's slices joined, padding dropped), `step` as saved;
        `"param_groups"` (hyper-parameters, `"params"` index lists); and `"master_weights"`
        {index: fp32 tensor of the param's shape} when there are fp32 masters. All tensors on
        CPU. Returns None on the other ranks. With dp > 1 every dp replica's rank `to` gets
        the same dict; under a pipeline each stage's optimizer gathers its own stage's params
        (save one file per stage). Differs from torch's ZeroRedundancyOptimizer,
        which stores the result for `state_dict()` on rank `to`: here `state_dict()` stays
        this rank's shard (Paddle's meaning). Needs memory for the whole state on rank `to`.
        Raises ValueError (on every rank) for a `to` outside [0, sharding degree). Mirrors
        torch's `ZeroRedundancyOptimizer.consolidate_state_dict` (Paddle merges shards in its
        trainer instead: PaddleNLP `sharding_io.py`).
        """
        return sharding_state.consolidate(self, to)

    def load_state_dict(self, state_dict):
        """Load this rank's `state_dict()`, or a consolidated / plain torch one re-sharded.

        A consolidated dict (from `consolidate_state_dict` on any sharding degree, or a plain
        torch optimizer over the same params and groups) is passed on every rank; each keeps
        its own params (v1) or cuts its slices (v2), copies the hyper-parameters and, if
        present, the fp32 masters (else the masters start from the model's params: load the
        model first). v1 and v2 dicts are interchangeable. v2 under the pipeline's comm
        overlap, loaded before the first train_batch, keeps the dict and cuts it once the
        pipeline has built its buffers. Collective over the sharding (and dp) group: call it
        on every rank. Allocates no grad and no grad buffer. Raises ValueError on every rank
        if any rank got a per-rank state of another layout (another sharding degree, rank or
        version), None, or a state of another model; nothing is loaded then.
        """
        if not isinstance(state_dict, dict):  # e.g. None off rank `to`: torch's hooks would
            sharding_state.load(self, state_dict, None)  # fail here alone; this raises everywhere
        super().load_state_dict(state_dict)  # torch's hooks, then _load_local_state_dict

    def _load_local_state_dict(self, state_dict):
        """What `load_state_dict` does after torch's pre-hooks (see there)."""
        sharding_state.load(self, state_dict, super()._load_local_state_dict)
