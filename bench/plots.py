"""Pictures of bench results (matplotlib: the `plot` extra, `pip install -e '.[plot]'`).

Plot code lives here only; the library packages draw nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

GiB = 2**30


def _pyplot():
    try:
        import matplotlib
    except ImportError as err:
        raise SystemExit(
            "plots need matplotlib: pip install -e '.[plot]' (or pip install matplotlib)"
        ) from err
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_resident_sweep(
    results: Sequence[dict[str, Any]], optimizer: str, path: Path, title: str
) -> None:
    """Step time and peak memory against `offload_gpu_resident_bytes`, one optimizer.

    The no-offload arm is a dashed line (state all on the GPU), the full-offload arm
    (offload+overlap, nothing resident) the point at 0; "auto" is drawn beside the
    largest value, labelled (what it chose is in the run's log).
    """
    plt = _pyplot()
    mine = [r for r in results if r["optimizer"] == optimizer and "error" not in r]
    none = next((r for r in mine if r["arm"] == f"{optimizer}/none"), None)
    points = []
    for r in mine:
        if r["arm"] == f"{optimizer}/offload+overlap":
            points.append((0.0, "full offload", r))
        elif r.get("resident_bytes") is not None:
            label = "auto" if r["resident_bytes"] == "auto" else None
            points.append((r["resident_bytes"], label, r))
    numeric = [x for x, _, _ in points if isinstance(x, int | float)]
    right = max(numeric, default=0.0)
    beside = right * 1.1 if right else GiB / 4
    points = [(x if isinstance(x, int | float) else beside, lbl, r) for x, lbl, r in points]
    points.sort(key=lambda p: p[0])
    fig, (time_ax, mem_ax) = plt.subplots(2, 1, sharex=True, figsize=(7, 6))
    xs = [x / GiB for x, _, _ in points]
    for ax, key, ylabel in (
        (time_ax, "step_ms", "step ms (median)"),
        (mem_ax, "peak_gib", "peak GiB"),
    ):
        ys = [r[key] for _, _, r in points]
        if any(y is None for y in ys):
            ax.text(0.5, 0.5, f"no {key} on this device", transform=ax.transAxes, ha="center")
        else:
            ax.plot(xs, ys, "o-", label="offload + overlap")
            for x, (_, lbl, r) in zip(xs, points, strict=True):
                if lbl:
                    ax.annotate(lbl, (x, r[key]), textcoords="offset points", xytext=(4, 4))
        if none is not None and none[key] is not None:
            ax.axhline(none[key], color="gray", linestyle="--", label="no offload")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best")
    mem_ax.set_xlabel("gpu_resident_bytes (GiB)")
    time_ax.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def plot_timeline(
    lanes: dict[str, list[tuple[float, float]]], floor_s: float, path: str | Path, title: str
) -> None:
    """One lane per stream (H2D, update, D2H), a box per chunk, the copy floor as a line."""
    plt = _pyplot()
    names = list(lanes)
    fig, ax = plt.subplots(figsize=(10, 0.9 * len(names) + 1.6))
    colors = plt.get_cmap("tab10").colors
    for row, name in enumerate(names):
        for chunk, (start, end) in enumerate(lanes[name]):
            ax.broken_barh(
                [(1e3 * start, 1e3 * (end - start))],
                (row - 0.35, 0.7),
                facecolors=colors[chunk % len(colors)],
                edgecolors="black",
                linewidth=0.4,
            )
    floor_ms = 1e3 * floor_s
    ax.axvline(floor_ms, color="red", linestyle="--", label=f"copy floor {floor_ms:.1f} ms")
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel("ms since step() was called (one color per chunk, cycling)")
    ax.set_title(title)
    ax.legend(loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
