"""The main job's report: the `--json` object and the printed tables.

`summarize` folds the ranks' measures into one JSON object (bytes are ints, times seconds;
lists marked "per rank" are indexed by global rank):

    config       what ran (`effective_config`): degrees, micro-batches, the base strategy's
                 pp_configs / sharding_configs, optimizer, model size, each mode's fields, the
                 fused grad buffers per rank and what release frees in this layout
    stages       per rank, its pipeline stage
    phases       names of the phase boundaries of `phase_bytes`
    baseline     the mode the others are compared with ("off")
    modes        per mode ("off", "on"):
      losses                   per step, mean over the data replicas
      grad_norms               per step, the global grad norm before clipping (clip_norm 1.0)
      idle_bytes_allocator     per rank: the whole run's in-use bytes between steps (params,
                               optimizer state, grads, buffers), above the run's start;
                               median over the steps after step 1
      idle_grad_bytes_counted  per rank: our count of grad storages between steps (max after
                               step 1)
      peak_bytes               per rank: highest in-use bytes during a step, above the start
      peak_reserved_bytes      per rank, GPU only (null on CPU): the CUDA caching allocator's
                               highest reserved bytes during a step, for the whole process
                               (all modes' runs share its pools; not above the start).
                               Neither this nor the allocated figures count NCCL's own
                               buffers or the CUDA context, which nvidia-smi adds
      peak_phase               per rank: the phase that peak fell in ("forward", "backward",
                               "comm": waiting for the grad collectives, "step": the optimizer
                               step and release; null where unknown, e.g. on GPU)
      phase_bytes              per rank: bytes at each of `phases` in the last step (null:
                               no such boundary in this layout)
      eval_peak_bytes          per rank: highest bytes during an eval pass between steps
                               (forward only, no grad, a larger batch; --eval-every), the
                               highest over the evals; null without evals
      step_time_s              median wall time of a step (slowest rank), after step 1
      step_time_iqr_s          [first, third] quartile of the same
      step_times_s             per step, the slowest rank's wall time
      param_sha256             per rank: SHA-256 of its final params' bytes (hex)
      step_trace               per rank: the run's bytes over the last step and an eval
                               pass after it, the samples `--plot` draws: {"t_ms": ms since
                               the step began, "bytes": the run's bytes then, "phases":
                               [t_ms, bytes] at each of `phases` and at "eval start", "after
                               eval" (null: no such boundary), "buffer": [t_ms, bytes the
                               fused grad buffers hold] at the step's start and each change};
                               the first sample as the step begins, then one per 0.5 ms
                               (CPU; none on GPU) and each boundary's reading, one after the
                               step, garbage collected (held until the next step), then the
                               eval's (not counted in eval_peak_bytes)
      (other modes only, against the baseline:)
      idle_grad_bytes_allocator  per rank: baseline's idle_bytes_allocator minus this mode's:
                                 the grad bytes this mode frees between steps
      eval_peak_lower_bytes    per rank: baseline's eval_peak_bytes minus this mode's (null
                               without evals)
      step_time_ratio          per step this mode's time / the baseline's (interleaved):
                               {"median", "iqr", "steps", "verdict"}
      bitwise_equal            losses, grad norms and final params equal the baseline's
    bitwise_equal  every mode equals the baseline bit for bit
    plot         with --plot only: what the picture holds, read back from it
                 (`plot.draw_step`): {"file", "panels": per stage (its first rank) {"title",
                 "rank", "lines": per run {"run": the mode, "x": on the phase axis, "bytes"},
                 "marks": the phase boundaries, alike, "buffer": the band's edges, alike}}
"""
import dataclasses
import statistics

from relgrad_demo.job import EVAL_BATCHES, MODES, make_strategy
from relgrad_demo.phases import PHASES

WIDE = 0.2  # a ratio's middle half wider than this, spanning 1.0, decides nothing
MIN_TIMED = 3  # fewer timed steps than this (after step 1) decide nothing either


def quartiles(values):
    """(first quartile, median, third quartile) of `values` (one value: that value thrice)."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


def time_ratio(times, base_times, name="on", base="off"):
    """Per-step ratios `times[s] / base_times[s]` of runs trained in turns, summarized:
    {"median", "iqr": [q1, q3], "steps", "verdict"}; the verdict says faster / slower only
    when there are at least MIN_TIMED ratios and their middle half lies on one side of 1."""
    ratios = [t / b for t, b in zip(times, base_times)]
    q1, median, q3 = quartiles(ratios)
    if len(ratios) < MIN_TIMED:
        verdict = (f"too few timed steps to conclude ({len(ratios)}; step 1 is not counted "
                   f"when there are more): pass --steps {MIN_TIMED + 1} or more")
    elif q3 < 1:
        verdict = f"{name} is faster than {base}"
    elif q1 > 1:
        verdict = f"{name} is slower than {base}"
    elif q3 - q1 <= WIDE:
        verdict = "no difference beyond the spread"
    else:
        verdict = "spread too wide to conclude (busy machine?): rerun idle or with more --steps"
    return {"median": median, "iqr": [q1, q3], "steps": len(ratios), "verdict": verdict}


def _median(values):
    return None if None in values else int(statistics.median(values))


def _max(values):
    return None if None in values else max(values)


def effective_config(opts, ranks):
    """What ran: the baseline's strategy (overlap as the layout allows it), the optimizer,
    the model, each mode's fields, and each rank's fused grad buffers."""
    base = opts["modes"][0]
    strategy = make_strategy(opts, base)
    buffers = [r["runs"][base]["buffers"] for r in ranks]
    params = sum({r["stage"]: r["stage_params"] for r in ranks}.values())
    return {
        "processes": len(ranks), "pp_degree": strategy.pp_degree,
        "sharding_degree": strategy.sharding_degree, "dp_degree": strategy.dp_degree,
        "accumulate_steps": strategy.accumulate_steps,
        "micro_batch_size": strategy.micro_batch_size,
        "pp_configs": dataclasses.asdict(strategy.pp_configs),
        "sharding_configs": dataclasses.asdict(strategy.sharding_configs),
        "optimizer": ranks[0]["optimizer"], "lr": opts["lr"], "steps": opts["steps"],
        "model": {"params": params, "vocab": ranks[0]["vocab"], "d_model": opts["d_model"],
                  "blocks": opts["layers"], "block_chars": opts["block"],
                  "dtype": "bfloat16 + fp32 main_grad" if opts["main_grad"] else "float32"},
        "data": opts["data"] or "this repo's *.py and *.md", "seed": opts["seed"],
        "modes": {mode: MODES[mode] for mode in opts["modes"]},
        "fused_buffers": buffers,
        "release_frees": ("fused grad buffers" if any(buffers) else
                          "only the .grad tensors, as torch's zero_grad(set_to_none=True) "
                          "does: no rank holds a fused grad buffer in this layout"),
    }


def summarize(results, opts):
    """Fold the ranks' results of `job.train_job` into the JSON object `--json` prints."""
    ranks = sorted(results, key=lambda r: r["rank"])
    steps = range(opts["steps"])
    after1 = slice(1, None) if opts["steps"] > 1 else slice(None)
    base = opts["modes"][0]
    times = {mode: [max(r["runs"][mode]["time"][s] for r in ranks) for s in steps]
             for mode in opts["modes"]}
    modes = {}
    for mode in opts["modes"]:
        ms = [r["runs"][mode] for r in ranks]
        q1, median, q3 = quartiles(times[mode][after1])
        entry = modes[mode] = {
            "losses": [statistics.fmean(m["losses"][s] for m in ms) for s in steps],
            "grad_norms": ms[0]["grad_norms"],  # global norm before clipping, equal on all
            "idle_bytes_allocator": [_median(m["idle"][after1]) for m in ms],
            "idle_grad_bytes_counted": [max(m["counted"][after1]) for m in ms],
            "peak_bytes": [_max(m["peak"]) for m in ms],
            "peak_reserved_bytes": [_max(m["peak_reserved"]) for m in ms],
            "peak_phase": [_phase_of_max(m["peak"], m["peak_phase"]) for m in ms],
            "phase_bytes": [m["phases"] for m in ms],
            "eval_peak_bytes": [_max(m["eval_peak"]) if m["eval_peak"] else None for m in ms],
            "step_time_s": median, "step_time_iqr_s": [q1, q3], "step_times_s": times[mode],
            "param_sha256": [m["param_sha256"] for m in ms],
            "step_trace": [m["step_trace"] for m in ms],
        }
        if mode != base:
            entry["idle_grad_bytes_allocator"] = [
                None if None in (b, m) else b - m
                for b, m in zip(modes[base]["idle_bytes_allocator"], entry["idle_bytes_allocator"])]
            entry["eval_peak_lower_bytes"] = [
                None if None in (b, m) else b - m
                for b, m in zip(modes[base]["eval_peak_bytes"], entry["eval_peak_bytes"])]
            entry["step_time_ratio"] = time_ratio(times[mode][after1], times[base][after1],
                                                  mode, base)
            entry["bitwise_equal"] = all(r["equal"][mode] for r in ranks)
    return {"config": effective_config(opts, ranks), "stages": [r["stage"] for r in ranks],
            "phases": list(PHASES), "baseline": base, "modes": modes,
            "bitwise_equal": all(r["equal"][mode] for r in ranks for mode in opts["modes"])}


def _print_reserved(summary, names):
    """On GPU: the caching allocator's reserved peak per rank, and what no figure counts."""
    modes = summary["modes"]
    rows = [[modes[m]["peak_reserved_bytes"][r] for m in names]
            for r in range(len(summary["stages"]))]
    if all(None in row for row in rows):
        return  # CPU: no such figure
    print("CUDA reserved (the caching allocator's highest during a step, whole process, KiB): "
          + "; ".join(f"rank {r}: " + "/".join(kib(v) for v in row)
                      for r, row in enumerate(rows)) + f" ({'/'.join(names)})")
    print("neither allocated nor reserved bytes count NCCL's own buffers (per communicator) "
          "or the CUDA context; nvidia-smi shows them too")


def _phase_of_max(peaks, phases):
    if None in peaks or not peaks:
        return None
    return phases[max(range(len(peaks)), key=peaks.__getitem__)]


def kib(n, digits=1):
    """Bytes as KiB with thousands separators; 'n/a' for None."""
    return "n/a" if n is None else f"{n / 1024:,.{digits}f}"


def print_report(summary, steps=True):
    """Print the per-step losses (if `steps`), what ran, the per-rank memory table, the
    phase table, step times and the bitwise verdict of `summarize`'s output."""
    config, modes, base = summary["config"], summary["modes"], summary["baseline"]
    names, others = list(modes), [m for m in modes if m != base]
    if steps:
        for s in range(config["steps"]):
            print(f"step {s + 1:3d}  loss release "
                  + "  ".join(f"{m} {modes[m]['losses'][s]:.6f}" for m in names))
    _print_config(config)
    print("\nper rank, KiB held by each run above its start, from the allocator (between steps: "
          "median after\nstep 1; peak: highest during a step); counted: our count of the grad "
          "storages between steps")
    print(f"{'rank':>4} {'stage':>5} | {'between steps':^{11 * len(names) + 10 * len(others)}}"
          f" | {'counted':^{9 * len(names)}} | {'peak':^{10 * len(names)}}".rstrip())
    print(f"{'':>10} | " + "".join(f"{m:>11}" for m in names)
          + "".join(f"{base + '-' + m:>10}" for m in others) + " | "
          + "".join(f"{m:>9}" for m in names) + " | " + "".join(f"{m:>10}" for m in names))
    for r, stage in enumerate(summary["stages"]):
        print(f"{r:>4} {stage:>5} | "
              + "".join(f"{kib(modes[m]['idle_bytes_allocator'][r]):>11}" for m in names)
              + "".join(f"{kib(modes[m]['idle_grad_bytes_allocator'][r]):>10}" for m in others)
              + " | "
              + "".join(f"{kib(modes[m]['idle_grad_bytes_counted'][r]):>9}" for m in names)
              + " | " + "".join(f"{kib(modes[m]['peak_bytes'][r]):>10}" for m in names))
    print("phase of each run's peak: " + "; ".join(
        f"rank {r}: " + "/".join(str(modes[m]["peak_phase"][r]) for m in names)
        for r in range(len(summary["stages"]))) + f" ({'/'.join(names)})")
    _print_reserved(summary, names)
    _print_phases(summary, names)
    _print_times(modes, base, others)
    first = modes[base]["losses"]
    print(f"loss: {first[0]:.4f} -> {first[-1]:.4f}; release {' vs '.join(names)} bitwise equal "
          f"(losses and final params): {summary['bitwise_equal']}")


def _print_config(config):
    pp, model = config["pp_configs"], config["model"]
    overlap = [k for k in ("sharding_comm_overlap", "dp_comm_overlap") if pp[k]]
    if config["sharding_configs"]["comm_overlap"]:
        overlap.append("sharding's own comm_overlap")
    if pp["num_virtual_pipeline_stages"] > 1:
        overlap.append(f"{pp['num_virtual_pipeline_stages']} virtual stages per rank")
    print(f"\nran: pp {config['pp_degree']} x sharding {config['sharding_degree']} x dp "
          f"{config['dp_degree']} = {config['processes']} processes, {config['optimizer']}, "
          f"{' and '.join(overlap) or 'no comm overlap'};\n{config['accumulate_steps']} "
          f"micro-batches of {config['micro_batch_size']} x {model['block_chars']} characters "
          f"per step and replica; {model['params']:,} params (the tied embedding / head "
          f"weight counted once), {model['dtype']}")
    if not any(config["fused_buffers"]):
        print("no rank holds a fused grad buffer in this layout: release on only drops each "
              ".grad after the step,\nas torch's default zero_grad() (set_to_none=True) does; "
              "off zeroes them in place")
        return
    print("fused grad buffers per rank (release on allocates them at the first backward and "
          "frees them after\nthe step; off keeps them for the whole run):")
    for r, buffers in enumerate(config["fused_buffers"]):
        kinds = {}
        for b in buffers:
            key = f"{b['owner']} {b['action']}"
            count, nbytes = kinds.get(key, (0, 0))
            kinds[key] = (count + 1, nbytes + b["bytes"])
        text = ", ".join(f"{n} x {k}, {kib(nbytes)} KiB" for k, (n, nbytes) in kinds.items())
        print(f"  rank {r}: {text or 'none'}")


def _print_phases(summary, names):
    modes, ranks = summary["modes"], list(range(len(summary["stages"])))
    steps = len(modes[names[0]]["losses"])
    print(f"\nwhere the memory goes in step {steps}: KiB held by each run at the phase "
          "boundaries (- : none here)")
    width = 7 * len(names) + 1
    for chunk in (ranks[i : i + 4] for i in range(0, len(ranks), 4)):
        print((f"{'':<20}" + "".join(f" |{'rank ' + str(r):^{width}}" for r in chunk)).rstrip())
        print(f"{'phase':<20}" + "".join(" | " + "".join(f"{m:>7}" for m in names)
                                         for _ in chunk))
        for p, phase in enumerate(summary["phases"]):
            cells = []
            for r in chunk:
                values = [modes[m]["phase_bytes"][r] for m in names]
                cells.append("".join(f"{'-' if v is None or v[p] is None else kib(v[p], 0):>7}"
                                     for v in values))
            print(f"{phase:<20}" + "".join(" | " + c for c in cells))
        cells = ["".join(f"{kib(modes[m]['eval_peak_bytes'][r], 0):>7}" for m in names)
                 for r in chunk]
        print(f"{'eval (peak)':<20}" + "".join(" | " + c for c in cells))
    lowers = {m: modes[m]["eval_peak_lower_bytes"] for m in names[1:]}
    lowers = {m: v for m, v in lowers.items() if None not in v}
    if lowers:
        print(f"eval (peak): during the eval pass between steps (forward only, no grad, a "
              f"batch {EVAL_BATCHES} times a\ntraining one), peak KiB lower than "
              f"{names[0]}'s:")
        for m, lower in lowers.items():
            print(f"  {m}: " + ", ".join(f"rank {r} {kib(v)}" for r, v in enumerate(lower)))


def _print_times(modes, base, others):
    print(f"\nstep time, the runs trained in turns (the slowest rank's, after step 1):")
    for m, v in modes.items():
        q1, q3 = v["step_time_iqr_s"]
        print(f"  {m}: median {v['step_time_s'] * 1e3:.1f} ms, middle half "
              f"{q1 * 1e3:.1f}-{q3 * 1e3:.1f} ms")
    for m in others:
        ratio = modes[m]["step_time_ratio"]
        print(f"  {m}/{base} per step: median {ratio['median']:.3f}, middle half "
              f"{ratio['iqr'][0]:.3f}-{ratio['iqr'][1]:.3f}:\n    {ratio['verdict']}")
