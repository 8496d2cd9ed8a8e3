"""How long planning takes at scale: one rank's plan, and the planner's estimate.

    python -m bench.plan_scale
    python -m bench.plan_scale --preset qwen3-30b-a3b --ep 8 --fsdp 64,1024,8192 --replicate 1,8

One rank's plan is what `Muon` builds on its first step (`MuonPlan.build` and every
bucket's `ExchangePlan`), here from simulated coordinates of an `--one-rank-fsdp` mesh,
for rank 0 (it owns the most) and a middle rank. The estimate is
`muon_offload.estimate.estimate` (every rank screened, the picked ranks planned), per
mesh; `python -m muon_offload.plan` adds its imports and the per-bucket table.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from muon.model_shapes import PRESETS, from_preset, meta_module
from muon.planning import MuonPlan
from muon_offload.estimate import MeshSpec, _split, estimate


def one_rank_plan_seconds(preset: str, fsdp: int, ep: int, rank: int) -> tuple[float, MuonPlan]:
    """Seconds to build rank `rank`'s plan and lay out every exchange it runs, and the plan."""
    mesh = MeshSpec(fsdp, ep=ep)
    muon, _, _ = _split(meta_module(from_preset(preset)), None)
    layouts = [mesh.layout(shape, blocks, g, rank) for _, shape, blocks, g in muon]
    start = time.perf_counter()
    plan = MuonPlan.build(layouts)
    for bucket in plan.buckets:
        plan.exchange(bucket.index, frozenset(bucket.params))
    return time.perf_counter() - start, plan


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.plan_scale", description=__doc__)
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-30b-a3b")
    p.add_argument("--ep", type=int, default=8)
    p.add_argument("--fsdp", default="64,1024,8192", help="comma-separated FSDP sizes")
    p.add_argument("--replicate", default="1,8", help="comma-separated HSDP replica counts")
    p.add_argument("--one-rank-fsdp", type=int, default=8192)
    args = p.parse_args(argv)
    fsdp = args.one_rank_fsdp
    for rank in (0, fsdp // 2 + 1):
        seconds, _ = one_rank_plan_seconds(args.preset, fsdp, args.ep, rank)
        print(f"one rank's plan, fsdp {fsdp} ep {args.ep}, rank {rank}: {seconds:.3f} s")
    shapes = from_preset(args.preset)
    for replicate in (int(r) for r in args.replicate.split(",")):
        for size in (int(f) for f in args.fsdp.split(",")):
            start = time.perf_counter()
            model = estimate(shapes, MeshSpec(size, replicate, args.ep))
            seconds = time.perf_counter() - start
            print(
                f"estimate, fsdp {size} x replicate {replicate} (world {size * replicate}): "
                f"{seconds:.2f} s, {len(model.ranks)} ranks planned"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
