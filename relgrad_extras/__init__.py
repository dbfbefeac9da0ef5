"""Beyond-seed features of relgrad that plug into the four core modules (never the reverse).

- `grad_clip`: Paddle's ClipGradByGlobalNorm, passed as `grad_clip=` to the sharding
  optimizers or `PipelineParallel.train_batch`.
- `shared_weights`: weights tied across pipeline stages (`PipelineParallel(shared_weights=)`).
- `interleave`: `PipelineParallelWithInterleave`, the interleaved 1F1B schedule (a subclass).
- `checkpoint`: consolidate a sharded optimizer state and re-shard it on any sharding degree
  (`opt.consolidate_state_dict`, and `opt.load_state_dict` given a consolidated dict).

Copy this folder beside `comm_buffer.py`, `sharding.py`, `pipeline.py` and `relgrad.py`.
"""
