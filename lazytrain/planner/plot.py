"""Gantt chart of a simulated step (compute, PCIe, NVMe, host optimizer) with memory per tier over time.

matplotlib is the optional extra ``plot`` (``pip install lazytrain[plot]``) and is imported lazily."""
from __future__ import annotations

import io
import os

from ..files import write_bytes_atomic
from .simulate import SimResult

# The extensions plot_step writes: matplotlib's savefig formats that need nothing beside it (pgf needs LaTeX,
# raw and rgba are bare pixel buffers, newer ones depend on the matplotlib and Pillow versions)
FORMATS = ("png", "svg", "svgz", "pdf", "eps", "ps", "jpg", "jpeg", "tif", "tiff")

LANES = ["compute", "h2d", "d2h", "nvme_read", "nvme_write", "optimizer", "wait"]
# by the first word of a span's label: every kind the simulator draws has its own colour and legend entry
COLORS = {"fwd": "#4c72b0", "head": "#8172b2", "recompute": "#c44e52", "diff": "#55a868", "bwd": "#2e7d32",
          "weights": "#8c8c8c", "prefetch": "#dd8452", "offload": "#937860", "grads": "#64b5cd",
          "update": "#ccb974", "embedding/head": "#a1887f", "optimizer": "#e377c2", "clip_grad_norm_": "#bcbd22",
          "refresh": "#17becf", "next": "#7f7f7f"}
OTHER = "#999999"   # a kind without a colour of its own: drawn, and named "other" in the legend


def pyplot():
    """matplotlib.pyplot on the Agg backend; ImportError naming the extra where matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plotting needs matplotlib: pip install lazytrain[plot]") from e
    return plt


def unsupported_format(path: str) -> str | None:
    """Why :func:`plot_step` cannot write ``path`` (its extension names no format of :data:`FORMATS`), else
    None: so that ``lazytrain plan`` refuses it before solving, not when matplotlib does after."""
    ext = os.path.splitext(path)[1]
    if ext[1:].lower() in FORMATS:
        return None
    what = f"{ext!r} is not a plot format" if ext else "no extension to tell the plot format"
    return f"{what} (use {', '.join('.' + f for f in FORMATS)})"


def plot_step(sim: SimResult, path: str, title: str = "") -> str:
    """Draw ``sim``'s timeline and per-window memory to ``path`` (PNG, SVG, PDF, ...: :data:`FORMATS`, by
    extension)."""
    why = unsupported_format(path)
    if why:
        raise ValueError(f"{path}: {why}")
    plt = pyplot()
    fig, (ax, axm) = plt.subplots(2, 1, figsize=(14, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    drawn: dict[str, str] = {}   # the legend: each kind drawn, in order of first appearance
    for ev in sim.timeline:
        if ev.end <= ev.start:
            continue
        y = LANES.index(ev.lane)
        kind = ev.label.split()[0]
        drawn.setdefault(kind if kind in COLORS else "other", COLORS.get(kind, OTHER))
        ax.barh(y, ev.end - ev.start, left=ev.start, height=0.8, color=COLORS.get(kind, OTHER), edgecolor="none")
    ax.set_yticks(range(len(LANES)))
    ax.set_yticklabels(LANES)
    ax.invert_yaxis()
    ax.set_title(title or f"step {sim.step_time_s:.3f} s, {sim.tflops:.1f} TFLOPS, {sim.tokens_per_s:.0f} tokens/s")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in drawn.values()]
    ax.legend(handles, list(drawn), ncol=len(drawn) or 1, fontsize=7, loc="upper right")
    xs, tiers = [], {"hbm": [], "host": [], "nvme": []}
    for m in sim.memory:
        xs += [m["start"], m["end"]]
        for k in tiers:
            tiers[k] += [m[k] / 1e9] * 2
    for k, v in tiers.items():
        if any(v):
            axm.plot(xs, v, label=f"{k} (peak {max(v):.1f} GB)")
    axm.set_ylabel("GB")
    axm.set_xlabel("time (s)")
    axm.legend(fontsize=8)
    fig.tight_layout()
    image = io.BytesIO()   # drawn whole, then written over the old file: a failed write leaves it as it was
    try:
        fig.savefig(image, format=os.path.splitext(path)[1][1:].lower(), dpi=110)
    finally:
        plt.close(fig)
    write_bytes_atomic(path, image.getvalue(), "plot path")
    return path
