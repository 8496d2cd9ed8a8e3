"""Newton-Schulz accuracy: plain bf16 path vs the Triton path against an fp64 reference.

For every named schedule and a tall, wide, square, batched and Qwen3-8B-sized shape:
the relative Frobenius error of each bf16 path against the same iteration run in
fp64 (`zeropower(x.double(), backend="torch")`), and the band of singular values of
each result. Gaussian inputs, one seed per shape. Prints a table, writes JSON.

    python -m bench.ns_accuracy --out bench/results/ns_accuracy.json
    python -m bench.ns_accuracy --device cpu --divisor 16 --skip-triton   # smoke test
"""

from __future__ import annotations

import argparse

import torch

from bench.report import write_json
from muon.newton_schulz import SCHEDULES, zeropower

SHAPES = {
    "tall": (2048, 768),
    "wide": (768, 2048),
    "square": (1024, 1024),
    "batched": (4, 640, 1280),
    "qwen3-8b gate_proj": (12288, 4096),
}


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


def _band(x: torch.Tensor) -> tuple[float, float]:
    sv = torch.linalg.svdvals(x.float())
    return sv.min().item(), sv.max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--divisor", type=int, default=1, help="divide every dim (smoke tests)")
    parser.add_argument("--skip-triton", action="store_true")
    parser.add_argument("--out", default="bench/results/ns_accuracy.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    backends = ["torch"] if args.skip_triton else ["torch", "triton"]
    rows = []
    for seed, (kind, shape) in enumerate(SHAPES.items()):
        shape = tuple(s // args.divisor if i >= len(shape) - 2 else s for i, s in enumerate(shape))
        gen = torch.Generator(device=device).manual_seed(seed)
        x = torch.randn(*shape, device=device, generator=gen).bfloat16()
        for name, schedule in SCHEDULES.items():
            ref = zeropower(x.double(), schedule, backend="torch")
            row: dict[str, object] = {"shape": kind, "dims": list(shape), "schedule": name}
            row["ref_band"] = _band(ref)
            for backend in backends:
                out = zeropower(x, schedule, backend=backend)
                row[f"{backend}_rel_err"] = _rel(out, ref)
                row[f"{backend}_band"] = _band(out)
            rows.append(row)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {name}; relative error against the fp64 iteration")
    header = f"{'shape':<20} {'schedule':<14} {'fp64 sv band':>14}"
    for backend in backends:
        header += f" {backend + ' err':>11} {backend + ' sv band':>15}"
    if "triton" in backends:
        header += f" {'triton/torch':>12}"
    print(header)
    for row in rows:
        lo, hi = row["ref_band"]
        line = f"{row['shape']:<20} {row['schedule']:<14} {lo:>6.3f}-{hi:<7.3f}"
        for backend in backends:
            blo, bhi = row[f"{backend}_band"]
            line += f" {row[f'{backend}_rel_err']:>11.2e} {blo:>7.3f}-{bhi:<7.3f}"
        if "triton" in backends:
            line += f" {row['triton_rel_err'] / row['torch_rel_err']:>12.2f}"
        print(line)
    write_json(args.out, {"torch": torch.__version__, "device": name, "rows": rows})


if __name__ == "__main__":
    main()
