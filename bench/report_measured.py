"""Write bench/measured/README.md from the JSON results beside it; never edit it by hand.

    python -m bench.report_measured           # rewrite bench/measured/README.md
    python -m bench.report_measured --check   # exit 1 if it differs from what the JSON gives

Every JSON result belongs to a bench (by its file name's start, `BENCHES`) and a
configuration (e.g. a train_step batch). Per (bench, configuration) the files of the
newest run are current and get a table each; older files are listed by name. A file's
commit and date are its own `run` entry (`bench.report.write_json` writes one, with the
versions that ran it) or else (no entry, or a run outside a git checkout) the commit that
added it to the repository; where the entry names the code that ran
(`code`), the earliest commit on this branch holding that code is its commit (a machine
the tree was synced onto may report a stale HEAD). Ratios are taken within one file (one run):
runs of the same arm on different days differ by more than most effects measured here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

MEASURED = Path(__file__).resolve().parent / "measured"
README = MEASURED / "README.md"

Table = tuple[list[str], list[list[str]]]
"""Column headers and rows of one markdown table."""


@dataclass(frozen=True)
class Result:
    path: Path
    data: dict[str, Any]
    commit: str
    date: datetime


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.3f}x" if value and base else ""


def _with_range(value: float, rounds: list[float] | None, digits: int, unit: str = "") -> str:
    """`value` and, where the run had rounds, their min-max: "1.04x (1.02-1.09)"."""
    text = f"{value:.{digits}f}{unit}"
    return text if not rounds else f"{text} ({min(rounds):.{digits}f}-{max(rounds):.{digits}f})"


def _offload_step(d: dict[str, Any]) -> Table:
    rows = []
    for r in d["rows"]:
        step_ms = [1e3 * t for t in r.get("step_s_rounds", ())]
        rows.append(
            [r["arm"], _with_range(r["step_s"] * 1e3, step_ms, 1)]
            + [_with_range(r["vs_floor"], r.get("vs_floor_rounds"), 2)]
            + [_with_range(r["serial_speedup"], r.get("serial_speedup_rounds"), 2)]
            + [_fmt(r.get("peak_gib"), 2)]
        )
    rounds = " (median; rounds' min-max)" if "rounds" in d else ""
    peak = "peak GiB (most of the rounds)" if rounds else "peak GiB"
    headers = ["arm", f"step ms{rounds}", f"x copy floor{rounds}"]
    return headers + [f"x faster than serial{rounds}", peak], rows


def _muon_offload_step(d: dict[str, Any]) -> Table:
    rounds = " (median; rounds' min-max)" if "rounds" in d else ""
    headers = ["matrix set", "momentum GiB"]
    headers += [f"{name}{rounds}" for name in ("unwrapped ms", "offloaded ms", "copy floor ms")]
    headers += [f"offloaded / unwrapped{rounds}", f"offloaded / max(floor, unwrapped){rounds}"]
    headers += ["peak GiB unwrapped / offloaded" + (" (most of the rounds)" if rounds else "")]
    headers += ["bitwise equal"]
    rows = [
        [name, _fmt(r["state_gib"], 2)]
        + [
            _with_range(r[f"{t}_ms"], r.get(f"{t}_ms_rounds"), 1)
            for t in ("unwrapped", "offloaded")
        ]
        + [_with_range(r["copy_floor_ms"], r.get("copy_floor_ms_rounds"), 1)]
        + [_with_range(r["offloaded_vs_unwrapped"], r.get("offloaded_vs_unwrapped_rounds"), 3, "x")]
        + [_with_range(r["offloaded_vs_floor"], r.get("offloaded_vs_floor_rounds"), 3, "x")]
        + [f"{r['unwrapped_peak_gib']:.2f} / {r['offloaded_peak_gib']:.2f}"]
        + [_fmt(r["bitwise_equal"])]
        for name, r in d.items()
        if isinstance(r, dict) and "offloaded_ms" in r
    ]
    return headers, rows


def _muon_step(d: dict[str, Any]) -> Table:
    arms = [k[: -len("_ms")] for k in d if k.endswith("_ms") and k[: -len("_ms")] + "_all_ms" in d]
    base = d.get("torch.optim.Muon_ms")
    rows = [
        [arm, _fmt(d[f"{arm}_ms"]), _ratio(base, d[f"{arm}_ms"]), _fmt(d.get(f"{arm}_peak_gib"), 2)]
        for arm in arms
    ]
    # Runs before `peak_per_arm` reset the peak after each arm, its params still held: a
    # later arm's peak held the earlier arm's memory, the first arm's the probes'.
    peak = "peak GiB" if d.get("peak_per_arm") else "peak GiB (with earlier arms' memory)"
    return ["arm (elementwise / Newton-Schulz backend)", "step ms", "speed vs torch.optim.Muon",
            peak], rows  # fmt: skip


def _failed(entry: dict[str, Any]) -> str:
    """The cell of an arm or config the bench recorded as failed (`{"error": ...}`)."""
    return f"failed: {entry['error']}"


def _newton_schulz(d: dict[str, Any]) -> Table:
    rows = []
    for shape, entry in d["shapes"].items():
        triton = {k: v["ms"] for k, v in entry.items() if k.startswith("triton:") and "ms" in v}
        best = min(triton, key=triton.__getitem__) if triton else None
        plain = entry["plain"].get("ms")
        plain_cell = _fmt(plain, 3) if plain is not None else _failed(entry["plain"])
        rows.append(
            [shape, plain_cell, best or "", _fmt(triton.get(best), 3) if best else ""]
            + [_ratio(plain, triton[best]) if best and plain is not None else ""]
        )
    return ["shape", "plain torch ms", "fastest Triton config", "its ms", "speed vs plain"], rows


def _ns_aspect(d: dict[str, Any]) -> Table:
    rows = [
        ["x".join(map(str, e["shape"])), _fmt(e["aspect"])]
        + [_fmt(e.get("standard:torch", {}).get("ms"), 2)]
        + [_fmt(e.get("gram:torch", {}).get("ms"), 2)]
        + [_fmt(e.get("standard:triton", {}).get("ms"), 2)]
        + [_fmt(e.get("gram:triton", {}).get("ms"), 2)]
        for e in d["aspect_sweep"]["entries"]
    ]
    headers = ["shape", "aspect", "standard ms (torch)", "Gram ms (torch)"]
    return headers + ["standard ms (Triton)", "Gram ms (Triton)"], rows


def _ns_accuracy(d: dict[str, Any]) -> Table:
    rows = [
        [r["shape"], r["schedule"], r["spectrum"], r["default_path"]]
        + [f"{r['default_rel_err']:.2e}", f"{r['std:torch_rel_err']:.2e}"]
        + [f"{r['default_rel_err'] / r['std:torch_rel_err']:.2f}x"]
        for r in d["rows"]
    ]
    headers = ["shape", "schedule", "spectrum", "default path", "default error"]
    return headers + ["plain bf16 error", "default / plain"], rows


def _sym_kernel(d: dict[str, Any]) -> Table:
    rows = []
    for name, entry in d["entries"].items():
        best = d["fastest"].get(f"{name} sym")
        rows.append(
            [name, _fmt(entry["cublas"]["ms"], 3), best or ""]
            + [_fmt(entry[best]["ms"], 3) if best else ""]
            + [_ratio(entry["cublas"]["ms"], entry[best]["ms"]) if best else ""]
        )
    return ["matrices x m x k:dtype", "cuBLAS x xT ms", "fastest config", "its ms",
            "speed vs cuBLAS"], rows  # fmt: skip


def _plan_vs_measured(d: dict[str, Any]) -> Table:
    rows = [
        [r["phase"], _fmt(r["estimate"] / 2**20), _fmt(r["measured"] / 2**20), _fmt(r["ratio"], 3)]
        for r in d["rows"]
    ]
    return ["phase", "estimate MiB", "measured MiB", "estimate / measured"], rows


def _muon_comm(d: dict[str, Any]) -> Table:
    if "model" in d["results"][0]:
        rows = [
            [r["model"], r["role"], _fmt(r["ours_step_ms"], 2), _fmt(r["ours_exchange_ms"], 2)]
            + [_fmt(r["padded_exchange_ms"], 2)]
            + [_ratio(r["padded_exchange_ms"], r["ours_exchange_ms"])]
            for r in d["results"]
            if "role" in r
        ]
        # HSDP rows (estimated): the busiest rank's Newton-Schulz with owners spread or not
        rows += [
            [r["model"], f"busiest, replicate {r['replicate']}, {e['replica_owners']} (estimated)"]
            + [_fmt(e["ns_s_max"] * 1e3, 2), "", "", f"{e['bytes_sent_max'] / 2**20:.1f} MiB sent"]
            for r in d["results"]
            if (e := r.get("hsdp_estimate")) is not None
        ]
        return ["model", "rank", "step ms (HSDP rows: NS ms)", "exchange ms",
                "padded exchange ms", "speed vs padded"], rows  # fmt: skip
    rows = [
        [str(r["R"]), _fmt(r["ours_step_ms"], 2), _fmt(r["padded_a2a_ms"], 2)]
        + [_fmt(r["agrs_ms"], 2)]
        + [str(r["ours_wire_bytes_max"]), str(r["padded_wire_bytes"]), str(r["agrs_wire_bytes"])]
        for r in d["results"]
    ]
    return ["R", "ours ms", "padded all-to-all ms", "all-gather + reduce-scatter ms",
            "ours wire bytes (max rank)", "padded wire bytes", "agrs wire bytes"], rows  # fmt: skip


def _train_step(d: dict[str, Any]) -> Table:
    results = d["results"]

    def family(r: dict[str, Any]) -> str:  # the arms one "none" arm is the baseline of
        return r["arm"].rsplit("/", 1)[0] if "/" in r["arm"] else r["optimizer"]

    base = {
        family(r): r for r in results if r["arm"].rsplit("/", 1)[-1] == "none" and "error" not in r
    }
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["arm"], _failed(r)] + [""] * 6)
            continue
        b = base.get(family(r), {})
        window = r.get("window_ms_per_step")
        rows.append(
            [r["arm"] if "/" in r["arm"] else f"{r['optimizer']}/{r['arm']}"]
            + [_fmt(r["step_ms"]), _ratio(r["step_ms"], b.get("step_ms"))]
            + [_fmt(window), _ratio(window, b.get("window_ms_per_step"))]
            + [_fmt(r["peak_gib"], 2), _fmt(r.get("kept_mib"), 2)]
            + [", ".join(_fmt(t) for t in r.get("step_ms_runs", ()))]
        )
    # Runs before `peak_gib_runs` gave an arm that ran several times its first run's peak.
    peak = "peak GiB"
    if any("step_ms_runs" in r for r in results):
        merged = any("peak_gib_runs" in r for r in results)
        peak += " (most of an arm's runs)" if merged else " (first of an arm's runs)"
    return ["arm", "median step ms", "vs none", "window ms/step", "window vs none",
            peak, "kept MiB", "step ms of each run"], rows  # fmt: skip


def _writeback_paths(d: dict[str, Any]) -> Table:
    rows = [
        [r["path"], _fmt(r.get("blocks")), _fmt(r.get("gib_s")), _fmt(r["item_ms"], 2)]
        for r in d["rows"]
    ]
    return ["write-back path", "thread blocks", "GiB/s", "trainer's .item() ms"], rows


def _copy_interference(d: dict[str, Any]) -> Table:
    rows = [
        [f"{r['kernel']} ({r['what']})", r["condition"], _fmt(r["ms"], 3),
         f"{r['vs_alone']:.3f}x", f"{r['vs_alone_range'][0]:.3f}-{r['vs_alone_range'][1]:.3f}"]
        for r in d["summary"]
    ]  # fmt: skip
    return ["kernel", "copies beside it", "median ms", "vs alone", "range over rounds"], rows


def _triton_launch(d: dict[str, Any]) -> Table:
    rows = [
        [f"{r['m']} x {r['k']}", r["config"], r["arm"]]
        + (
            [f"failed: {r['error']}", "", ""]
            if "error" in r
            else [_fmt(r["host_us_median"]), _fmt(r["host_us_min"]), _bits(r["bit_equal"])]
        )
        for r in d["rows"]
    ]
    return ["m x k", "config", "arm", "host us/call", "min", "bits"], rows


def _bits(equal: bool | None) -> str:
    return "" if equal is None else ("equal" if equal else "DIFFER")


def _machine_drift(d: dict[str, Any]) -> Table:
    rows = [
        [name, *(_fmt(r[k], 2) for k in ("median", "p10", "p90", "min", "max")),
         f"{r['slow_share']:.1%}", _fmt(r["longest_slow_s"])]
        for name, r in d["summary"].items()
    ]  # fmt: skip
    slow = f"slow share (> {d['slow_share']:.0%} slower than the fastest tenth)"
    headers = ["series", "median", "p10", "p90", "min", "max", slow, "longest slow stretch s"]
    return headers, rows


def _train_step_config(d: dict[str, Any]) -> str:
    micro = d.get("micro_batches") or 1
    micro_text = f", {micro} micro-batches" if micro > 1 else ""
    # The GPU is part of the configuration: a ratio on one kind is no newer run of another's.
    return f"{d['model']}, batch {d['batch']} x 2048{micro_text}, {_device(d)}"


def _muon_comm_config(d: dict[str, Any]) -> str:
    return "model shapes" if "model" in d["results"][0] else "synthetic matrices"


@dataclass(frozen=True)
class Bench:
    prefix: str
    """File names that start with this are this bench's results."""
    command: str
    table: Callable[[dict[str, Any]], Table]
    config: Callable[[dict[str, Any]], str] = lambda d: ""


BENCHES = (  # longest prefix first: offload_step is a suffix of muon_offload_step
    Bench("muon_offload_step", "python -m bench.muon_offload_step", _muon_offload_step),
    Bench("offload_step", "python -m bench.offload_step", _offload_step),
    Bench("muon_step", "python -m bench.muon_step", _muon_step),
    Bench("muon_comm", "python -m bench.muon_comm", _muon_comm, _muon_comm_config),
    Bench("newton_schulz", "python -m bench.newton_schulz", _newton_schulz),
    Bench("ns_aspect", "python -m bench.newton_schulz --aspect-sweep", _ns_aspect),
    Bench("ns_accuracy", "python -m bench.ns_accuracy", _ns_accuracy),
    Bench("sym_kernel", "python -m bench.sym_kernel", _sym_kernel),
    Bench("triton_launch", "python -m bench.triton_launch", _triton_launch),
    Bench("plan_vs_measured", "python -m bench.plan_vs_measured", _plan_vs_measured),
    Bench("train_step", "python -m bench.train_step", _train_step, _train_step_config),
    Bench("writeback_paths", "python -m bench.writeback_paths", _writeback_paths),
    Bench("copy_interference", "python -m bench.copy_interference", _copy_interference),
    Bench("machine_drift", "python -m bench.machine_drift", _machine_drift),
)


def bench_of(path: Path) -> Bench:
    for bench in BENCHES:
        if path.name.startswith(bench.prefix):
            return bench
    raise ValueError(
        f"{path.name}: no bench in bench/report_measured.py's BENCHES starts its name; add "
        "one (prefix, command, table) for the bench that wrote it"
    )


def added_commits(folder: Path) -> dict[str, tuple[str, datetime]]:
    """File name -> (short commit, commit date) of the earliest commit that has it.

    `-m` lists merges' files too (a file can enter in a merge); the earliest date, not
    the log's order, picks the commit, so merging this branch elsewhere changes nothing.
    """
    log = subprocess.run(
        ["git", "log", "-m", "--format=@%h %cI", "--name-only", "--", "."],
        cwd=folder, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    added: dict[str, tuple[str, datetime]] = {}
    commit = None
    for line in log.splitlines():
        if line.startswith("@"):
            short, date = line[1:].split()
            commit = (short, datetime.fromisoformat(date))
        elif line and commit:
            name = Path(line).name
            if name not in added or commit[1] < added[name][1]:
                added[name] = commit
    return added


def code_commits(folder: Path, wanted: set[str]) -> dict[str, str]:
    """Code fingerprint (`bench.report.code_id`) -> the short hash of the earliest commit
    reachable from HEAD that holds that code, for the fingerprints in `wanted` found."""
    from bench.report import commit_code_id

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=folder, capture_output=True, text=True, check=True
        ).stdout

    root = Path(git("rev-parse", "--show-toplevel").strip())
    found: dict[str, str] = {}
    for short in git("rev-list", "--reverse", "--abbrev-commit", "HEAD").split():
        if len(found) == len(wanted):
            break
        code = commit_code_id(short, root)
        if code in wanted and code not in found:
            found[code] = short
    return found


def load_results(folder: Path = MEASURED) -> list[Result]:
    added = added_commits(folder)
    runs = {path: json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))}
    wanted = {(d.get("run") or {}).get("code") for d in runs.values()} - {None}
    by_code = code_commits(folder, wanted) if wanted else {}
    results = []
    for path, data in runs.items():
        run = data.get("run") or {}
        if run.get("commit"):  # None: run outside a git checkout
            commit = by_code.get(run.get("code"), run["commit"])
            date = datetime.fromisoformat(run["date"])
        elif path.name in added:
            commit, date = added[path.name]
        else:
            raise ValueError(
                f"{path.name} is not committed and has no 'run' entry: commit it, then run "
                "python -m bench.report_measured"
            )
        results.append(Result(path, data, commit, date))
    return results


def _experiment(result: Result) -> str:
    """What an unlanded experiment's run tried (`run.experiment`: a branch or a toggle the
    main line does not have), else "": its numbers are no configuration a user can run."""
    return (result.data.get("run") or {}).get("experiment", "")


def _device(d: dict[str, Any]) -> str:
    device = d.get("device") or d.get("gpu") or d.get("env", {}).get("gpu")
    return device or f"CPU ({d.get('backend', 'no backend')}, world {d.get('world', 1)})"


def _versions(d: dict[str, Any]) -> str:
    """ "torch X, CUDA Y, driver Z, Python W" from the run entry (`bench.report.run_info`),
    or the torch version older runs recorded themselves."""
    run = d.get("run") or {}
    if "torch" not in run:
        return f"torch {d.get('torch') or d['env']['torch']}"
    return (
        f"torch {run['torch']}, CUDA {run['cuda']}, driver {run['driver']}, Python {run['python']}"
    )


def _markdown(table: Table) -> list[str]:
    headers, rows = table
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def render(results: list[Result]) -> str:
    groups: dict[tuple[str, str], list[Result]] = {}
    for result in results:
        bench = bench_of(result.path)
        groups.setdefault((bench.prefix, bench.config(result.data)), []).append(result)
    lines = [
        "# Measured results",
        "",
        "Generated by `python -m bench.report_measured` from the JSON files in this folder;",
        "do not edit by hand (`tests/test_report_measured.py` checks it is current). Per bench",
        "and configuration, the newest run's files get a table each (experiments that did not",
        "land are only listed); ratios are within one file (one run). Logs (`*.log`) and",
        "pictures (`*.png`) beside them are the runs' raw output. Commit: the run's own, or",
        "else the commit that added the file.",
    ]
    for bench in BENCHES:
        for (prefix, config), members in groups.items():
            if prefix != bench.prefix:
                continue
            experiments = sorted((r for r in members if _experiment(r)), key=lambda r: r.path.name)
            members = [r for r in members if not _experiment(r)]
            newest = max((r.date for r in members), default=None)
            title = f"`{bench.command}`" + (f": {config}" if config else "")
            lines += ["", f"## {title}"]
            for result in sorted(members, key=lambda r: r.path.name):
                if result.date != newest:
                    continue
                d = result.data
                lines += ["", f"`{result.path.name}`: {_device(d)}, {_versions(d)}, "
                          f"commit {result.commit}, {result.date.date()}", ""]  # fmt: skip
                lines += _markdown(bench.table(d))
            older = sorted(r.path.name for r in members if r.date != newest)
            if older:
                lines += ["", "Older runs: " + ", ".join(f"`{name}`" for name in older) + "."]
            if experiments:
                listed = ", ".join(f"`{r.path.name}` ({_experiment(r)})" for r in experiments)
                lines += ["", f"Experiments, not landed (no table): {listed}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md is stale")
    args = parser.parse_args(argv)
    text = render(load_results())
    if args.check:
        if README.read_text() != text:
            print(f"{README} is stale: run python -m bench.report_measured", file=sys.stderr)
            return 1
        return 0
    README.write_text(text)
    print(f"wrote {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
