"""`--plot FILE`: one step's memory as a picture, phase by phase (or the `--peers` systems).

The x axis is the phases of one step (`phases.PHASES`, then an eval pass: "eval start", "after
eval"), at the same positions for every run: between two boundaries a sample sits at its share
of that stretch's time, so release off and on line up phase by phase. Per stage (its first
rank), the top panel draws what the allocator holds (each run's `step_trace` samples in
`--json`: in-use bytes every 0.5 ms on CPU, above the run's start; the boundary readings are
samples too, so each mark sits on its line) and the bottom panel the fused grad buffer's bytes
(the buffers' own allocate / free events): flat at the buffer's size with release off, 0 ->
buffer -> 0 with release on. With `--peers` one panel (rank 0): each system's line, its peak
marked. PNG or SVG, by the file's suffix; matplotlib is imported here only (the Agg canvas).
"""
from relgrad_demo.phases import PHASES

SUFFIXES = (".png", ".svg")
BOUNDARIES = PHASES + ("eval start", "after eval")
_TICKS = ("step\nstart", "1st\nbackward", "after 1st\nbackward", "last\nbackward",
          "collec-\ntives", "optimizer\nstep", "release /\nzero", "eval\nstart", "after\neval")
_LABELS = {"off": "release off", "on": "release on",
           "free": "release on + free_grads_in_comm"}


def phase_x(t_ms, phases):
    """`t_ms` (ms since the step began) on the phase axis: boundary i at x = i (the ones that
    are None skipped), linear in time between two; None outside the boundaries."""
    known = [(i, p[0]) for i, p in enumerate(phases) if p is not None]
    for (i, a), (j, b) in zip(known, known[1:]):
        if a <= t_ms <= b:
            return float(i) if b == a else i + (j - i) * (t_ms - a) / (b - a)
    return None


def _runs(summary, peers):
    """(name, label, step_trace per rank) of each run of a report or peers summary."""
    if peers:
        return [(name, name, v["step_trace"]) for name, v in summary["systems"].items()]
    return [(mode, _LABELS.get(mode, f"release {mode}"), v["step_trace"])
            for mode, v in summary["modes"].items()]


def _shown_ranks(summary, peers):
    """Rank 0 (peers), else the first rank of each stage."""
    if peers:
        return [0]
    return [summary["stages"].index(s) for s in sorted(set(summary["stages"]))]


def draw_step(summary, path, peers=False):
    """Draw `summary` (`report.summarize` or, with `peers`, `peers.summarize`) into `path`.

    Returns what the figure holds, read back from it (for `--json` and its test): {"file":
    path, "panels": [{"title", "rank", "lines": [{"run", "x", "bytes"}], "marks": [{"run",
    "x", "bytes"}], "buffer": [{"run", "x", "bytes"}]}]}: one panel per rank shown, one line
    and one set of marks per run (`run`: the mode or system name), `buffer` the band's edge.
    Raises ValueError for a suffix other than .png / .svg.
    """
    if not str(path).lower().endswith(SUFFIXES):
        raise ValueError(f"--plot {path}: the file must end in .png or .svg (the format)")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    runs, ranks = _runs(summary, peers), _shown_ranks(summary, peers)
    fig = Figure(figsize=(6.6 * len(ranks), 5.6) if not peers else (8.4, 4.6),
                 layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(1 if peers else 2, len(ranks), height_ratios=None if peers else [3, 1])
    panels = []
    for col, rank in enumerate(ranks):
        top = fig.add_subplot(grid[0, col])
        band = None if peers else fig.add_subplot(grid[1, col], sharex=top)
        title = (f"rank {rank}" if peers else f"rank {rank} (stage {summary['stages'][rank]})")
        top.set_title(title, fontsize=9)
        for k, (name, label, traces) in enumerate(runs):
            trace = traces[rank]
            if trace is None or not trace.get("phases"):
                continue
            _draw_run(top, band, name, label, trace, f"C{k}", peers)
        _style(top, band, max(len(t[rank]["phases"] or ()) for _, _, t in runs if t[rank]))
        panels.append(_read_back(top, band, title, rank))
    if peers:
        config = summary["config"]
        fig.suptitle(f"--peers, rank 0, {config['params']:,} params: what the allocator "
                     "holds over one step; dots: each system's peak", fontsize=10)
    else:
        config = summary["config"]
        fig.suptitle(f"One step of the main job, pp {config['pp_degree']} x sharding "
                     f"{config['sharding_degree']} x dp {config['dp_degree']}: what the "
                     "allocator holds (top) and the fused grad buffer in it (bottom)", fontsize=10)
    fig.savefig(path, dpi=110)
    return {"file": str(path), "panels": panels}


def _draw_run(top, band, name, label, trace, color, peers):
    phases = trace["phases"]
    xs, ys = [], []
    for t, b in zip(trace["t_ms"], trace["bytes"]):
        x = phase_x(t, phases)
        if x is not None:
            xs.append(x)
            ys.append(b)
    top.plot(xs, ys, color=color, lw=1.2, label=label, gid=name)
    if peers:
        peak = max(range(len(ys)), key=ys.__getitem__)
        top.scatter([xs[peak]], [ys[peak]], s=22, color=color, zorder=3, gid=name)
        top.annotate(f"{ys[peak] / 1024:,.0f} KiB", (xs[peak], ys[peak]), fontsize=7,
                     color=color, textcoords="offset points", xytext=(3, 3))
        return
    marks = [(i, p[1]) for i, p in enumerate(phases) if p is not None]
    top.scatter([i for i, _ in marks], [b for _, b in marks], s=14, color=color, zorder=3,
                gid=name)
    held = trace.get("buffer") or []
    end = max(i for i, _ in marks)
    bx = [phase_x(t, phases) for t, _ in held]
    bx = [0.0 if x is None else x for x in bx] + [float(end)]
    by = [b for _, b in held] + ([held[-1][1]] if held else [])
    band.fill_between(bx, 0, by, step="post", color=color, alpha=0.25, gid=name)
    band.step(bx, by, where="post", color=color, lw=1.2, gid=name)


def _style(top, band, n):
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    class KiBLocator(MaxNLocator):  # round KiB ticks on an axis of bytes
        def tick_values(self, vmin, vmax):
            return super().tick_values(vmin / 1024, vmax / 1024) * 1024

    kib = FuncFormatter(lambda v, _: f"{v / 1024:,.0f}")
    for ax in (top, band) if band is not None else (top,):
        ax.yaxis.set_major_locator(KiBLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]))
        ax.yaxis.set_major_formatter(kib)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
        ax.set_xticks(range(n))
    top.set_ylabel("KiB the allocator holds", fontsize=8)
    top.legend(fontsize=7, loc="upper right")
    last = band if band is not None else top
    last.set_xticklabels(_TICKS[:n], fontsize=7)
    if band is not None:
        top.tick_params(labelbottom=False)
        band.set_ylabel("KiB of fused\ngrad buffer", fontsize=8)
        band.set_ylim(0, band.get_ylim()[1] * 1.45)
        band.text(0.01, 0.97, "release off: held all the time (also in eval)   release on: "
                  "from the 1st backward to the release", transform=band.transAxes,
                  fontsize=7, va="top")


def _read_back(top, band, title, rank):
    """The data of the panel's lines, marks and band edges, as the figure holds them."""
    lines = [{"run": line.get_gid(), "x": [float(x) for x in line.get_xdata()],
              "bytes": [int(b) for b in line.get_ydata()]} for line in top.get_lines()]
    marks = [{"run": c.get_gid(), "x": [float(x) for x, _ in c.get_offsets()],
              "bytes": [int(b) for _, b in c.get_offsets()]} for c in top.collections]
    buffer = [] if band is None else [
        {"run": line.get_gid(), "x": [float(x) for x in line.get_xdata()],
         "bytes": [int(b) for b in line.get_ydata()]} for line in band.get_lines()]
    return {"title": title, "rank": rank, "lines": lines, "marks": marks, "buffer": buffer}
