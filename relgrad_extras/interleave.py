"""Interleaved 1F1B with virtual pipeline stages in torch (Paddle's PipelineParallelWithInterleave).

Mirrors `PipelineParallelWithInterleave` in
`python/paddle/distributed/fleet/meta_parallel/pipeline_parallel.py` at commit 9b40c67f672f,
whose schedule is Megatron-LM's interleaved 1F1B (Narayanan et al. 2021, section 2.2, Fig. 4).

With V virtual stages on P ranks the layer list is cut into P*V chunks, and rank s holds chunks
s, s+P, ..., s+(V-1)P: its virtual stages v = 0..V-1 (v is the key of
`_chunk_2_comm_buffers` and the chunk in `schedule_trace`). A micro-batch goes round the ring
of ranks V times. Each rank runs acc*V forward steps and as many backward steps; step k works
on micro-batch (k // PV) * P + k % P, on virtual stage (k % PV) // P for forwards and the
reverse, V-1 - (k % PV) // P, for backwards: groups of P micro-batches go through chunk 0, then
the same group through chunk 1, and so on. Phases: warm-up (2(P-s-1) + (V-1)P forwards, at
most all; the last one also receives the first backward's grad), steady 1F1B (one forward,
one backward, one exchange), cool-down (the remaining backwards). The bubble shrinks by V,
for V times the p2p messages.

Worked example, P=2, V=2, acc=4, 7 layers cut [0,1) [1,3) [3,5) [5,7): rank 0 holds chunks 0
and 2 (virtual stages 0, 1), rank 1 chunks 1 and 3. ("F", micro-batch, v) on rank 0:
F0.0 F1.0 F0.1 F1.1 | F2.0 B0.1  F3.0 B1.1  F2.1 B0.0  F3.1 B1.0 | B2.1 B3.1 B2.0 B3.0.

Comm overlap per chunk, as Paddle: each chunk's params get their own buckets (one per chunk
and owner: group_size sys.maxsize); the hooks only check in (`add_grad(use_comm=False)`);
after every backward step `_overlap_comm_grads` issues the collectives of a chunk whose last
micro-batch is done; after the schedule `_sync_overlap_grads` waits and scales every chunk's
buffers, and `_optimizer_step` (pipeline.py, the seed hunk) releases every chunk's buffers.
Phases of a step: warm-up -> steady 1F1B -> cool-down -> wait and scale -> step -> release.

Leaves out: Paddle's later schedules for acc not a multiple of P (`best_unbalanced_scheduler`),
`overlap_p2p_comm`, `static_scheduler`, profiling records.

References: Paddle PR #59739; Narayanan et al., "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM" (2021), section 2.2.
"""
import sys
from itertools import combinations

import torch
import torch.distributed as dist
from torch import nn

from pipeline import _DTYPES, _META_LEN, PipelineParallel, _build_segment, _chunk_of, _cut_layers
from relgrad_extras.shared_weights import SharedWeights


class PipelineParallelWithInterleave(PipelineParallel):
    """V model chunks of `layers` per pipeline rank, trained with interleaved 1F1B.

    Args as `PipelineParallel`; V is `strategy.pp_configs.num_virtual_pipeline_stages`
    (Paddle: `PipelineLayer(num_virtual_pipeline_stages=V)`). `seg_boundaries` has P*V + 1
    entries: chunk c is `layers[b[c]:b[c+1]]`; default an even split of the layers by count
    (fewer layers than P*V chunks leaves some chunks empty, i.e. the identity).
    `self._layers` is an `nn.ModuleList` of this rank's V chunks (`nn.Sequential` each).
    `shared_weights` as PipelineParallel (names index the whole layer list; typically the
    embedding in chunk 0 on stage 0 and the head in chunk P*V-1 on stage P-1).
    Raises ValueError, on every rank before any communication, unless V is an int > 1,
    pp_degree >= 2 and accumulate_steps is a multiple of pp_degree; and as PipelineParallel.
    """

    _interleaved = True  # hooks only check in; the schedule fires each chunk's buckets

    def _check_virtual_stages(self, num_virtual_stages):
        # Called by PipelineParallel.__init__ before its first collective.
        stages, acc, v = self.num_stages, self.accumulate_steps, num_virtual_stages
        if not isinstance(v, int) or isinstance(v, bool) or v < 2:
            raise ValueError(f"PipelineParallelWithInterleave needs pp_configs."
                             f"num_virtual_pipeline_stages >= 2, got {v!r}; with 1 build "
                             "PipelineParallel")
        # Later Paddle asserts pp_degree > 2. With 2 the previous and next rank are the same one;
        # `_ring_p2p` posts sends and receives in an order that matches on both, so 2 works.
        if stages < 2:
            raise ValueError(f"the interleaved schedule needs pp_degree >= 2, got {stages}; "
                             "set num_virtual_pipeline_stages=1 for a single stage")
        if acc % stages:
            near = sorted({max(acc // stages * stages, stages), (acc // stages + 1) * stages})
            raise ValueError(
                f"the interleaved schedule needs accumulate_steps to be a multiple of "
                f"pp_degree (micro-batches go through each chunk in groups of pp_degree); got "
                f"accumulate_steps={acc}, pp_degree={stages}; use accumulate_steps="
                + " or ".join(map(str, near)))
        self.num_model_chunks = v

    def _check_untied_shares(self, layers, bounds, shared_weights):
        """As PipelineParallel's, and a tie between model chunks of one stage is checked too."""
        super()._check_untied_shares(layers, bounds, shared_weights)
        for tie in shared_weights or ():
            names = sorted(n for n in tie if n.split(".")[0].isdigit())
            for a, b in combinations(names, 2):
                self._check_share(a, b, bounds, tied=True)

    def _check_share(self, a, b, bounds, tied):
        """As PipelineParallel's; and one param in two chunks of one stage under comm overlap
        is refused: each chunk's buckets would take a slot for it."""
        super()._check_share(a, b, bounds, tied)
        chunks = [_chunk_of(bounds, n) for n in (a, b)]
        same_stage = chunks[0] % self.num_stages == chunks[1] % self.num_stages
        if same_stage and chunks[0] != chunks[1] and self._comm_overlap:
            raise ValueError(f"'{a}' (model chunk {chunks[0]}) and '{b}' (model chunk "
                             f"{chunks[1]}) are one param on stage {chunks[0] % self.num_stages}:"
                             " under comm overlap each chunk's buckets would hold it; "
                             "shared_weights ties copies on different stages only: give each "
                             "chunk its own param, or turn the overlap off")

    def _build_layers(self, layers, seg_boundaries):
        parts = self.num_stages * self.num_model_chunks
        bounds = _cut_layers(layers, seg_boundaries, parts)
        chunks = [self.stage_id + v * self.num_stages for v in range(self.num_model_chunks)]
        return nn.ModuleList([_build_segment(layers[bounds[c] : bounds[c + 1]])
                              for c in chunks]), bounds

    def _shared_weights(self, shared_weights, bounds):
        stages = self.num_stages

        def placement(i):  # layer i -> (its rank's stage, its index among that rank's layers)
            c = max(c for c in range(len(bounds) - 1) if bounds[c] <= i)
            before = sum(bounds[d + 1] - bounds[d] for d in range(c % stages, c, stages))
            return c % stages, before + i - bounds[c]

        flat = nn.Sequential(*[layer for chunk in self._layers for layer in chunk])
        assert len(flat) == sum(len(chunk) for chunk in self._layers)  # no module twice
        return SharedWeights(flat, self._hcg, shared_weights, bounds, self._device(), placement)

    def forward(self, x, chunk_id):
        """Virtual stage `chunk_id` (0..V-1) of this rank on `x` (no communication)."""
        return self._layers[chunk_id](x)

    # ---- comm overlap per chunk: hooks check in, the schedule issues the collectives ----

    def fused_gradient(self, model, comm_group, acc_steps, dp, param2rank=None,
                       group_size=sys.maxsize):
        """`PipelineParallel.fused_gradient` with one bucket per chunk (and owner, for v1)."""
        return super().fused_gradient(model, comm_group, acc_steps, dp, param2rank,
                                      group_size)

    def _overlap_comm_grads(self):
        """After each backward step: issue a chunk's collectives once its last micro-batch is
        done. As Paddle, the count is 1..P*V over the last P*V backward steps, in which stage
        s finishes chunk V-1 at P, chunk V-2 at 2P, ...; Paddle fires chunk V-m at step mP + s
        (s steps late) and chunk 0 of stages s > 0 at the last step, which we keep."""
        if not self._comm_overlap:
            return
        stages, chunks = self.num_stages, self.num_model_chunks
        self._backward_step_count += 1
        sync_step = self._backward_step_count - self.stage_id
        if sync_step > 0 and sync_step % stages == 0:
            self._comm_chunk(chunks - sync_step // stages)
        if self.stage_id != 0 and self._backward_step_count == stages * chunks:
            self._comm_chunk(0)

    def _comm_chunk(self, chunk):
        """Issue `chunk`'s buckets (a tied copy's waits for the tie sum), complete or not:
        an incomplete one is agreed on at `_sync_overlap_grads`, on every rank."""
        held = self._scheduler.held
        self._scheduler.fire([b for b in self._chunk_2_comm_buffers.get(chunk, [])
                              if b not in held])

    def _sync_overlap_grads(self):
        """Tie sum, the rest issued, every chunk's buffers waited, scaled and agreed on
        (Paddle's `_sync_overlap_grads` waits and scales)."""
        if self._comm_overlap:
            assert self._backward_step_count == self.num_stages * self.num_model_chunks
        self._finish_schedule()

    # ---- the schedule ----

    def _chunk_id(self, k, forward):
        group = self.num_stages * self.num_model_chunks
        v = (k % group) // self.num_stages
        return v if forward else self.num_model_chunks - 1 - v

    def _micro_batch_id(self, k):
        group = self.num_stages * self.num_model_chunks
        return (k // group) * self.num_stages + k % self.num_stages

    def forward_backward_pipeline(self, data, forward_only=False, compute_loss=True):
        """Interleaved warm-up, steady 1F1B and cool-down over `data`; no optimizer step.

        Returns the mean loss as `PipelineParallel.train_batch` does (with `forward_only`,
        no backward; with `compute_loss` False too, the last stage's outputs concatenated,
        None elsewhere). Raises ValueError as `train_batch` does.
        """
        if not forward_only:
            self._check_accumulation()  # a second call before the step: as PipelineParallel
            self._agree_at_entry(None, data)  # a direct call agrees, as train_batch does
        return self._schedule(data, forward_only, compute_loss)

    def _schedule(self, data, forward_only=False, compute_loss=True):
        inputs, labels = self._micro_batches(data)
        stages, chunks, acc = self.num_stages, self.num_model_chunks, self.accumulate_steps
        first, last = self.stage_id == 0, self.stage_id == stages - 1
        total = acc * chunks
        self.schedule_trace, self._outputs = [], []
        self._forward_only, self._compute_loss = forward_only, compute_loss
        self._meta_sent, self._meta_recv = set(), {}
        self._total_loss = torch.zeros((), device=self._device())
        if forward_only:
            warm = total
        else:
            warm = min(2 * (stages - self.stage_id - 1) + (chunks - 1) * stages, total)
        steady = total - warm
        # Paddle's offset: the count reaches 1..P*V over the last P*V backward steps
        self._backward_step_count = -(total - stages * chunks)
        # per virtual stage, oldest first: inputs and outputs awaiting their backward, and
        # the output grads received for them (Paddle's names)
        self.input_tensors = ins = [[] for _ in range(chunks)]
        self.output_tensors = outs = [[] for _ in range(chunks)]
        self.output_tensor_grads = grads = [[] for _ in range(chunks)]

        def recv_input(k):  # the virtual stage whose input arrives for forward k, or None
            v = self._chunk_id(k, forward=True)
            return None if k >= total or (first and v == 0) else v

        def recv_grad(k):  # the virtual stage whose output grad arrives for backward k
            v = self._chunk_id(k, forward=False)
            return None if k >= total or (last and v == chunks - 1) else v

        def exchange(out=None, out_chunk=None, in_grad=None, in_chunk=None, fwd=None, bwd=None):
            send_out = None if out_chunk is None or (last and out_chunk == chunks - 1) else out
            send_grad = None if in_chunk is None or (first and in_chunk == 0) else in_grad
            like = None if bwd is None else outs[bwd][len(grads[bwd])]
            x, g = self._ring_p2p(send_out, out_chunk, send_grad, fwd, like)
            if fwd is not None:
                ins[fwd].append(x)
            if bwd is not None:
                grads[bwd].append(g)

        exchange(fwd=recv_input(0))
        # warm-up: forwards only; the last one also receives the first backward's grad
        for k in range(warm):
            out = self._forward_step_helper(inputs, labels, k)
            grad_chunk = recv_grad(0) if k == warm - 1 and not forward_only else None
            exchange(out, self._chunk_id(k, True), fwd=recv_input(k + 1), bwd=grad_chunk)

        # steady 1F1B: forward k + warm, backward k, then one exchange for both
        for k in range(steady):
            out = self._forward_step_helper(inputs, labels, k + warm)
            in_grad = self._backward_step_helper(k)
            exchange(out, self._chunk_id(k + warm, True), in_grad, self._chunk_id(k, False),
                     fwd=recv_input(k + warm + 1), bwd=recv_grad(k + 1))

        # cool-down: the remaining backwards
        for k in range(steady, total if not forward_only else 0):
            in_grad = self._backward_step_helper(k)
            exchange(in_grad=in_grad, in_chunk=self._chunk_id(k, False), bwd=recv_grad(k + 1))

        # wait and scale: every chunk's collectives were issued by _overlap_comm_grads
        if not forward_only:
            self._sync_overlap_grads()
        if forward_only and not compute_loss:
            outputs, self._outputs = self._outputs, []
            return torch.cat(outputs) if outputs else None
        return self._broadcast_final_loss()

    def _is_loss_chunk(self, v):
        return self.stage_id == self.num_stages - 1 and v == self.num_model_chunks - 1

    def _forward_step_helper(self, inputs, labels, k):
        """Forward step k: its virtual stage on its input (the data on chunk 0 of stage 0)."""
        v, micro_batch = self._chunk_id(k, forward=True), self._micro_batch_id(k)
        if self.stage_id == 0 and v == 0:
            self.input_tensors[0].append(inputs[micro_batch])
        x = self.input_tensors[v][-1]  # received one step ahead, so the newest one
        self.schedule_trace.append(("F", micro_batch, v))
        out = self._layers[v](x)
        if self._is_loss_chunk(v):
            if self._compute_loss:
                out = self._loss_of(out, labels[micro_batch])
            else:
                self._outputs.append(out)
        if self._forward_only:
            self.input_tensors[v].pop()
        else:
            self.output_tensors[v].append(out)
        return out

    def _backward_step_helper(self, k):
        """Backward step k on its virtual stage's oldest pending micro-batch; returns the
        input's grad (None for data); then `_overlap_comm_grads`."""
        v, micro_batch = self._chunk_id(k, forward=False), self._micro_batch_id(k)
        x, out = self.input_tensors[v].pop(0), self.output_tensors[v].pop(0)
        out_grad = None if self._is_loss_chunk(v) else self.output_tensor_grads[v].pop(0)
        self.schedule_trace.append(("B", micro_batch, v))
        if out.requires_grad:  # not on a chunk without params fed by data
            torch.autograd.backward(out, grad_tensors=out_grad)
        self._overlap_comm_grads()
        return x.grad if x.requires_grad else None

    def eval_batch(self, data, compute_loss=True):
        """Forward only, in the interleaved order; returns as `PipelineParallel.eval_batch`."""
        with torch.no_grad():
            return self._schedule(data, forward_only=True, compute_loss=compute_loss)

    # ---- point-to-point round the ring of stages ----

    def _ring_p2p(self, send_next, send_chunk, send_prev, recv_prev, recv_next):
        """One batched exchange with the neighbours on the ring; returns (input, grad).

        `send_next`: this rank's output of virtual stage `send_chunk`, for the next rank (the
        last rank's goes to rank 0, the next chunk); `send_prev`: an input grad for the
        previous rank; `recv_prev`: the virtual stage whose input comes in, or None;
        `recv_next`: the output whose grad comes back (same shape), or None.
        Differs from `PipelineParallel._p2p`: neighbours wrap round, and a meta message goes
        once per batch and boundary (chunk), by a non-blocking batched send, so two ranks that send
        each other their first activation in the same exchange (pp 2) do not both wait.
        (Paddle's helper caches one shape for every message, `p2p_cache_shape`; one per
        boundary lets chunk outputs differ in shape.)
        With pp 2 both neighbours are one rank: its sends are posted activation first, grad
        second, and so are its receives, so they pair up in order.
        """
        stages, group = self.num_stages, self._hcg.get_pipe_parallel_group()
        prev = self._hcg.get_rank_from_stage((self.stage_id - 1) % stages)
        nxt = self._hcg.get_rank_from_stage((self.stage_id + 1) % stages)
        meta_works, ops, got_prev, got_next = [], [], None, None
        if send_next is not None and send_chunk not in self._meta_sent:
            meta = self._meta(send_next)  # held here until its send is done
            # batched like every p2p here (see PipelineParallel._p2p_one), and not waited yet
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, meta, nxt, group)])
            meta_works += [(meta, work) for work in works]
            self._meta_sent.add(send_chunk)
        if recv_prev is not None and recv_prev not in self._meta_recv:
            meta = torch.zeros(_META_LEN, dtype=torch.long, device=self._device())
            self._p2p_one(dist.irecv, meta, prev, group)
            code, ndim = int(meta[0]), int(meta[1])
            self._meta_recv[recv_prev] = (_DTYPES[code], [int(d) for d in meta[2 : 2 + ndim]])
        if send_next is not None:
            ops.append(dist.P2POp(dist.isend, send_next.detach().contiguous(), nxt, group))
        if send_prev is not None:
            ops.append(dist.P2POp(dist.isend, send_prev.contiguous(), prev, group))
        if recv_prev is not None:
            dtype, shape = self._meta_recv[recv_prev]
            got_prev = torch.empty(shape, dtype=dtype, device=self._device())
            ops.append(dist.P2POp(dist.irecv, got_prev, prev, group))
        if recv_next is not None:
            got_next = torch.empty_like(recv_next)
            ops.append(dist.P2POp(dist.irecv, got_next, nxt, group))
        if ops:
            self._wait_p2p(dist.batch_isend_irecv(ops), [op.peer for op in ops])
        self._wait_p2p([work for _, work in meta_works], [nxt] * len(meta_works))
        if got_prev is not None:
            got_prev.requires_grad_(got_prev.is_floating_point())
        return got_prev, got_next
