"""The Colab install plan: one CUDA line per runtime, Colab's torch kept, a restart only when it is needed.

Runtimes are faked (torch version, its CUDA line, the GPU's compute capability); nothing is installed.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

import grpo_kit.colab_install as colab_install
from grpo_kit.colab_install import Runtime, plan_install, read_requirements

REQUIREMENTS = Path(__file__).resolve().parents[1] / "requirements-colab.txt"
REPO = "/content/grpo-kit"


def _plan(torch="2.11.0+cu130", cuda="13.0", capability=(8, 0)):
    return plan_install(
        Runtime(torch=torch, cuda=cuda, capability=capability, gpu="fake"), read_requirements(REQUIREMENTS), REPO
    )


def _chosen(plan):
    """The requirement lines a GPU plan installs: its first command, after ``python -m pip install -q``."""
    assert plan.commands[0][1:5] == ("-m", "pip", "install", "-q")
    return plan.commands[0][5:]


def _pins(plan):
    return {colab_install.requirement_name(line): line for line in _chosen(plan)}


def _vllm(plan):
    return _pins(plan).get("vllm", "").removeprefix("vllm==") or None


def test_cuda13_torch_2_11_gets_vllm_0_26_and_keeps_colabs_torch():
    plan = _plan()
    pins = _pins(plan)
    assert pins["vllm"] == "vllm==0.26.0"
    assert pins["torch"] == "torch==2.11.0+cu130"  # the exact installed build: pip cannot swap it
    assert "torchvision" not in pins and "torchaudio" not in pins  # vLLM's own pins pick the matching ones
    # xformers is a CUDA 12 build: never pinned here, and removed after Unsloth pulled it in.
    assert "xformers" not in pins
    assert plan.commands[-1][-4:] == ("uninstall", "-q", "-y", "xformers")


def test_cuda12_torch_gets_no_vllm_with_the_reason_and_a_cuda12_xformers():
    plan = _plan(torch="2.11.0+cu126", cuda="12.6", capability=(7, 5))
    pins = _pins(plan)
    assert "vllm" not in pins
    reason = next(r for r in plan.reasons if r.startswith("vLLM"))
    assert "CUDA 12.6" in reason and "Unsloth/transformers" in reason and "torch 2.11 + CUDA 13" in reason
    assert pins["xformers"] == "xformers==0.0.35" and pins["torch"] == "torch==2.11.0+cu126"
    assert not any("uninstall" in command for command in plan.commands)


def test_other_torch_versions_choose_their_own_vllm_or_none():
    assert _vllm(_plan(torch="2.13.0+cu130")) == "0.31.0"
    assert "vllm-bnb-plugin" in _pins(_plan(torch="2.13.0+cu130"))  # vLLM >= 0.28 loads 4-bit weights through it
    assert "vllm-bnb-plugin" not in _pins(_plan())  # vLLM 0.26 still has bitsandbytes in its tree
    assert _vllm(_plan(torch="2.12.0+cu130")) is None  # no vLLM pins torch 2.12
    older = _plan(torch="2.9.1+cu128", cuda="12.8")
    assert _vllm(older) is None and "xformers" not in _pins(older)  # 0.0.35 needs torch >= 2.10: pip picks


def test_t4_is_told_flashattention_is_missing_and_older_gpus_get_no_vllm():
    t4 = _plan(capability=(7, 5))
    assert _vllm(t4) == "0.26.0" and "no FlashAttention" in " ".join(t4.reasons)
    assert _vllm(_plan(capability=(7, 0))) is None  # a V100: vLLM 0.26's wheels have no sm70 kernels
    assert _vllm(_plan(capability=(6, 0))) is None


def test_every_other_line_of_the_file_is_installed_once():
    plan = _plan()
    names = [colab_install.requirement_name(line) for line in _chosen(plan)]
    assert len(names) == len(set(names))
    expected = {colab_install.requirement_name(line) for line in read_requirements(REQUIREMENTS)}
    assert set(names) == (expected - {"xformers", "torchvision", "torchaudio"}) | {"torch", "vllm"}
    kit = plan.commands[1]
    assert "--no-deps" in kit and REPO in kit and colab_install.EMBEDDED_MODEL in kit


def test_no_gpu_installs_the_cpu_kit_only():
    plan = plan_install(
        Runtime(torch="2.11.0+cu126", cuda="12.6", capability=None), read_requirements(REQUIREMENTS), REPO
    )
    flat = " ".join(" ".join(command) for command in plan.commands)
    assert "unsloth" not in flat and "vllm" not in flat and "CPU install" in plan.reasons[0]


def test_restart_only_when_an_imported_package_changed():
    same = colab_install.restart_message({"numpy": "2.0.2"}, {"numpy": "2.0.2"}, colab=True)
    assert "RESTART NEEDED" not in same and "No restart needed" in same
    gone = colab_install.restart_message({"numpy": "2.0.2", "ipython": "8"}, {"ipython": "8"}, colab=False)
    assert "RESTART NEEDED: numpy 2.0.2 -> removed was" in gone and "restart the Python kernel" in gone
    message = colab_install.restart_message({"numpy": "2.0.2"}, {"numpy": "2.3.1"}, colab=True)
    assert "numpy 2.0.2 -> 2.3.1" in message and "Runtime > Restart session" in message


def test_install_probes_in_a_child_runs_the_plan_and_reports_a_restart(monkeypatch, tmp_path, capsys):
    """The notebook's cell on a stand-in Colab: the probe answers for a CUDA 12 T4, pip is recorded, not run."""
    repo = tmp_path / "grpo-kit"
    repo.mkdir()
    (repo / "requirements-colab.txt").write_text(REQUIREMENTS.read_text())
    versions = iter([{"numpy": "2.0.2"}, {"numpy": "2.3.1"}])  # before / after the pip commands
    seen = []
    monkeypatch.setattr(colab_install, "loaded_distributions", lambda modules: seen.append(modules) or next(versions))
    calls = []

    def run(command, **kwargs):
        calls.append(command)
        if command[1] == "-c":  # the probe must not run in this process
            info = {"torch": "2.11.0+cu126", "cuda": "12.6", "capability": [7, 5], "gpu": "Tesla T4"}
            return types.SimpleNamespace(stdout="some warning\n" + json.dumps(info) + "\n")
        return types.SimpleNamespace(returncode=0)

    monkeypatch.setattr(colab_install.subprocess, "run", run)
    plan = colab_install.install(str(repo), loaded=["numpy", "IPython"], colab=True)
    assert calls[0][1:3] == ["-c", colab_install.PROBE] and calls[0][0] == sys.executable
    assert [tuple(c) for c in calls[1:]] == list(plan.commands) and "vllm" not in _pins(plan)
    lines = capsys.readouterr().out.splitlines()
    assert "GPU Tesla T4 (sm75)" in lines[0] and "vLLM skipped" in lines[1]
    assert "RESTART NEEDED: numpy 2.0.2 -> 2.3.1" in lines[-1]
    assert "Runtime > Restart session" in lines[-1] and seen == [["numpy", "IPython"]] * 2


def test_loaded_distributions_reads_what_is_imported():
    found = colab_install.loaded_distributions(["pytest", "json", "_pytest.python"])
    assert found == {"pytest": pytest.__version__}


def test_without_install_the_command_only_prints_the_plan(monkeypatch, capsys):
    """``python -m grpo_kit.colab_install`` on any machine: the plan for this checkout, and no pip run."""
    h100 = Runtime(torch="2.13.0+cu130", cuda="13.0", capability=(9, 0), gpu="H100")
    monkeypatch.setattr(colab_install, "probe_runtime", lambda: h100)
    monkeypatch.setattr(colab_install.subprocess, "run", lambda *a, **k: pytest.fail("nothing may be installed"))
    assert colab_install.main([]) == 0
    printed = capsys.readouterr().out
    assert "vLLM 0.31.0" in printed and "commands:" in printed
