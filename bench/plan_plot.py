"""Per-rank optimizer memory from `muon_offload.estimate` as a PNG: the busy and the idle rank,
with and without offload, one stacked bar each.

    python -m bench.plan_plot --preset qwen3-8b --fsdp 8 \
        --out bench/measured/plan_qwen3-8b_fsdp8.png

Takes `python -m muon_offload.plan`'s arguments. Each bar stacks what the optimizer holds on
the GPU at the step's peak: kept between steps (the state; with offload only GPU-resident
state, none by default), then the step's transient (offload's staging ring, allocated for
the step only; exchange buffers of the launches in flight, Newton-Schulz workspace,
momentum / AdamW temporaries). Needs matplotlib (`pip install -e .[plot]`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from muon_offload.estimate import ModelEstimate, StepMemory
from muon_offload.plan import estimate_from, parser

# (label, bytes of a StepMemory, colour)
PARTS = (
    ("optimizer state on the GPU (kept)", lambda m: m.state_bytes, "#4c72b0"),
    ("offload staging ring (step)", lambda m: m.staging_bytes, "#8172b2"),
    ("exchange buffers (step)", lambda m: m.transient.buffer_bytes, "#dd8452"),
    ("Newton-Schulz workspace (step)", lambda m: m.transient.ns_bytes, "#55a868"),
    ("momentum / AdamW temporaries (step)", lambda m: m.transient.other_bytes, "#c44e52"),
)


def plot(model: ModelEstimate, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gib = 2**30
    bars: list[tuple[str, StepMemory]] = []
    for offload in (False, True):
        for role, rank in (("busy", model.busiest), ("idle", model.idlest)):
            memory = rank.offload if offload else rank.no_offload
            where = "offload" if offload else "no offload"
            bars.append((f"{role}, rank {rank.rank}\n{where}", memory))
    fig, ax = plt.subplots(figsize=(9, 5.5), layout="constrained")
    x = list(range(len(bars)))
    bottom = [0.0] * len(bars)
    for label, part, colour in PARTS:
        heights = [part(memory) / gib for _, memory in bars]
        if not any(heights):
            continue
        ax.bar(x, heights, 0.6, bottom=bottom, label=label, color=colour)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    for i, (_, memory) in enumerate(bars):
        kept = memory.kept_bytes / gib
        ax.hlines(kept, i - 0.3, i + 0.3, colors="black", linewidth=1)
        ax.annotate(
            f"peak {memory.peak_bytes / gib:.2f}\nkept {kept:.2f}",
            (i, memory.peak_bytes / gib),
            xytext=(0, 4),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=9,
        )
    ax.set_xticks(x, [label for label, _ in bars])
    ax.set_ylabel("GiB per rank (optimizer only: params, grads, activations excluded)")
    ax.set_ylim(0, max(bottom) * 1.22)
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(prog="python -m bench.plan_plot")
    p.add_argument("--out", required=True, help="PNG path")
    args = p.parse_args(argv)
    try:
        model = estimate_from(args)
    except ValueError as error:  # one line, as the planner's own CLI says it
        p.error(str(error))
    mesh, s = model.mesh, model.settings
    title = (
        f"{args.preset or args.config}: fsdp {mesh.fsdp} x replicate {mesh.replicate}, "
        f"ep {mesh.ep}; bucket cap {s.bucket_cap_bytes / 2**20:.0f} MiB, max_inflight "
        f"{s.max_inflight}; offload {s.offload_chunk_bytes / 2**20:.0f} MiB chunks x "
        f"{s.offload_slots} slots\nbusy/idle: most/fewest Newton-Schulz FLOPs; "
        f"black line: kept between steps, above it the step's transient at its peak"
    )
    plot(model, args.out, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
