"""World-size independent checkpoints of the sharding optimizers (sharding v1 / v2).

`sharding_state` gathers a sharded optimizer state into torch's one-process format and cuts
such a state into any sharding degree's shards; `sharding.py`'s `consolidate_state_dict` and
`load_state_dict` call it.
"""
