"""`--plan`: what `release_gradients` saves on a model and layout, per rank, before it runs.

For a model (a public config by name, a shape given by flags, or this repo's demo LM) and a
layout (pp x vpp x sharding v1 / v2 x dp, micro-batches, dtypes, optimizer) it computes, for
every rank, the bytes held at the phase boundaries of one 1F1B step (the main job's names,
`relgrad_demo.phases.PHASES`) with release off, on and free (free-in-comm, sharding >= 2),
between steps and at the peak, and prints the most loaded rank. The fused grad buffers follow
Paddle's rules as `comm_buffer.py` lays them out (256-byte slots in the param dtype; v2's
reduce-scatter unit `(256 / elem_size) * degree`; buckets of `assign_group_by_size`, grouped by
owner for v1), redone in plain Python: a public config's plan imports no torch code of this
repo. Activations: Korthikanti et al. (2022) for a public config. The demo LM's layers are
measured instead (one forward, backward and eval pass per layer kind, `relgrad_demo.memory`'s
allocator reading) and so are the runtime's own heap bytes (the same job at d_model 4), which
is what `--plan-check` compares with the main job, at three sizes.
Phases of a step: warm-up -> steady 1F1B -> cool-down -> collectives -> step -> release.

Leaves out: NCCL's own buffers, the CUDA context and caching-allocator fragmentation, CUDA
graphs, activation recomputation, sequence / tensor parallelism, the optimizer step's
temporaries; for a public config, the runtime's host-side objects (not device memory).

References: Paddle PR #59739; Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models" (2022); Narayanan et al., "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM" (2021).
"""
import argparse
import json
import sys
import textwrap
from dataclasses import asdict, dataclass, replace

from relgrad_demo.phases import PHASES  # the phase names the main job reports

ALIGN = 256  # comm_buffer.ALIGNMENT_BYTES: Paddle's alignment["gpu"]
PIPELINE_BUCKET = 128 * 1024 * 1024  # pipeline.PipelineParallel.fused_gradient's group_size
SHARDING_BUCKET = 256 * 1024 * 1024  # the sharding optimizers' own buckets (Paddle's default)
UNBOUNDED = sys.maxsize  # the interleaved pipeline: one bucket per chunk (and owner)
MODES = ("off", "on", "free")
ROWS = PHASES + ("eval (peak)",)  # the main job's phase table rows (report.py)


# ============================================================================================
# Models: a list of layers, each its params' sizes and its activation bytes per micro-batch
# ============================================================================================

@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer by its published sizes."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int  # = heads without GQA
    ffn: int
    vocab: int
    seq: int  # sequence length of a training sample
    tied: bool  # embedding and LM head share one weight
    mlp: str  # "gelu": GPT-2's block (biases, LayerNorm, learned positions); "swiglu": Llama's


# Published sizes; the param counts (Shape's layer list) match the published totals:
# gpt2-124m 124,439,808 (GPT-2 small, "124M"); llama2-7b 6,738,415,616 ("6.74e9");
# llama2-13b 13,015,864,320; llama2-70b 68,976,648,192 (GQA, 8 kv heads).
PUBLIC = {
    "gpt2-124m": Shape(12, 768, 12, 12, 3072, 50257, 1024, True, "gelu"),
    "llama2-7b": Shape(32, 4096, 32, 32, 11008, 32000, 4096, False, "swiglu"),
    "llama2-13b": Shape(40, 5120, 40, 40, 13824, 32000, 4096, False, "swiglu"),
    "llama2-70b": Shape(80, 8192, 64, 8, 28672, 32000, 4096, False, "swiglu"),
}


@dataclass(frozen=True)
class Layer:
    """One pipeline layer: its params' elements (in the module's order) and, per micro-batch,
    bytes: `act` kept for backward (its output included), `bwd` its backward needs beyond
    them, `out` its output (what p2p sends); per eval micro-batch, `eval` a no-grad forward
    needs at once (its output included), `eval_out` its output, `keep` what eval keeps."""

    kind: str  # "embedding", "block" or "head"
    params: tuple
    act: int = 0
    bwd: int = 0
    out: int = 0
    eval: int = 0
    eval_out: int = 0
    keep: int = 0


def shape_layers(shape, micro_batch, elem, flash=False):
    """[embedding, block x layers, head] of `shape` (elem: bytes per activation element).

    Activations per block: s*b*h*(34 + 5*a*s/h) bytes with 16-bit activations (Korthikanti
    et al. 2022: no recomputation, no sequence or tensor parallelism), scaled by
    elem / 2; `flash` drops the 5*a*s/h attention-score term. It is GPT's block (a 4h GELU MLP,
    MHA): SwiGLU's MLP and GQA's k / v are not modelled. The head keeps the fp32 logits for
    the loss, 4*s*b*v (the paper's output layer); the embedding keeps nothing counted.
    """
    h, f, s, b, v = shape.hidden, shape.ffn, shape.seq, micro_batch, shape.vocab
    kv = h // shape.heads * shape.kv_heads  # k and v widths under GQA
    if shape.mlp == "gelu":
        block = (h, h, h * (h + 2 * kv), h + 2 * kv, h * h, h, h, h, h * f, f, f * h, h)
        embedding, head = (v * h, s * h), (h, h, v * h)
    else:
        block = (h, h * h, h * kv, h * kv, h * h, h, h * f, h * f, f * h)
        embedding, head = (v * h,), (h, v * h)
    attention = 0 if flash else 5 * shape.heads * s / h
    act = int(s * b * h * (34 + attention) * elem / 2)
    out = s * b * h * elem
    logits = 4 * s * b * v
    return ([Layer("embedding", embedding, 0, 0, out, out, out)]
            + [Layer("block", block, act, max(block) * elem, out, act, out)] * shape.layers
            + [Layer("head", head, logits, max(head) * elem + logits, 0, logits)])


# ============================================================================================
# Layout arithmetic: Paddle's rules, as comm_buffer.py / sharding.py / pipeline.py apply them
# ============================================================================================

def cut(n, parts):
    """Chunk boundaries over n layers: pipeline._cut_layers's even split by count."""
    return [n * i // parts for i in range(parts + 1)]


def slot(numel, elem):
    """Elements of a param's slot in an all-reduce / reduce buffer (flatten_dense_tensors):
    numel padded to 256 bytes of the *param* dtype. bf16, 1000 elements: 1024."""
    return numel + (-numel * elem % ALIGN) // elem


def buckets(numels, size, elem):
    """Indices of `numels` per bucket (assign_group_by_size, one dtype): a bucket closes once
    its bytes (param dtype) reach `size`, so its last param may overshoot."""
    out, open_, nbytes = [], [], 0
    for i, n in enumerate(numels):
        open_.append(i)
        nbytes += n * elem
        if nbytes >= size:
            out, open_, nbytes = out + [open_], [], 0
    return out + [open_] if open_ else out


def partition(numels, degree):
    """Owner of each param (sharding v1's _partition_parameters): largest first, each to the
    rank with the fewest elements so far (ties: the lowest rank)."""
    loads, owner = [0] * degree, [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
        owner[i] = loads.index(min(loads))
        loads[owner[i]] += numels[i]
    return owner


def rs_layout(numels, elem, degree, rank):
    """A reduce-scatter bucket (build_reduce_scatter_buffer): (total elements T, this rank's
    slice elements per param). Each param pads to the unit (256 / elem) * degree; rank r owns
    [r*T/D, (r+1)*T/D); a param's slice is its padded range's overlap with it, padding
    included, and empty when that overlap holds only padding (ShardingGradView)."""
    unit = ALIGN // elem * degree
    padded = [-(-n // unit) * unit for n in numels]
    total = sum(padded)
    lo, hi = rank * total // degree, (rank + 1) * total // degree
    slices, index = [], 0
    for n, size in zip(numels, padded):
        begin, end = max(index, lo), min(index + size, hi)
        slices.append(end - begin if begin < min(end, index + n) else 0)
        index += size
    return total, slices


@dataclass(frozen=True)
class Layout:
    """What runs: degrees, schedule, dtypes and optimizer, as the main job's flags name them."""

    pp: int = 2
    vpp: int = 1  # virtual stages per rank (interleaved 1F1B when > 1)
    sharding: int = 2
    dp: int = 1
    split_param: bool = False  # sharding v2
    overlap: bool = True  # comm overlap where the layout allows it (job.make_strategy's rule)
    micro_batches: int = 4
    micro_batch_size: int = 4
    dtype: str = "fp32"  # of the params: "fp32" or "bf16"
    main_grad: bool = False  # fp32 grads beside bf16 params
    optimizer: str = "adamw"  # "adamw", "sgd" (with momentum) or "lamb"
    comm_buffer_mb: int = None  # sharding_configs.comm_buffer_size_MB
    free: bool = False  # also plan release + sharding_configs.free_grads_in_comm

    @property
    def modes(self):
        return MODES if self.free else MODES[:2]


def _groups(layout, chunks, owner):
    """The rank's fused grad buffers before bucketing: ([(action, owner or -1, [param
    index])], bucket bytes). The pipeline's overlap (pp > 1) builds them per chunk: reduce to
    each owner (v1, grouped by owner in order of appearance) or reduce-scatter (v2) over
    sharding, all-reduce over dp without sharding; without a pipeline sharding's own overlap
    builds them (v1 per owner, v2); v2 without overlap still builds its own (filled in step()).
    Elsewhere there are none: the grads stay tensors of their own."""
    sharding, mb = layout.sharding, layout.comm_buffer_mb
    own_size = SHARDING_BUCKET if mb is None else mb * 1024 * 1024
    if layout.overlap and layout.pp > 1 and (sharding > 1 or layout.dp > 1):
        size = UNBOUNDED if layout.vpp > 1 else PIPELINE_BUCKET
        if sharding > 1 and mb is not None:  # the pipeline's sharding buffers read it too
            size = own_size
        act = ("all-reduce" if sharding == 1 else "reduce-scatter" if layout.split_param
               else "reduce")
        groups = []
        for indices in chunks:
            keys = [owner[i] if act == "reduce" else -1 for i in indices]
            groups += [(act, k, [i for i, o in zip(indices, keys) if o == k])
                       for k in dict.fromkeys(keys)]
        return groups, size
    every = [i for indices in chunks for i in indices]
    if sharding > 1 and layout.split_param:
        return [("reduce-scatter", -1, every)], own_size
    if sharding > 1 and layout.overlap and layout.pp == 1:
        return [("reduce", k, [i for i in every if owner[i] == k]) for k in range(sharding)
                if k in owner], own_size
    return [], own_size


def rank_plan(layers, layout, stage, srank, tied=None, runtime=None):
    """The rank at `stage`, sharding rank `srank` (dp replicas hold the same): its params,
    buffers, parts (bytes) and, per mode, bytes at each of ROWS, between steps and at peak.

    `tied`: the index, in the head's params, of the weight it shares with the embedding (a
    copy on each stage, one param on one rank), or None. `runtime`: {mode: bytes} that the
    runtime holds beyond its tensors (the demo on CPU), or None.
    """
    pp, vpp, d, m = layout.pp, layout.vpp, layout.sharding, layout.micro_batches
    elem = 2 if layout.dtype == "bf16" else 4
    gelem = 4 if layout.main_grad else elem
    bounds = cut(len(layers), pp * vpp)
    mine = [stage + v * pp for v in range(vpp)]  # this rank's chunks (virtual stages)
    numels, chunks, chunk_of = [], [], []
    for c in mine:
        chunks.append([])
        for li in range(bounds[c], bounds[c + 1]):
            for pi, n in enumerate(layers[li].params):
                if tied is not None and pp == 1 and li == len(layers) - 1 and pi == tied:
                    continue  # on one rank the head's tied weight is the embedding's param
                chunks[-1].append(len(numels))
                numels.append(n)
                chunk_of.append(c)
    v2 = layout.split_param and d > 1
    owner = partition(numels, d) if d > 1 and not v2 else [srank] * len(numels)
    groups, size = _groups(layout, chunks, owner)
    stepped = [] if v2 else [n for n, o in zip(numels, owner) if o == srank]
    params = 0 if v2 else sum(numels) * elem  # v2: the params live in flat param buffers
    buffers = []  # (action, owner or -1, elements, elements free-in-comm keeps, chunk)
    for act, dst, indices in groups:
        for bucket in buckets([numels[i] for i in indices], size, elem):
            sizes = [numels[indices[j]] for j in bucket]
            if act == "reduce-scatter":
                total, slices = rs_layout(sizes, elem, d, srank)
                stepped += [n for n in slices if n]
                params += total * elem
                buffers.append((act, dst, total, total // d, chunk_of[indices[0]]))
            else:
                total = sum(slot(n, elem) for n in sizes)
                buffers.append((act, dst, total, total if dst in (-1, srank) else 0,
                                chunk_of[indices[0]]))
    state = {"adamw": 8, "lamb": 8, "sgd": 4}[layout.optimizer] * sum(stepped)
    if layout.optimizer != "sgd":
        state += 4 * len(stepped)  # Adam's step count: a 0-d fp32 tensor per param
    parts = {"params": params, "fp32 masters": 4 * sum(stepped) if elem < 4 else 0,
             "optimizer state": state}
    if buffers:
        grads = sum(b[2] for b in buffers) * gelem
        kept = sum(b[3] for b in buffers) * gelem
    else:  # grads of their own: v1's free-in-comm drops those it does not own
        grads, kept = sum(numels) * gelem, sum(stepped) * gelem
    parts["grads"] = grads
    # v2 with release and no hooks: backward leaves plain grads, step() copies them in
    loose = sum(numels) * gelem if v2 and not (layout.overlap and d > 1) else 0
    alloc = dict.fromkeys(mine, 0)  # with release: allocated by a chunk's first backward
    for c, n in zip(chunk_of, numels):
        alloc[c] += 0 if buffers and not loose else n * gelem
    for b in [] if loose else buffers:
        alloc[b[4]] += b[2] * gelem

    def chunk(c):  # bytes per micro-batch: kept (received input included), input, output
        held = layers[bounds[c]:bounds[c + 1]]
        recv = layers[bounds[c] - 1].out if bounds[c] > 0 else 0
        return sum(l.act for l in held) + recv, recv, held[-1].out if held else recv
    acts = {c: chunk(c) for c in mine}
    # the schedule: `warm` forwards, then forward k + warm before backward k (1F1B; the
    # interleaved one runs virtual stage (k % (pp * vpp)) // pp forward, the reverse backward)
    total, group = m * vpp, pp * vpp
    warm = min(pp - stage - 1 if vpp == 1 else 2 * (pp - stage - 1) + (vpp - 1) * pp, total)
    fwd = [stage + k % group // pp * pp for k in range(total)]
    bwd_of = [stage + (vpp - 1 - k % group // pp) * pp for k in range(total)]
    held_at = [sum(acts[c][0] for c in fwd[:min(k + warm + 1, total)])
               - sum(acts[c][0] for c in bwd_of[:k]) for k in range(total)]
    first, last = bwd_of[0], bwd_of[-1]  # the chunks of the first and the last backward

    def grad_of_out(c):  # received before chunk c's backward (none for the loss chunk)
        return acts[c][2] if c != pp * vpp - 1 else 0
    held, out_grad = held_at[0], grad_of_out(first)
    busiest = [h + grad_of_out(c) for h, c in zip(held_at, bwd_of)]
    allocated = [sum(alloc[c] for c in set(bwd_of[:k + 1])) for k in range(total)]
    parts["activations in flight"] = held

    def after(c):  # a backward's input and output and their grads, still referenced then
        return 2 * acts[c][1] + acts[c][2] + grad_of_out(c)
    kinds = [(i, c) for c in mine for i in range(bounds[c], bounds[c + 1])]
    transient = max([layers[i].bwd for i, _ in kinds] or [0])
    evals = [layers[i].eval + (layers[i - 1].eval_out if i > bounds[c] else 0)
             for i, c in kinds]  # a no-grad layer and its input
    eval_extra = (max([layers[bounds[c] - 1].eval_out for c in mine if bounds[c] > 0] or [0])
                  + (m - 1) * sum(layers[i].keep for i, _ in kinds) + max(evals or [0]))
    if runtime:
        parts["runtime"] = runtime
    base = params + parts["fp32 masters"] + state
    rows, between, peak = {}, {}, {}
    for mode in layout.modes:
        b = base + (runtime or {}).get(mode, 0) + (grads if mode == "off" else 0)
        on = mode != "off"  # then a chunk's first backward allocates its grads
        comm = 0 if mode == "off" else kept if mode == "free" else grads
        rows[mode] = [b, b + held + out_grad,
                      b + held - acts[first][0] + after(first) + on * allocated[0],
                      b + after(last) + on * allocated[-1], b + after(last) + comm, b + comm,
                      b, b + eval_extra]
        top = b + transient + max(h + on * a for h, a in zip(busiest, allocated))
        if loose and mode != "off":
            top = max(top, b + loose + grads)  # step() copies the plain grads in
        between[mode], peak[mode] = b, max(rows[mode][:7] + [top])
    return {"stage": stage, "sharding_rank": srank, "params": len(numels),
            "elements": sum(numels), "buffers": buffers, "parts": parts, "rows": rows,
            "between": between, "peak": peak}


# ============================================================================================
# The plan of every rank; the demo LM's layers, measured
# ============================================================================================

@dataclass(frozen=True)
class Model:
    """A model as the plan sees it: its layers and which head param is the tied weight."""

    name: str
    layers: tuple
    tied: int = None  # index of the head's param shared with the embedding, or None
    about: str = ""
    seq: int = 0  # tokens per sample


def public_model(name, shape, layout, flash=False):
    """`shape` as a Model, activations by Korthikanti et al. (`shape_layers`)."""
    elem = 2 if layout.dtype == "bf16" else 4
    layers = tuple(shape_layers(shape, layout.micro_batch_size, elem, flash))
    gqa = f", {shape.kv_heads} kv heads" if shape.kv_heads != shape.heads else ""
    about = (f"{shape.layers} layers, hidden {shape.hidden}, {shape.heads} heads{gqa}, ffn "
             f"{shape.ffn}, vocab {shape.vocab}, {'tied' if shape.tied else 'untied'}, "
             f"{'SwiGLU' if shape.mlp == 'swiglu' else 'GELU'}")
    return Model(name, layers, len(layers[-1].params) - 1 if shape.tied else None, about,
                 shape.seq)


def plan(model, layout, runtime=None):
    """Every rank's `rank_plan` (dp index 0; the other replicas hold the same), by global
    rank: rank = stage * sharding + sharding rank (HybridCommunicateGroup's grid).
    `runtime`: per global rank, {mode: bytes}, or None."""
    out = []
    for stage in range(layout.pp):
        for srank in range(layout.sharding):
            rank = stage * layout.sharding + srank
            out.append(dict(rank=rank, **rank_plan(
                model.layers, layout, stage, srank, model.tied,
                runtime[rank] if runtime else None)))
    return out


def demo_model(opts, measure=True):
    """The demo LM of `opts` (the main job's flags) as a Model; with `measure`, each layer
    kind's bytes from one forward, backward and eval pass in this process, read as the main
    job reads them (relgrad_demo.memory), after one pass to warm up."""
    import gc
    import torch
    from relgrad_demo.job import EVAL_BATCHES
    from relgrad_demo.lm import lm_layers, lm_shared_weights, load_text
    vocab = len(set(load_text(opts["data"])))
    builders = lm_layers(vocab, opts, torch.device("cpu"))
    kinds = {"embedding": builders[0], "block": builders[1], "head": builders[-1]}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run: no other thread's scratch in the figures
    gc.collect()
    gc.freeze()  # as job.warm_up_then_measure: each reading's collection skips torch's objects
    try:
        made = {}
        for kind, build in kinds.items():
            layer = build()
            params = tuple(p.numel() for p in layer.parameters())
            figures = _measure(layer, kind, opts, vocab, EVAL_BATCHES) if measure else {}
            made[kind] = Layer(kind, params, **figures)
            if kind == "head":
                tied_name = lm_shared_weights(opts)[0][1].split(".", 1)[1]
                tied = [n for n, _ in layer.named_parameters()].index(tied_name)
    finally:
        torch.set_num_threads(threads)
        gc.unfreeze()
    layers = (made["embedding"],) + (made["block"],) * opts["layers"] + (made["head"],)
    about = (f"this repo's LM: {opts['layers']} blocks, d_model {opts['d_model']}, 4 heads, "
             f"vocab {vocab} characters, tied")
    return Model("demo", layers, tied, about, opts["block"])


def _measure(layer, kind, opts, vocab, eval_batches):
    """Bytes of one layer per micro-batch: kept by forward (`act`), needed beyond them by
    backward (`bwd`: the highest reading before and after each autograd node), its output;
    per eval micro-batch (`eval_batches` times larger, eval mode, no grad) the highest
    reading while it runs (sampled, as the main job samples its peak: the fused inference
    kernel allocates inside one op) and its output."""
    import gc
    import torch
    from relgrad_demo.lm import lm_loss
    from relgrad_demo.memory import Ledger, PeakSampler, allocator_in_use_bytes
    cpu = torch.device("cpu")
    dtype = torch.bfloat16 if opts["main_grad"] else torch.float32
    b, t, d, acc = opts["micro_batch_size"], opts["block"], opts["d_model"], opts["micro_batches"]

    def drop(p):  # as the fused buffer does: it takes the grad in, the grad tensor goes
        p.grad = p.main_grad = None
    for p in layer.parameters():  # after the main-grad hooks lm_layers registered
        p.register_post_accumulate_grad_hook(drop)

    def data(batch):
        x = (torch.randint(0, vocab, (batch, t)) if kind == "embedding" else
             torch.randn(batch, t, d, dtype=dtype, requires_grad=True))
        return x, torch.randint(0, vocab, (batch, t))

    def watch(node, readings, seen):  # read the allocator around every node of the graph
        if node is None or node in seen:
            return
        seen.add(node)
        node.register_prehook(lambda *_: readings.append(allocator_in_use_bytes(cpu)))
        node.register_hook(lambda *_: readings.append(allocator_in_use_bytes(cpu)))
        for child, _ in node.next_functions:
            watch(child, readings, seen)
    for _ in range(2):  # the first pass allocates for good what the job's warm-up keeps
        layer.train()
        x, y = data(b)
        ledger = Ledger(cpu)  # bytes above what is in use at begin()
        gc.collect()
        ledger.begin()
        out = layer(x)
        size = out.numel() * out.element_size() if kind != "head" else 0
        if kind == "head":
            out = lm_loss(out, y) / acc
        act = ledger.end()
        grad, readings = None if kind == "head" else torch.ones_like(out), []
        watch(out.grad_fn, readings, set())
        gc.collect()
        start = allocator_in_use_bytes(cpu)
        torch.autograd.backward(out, grad)
        bwd = max(readings) - start
        del out, grad, x, y
        layer.eval()
        x, y = data(b * eval_batches)
        ledger = Ledger(cpu)
        gc.collect()
        ledger.begin()
        with torch.no_grad(), PeakSampler(ledger) as sampler:
            for _ in range(8):
                out = layer(x)
                eval_out = out.numel() * out.element_size()
                if kind == "head":
                    lm_loss(out, y)
                del out
    return {"act": act, "bwd": bwd, "out": size, "eval": max(sampler.peak, eval_out),
            "eval_out": 0 if kind == "head" else eval_out,
            "keep": eval_out if kind == "head" else 0}


def layout_of(opts):
    """The Layout of the main job's flags (`cli.parse_args`'s opts)."""
    return Layout(opts["pp"], opts.get("vpp", 1), opts["sharding"], opts["dp"],
                  opts["split_param"], opts["overlap"], opts["micro_batches"],
                  opts["micro_batch_size"], "bf16" if opts["main_grad"] else "fp32",
                  opts["main_grad"], "adamw", opts.get("comm_buffer_mb"),
                  "free" in opts["modes"])


def runtime_of(summary, opts):
    """Per global rank, {mode: bytes} the runtime holds beyond the plan's tensors: the main
    job's between-steps bytes (`summary`, its --json) minus the plan's without a runtime,
    on the same layout (`opts`). Run at d_model 4, where tensors are a few KiB, it is the
    heap bytes of the modules' and optimizer's objects, the hooks and the gloo groups."""
    plans = plan(demo_model(opts, measure=False), layout_of(opts))
    modes = summary["modes"]
    return [{mode: modes[mode]["idle_bytes_allocator"][r["rank"]] - r["between"][mode]
             for mode in modes} for r in plans]


# ============================================================================================
# The command line: --plan prints the most loaded rank; --plan-check compares with the job
# ============================================================================================

KORTHIKANTI = ("s*b*h*(34 + 5*a*s/h) bytes per block and micro-batch with 16-bit activations "
               "(Korthikanti et al. 2022: no recomputation, no sequence or tensor parallelism; "
               "GPT's block, so SwiGLU's wider MLP and GQA's smaller k / v are not modelled), "
               "twice that in fp32; the head keeps the fp32 logits, 4*s*b*v")
MEASURED = ("measured here, one forward, backward and eval pass per layer kind "
            "(relgrad_demo.memory's allocator reading), summed over each stage's layers; "
            "runtime: the heap's bytes beyond the tensors, by the same job at d_model 4")
LEFT_OUT = ("NCCL's own buffers, the CUDA context, the caching allocator's fragmentation, "
            "CUDA graphs, activation recomputation, sequence / tensor parallelism, the "
            "temporaries of the optimizer step and of the collectives while they run; for a "
            "public config, the runtime's host-side objects (not device memory)")


class _Parser(argparse.ArgumentParser):
    """argparse, with an error as one line (status 2), as relgrad_demo.cli's parser."""

    def error(self, message):
        self.exit(2, f"relgrad.py --plan: error: {message} (relgrad.py --plan --help lists "
                     "the flags)\n")


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless it has none (None, False)."""

    def _get_help_string(self, action):
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


def parse_args(argv):
    """--plan's flags, checked: (args, Shape, Model or None for the demo LM, Layout). A bad
    name or size, or a layout that the pipeline or the sharding optimizers would refuse,
    ends in one line naming the rule, status 2, before anything is computed."""
    p = _Parser(prog="relgrad.py --plan", formatter_class=_Help, description="What "
                "release_gradients saves on a model and layout: per rank, the bytes held at the "
                "phase boundaries of one 1F1B step with release off, on and free (free-in-comm, "
                "sharding >= 2), between steps and at the peak; prints the most loaded rank. "
                "--plan-check compares the demo LM's plan with what the main job measures.")
    p.add_argument("--plan", action="store_true", help="print the plan (this command)")
    p.add_argument("--plan-check", action="store_true",
                   help="run the main job at --sizes and compare the plan with it (minutes)")
    p.add_argument("--model", default="demo", choices=["demo", *PUBLIC],
                   help="demo: this repo's LM (relgrad_demo/lm.py); else a public config")
    shape = p.add_argument_group("model shape: a named config's, or the demo's own")
    for flag, what in (("--layers", "blocks"), ("--heads", "attention heads"),
                       ("--kv-heads", "key / value heads (GQA)"), ("--ffn", "MLP width"),
                       ("--vocab", "vocabulary")):
        shape.add_argument(flag, type=int, help=what)
    shape.add_argument("--hidden", "--d-model", type=int, dest="hidden", help="model width")
    shape.add_argument("--seq", "--block", type=int, dest="seq", help="tokens per sample")
    shape.add_argument("--tied", action=argparse.BooleanOptionalAction, default=None,
                       help="embedding and LM head share one weight")
    shape.add_argument("--mlp", choices=("gelu", "swiglu"), help="GPT-2's block or Llama's")
    shape.add_argument("--flash-attention", action="store_true",
                       help="no attention scores kept (drops the 5*a*s/h term)")
    lay = p.add_argument_group("layout: the main job's flags")
    for flag, default, what in (("--pp", 2, "pipeline stages"), ("--vpp", 1, "virtual "
                                "stages per rank"), ("--sharding", 2, "ZeRO-1 shards"),
                                ("--dp", 1, "data-parallel replicas"),
                                ("--micro-batches", 4, "micro-batches per step")):
        lay.add_argument(flag, type=int, default=default, help=what)
    lay.add_argument("--micro-batch-size", type=int,
                     help="samples per micro-batch and replica (the demo: 4, else 1)")
    lay.add_argument("--split-param", action="store_true", help="sharding v2 instead of v1")
    lay.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                     help="comm overlap where the layout allows it")
    lay.add_argument("--dtype", choices=("fp32", "bf16"), help="params (bf16 with "
                     "--main-grad, else fp32)")
    lay.add_argument("--main-grad", action="store_true", help="bf16 params, fp32 main grads")
    lay.add_argument("--optimizer", choices=("adamw", "sgd", "lamb"), default="adamw",
                     help="sgd: with momentum; lamb: Adam's moments, whole-param norms")
    lay.add_argument("--comm-buffer-mb", type=int, metavar="MB",
                     help="sharding_configs.comm_buffer_size_MB")
    lay.add_argument("--free-grads-in-comm", action="store_true",
                     help="as the main job takes it: the free column shows with sharding >= 2")
    demo = p.add_argument_group("the demo LM: measured runs")
    demo.add_argument("--data", metavar="FILE", help="its text (the vocabulary)")
    demo.add_argument("--steps", type=int, default=10, help="steps of each measured run")
    demo.add_argument("--sizes", default=",".join(f"{d}x{n}" for d, n in SIZES),
                      help="--plan-check: d_model x blocks of the LMs, comma-separated")
    demo.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--json", action="store_true", help="one JSON object: every rank's plan")
    a = p.parse_args(argv)
    try:
        a.sizes = [tuple(int(x) for x in size.split("x")) for size in a.sizes.split(",")]
    except ValueError:
        p.error(f"--sizes takes d_model x blocks, comma-separated (e.g. 64x4,256x4), got "
                f"{a.sizes!r}")
    if any(len(size) != 2 or min(size) < 1 or size[0] % 4 for size in a.sizes):
        p.error(f"--sizes: each is d_model x blocks, d_model a multiple of 4, got {a.sizes}")
    for flag in ("layers", "heads", "kv_heads", "ffn", "vocab", "micro_batch_size",
                 "comm_buffer_mb", "hidden", "seq", "pp", "vpp", "sharding", "dp",
                 "micro_batches", "steps"):
        if getattr(a, flag) is not None and getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(a, flag)}")
    if a.main_grad and a.dtype == "fp32":
        p.error("--main-grad keeps fp32 grads beside bf16 params: drop --dtype fp32")
    if a.model == "demo":
        fixed = [f"--{f.replace('_', '-')}" for f in ("heads", "kv_heads", "ffn", "vocab",
                                                      "tied", "mlp", "dtype")
                 if getattr(a, f) is not None] + ["--flash-attention"] * a.flash_attention
        if fixed or a.optimizer != "adamw":
            p.error(f"{' '.join(fixed) or '--optimizer'} does not apply to the demo LM (4 "
                    "heads, MLP 4 x d_model, its text's vocabulary, tied, AdamW, fp32 or "
                    "--main-grad); pass --model NAME and the shape you want")
        shape = Shape(a.layers or 4, a.hidden or 64, 4, 4, 4 * (a.hidden or 64), 1,
                      a.seq or 64, True, "gelu")
    else:
        named = PUBLIC[a.model]
        given = {k: getattr(a, k) for k in ("layers", "hidden", "heads", "ffn", "vocab", "seq",
                                            "tied", "mlp") if getattr(a, k) is not None}
        shape = replace(named, **given)
        shape = replace(shape, kv_heads=a.kv_heads or (shape.heads if "heads" in given
                                                       else named.kv_heads))
    if shape.hidden % shape.heads or shape.heads % shape.kv_heads:
        p.error(f"the heads must divide the width and the kv heads the heads: got width "
                f"{shape.hidden}, {shape.heads} heads, {shape.kv_heads} kv heads")
    from relgrad_demo.cli import layout_problem  # the main job's rules, written once
    if problem := layout_problem(a.pp, a.vpp, shape.layers, a.micro_batches, a.sharding,
                                 a.free_grads_in_comm):
        p.error(problem)
    if a.split_param and a.sharding > 1 and a.optimizer == "lamb":
        p.error("sharding v2 (--split-param) steps flat 1-D slices, so it needs an "
                "element-wise optimizer (adamw, sgd); lamb reads whole-param norms: use v1")
    layout = Layout(a.pp, a.vpp, a.sharding, a.dp, a.split_param, a.overlap, a.micro_batches,
                    a.micro_batch_size or (4 if a.model == "demo" else 1),
                    "bf16" if a.main_grad or a.dtype == "bf16" else "fp32", a.main_grad,
                    a.optimizer, a.comm_buffer_mb, a.sharding > 1)
    overridden = [] if a.model == "demo" else [f"--{k.replace('_', '-')}" for k in (
        "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq", "tied", "mlp")
        if getattr(a, k) is not None]
    name = a.model if not overridden else f"{a.model}'s shape with {' '.join(overridden)}"
    model = None if a.model == "demo" else public_model(name, shape, layout,
                                                        a.flash_attention)
    return a, shape, model, layout


def describe(layout, seq):
    """What runs, in one line: degrees, sharding, whose buffers, micro-batches, dtypes."""
    pp, d = layout.pp, layout.sharding
    what = [f"pp {pp} x sharding {d} x dp {layout.dp} = {pp * d * layout.dp} ranks"]
    if layout.vpp > 1:
        what.append(f"{layout.vpp} virtual stages per rank")
    if d > 1:
        what.append("sharding v2" if layout.split_param else "sharding v1")
    if not _groups(layout, [[0]], [0])[0]:
        what.append("no fused grad buffers")
    elif layout.overlap and pp > 1:
        what.append(f"the pipeline's {'dp' if d == 1 else 'sharding'} overlap")
    else:
        what.append("sharding's own overlap" if layout.overlap else "v2's own buffers")
    grads = "fp32 main grads" if layout.main_grad else f"{layout.dtype} grads"
    return (", ".join(what) + f"; {layout.micro_batches} micro-batches of "
            f"{layout.micro_batch_size} x {seq} tokens; {layout.dtype} params, {grads}, "
            f"{layout.optimizer}")


def print_plan(model, layout, plans, activations):
    """The most loaded rank (highest peak with release off): its parts, its bytes at each
    phase boundary per mode, between steps and at the peak, what release saves; then where
    the activations come from and what the plan leaves out."""
    top = max(plans, key=lambda r: (r["peak"]["off"], -r["rank"]))
    low = top["between"]["on"]
    name, div = ("GiB", 2**30) if low >= 2**30 else ("MiB", 2**20) if low >= 2**23 else (
        "KiB", 2**10)

    def show(nbytes):
        return f"{nbytes / div:,.{2 if name == 'GiB' else 1}f}"
    total = sum(sum(l.params) for l in model.layers) - (
        model.layers[-1].params[model.tied] if model.tied is not None else 0)
    for line in (f"plan: {model.name}, {total:,} params ({model.about})",
                 f"layout: {describe(layout, model.seq)}",
                 f"most loaded rank: {top['rank']} (stage {top['stage']}, sharding rank "
                 f"{top['sharding_rank']}): {top['params']} params, {top['elements']:,} "
                 f"elements; {name}:"):
        print(textwrap.fill(line, 100, subsequent_indent="  ", break_on_hyphens=False))
    for part, value in top["parts"].items():
        if part == "runtime":
            print(f"  {'runtime':<22}{' / '.join(show(v) for v in value.values())} "
                  f"({' / '.join(value)})")
        elif value:
            kinds = " / ".join(dict.fromkeys(b[0] for b in top["buffers"]))
            note = {"grads": f" in {len(top['buffers'])} fused buffer(s), {kinds}" if kinds
                    else " (tensors of their own)", "activations in flight":
                    " at the 1st backward"}.get(part, "")
            print(f"  {part:<22}{show(value):>10}{note}")
    modes = list(top["rows"])
    print(f"\n{name} held at the phase boundaries of one 1F1B step\n{'':<21}|"
          + "".join(f"{m:>10}" for m in modes))
    lines = [(row, [top["rows"][m][i] for m in modes]) for i, row in enumerate(ROWS)]
    lines += [(label, [top[key][m] for m in modes])
              for label, key in (("between steps", "between"), ("peak", "peak"))]
    for label, values in lines:
        print(f"{label:<21}|" + "".join(f"{show(v):>10}" for v in values))
    for m in modes[1:]:
        saved = [(top[w]["off"] - top[w][m], top[w]["off"]) for w in ("between", "peak")]
        print(f"release {'on' if m == 'on' else '+ free'} saves {show(saved[0][0])} "
              f"{name} between steps ({100 * saved[0][0] / saved[0][1]:.1f} % of off's) and "
              f"{show(saved[1][0])} {name} at the peak ({100 * saved[1][0] / saved[1][1]:.1f} %)")
    for label, text in (("activations", activations), ("left out", LEFT_OUT)):
        print(textwrap.fill(f"{label}: {text}", 100, subsequent_indent="  ",
                            break_on_hyphens=False))


def main(argv=None):
    """`relgrad.py --plan` / `--plan-check`; returns the exit status."""
    args, shape, model, layout = parse_args(sys.argv[1:] if argv is None else argv)
    if args.plan_check:
        return check(args.sizes, args.steps, args.timeout)
    runtime, source = None, KORTHIKANTI
    if args.flash_attention:
        source = source.replace("5*a*s/h", "0 (flash attention keeps no scores)")
    if model is None:  # the demo LM: its layers measured here, its runtime by a short job
        argv = demo_argv(args, shape, layout)
        model = demo_model(job_opts(argv))
        runtime, source = runtime_of(*run_job(at_width(argv, 4))), MEASURED
    plans = plan(model, layout, runtime)
    if args.json:
        print(json.dumps({"model": model.name, "about": model.about, "layout": asdict(layout),
                          "phases": list(ROWS), "ranks": plans}))
    else:
        print_plan(model, layout, plans, source)
    return 0


def demo_argv(args, shape, layout):
    """The main job's flags (relgrad_demo.cli) for the demo LM of --plan's flags."""
    argv = ["--pp", layout.pp, "--vpp", layout.vpp, "--sharding", layout.sharding, "--dp",
            layout.dp, "--micro-batches", layout.micro_batches, "--micro-batch-size",
            layout.micro_batch_size, "--block", shape.seq, "--d-model", shape.hidden,
            "--layers", shape.layers, "--steps", args.steps, "--timeout", args.timeout]
    argv += (["--split-param"] * layout.split_param + ["--no-overlap"] * (not layout.overlap)
             + ["--main-grad"] * layout.main_grad + ["--free-grads-in-comm"] * layout.free)
    argv += ["--comm-buffer-mb", layout.comm_buffer_mb] * (layout.comm_buffer_mb is not None)
    argv += ["--data", args.data] * (args.data is not None)
    return [str(x) for x in argv]


def at_width(argv, d_model):
    """The main job's flags `argv` with `--d-model d_model`."""
    i = argv.index("--d-model")
    return argv[:i + 1] + [str(d_model)] + argv[i + 2:]


def job_opts(argv):
    """The opts the main job runs with for its flags `argv` (its own checks apply: a bad
    flag ends in one line, status 2)."""
    from relgrad_demo import cli
    return cli.parse_args(argv)[1]


def run_job(argv):
    """The main job of `argv` run as `python relgrad.py --json` runs it, on local ranks:
    (its --json object, its opts). Raises RuntimeError if it fails."""
    import contextlib
    import io
    from relgrad_demo import cli
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = cli.main(argv + ["--json"])
    if status:
        raise RuntimeError(f"the main job with {' '.join(argv)} ended with status {status}")
    return json.loads(out.getvalue()), job_opts(argv)


# ============================================================================================
# --plan-check: the demo LM's plan against the allocator, three sizes, two layouts
# ============================================================================================

SIZES = ((128, 4), (256, 4), (512, 6))  # (d_model, blocks): about 0.8M, 3.2M and 19M params
LAYOUTS = (("the main job's layout (pp 2 x sharding 2, v1)", []),
           ("--peers' layout (sharding 2, v2, no pipeline)", ["--pp", "1", "--split-param"]))
BOUNDS = {"between": 0.03, "peak": 0.10}  # relative errors; the buffers' bytes are exact


def compare(plans, summary, layout):
    """The plan against the main job's --json `summary`, per rank and mode: {"rank", "mode",
    and (plan, measured) bytes for "between", "peak", "buffer" and each of ROWS ("rows")}."""
    gelem = 4 if layout.main_grad or layout.dtype == "fp32" else 2
    out = []
    for r in plans:
        k = r["rank"]
        buffer = (sum(b[2] for b in r["buffers"]) * gelem,
                  sum(b["bytes"] for b in summary["config"]["fused_buffers"][k]))
        for mode, m in summary["modes"].items():
            measured = m["phase_bytes"][k] + [m["eval_peak_bytes"][k]]
            out.append({"rank": k, "mode": mode, "buffer": buffer,
                        "between": (r["between"][mode], m["idle_bytes_allocator"][k]),
                        "peak": (r["peak"][mode], m["peak_bytes"][k]),
                        "rows": list(zip(r["rows"][mode], measured))})
    return out


def error(pair):
    """plan / measured - 1 of a (plan, measured) pair."""
    return pair[0] / pair[1] - 1


def out_of_bounds(rows):
    """What in `compare`'s rows breaks BOUNDS or is not exact (a list of lines)."""
    return ([f"rank {r['rank']} {r['mode']} {what} {100 * error(r[what]):+.1f} %"
             for r in rows for what in BOUNDS if abs(error(r[what])) > BOUNDS[what]]
            + [f"rank {r['rank']} buffer {r['buffer'][0]:,} B planned, {r['buffer'][1]:,} B "
               "measured" for r in rows if r["buffer"][0] != r["buffer"][1]])


def check(sizes, steps, timeout):
    """The main job at `sizes` ((d_model, blocks) each) on LAYOUTS, release off, on and free,
    against the plan: per size the worst rank's errors per mode and the buffers, then a
    verdict. Returns 1 if a figure is out of BOUNDS or a buffer is not exact, else 0."""
    bad = []
    print(f"the demo LM's plan against the main job's --json ({steps} steps, modes off, on, "
          f"free), KiB;\nerror: plan / measured - 1 at the worst rank; bounds: between steps "
          f"{BOUNDS['between']:.0%}, peak {BOUNDS['peak']:.0%}, fused buffers exact")
    for title, flags in LAYOUTS:
        runtimes = {}
        for d_model, blocks in sizes:
            argv = [str(x) for x in flags + ["--d-model", d_model, "--layers", blocks, "--steps",
                                             steps, "--free-grads-in-comm", "--timeout",
                                             timeout]]
            if blocks not in runtimes:  # the runtime's own bytes, per layout and depth
                runtimes[blocks] = runtime_of(*run_job(at_width(argv, 4)))
            summary, opts = run_job(argv)
            layout = layout_of(opts)
            rows = compare(plan(demo_model(opts), layout, runtimes[blocks]), summary, layout)
            print(f"\n{title}: d_model {d_model}, {blocks} blocks, "
                  f"{summary['config']['model']['params']:,} params\n{'mode':<5}| "
                  f"{'between steps: plan / measured, error':<42}| peak: the same")
            for mode in summary["modes"]:
                cells = []
                for what in ("between", "peak"):
                    worst = max((r for r in rows if r["mode"] == mode),
                                key=lambda r: abs(error(r[what])))
                    planned, measured = worst[what]
                    cells.append(f"{planned / 1024:>11,.1f} / {measured / 1024:>11,.1f} "
                                 f"{100 * error(worst[what]):+5.1f} % (rank {worst['rank']})")
                print(f"{mode:<5}| {cells[0]:<42}| {cells[1]}")
            exact = sum(r["buffer"][0] == r["buffer"][1] for r in rows)
            print(f"buffers exact: {exact} of {len(rows)} (rank, mode); " + ", ".join(
                f"rank {r['rank']} {r['buffer'][1] / 1024:,.1f}" for r in rows
                if r["mode"] == "off"))
            bad += [f"{title.split(' (')[0]}, d_model {d_model}: {line}"
                    for line in out_of_bounds(rows)]
    verdict = (f"{len(bad)} out of bounds: " + "; ".join(bad)) if bad else (
        "every figure within bounds")
    print(textwrap.fill(f"\nverdict: {verdict}", 100, subsequent_indent="  ",
                        replace_whitespace=False))
    return 1 if bad else 0
