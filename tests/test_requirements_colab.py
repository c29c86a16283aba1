"""requirements-colab.txt, and each vLLM line the Colab install plan can choose, resolve on PyPI for a Colab GPU
runtime (Linux x86_64, CPython 3.12 and 3.13, glibc 2.35).

pip resolves for that target platform without installing anything (``--dry-run --only-binary=:all:``), given the
platform tags pip itself would use on glibc 2.35 (``PLATFORMS``; ``test_platforms_are_the_ones_pip_uses`` derives
them from pip's own tag code). It runs on any machine with PyPI access and is skipped when PyPI cannot be reached.

One resolution per distinct package set, four in all (``RESOLUTIONS``): the file itself on CPython 3.12 and on 3.13
(pip resolves for one Python version at a time, and wheels differ by version), and the two other plans the install
can choose (CUDA 12: no vLLM, xformers pinned; torch 2.13: vLLM 0.31), whose pins differ from the file's. pip reads
the metadata of ~230 wheels for each; ``--use-feature=fast-deps`` reads it with HTTP range requests instead of
downloading the wheels (the CUDA ones are GBs; it resolves the same set), and the four start together in the
background when the first is needed (``_resolve``), so their network waits overlap; ``make test`` runs this module
first (a ``network`` module: tests/conftest.py), on one of its two workers while the other starts the notebooks.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest

REQUIREMENTS = Path(__file__).resolve().parents[1] / "requirements-colab.txt"
INDEX = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
GLIBC = (2, 35)  # Colab runs Ubuntu 22.04
# What pip accepts on glibc 2.35 x86_64: manylinux_2_35 down to manylinux_2_5, the legacy aliases of 2_17/2_12/2_5,
# and plain linux. Some wheels of this set exist only for old tags (nvidia-nccl-cu13: manylinux_2_18 only).
LEGACY_ALIASES = {17: "manylinux2014_x86_64", 12: "manylinux2010_x86_64", 5: "manylinux1_x86_64"}
PLATFORMS = [
    tag for minor in range(GLIBC[1], 4, -1) for tag in (f"manylinux_2_{minor}_x86_64", LEGACY_ALIASES.get(minor)) if tag
] + ["linux_x86_64"]
PYPROJECT = REQUIREMENTS.with_name("pyproject.toml")


def _file_pins() -> dict[str, str]:
    """``{project: version}`` of every ``name==version`` line of requirements-colab.txt."""
    from grpo_kit.colab_install import read_requirements, requirement_name

    return {
        requirement_name(line): line.split("==", 1)[1]
        for line in read_requirements(REQUIREMENTS)
        if "==" in line and ";" not in line
    }


def _pypi_reachable(timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(f"{INDEX}/pip/", timeout=timeout) as response:
            return response.status == 200
    except OSError:
        return False


def _clean_pip_env() -> dict[str, str]:
    """This machine's env without pip's local settings: a site-wide pip.conf here caps torch with a constraint
    file, and ``--isolated`` does not drop site-wide config, so all config files are disabled
    (PIP_CONFIG_FILE=os.devnull) and the constraint/find-links variables are emptied."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in {"PIP_CERT", "PIP_INDEX_URL"}}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_CONSTRAINT="", PIP_FIND_LINKS="", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def _plan(torch: str, cuda: str) -> list[str]:
    """The requirement lines the Colab install picks for a runtime with this torch and CUDA line."""
    from grpo_kit.colab_install import Runtime, plan_install, read_requirements

    plan = plan_install(Runtime(torch=torch, cuda=cuda, capability=(8, 0)), read_requirements(REQUIREMENTS), "repo")
    return list(plan.commands[0][5:])  # after `python -m pip install -q`


#: ``{name: (requirement arguments, Python version)}``: each distinct package set the Colab install can ask pip for.
RESOLUTIONS = {
    "file-3.12": (lambda: ["-r", str(REQUIREMENTS)], "3.12"),  # GPU hosts other than Colab
    "file-3.13": (lambda: ["-r", str(REQUIREMENTS)], "3.13"),  # Colab moved to 3.13 in 2026
    "cuda12-no-vllm": (lambda: _plan("2.11.0", "12.6"), "3.12"),
    "torch2.13-vllm0.31": (lambda: _plan("2.13.0", "13.0"), "3.12"),
}
_RUNNING: dict[str, tuple[list[str], Path, subprocess.Popen]] = {}


def _start(name: str) -> None:
    requirements, python = RESOLUTIONS[name][0](), RESOLUTIONS[name][1]
    report = Path(tempfile.mkdtemp(prefix=f"pip-{name}-")) / "report.json"
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--only-binary=:all:"]
    command += [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    command += ["--python-version", python, "--implementation", "cp", "--quiet", "--report", str(report)]
    command += ["--use-feature=fast-deps", *requirements]
    pip = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_clean_pip_env())
    atexit.register(pip.kill)  # a session that ends first (-x) leaves no pip behind
    _RUNNING[name] = (requirements, report, pip)


def _resolve(name: str) -> dict[str, str]:
    """``{project: version}`` pip would install for Colab's platform, or an assertion with pip's error."""
    if not _pypi_reachable():
        pytest.skip(f"PyPI ({INDEX}) is not reachable")
    if not _RUNNING:  # the first one needed starts all four
        for each in RESOLUTIONS:
            _start(each)
    requirements, report, pip = _RUNNING[name]
    _, stderr = pip.communicate(timeout=900)
    assert pip.returncode == 0, f"{requirements} does not resolve:\n{stderr[-4000:]}"
    install = json.loads(report.read_text())["install"]
    return {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"] for item in install}


@pytest.fixture(scope="module", params=["3.12", "3.13"])
def resolved(request) -> dict[str, str]:
    return _resolve(f"file-{request.param}")


@pytest.mark.network
def test_requirements_colab_resolves(resolved):
    """pip finds one consistent set for Colab (``_resolve`` asserts that), and it holds what Unsloth and vLLM pull
    in."""
    for name in ("unsloth-zoo", "datasets", "accelerate", "gguf", "xformers", "torchvision"):
        assert name in resolved, f"{name} is missing from the resolved set"


def test_requirements_file_agrees_with_pyproject_and_the_install_plan():
    """One stack, written in three places: the file's pins, pyproject.toml's pins, and the vLLM line that
    grpo_kit.colab_install picks for the file's torch on CUDA 13 (vLLM pins torch exactly)."""
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    from grpo_kit.colab_install import Runtime, plan_install, read_requirements

    pins = _file_pins()
    project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]["dependencies"]
    for requirement in map(Requirement, project):
        name = requirement.name.lower().replace("_", "-")
        exact = [spec.version for spec in requirement.specifier if spec.operator == "=="]
        if exact:
            assert pins.get(name) == exact[0], f"{name}: pyproject.toml pins {exact[0]}, the file {pins.get(name)}"
        elif name in pins:
            assert requirement.specifier.contains(pins[name]), f"{name}=={pins[name]} is outside {requirement}"
    runtime = Runtime(torch=f"{pins['torch']}+cu130", cuda="13.0", capability=(8, 0))
    assert f"vllm=={pins['vllm']}" in plan_install(runtime, read_requirements(REQUIREMENTS), "repo").commands[0]
    assert pins["unsloth"] == pins["unsloth-zoo"]  # released together


def test_platforms_are_the_ones_pip_uses(monkeypatch):
    """PLATFORMS is exactly what pip's own tag code yields on x86_64 with glibc 2.35 (plus plain linux)."""
    from pip._vendor.packaging import _manylinux

    if sys.platform != "linux" or os.uname().machine != "x86_64":
        pytest.skip("pip derives manylinux tags from the running interpreter's ELF header: needs Linux x86_64")
    monkeypatch.setattr(_manylinux, "_get_glibc_version", lambda: GLIBC)
    assert list(_manylinux.platform_tags(["x86_64"])) + ["linux_x86_64"] == PLATFORMS


@pytest.mark.network
@pytest.mark.parametrize(
    ("name", "torch", "vllm"),
    [("cuda12-no-vllm", "2.11.0", None), ("torch2.13-vllm0.31", "2.13.0", "0.31.0")],
    ids=["cuda12-no-vllm", "torch2.13-vllm0.31"],
)
def test_each_colab_plan_resolves(name, torch, vllm):
    """The plans for the other runtimes (the file itself is the torch 2.11 + CUDA 13 one) resolve as well."""
    chosen = RESOLUTIONS[name][0]()
    assert (f"vllm=={vllm}" in chosen) if vllm else not any(line.startswith("vllm") for line in chosen)
    found = _resolve(name)
    assert found["torch"] == torch and found.get("vllm") == vllm
    pins = _file_pins()
    for project in ("unsloth", "trl", "transformers", "peft", "bitsandbytes"):
        assert found[project] == pins[project]
