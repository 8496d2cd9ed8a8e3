"""bench.trace_summary on a synthetic Chrome trace: busy time, copy rates, compute gaps."""

from __future__ import annotations

import gzip
import json

from bench.trace_summary import load_events, summarize, union_ms


def _written(tmp_path, events: list[dict]):
    """`events` as a gzipped Chrome trace, as torch.profiler writes one."""
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def test_union_counts_overlaps_once():
    assert union_ms([(0, 1000), (500, 2000), (3000, 4000)]) == 3.0
    assert union_ms([]) == 0.0


def test_summary_of_a_copy_bound_trace(tmp_path):
    events = []
    for i in range(10):  # 1 ms kernels every 3 ms on stream 7; a 2.5 ms copy beside each
        t = i * 3000.0
        events.append(
            {"ph": "X", "cat": "kernel", "name": "k", "ts": t, "dur": 1000.0, "args": {"stream": 7}}
        )
        events.append(
            {
                "ph": "X",
                "cat": "gpu_memcpy",
                "name": "Memcpy HtoD (Pinned -> Device)",
                "ts": t + 100,
                "dur": 2500.0,
                "args": {"stream": 20, "bytes": 125_000_000},
            }
        )
    events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 0, "dur": 7})
    path = _written(tmp_path, events)

    s = summarize(load_events(path), steps=2, bins=10)

    assert s["compute_stream"] == 7
    assert s["streams"][7]["busy_ms_per_step"] == 5.0
    assert s["streams"][20]["busy_ms_per_step"] == 12.5
    copy = s["copies"]["Memcpy HtoD (Pinned -> Device) (stream 20)"]
    assert copy["gb_per_s"] == 50.0 and copy["count_per_step"] == 5
    assert s["compute_gaps"]["count_per_step"] == 4.5  # nine 2 ms gaps between ten kernels
    assert (
        s["compute_gaps"]["longest"][0]["others_busy"][20] == 0.8
    )  # copies cover 1.6 of each 2 ms gap
    assert s["runtime_calls"]["cudaMemcpyAsync"]["count_per_step"] == 0.5


def test_a_trainer_copy_queued_behind_another_streams_copy_is_counted(tmp_path):
    def event(cat, name, ts, dur, stream, correlation=None):
        args = {"stream": stream, "bytes": 1000}
        if correlation is not None:
            args["correlation"] = correlation
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}

    h2d = "Memcpy HtoD (Pinned -> Device)"
    events = [
        event("kernel", "k", 0.0, 1000.0, 7),
        event("gpu_memcpy", h2d, 500.0, 4000.0, 20),  # a load on a side stream
        # the trainer's copy, launched at 900 us and ready at 1000 (its stream's kernel
        # ends), starts when the load is done: 3.5 ms late, behind the load
        event("gpu_memcpy", h2d, 4500.0, 10.0, 7, correlation=1),
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaMemcpyAsync",
            "ts": 890.0,
            "dur": 10.0,
            "args": {"correlation": 1},
        },
        # another, launched late (at 6 ms), starts at once: no wait
        event("gpu_memcpy", h2d, 6005.0, 10.0, 7, correlation=2),
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaMemcpyAsync",
            "ts": 5990.0,
            "dur": 10.0,
            "args": {"correlation": 2},
        },
    ]
    path = _written(tmp_path, events)

    copies = summarize(load_events(path), steps=1, bins=4)["trainer_copies"]

    assert copies["count_per_step"] == 2
    assert copies["waited_ms_per_step"] == 3.5 + 0.005
    assert copies["waited_behind_ms_per_step"] == 3.5
    assert copies["longest_ms"] == 3.5


def test_an_optimizer_step_whose_host_work_the_device_did_not_cover_is_told(tmp_path):
    # compute kernels 0-10 ms and 30-40 ms; step() calls at 5-35 ms (the device idled
    # 20 ms of its 30) and 50-60 ms (after the last kernel: all 10 idle)
    events = [
        {"ph": "X", "cat": "kernel", "name": "k", "ts": lo, "dur": 10_000.0, "args": {"stream": 7}}
        for lo in (0.0, 30_000.0)
    ]
    events += [
        {"ph": "X", "cat": "user_annotation", "name": f"Optimizer.step#{n}.step", "ts": t, "dur": d}
        for n, t, d in (("A", 5_000.0, 30_000.0), ("A", 50_000.0, 10_000.0))
    ]
    projection = {"cat": "gpu_user_annotation", "name": "Optimizer.step#A.step", "dur": 1e4}
    events.append({"ph": "X", "ts": 30_000.0, "args": {"stream": 7}, **projection})  # no host call
    path = _written(tmp_path, events)

    steps = summarize(load_events(path), steps=2, bins=10)["optimizer_steps"]

    assert steps == [
        {"at_ms": 5.0, "host_ms": 30.0, "compute_idle_ms": 20.0},
        {"at_ms": 50.0, "host_ms": 10.0, "compute_idle_ms": 10.0},
    ]
