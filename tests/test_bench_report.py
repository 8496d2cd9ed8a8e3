"""Every bench JSON says what ran it: one `run` entry (`bench.report.write_json`) with the
versions, the commit and the date."""

from __future__ import annotations

import json
import platform
import subprocess

import torch

from bench import report


def test_every_written_result_records_the_versions_and_commit(tmp_path, capsys):
    out = tmp_path / "r.json"
    report.write_json(out, {"rows": []})
    run = json.loads(out.read_text())["run"]
    assert run["torch"] == torch.__version__
    assert run["cuda"] == torch.version.cuda
    assert run["python"] == platform.python_version()
    assert run["driver"] == report.driver_version()
    in_git = subprocess.run(["git", "rev-parse", "--git-dir"], cwd=report.ROOT, capture_output=True)
    assert bool(run["commit"]) == (in_git.returncode == 0)  # this checkout's; None outside git
    printed = capsys.readouterr().out
    assert f"torch {torch.__version__}, CUDA {torch.version.cuda}" in printed
    assert f"Python {platform.python_version()}" in printed


def test_outside_a_git_checkout_the_commit_is_none(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "ROOT", tmp_path)
    run = report.run_info()
    assert run["commit"] is None and "code" not in run


def test_the_driver_version_is_nvidia_smis_and_none_without_a_gpu(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 570.124.06\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert report.driver_version() is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert report.driver_version() == "570.124.06"
    smi.unlink()  # a GPU but no nvidia-smi
    assert report.driver_version() is None
