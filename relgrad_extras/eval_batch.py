"""`PipelineParallel.eval_batch`: forward only over the pipe (Paddle's `eval_batch`).

Moved here from `pipeline.py`, whose `eval_batch` imports this module at the call. Every rank
of the pipe runs it (each stage sends its activations on, the last computes the loss); the
modules' train / eval modes stay as the user set them. Interleave has its own
(`PipelineParallelWithInterleave.eval_batch`).
"""
import torch

from pipeline import PipelineParallel


def eval_batch(model: PipelineParallel, data: tuple,
               compute_loss: bool = True) -> torch.Tensor | None:
    """`model`'s mean loss over `data = (inputs, labels)` on every rank of the pipe; with
    `compute_loss=False` the last stage's outputs, concatenated (None on the other stages)."""
    inputs, labels = model._new_batch(data)
    last = model.stage_id == model.num_stages - 1
    outputs = []
    with torch.no_grad():
        for k in range(model.accumulate_steps):
            out = model._layers(model.recv_forward(inputs[k]))
            if last and compute_loss:
                model._total_loss += model._loss_fn(out, labels[k]).float()
            elif last:
                outputs.append(out)
            else:
                model.send_forward(out)
    if not compute_loss:
        return torch.cat(outputs) if outputs else None
    if not model._delay_scale_loss:  # else _broadcast_final_loss divides the sum once
        model._total_loss /= model.accumulate_steps
    return model._broadcast_final_loss()
