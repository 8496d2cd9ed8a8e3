"""bench.train_step helpers that need no GPU."""

from __future__ import annotations

import pytest
import torch
from spawn_ranks import one_rank_group

from bench.train_step import _storage_bytes, device_state_tensors, selected_arms


class _NoStateOptimizer:
    """Like torchao's CPUOffloadOptimizer: no `state` attribute."""


def test_state_tensors_of_an_optimizer_without_state_is_empty():
    # torchao's arm crashed here after its timed window (H200), losing its measurement
    assert device_state_tensors(_NoStateOptimizer()) == []


def test_state_tensors_and_their_distinct_storage_bytes():
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.AdamW([p])
    p.grad = torch.ones(4)
    opt.step()
    tensors = device_state_tensors(opt)
    assert len(tensors) == 3  # step, exp_avg, exp_avg_sq
    shared = torch.zeros(8)
    assert _storage_bytes([shared[:4], shared[4:], torch.zeros(2)], torch.device("cpu")) == 40


def test_baselines_run_first_and_last_and_merge_into_one_row_with_their_spread():
    from bench.train_step import Arm, merge_runs, run_order

    none, a, b, c = Arm("adamw", "none"), Arm("adamw", "offload"), Arm("adamw", "x"), Arm("m", "y")
    assert run_order([none, a, b, c], 2) == [none, a, b, c, none]
    assert run_order([none, a, b, c], 3) == [none, a, none, b, c, none]
    assert run_order([a, b], 2) == [a, b]
    # --rounds: the other arms round-robin, the baselines spread among all their runs
    assert run_order([none, a, b], 3, rounds=2) == [none, a, b, none, a, b, none]
    assert run_order([none, a, b], 2, rounds=3) == [none, a, b, a, b, a, b, none]
    assert run_order([a, none, b], 1, rounds=2) == [a, none, b, a, b]
    runs = [
        {"arm": "adamw/none", "step_ms": 200.0, "window_ms_per_step": 201.0, "peak_gib": 1.0},
        {"arm": "adamw/offload", "step_ms": 210.0, "window_ms_per_step": 211.0, "peak_gib": 0.5},
        {"arm": "adamw/none", "step_ms": 180.0, "window_ms_per_step": 181.0, "peak_gib": 1.0},
    ]
    merged = merge_runs(runs)
    assert [r["arm"] for r in merged] == ["adamw/none", "adamw/offload"]
    assert merged[0]["step_ms"] == 190.0 and merged[0]["step_ms_runs"] == [200.0, 180.0]
    assert abs(merged[0]["spread"] - (200 / 180 - 1)) < 1e-12
    assert "spread" not in merged[1]


def test_each_arm_records_the_machine_it_ran_on(tmp_path, capsys):
    """The CPU smoke run: each arm's process measures the host's speed at a fixed loop
    (no link on the CPU) and the run prints it beside the arm's step."""
    pytest.importorskip("transformers")
    import json

    from bench.train_step import main

    out = tmp_path / "smoke.json"
    main(
        ["--device", "cpu", "--model", "hf-llama-tiny", "--arms", "adamw/none"]
        + ["--steps", "2", "--warmup", "1", "--baseline-runs", "1", "--json", str(out)]
    )
    (run,) = json.loads(out.read_text())["runs"]
    machine = run["machine"]
    assert machine["host_loop_ms"] > 0
    assert machine["h2d_gb_s"] is None and machine["both_gb_s"] is None
    assert f"host loop {machine['host_loop_ms']:.2f} ms" in capsys.readouterr().out


def _tiny_hf_llama_run(main, arm: str, flag: str, out) -> None:
    """`bench.train_step`'s `main` on the CPU: `arm` of hf-llama-tiny, one step, with `flag`."""
    main(
        ["--device", "cpu", "--model", "hf-llama-tiny", "--arms", arm]
        + ["--steps", "1", "--warmup", "1", "--baseline-runs", "1", flag, "--json", str(out)]
    )


def test_the_host_profile_names_the_offloaded_steps_own_functions(tmp_path, capsys):
    """--host-profile: per arm, the project's functions by host ms a step in the JSON, and
    the whole cProfile text next to it."""
    pytest.importorskip("transformers")
    import json

    from bench.train_step import HOST_PROFILE_TOP, main

    out = tmp_path / "host.json"
    _tiny_hf_llama_run(main, "adamw/offload+overlap", "--host-profile", out)
    runs = json.loads(out.read_text())["runs"]
    (run,) = [r for r in runs if r["arm"] == "adamw/offload+overlap"]
    functions = {f["function"].split(" ")[-1]: f for f in run["host_profile"]}
    assert "step" in functions and functions["step"]["calls_per_step"] == 1
    assert functions["step"]["function"].startswith("offload/cpu_offload.py:")
    assert all(f["ms_per_step"] > 0 for f in run["host_profile"])
    assert (tmp_path / "host.adamw-offload-overlap.host.txt").read_text().count("function calls")
    assert "host ms a step under cProfile, adamw/offload+overlap" in capsys.readouterr().out
    assert len(run["host_profile"]) <= HOST_PROFILE_TOP


def test_trace_search_profiles_auto_from_its_last_measured_step_until_it_settles(tmp_path):
    """--trace-search: a trace of the "auto" search's steps from the last measured one on
    (on the CPU it settles at the first choice, with nothing to search with: two steps,
    so two backwards whose every linear layer's grad is in it)."""
    pytest.importorskip("transformers")
    import gzip
    import json

    from bench.train_step import TRACE_SEARCH_STEPS, main
    from offload.residency import AUTO_MEASURED_STEPS, AUTO_WARMUP_STEPS

    out = tmp_path / "search.json"
    _tiny_hf_llama_run(main, "adamw/offload+overlap@auto", "--trace-search", out)
    (run,) = json.loads(out.read_text())["runs"]
    traced = run["search_steps"] - 1 - TRACE_SEARCH_STEPS[0]  # less the window's first
    assert traced == AUTO_WARMUP_STEPS + AUTO_MEASURED_STEPS + 1 - TRACE_SEARCH_STEPS[0] == 2
    trace = tmp_path / "search.adamw-offload-overlap-auto.search.trace.json.gz"
    events = json.loads(gzip.open(trace).read())["traceEvents"]
    grads = sum(e.get("name") == "MmBackward0" for e in events)
    linears = 2 * 7 + 1  # hf-llama-tiny: 2 layers of 7 projections, and the head
    assert grads == traced * linears  # one MmBackward0 node per linear layer a backward


def test_a_plain_arm_can_load_state_in_the_backward_and_names_its_bytes():
    arms = selected_arms("plain/offload+overlap,plain/offload+overlap+bwd=2GiB", [], "")
    assert [(a.mode, a.backward_load) for a in arms] == [
        ("offload+overlap", None),
        ("offload+overlap+bwd", 2 * 2**30),
    ]
    assert [a.name for a in arms] == ["plain/offload+overlap", "plain/offload+overlap+bwd=2GiB"]
    for bad in ("plain/offload+overlap+bwd", "plain/offload+overlap=2GiB", "plain/offload"):
        with pytest.raises(SystemExit, match="unknown arm"):
            selected_arms(bad, [], "")


def test_an_arm_loads_nothing_in_the_backward_with_zero_bytes():
    # +bwd=0 was refused, pointing at an arm without +bwd, which loads what the tuning
    # chooses: no arm measured a step without backward loads
    from bench.train_step import load_in_backward

    spec = "plain/offload+overlap+bwd=0B,muon/offload+overlap+bwd=0,adamw/offload+overlap+bwd"
    arms = selected_arms(spec + ",adamw/offload+overlap+bwd=1MiB,adamw/offload+overlap", [], "")
    assert [load_in_backward(a) for a in arms] == [False, False, True, 2**20, None]
    assert arms[0].name == "plain/offload+overlap+bwd=0B"
    assert arms[1].name == "muon/offload+overlap+bwd=0B"


def test_the_forward_loads_the_staged_chunks_the_backward_does_not_and_its_floor():
    from bench.train_step import copy_floor_ms, forward_load_bytes
    from offload import CPUOffloadOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(4)))
    state = 8 * sum(p.numel() for p in model.parameters())  # AdamW: two fp32 tensors
    opt = CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters()),
        chunk_bytes=state // 8,
        staging_slots=2,
        overlap_forward=model,
        load_in_backward=state // 2,
    )
    model(torch.ones(2, 16)).sum().backward()
    opt.step()
    opt.wait_for_optimizer_step()
    chunks, loaded = opt.plan.chunks, set(opt.schedule.loaded_in_backward)
    assert 0 < len(loaded) < len(chunks)
    expected = sum(c.invariant_bytes for i, c in enumerate(chunks) if i not in loaded)
    assert forward_load_bytes(opt) == expected
    assert state // 2 - state // 8 <= expected <= state - state // 2
    assert copy_floor_ms(48 * 10**9, 48.0) == 1000.0
    assert copy_floor_ms(1, None) is None


def test_gpu_budget_bounds_the_auto_arms_only():
    from bench.train_step import build_optimizer, parse_args

    args = parse_args(["--gpu-budget", "3MiB", "--device", "cpu"])
    assert args.gpu_budget == 3 * 2**20
    for spec, budget in (("adamw/offload+overlap@auto", 3 * 2**20), ("adamw/offload", None)):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        (arm,) = selected_arms(spec, [], "")
        opt = build_optimizer(arm, model, args)
        assert opt.gpu_budget_bytes == budget
        opt.close()


def test_an_arm_sets_environment_variables_in_its_own_process(tmp_path):
    """`arm%NAME=VALUE`: an A/B of an environment switch in one run; the arm's process sees
    it (here the Newton-Schulz backend it records), the other arms and this process not."""
    pytest.importorskip("transformers")
    import json
    import os

    from bench.train_step import main

    arms = selected_arms("muon/none%MUON_NS_BACKEND=torch%X_Y=a=b,adamw/none", [], "")
    assert [a.name for a in arms] == ["muon/none%MUON_NS_BACKEND=torch%X_Y=a=b", "adamw/none"]
    assert arms[0].env == (("MUON_NS_BACKEND", "torch"), ("X_Y", "a=b"))
    for bad in ("muon/none%MUON_NS_BACKEND", "muon/none%=torch", "muon/none%1A=b"):
        with pytest.raises(SystemExit, match="not NAME=VALUE"):
            selected_arms(bad, [], "")
    out = tmp_path / "env.json"
    main(
        ["--device", "cpu", "--model", "hf-llama-tiny", "--steps", "1", "--warmup", "1"]
        + ["--arms", "muon/none,muon/none%MUON_NS_BACKEND=torch", "--baseline-runs", "1"]
        + ["--json", str(out)]
    )
    runs = {r["arm"]: r for r in json.loads(out.read_text())["runs"]}
    assert runs["muon/none"]["backends"]["ns"] == "auto"
    assert runs["muon/none%MUON_NS_BACKEND=torch"]["backends"]["ns"] == "torch"
    assert runs["muon/none%MUON_NS_BACKEND=torch"]["env"] == {"MUON_NS_BACKEND": "torch"}
    assert "MUON_NS_BACKEND" not in os.environ


def test_an_arm_whose_process_dies_before_it_runs_is_an_error_not_a_hang(tmp_path):
    """A bad environment value fails the child's imports, before it can report."""
    pytest.importorskip("transformers")
    import json

    from bench.train_step import main

    out = tmp_path / "dead.json"
    main(
        ["--device", "cpu", "--model", "hf-llama-tiny", "--steps", "1", "--warmup", "1"]
        + ["--arms", "muon/none%MUON_NS_BACKEND=bogus", "--baseline-runs", "1"]
        + ["--json", str(out)]
    )
    (run,) = json.loads(out.read_text())["runs"]
    assert run["error"] == "arm process exited with 1"


def test_an_arm_run_several_times_takes_every_figure_from_all_its_runs():
    """A first run is often cold (train_step_hf_b4_muon_d214643_h200.json: muon/none's first
    30 steps averaged 1005.5 ms in its first run, 333.0 in its second): times are the
    median of the runs, memory the most any run took, each run's value kept beside."""
    from bench.train_step import merge_runs

    def run(step, returns, first_30, peak, reserved, kept):
        return {
            "arm": "adamw/none",
            "step_ms": step,
            "window_ms_per_step": step + 1,
            "step_returns_ms": returns,
            "first_30_mean_ms": first_30,
            "peak_gib": peak,
            "reserved_gib": reserved,
            "kept_mib": kept,
        }

    runs = [
        run(200.0, 9.0, 1005.5, 1.0, 2.0, 5.0),
        run(180.0, 7.0, 333.0, 1.5, 2.5, 4.0),
        run(190.0, 8.0, 350.0, 1.2, 2.2, 6.0),
    ]
    (merged,) = merge_runs(runs)
    assert merged["first_30_mean_ms"] == 350.0
    assert merged["first_30_mean_ms_runs"] == [1005.5, 333.0, 350.0]
    assert merged["step_returns_ms"] == 8.0 and merged["step_returns_ms_runs"] == [9.0, 7.0, 8.0]
    assert merged["peak_gib"] == 1.5 and merged["peak_gib_runs"] == [1.0, 1.5, 1.2]
    assert merged["reserved_gib"] == 2.5 and merged["kept_mib"] == 6.0
    assert "phases" not in merged
    # phases, where every run timed them: each phase's median (the floor reads none's)
    for r, (layers, host, step) in zip(
        runs, [(51.0, 50.0, 9.0), (38.0, 33.0, None), (40.0, 34.0, 9.5)], strict=True
    ):
        r["phases"] = {
            "layers": {"device_ms": layers, "host_ms": host},
            "step()": {"device_ms": step, "host_ms": 1.0},
        }
    (merged,) = merge_runs(runs)
    assert merged["phases"] == {
        "layers": {"device_ms": 40.0, "host_ms": 34.0},
        "step()": {"device_ms": None, "host_ms": 1.0},
    }
    (merged,) = merge_runs([runs[0], {**runs[1], "phases": None}])
    assert merged["phases"] == runs[0]["phases"]  # not every run: the first run's
    # on the CPU no memory is measured: None stays None, an absent field absent
    cpu = [{**r, "peak_gib": None, "reserved_gib": None} for r in runs]
    for r in cpu:
        del r["kept_mib"]
    (merged,) = merge_runs(cpu)
    assert merged["peak_gib"] is None and merged["reserved_gib"] is None
    assert "kept_mib" not in merged
    # a run that failed is counted, not silently dropped (it printed "ran 2 times")
    (merged,) = merge_runs([*runs[:2], {"arm": "adamw/none", "error": "OutOfMemoryError"}])
    assert merged["step_ms_runs"] == [200.0, 180.0]
    assert merged["failed_runs"] == ["OutOfMemoryError"]
    failing = [{"arm": "adamw/none", "error": error} for error in ("OutOfMemoryError", "Timeout")]
    (merged,) = merge_runs(failing)
    assert merged["failed_runs"] == ["OutOfMemoryError", "Timeout"]


def _measure_tiny_plain_arm(warmup: int) -> dict:
    """`bench.train_step.measure` of the plain/none arm, a tiny model, 3 timed steps, in
    this process (a one-rank gloo group), where a test's monkeypatches hold."""
    from bench import train_step

    args = train_step.parse_args(
        ["--device", "cpu", "--model", "tiny", "--batch", "1", "--seq", "8"]
        + ["--steps", "3", "--warmup", str(warmup)]
    )
    (arm,) = selected_arms("plain/none", [], "")
    with one_rank_group():
        return train_step.measure(arm, args, torch.device("cpu"))


def test_a_slow_arm_times_as_many_steps_as_every_other_arm(monkeypatch):
    """Each arm times --steps steps however long its warmup took, so the medians a ratio
    compares are over as many steps (a time budget gave a slow arm fewer)."""
    import itertools
    import types

    from bench import train_step

    clock = itertools.count(step=100.0)  # every reading 100 s after the last: a slow arm
    monkeypatch.setattr(train_step, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    result = _measure_tiny_plain_arm(warmup=2)
    assert result["timed_steps"] == 3 and len(result["step_ms_all"]) == 3
    assert result["warmup_steps"] == 2
    assert result["first_30_steps"] == 5  # the "first 30 steps' mean" says over how many
    assert result["steps_1_to_30_steps"] == 4  # and the mean without the first step


def test_first_steps_means_over_other_step_counts_get_no_ratio(capsys):
    # an "auto" arm's first 30 steps against a baseline that ran 9: one-off costs (warmup,
    # the search) spread over other counts made the ratio say nothing
    from bench.train_step import print_table

    def row(arm, mean, steps):
        return {"optimizer": "adamw", "arm": arm, "step_ms": 100.0, "window_ms_per_step": 100.0,
                "step_returns_ms": 1.0, "peak_gib": None, "reserved_gib": None,
                "timed_steps": 6, "first_30_mean_ms": mean, "first_30_steps": steps}  # fmt: skip

    # the auto arm alone has steps 1-30's mean (a baseline from a run before it had none)
    auto_row = {**row("adamw/auto", 130.0, 30), "steps_1_to_30_mean_ms": 125.0}
    auto_row["steps_1_to_30_steps"] = 30
    print_table([row("adamw/none", 120.0, 9), row("adamw/offload", 150.0, 9), auto_row])
    out = capsys.readouterr().out
    lines = out.split("the first 30 steps' mean")[1].splitlines()
    offload = next(line for line in lines if line.startswith("adamw/offload"))
    auto = next(line for line in lines if line.startswith("adamw/auto"))
    assert "1.250x" in offload
    assert "x" not in auto.split("ms")[1].split("(")[0] and "over " not in auto
    lines = out.split("steps 1-30's mean")[1].splitlines()
    auto = next(line for line in lines if line.startswith("adamw/auto"))
    assert "125.0 ms" in auto and "x" not in auto.split("ms")[1]


def test_a_full_collection_is_named_with_the_window_step_it_fell_in():
    """A lone slow step in a window may be Python's full collection holding the host:
    the bench records which step had one, and how long it took."""
    import gc

    from bench.timing import GcPauses, full_collections

    seen = []
    with GcPauses() as pauses:
        gc.collect()  # before any step: the window's set-up
        for k in range(4):
            before = len(pauses.events)
            gc.collect(0)  # a young collection: not a full one
            if k == 2:
                gc.collect()
            seen.append((before, len(pauses.events)))
        gc.collect()  # after the last step: the window's tail
    full = full_collections(pauses, seen)
    assert full["steps"] == [2]
    assert len(full["ms"]) == 1 and full["ms"][0] > 0
    assert len(full["outside_steps_ms"]) == 2
    assert gc.callbacks.count(pauses._callback) == 0


def test_each_run_records_its_full_collections_in_the_window(monkeypatch):
    import gc

    from bench import train_step

    timed = train_step.timed_window
    step = torch.optim.AdamW.step

    def collecting_step(self, *args, **kwargs):  # inside each step: a full collection
        gc.collect()
        return step(self, *args, **kwargs)

    def window(step, steps, device):  # and one between the window's steps
        calls = iter(range(steps))
        return timed(lambda: (next(calls) == 1 and gc.collect(), step()), steps, device)

    monkeypatch.setattr(torch.optim.AdamW, "step", collecting_step)
    monkeypatch.setattr(train_step, "timed_window", window)
    full = _measure_tiny_plain_arm(warmup=1)["gc_full_in_window"]
    assert full["steps"] == [0, 1, 2] and min(full["ms"]) > 0
    assert len(full["outside_steps_ms"]) == 1
    assert train_step.describe_gc(full).startswith("; full gc in the window's steps")
    assert train_step.describe_gc({"steps": [], "ms": [], "outside_steps_ms": []}) == ""


def test_auto_steps_1_to_30_leave_out_the_first_step(monkeypatch):
    """The first step pins slabs and builds: it is timed apart (synced), and the means
    without it ("steps 1-30") hold none of it. Each step() call here takes 1 s but the
    first, 1000 s (a made-up clock)."""
    import time

    from bench import train_step
    from offload import CPUOffloadOptimizer

    now, calls = [0.0], [0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    real_step = CPUOffloadOptimizer.step

    def step(self, *args, **kwargs):
        calls[0] += 1
        now[0] += 1000.0 if calls[0] == 1 else 1.0
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(CPUOffloadOptimizer, "step", step)
    args = train_step.parse_args(
        ["--device", "cpu", "--model", "tiny", "--batch", "1", "--seq", "8"]
        + ["--steps", "3", "--warmup", "1"]
    )
    (arm,) = selected_arms("adamw/offload+overlap@auto", [], "")
    with one_rank_group():
        result = train_step.measure(arm, args, torch.device("cpu"))
    assert result["search_steps"] > 1
    assert result["steps_1_to_30_mean_ms"] == 1000.0
    assert result["first_30_mean_ms"] > 1000.0


def _phases(**device_ms):
    names = {"to_layer_0": "to layer 0", "layers": "layers", "head": "head + loss"}
    phases = {names.get(k, k): {"device_ms": v, "host_ms": 0.0} for k, v in device_ms.items()}
    return {**phases, "backward": {"device_ms": 100.0, "host_ms": 0.0}}


def test_the_step_floor_is_none_without_its_step_plus_the_loads_beyond_its_forward():
    from bench.train_step import add_step_floors, step_floor_ms

    none = {
        "arm": "adamw/none",
        "optimizer": "adamw",
        "step_ms": 172.0,
        "phases": _phases(to_layer_0=3.0, layers=38.0, head=3.0, **{"step()": 9.0}),
    }
    slow_link = {"arm": "adamw/offload+overlap", "optimizer": "adamw", "step_ms": 206.0}
    slow_link["forward_load_floor_ms"] = 64.0  # 11 ms more than none's forward and step()
    assert step_floor_ms(slow_link, none) == 172.0 + 11.0
    hidden = {**slow_link, "forward_load_floor_ms": 50.0}  # within them
    assert step_floor_ms(hidden, none) == 172.0
    assert step_floor_ms(slow_link, {**none, "phases": None}) is None
    assert step_floor_ms({"step_ms": 1.0}, none) is None
    untimed = {**none, "phases": _phases(to_layer_0=None, layers=1.0, head=1.0, **{"step()": 1.0})}
    assert step_floor_ms(slow_link, untimed) is None

    plain = {"arm": "plain/offload+overlap", "optimizer": "adamw", "forward_load_floor_ms": 64.0}
    muon = {"arm": "muon/offload+overlap", "optimizer": "muon", "forward_load_floor_ms": 64.0}
    results = [none, dict(slow_link), plain, muon, {"arm": "adamw/offload", "optimizer": "adamw"}]
    add_step_floors(results)
    assert results[1]["step_floor_ms"] == 183.0
    # no plain/none nor muon/none ran: no floor, not adamw/none's
    assert "step_floor_ms" not in plain and "step_floor_ms" not in muon
    assert "step_floor_ms" not in results[4]
