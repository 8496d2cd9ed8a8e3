"""bench/measured/README.md is what `bench.report_measured` makes of the JSON results: the
committed file is current, the newest run per bench and configuration gets the table, and
ratios are taken within one run."""

from __future__ import annotations

import json
import shutil
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import pytest

from bench import report_measured
from bench.report_measured import README, Result, load_results, render

ROOT = Path(__file__).resolve().parents[1]


def _in_full_git_checkout() -> bool:
    """A checkout with its whole history: a shallow clone lacks the commits that added the
    older JSON files, whose dates order the tables."""
    if shutil.which("git") is None:
        return False
    probe = subprocess.run(
        ["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True
    )
    return probe.returncode == 0 and probe.stdout.strip() == "false"


@pytest.mark.skipif(
    not _in_full_git_checkout(), reason="commits and dates come from the whole git history"
)
def test_committed_readme_is_what_the_json_gives():
    assert README.read_text() == render(load_results()), (
        "bench/measured/README.md is stale: run python -m bench.report_measured"
    )


def _train_step(name: str, day: int, arms: dict[str, float]) -> Result:
    data = {
        "torch": "2.13.0",
        "device": "GPU",
        "model": "m",
        "batch": 4,
        "micro_batches": 1,
        "results": [
            {"optimizer": "adamw", "arm": arm, "step_ms": ms, "peak_gib": 1.0}
            for arm, ms in arms.items()
        ],
    }
    return Result(Path(name), data, f"c{day}", datetime(2026, 1, day, tzinfo=timezone.utc))


def test_newest_run_gets_the_table_and_ratios_stay_in_their_run():
    old = _train_step("train_step_old.json", 1, {"adamw/none": 100.0, "adamw/offload": 300.0})
    new = _train_step("train_step_new.json", 2, {"adamw/none": 200.0, "adamw/offload": 250.0})
    text = render([old, new])
    assert "| adamw/offload | 250.0 | 1.250x |" in text  # against 200, its own run's none
    assert "300.0" not in text
    assert "Older runs: `train_step_old.json`." in text
    assert "commit c2, 2026-01-02" in text


def test_a_result_of_no_known_bench_names_the_file():
    with pytest.raises(ValueError, match="mystery_h200.json.*BENCHES"):
        report_measured.bench_of(Path("mystery_h200.json"))


def test_an_unlanded_experiment_is_listed_not_tabled_even_when_newest():
    landed = _train_step("train_step_landed.json", 1, {"adamw/none": 100.0, "adamw/offload": 120.0})
    trial = _train_step("train_step_trial.json", 2, {"adamw/none": 100.0, "adamw/offload": 300.0})
    trial.data["run"] = {"experiment": "branch exp/x, X=1"}
    text = render([landed, trial])
    assert "| adamw/offload | 120.0 | 1.200x |" in text
    assert "300.0" not in text
    listed = "Experiments, not landed (no table): `train_step_trial.json` (branch exp/x, X=1)."
    assert listed in text


def _git(repo: Path, *args: str) -> str:
    command = ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args]
    return subprocess.run(command, cwd=repo, capture_output=True, text=True, check=True).stdout


def _commit_all(repo: Path, message: str) -> str:
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", message)
    return _git(repo, "rev-parse", "--short", "HEAD").strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="fingerprints come from git")
def test_the_code_fingerprint_is_the_committed_codes_whatever_else_changes(tmp_path):
    from bench.report import code_id, commit_code_id

    _git(tmp_path, "init", "-q")
    (tmp_path / ".gitignore").write_text("__pycache__/\n")
    for name, text in [("offload/a.py", "a = 1\n"), ("bench/measured/r.json", "{}"), ("x.md", "")]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    _commit_all(tmp_path, "one")
    assert code_id(tmp_path) == commit_code_id("HEAD", tmp_path)
    (tmp_path / "bench/measured/r.json").write_text('{"new": 1}')  # a result, not code
    (tmp_path / "x.md").write_text("docs")  # outside the code
    (tmp_path / "offload/__pycache__").mkdir()
    (tmp_path / "offload/__pycache__/a.pyc").write_bytes(b"\0")  # ignored
    assert code_id(tmp_path) == commit_code_id("HEAD", tmp_path)
    (tmp_path / "offload/b.py").write_text("")  # new code, not committed
    assert code_id(tmp_path) != commit_code_id("HEAD", tmp_path)
    (tmp_path / "offload/b.py").unlink()
    (tmp_path / "offload/a.py").write_text("a = 2\n")
    assert code_id(tmp_path) != commit_code_id("HEAD", tmp_path)


@pytest.mark.skipif(shutil.which("git") is None, reason="fingerprints come from git")
def test_a_run_names_the_earliest_commit_holding_its_code_not_its_stale_head(tmp_path):
    from bench.report import code_id

    _git(tmp_path, "init", "-q")
    measured = tmp_path / "bench" / "measured"
    measured.mkdir(parents=True)
    (tmp_path / "offload").mkdir()
    (tmp_path / "offload/a.py").write_text("a = 1\n")
    first = _commit_all(tmp_path, "one")
    (tmp_path / "offload/a.py").write_text("a = 2\n")
    second = _commit_all(tmp_path, "two")
    code = code_id(tmp_path)
    (tmp_path / "x.md").write_text("docs")
    _commit_all(tmp_path, "three: docs only, the same code")
    run = _train_step("train_step_synced.json", 1, {"adamw/none": 1.0}).data
    run["run"] = {"commit": first, "date": "2026-01-01T00:00:00+00:00", "code": code}
    (measured / "train_step_synced.json").write_text(json.dumps(run))
    (result,) = load_results(measured)
    assert result.commit == second
    run["run"]["code"] = "0" * 12  # code no commit holds: what the run said
    (measured / "train_step_synced.json").write_text(json.dumps(run))
    (result,) = load_results(measured)
    assert result.commit == first


def test_a_train_step_table_says_whose_peak_it_shows():
    """Before merged rows kept each run's peak (`peak_gib_runs`), an arm that ran several
    times showed its first run's peak: the header says so for those runs, and for newer
    ones that the peak is the most of an arm's runs."""
    old = _train_step("train_step_old.json", 1, {"adamw/none": 100.0, "adamw/offload": 120.0})
    old.data["results"][0]["step_ms_runs"] = [100.0, 101.0]
    assert "| peak GiB (first of an arm's runs) |" in render([old])
    new = _train_step("train_step_new.json", 1, {"adamw/none": 100.0, "adamw/offload": 120.0})
    new.data["results"][0].update(step_ms_runs=[100.0, 101.0], peak_gib_runs=[1.0, 1.0])
    assert "| peak GiB (most of an arm's runs) |" in render([new])
    single = _train_step("train_step_one.json", 1, {"adamw/none": 100.0})
    assert "| peak GiB |" in render([single])


def _result(name: str, data: dict) -> Result:
    return Result(Path(name), data, "c1", datetime(2026, 1, 1, tzinfo=timezone.utc))


def test_offload_tables_give_the_rounds_range_beside_each_ratio():
    row = {"arm": "chunked", "step_s": 0.2, "vs_floor": 1.005, "serial_speedup": 1.8}
    rounds = {"step_s_rounds": [0.21, 0.19], "vs_floor_rounds": [1.05, 0.96]}
    rounds["serial_speedup_rounds"] = [1.7, 1.9]
    data = {"device": "GPU", "torch": "2.13.0", "rows": [{**row, "peak_gib": 9.5, **rounds}]}
    text = render([_result("offload_step_new.json", data)])
    assert "| chunked | 200.0 (190.0-210.0) | 1.00 (0.96-1.05) | 1.80 (1.70-1.90) | 9.50 |" in text
    old = {"device": "GPU", "torch": "2.13.0", "rows": [{**row, "peak_gib": 9.5}]}
    assert "| chunked | 200.0 | 1.00 | 1.80 | 9.50 |" in render([_result("offload_step.json", old)])
    muon = {"state_gib": 8.6, "unwrapped_ms": 250.0, "offloaded_ms": 260.0}
    muon |= {"copy_floor_ms": 200.0, "offloaded_vs_unwrapped": 1.04, "offloaded_vs_floor": 1.04}
    muon |= {"unwrapped_peak_gib": 27.2, "offloaded_peak_gib": 18.9, "bitwise_equal": True}
    muon |= {"unwrapped_ms_rounds": [250.0, 240.0], "offloaded_ms_rounds": [260.0, 262.0]}
    muon |= {"copy_floor_ms_rounds": [200.0, 210.0]}
    muon |= {
        "offloaded_vs_unwrapped_rounds": [1.04, 1.09],
        "offloaded_vs_floor_rounds": [1.04, 1.09],
    }
    text = render(
        [_result("muon_offload_step_new.json", {"device": "GPU", "torch": "2", "q": muon})]
    )
    cells = "| q | 8.60 | 250.0 (240.0-250.0) | 260.0 (260.0-262.0) | 200.0 (200.0-210.0) | "
    assert cells + "1.040x (1.040-1.090) | 1.040x (1.040-1.090) | 27.20 / 18.90 | yes |" in text


def test_the_table_line_gives_the_runs_versions():
    run = {"commit": "c1", "date": "2026-01-01T00:00:00+00:00", "torch": "2.13.0"}
    run |= {"cuda": "13.0", "driver": "570.124.06", "python": "3.12.3"}
    data = {"device": "GPU", "run": run, "rows": []}
    text = render([_result("offload_step_new.json", data)])
    assert "GPU, torch 2.13.0, CUDA 13.0, driver 570.124.06, Python 3.12.3, commit c1" in text


@pytest.mark.skipif(shutil.which("git") is None, reason="commits come from git")
def test_a_run_without_a_commit_takes_the_commit_that_added_it(tmp_path):
    _git(tmp_path, "init", "-q")
    measured = tmp_path / "bench" / "measured"
    measured.mkdir(parents=True)
    run = _train_step("train_step_x.json", 1, {"adamw/none": 1.0}).data
    run["run"] = {"commit": None, "date": "2026-01-01T00:00:00+00:00"}
    (measured / "train_step_x.json").write_text(json.dumps(run))
    added = _commit_all(tmp_path, "a run made outside a checkout")
    (result,) = load_results(measured)
    assert result.commit == added


def test_a_failed_arm_or_config_is_shown_as_failed_not_a_crash():
    # the benches record an arm that raised as {"error": ...}; rendering read its times
    failed = {"optimizer": "adamw", "arm": "adamw/offload", "error": "OutOfMemoryError: x"}
    run = _train_step("train_step_failed.json", 1, {"adamw/none": 100.0})
    run.data["results"].append(failed)
    ns = {
        "torch": "2.11.0",
        "device": "GPU",
        "shapes": {
            "4096x4096": {
                "plain": {"ms": 2.0},
                "triton:a": {"ms": 1.0},
                "triton:b": {"error": "CompilationError: y"},
            },
            "512x512": {"plain": {"error": "OutOfMemoryError: z"}, "triton:a": {"ms": 1.0}},
        },
    }
    when = datetime(2026, 1, 2, tzinfo=timezone.utc)
    text = render([run, Result(Path("newton_schulz_failed.json"), ns, "c2", when)])
    assert "| adamw/offload | failed: OutOfMemoryError: x |" in text
    assert "| 4096x4096 | 2.000 | triton:a | 1.000 | 2.000x |" in text
    assert "| 512x512 | failed: OutOfMemoryError: z | triton:a | 1.000 |  |" in text
