"""`--plot FILE`: one step's memory as a picture, release off vs on (or the `--peers` systems).

Draws, per rank, the bytes each run held over the last step of the job (its `step_trace` in
the `--json` object: the allocator's in-use bytes sampled every 0.5 ms on CPU, above the run's
start), with the phase boundaries of `phases.PHASES` marked and numbered on each line. With
release on, the fused grad buffer appears at the first backward and is gone after the step:
the on line starts and ends lower by the buffer. PNG or SVG, by the file's suffix. matplotlib
is imported here only, when a plot is asked for (the Agg canvas: no display needed).
"""
import math

from relgrad_demo.phases import PHASES

SUFFIXES = (".png", ".svg")
_LABELS = {"off": "release off", "on": "release on",
           "free": "release on + free_grads_in_comm"}


def _runs(summary, peers):
    """(name, label, step_trace per rank) of each run of a report or peers summary."""
    if peers:
        return [(name, name, v["step_trace"]) for name, v in summary["systems"].items()]
    return [(mode, _LABELS.get(mode, f"release {mode}"), v["step_trace"])
            for mode, v in summary["modes"].items()]


def _title(summary, peers):
    config = summary["config"]
    if peers:
        return (f"--peers: one step's memory per rank, {config['layout']}, "
                f"{config['params']:,} params (last of {config['steps']} steps)")
    return (f"One step's memory per rank, release off vs on: pp {config['pp_degree']} x "
            f"sharding {config['sharding_degree']} x dp {config['dp_degree']}, "
            f"{config['model']['params']:,} params (last of {config['steps']} steps)")


def draw_step(summary, path, peers=False):
    """Draw `summary` (`report.summarize` or, with `peers`, `peers.summarize`) into `path`.

    Returns what the figure holds, read back from it (for `--json` and its test): {"file":
    path, "panels": [{"title", "lines": [{"run", "t_ms", "bytes"}], "marks": [{"run",
    "t_ms", "bytes"}]}]}, one panel per rank, one line and one set of phase marks per run
    (`run`: the mode or system name). Raises ValueError for a suffix other than .png / .svg.
    """
    if not str(path).lower().endswith(SUFFIXES):
        raise ValueError(f"--plot {path}: the file must end in .png or .svg (the format)")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    class KiBLocator(MaxNLocator):  # round KiB ticks on an axis of bytes
        def tick_values(self, vmin, vmax):
            return super().tick_values(vmin / 1024, vmax / 1024) * 1024

    runs = _runs(summary, peers)
    n_ranks = len(runs[0][2])
    cols = min(2, n_ranks)
    rows = math.ceil(n_ranks / cols)
    fig = Figure(figsize=(6.4 * cols, 3.4 * rows + 1.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).reshape(-1)
    kib = FuncFormatter(lambda v, _: f"{v / 1024:,.0f}")
    for rank, ax in enumerate(axes[:n_ranks]):
        title = f"rank {rank}" if peers else (f"rank {rank} (stage {summary['stages'][rank]})"
                                              f"\n{_between_steps(summary, runs, rank)}")
        ax.set_title(title, fontsize=9)
        for k, (name, label, traces) in enumerate(runs):
            trace, color = traces[rank], f"C{k}"
            if trace is None:
                continue
            ax.plot(trace["t_ms"], trace["bytes"], color=color, lw=1.2, label=label, gid=name)
            marks = [(i, p) for i, p in enumerate(trace["phases"] or []) if p is not None]
            if marks:
                ax.scatter([p[0] for _, p in marks], [p[1] for _, p in marks], s=18,
                           color=color, zorder=3, gid=name)
                for i, (t, b) in marks:
                    ax.annotate(str(i + 1), (t, b), textcoords="offset points", xytext=(2, 3),
                                fontsize=7, color=color)
        ax.yaxis.set_major_locator(KiBLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]))
        ax.yaxis.set_major_formatter(kib)
        ax.set_xlabel("ms since the step began", fontsize=9)
        ax.set_ylabel("KiB held by the run", fontsize=9)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
    for ax in axes[n_ranks:]:
        ax.set_visible(False)
    axes[0].legend(fontsize=8, loc="upper right")
    fig.suptitle(_title(summary, peers), fontsize=11)
    fig.supxlabel("phase boundaries: " + ", ".join(f"{i + 1} {p}" for i, p in enumerate(PHASES))
                  + "; bytes from the allocator, above each run's start", fontsize=8)
    fig.savefig(path, dpi=110)
    return {"file": str(path), "panels": [_read_back(ax) for ax in axes[:n_ranks]]}


def _between_steps(summary, runs, rank):
    """How much less than off each run holds after the step, and the bytes of this rank's
    fused grad buffers (one line of text)."""
    base = runs[0][2][rank]
    buffers = sum(b["bytes"] for b in summary["config"]["fused_buffers"][rank])
    parts = [f"after the step {label} holds "
             f"{(base['bytes'][-1] - t[rank]['bytes'][-1]) / 1024:,.0f} KiB less than off"
             for _, label, t in runs[1:] if t[rank] is not None and base is not None]
    return "; ".join(parts + [f"fused grad buffers {buffers / 1024:,.0f} KiB"])


def _read_back(ax):
    """The data of `ax`'s run lines and phase marks, as the figure holds them."""
    lines = [{"run": line.get_gid(), "t_ms": [float(t) for t in line.get_xdata()],
              "bytes": [int(b) for b in line.get_ydata()]} for line in ax.get_lines()]
    marks = [{"run": c.get_gid(), "t_ms": [float(t) for t, _ in c.get_offsets()],
              "bytes": [int(b) for _, b in c.get_offsets()]} for c in ax.collections]
    return {"title": ax.get_title(), "lines": lines, "marks": marks}
