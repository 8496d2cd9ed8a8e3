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
