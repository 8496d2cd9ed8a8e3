"""bench/measured/README.md is what `bench.report_measured` makes of the JSON results: the
committed file is current, the newest run per bench and configuration gets the table, and
ratios are taken within one run."""

from __future__ import annotations

import shutil
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import pytest

from bench import report_measured
from bench.report_measured import README, Result, load_results, render

ROOT = Path(__file__).resolve().parents[1]


def _in_git_checkout() -> bool:
    if shutil.which("git") is None:
        return False
    probe = subprocess.run(["git", "rev-parse", "--git-dir"], cwd=ROOT, capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _in_git_checkout(), reason="commits and dates come from git history")
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
