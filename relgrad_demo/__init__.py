"""The main job of `python relgrad.py` and its report: what release buys, where, and against what.

`lm` the model and data; `memory` allocator figures and our grad count; `phases` the phase
boundaries of a pipeline step, watched from outside; `trace` the Chrome trace; `job` the
runs per release mode, trained in turns and measured; `report` the --json object and tables;
`peers` the same LM under torch's DDP + ZeRO and FSDP2; `walkthrough` (`--walkthrough`) the
life of the fused grad buffers on a tiny model, event by event. The library modules never
import this.
"""
