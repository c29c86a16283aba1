"""requirements-colab.txt resolves on PyPI for a Colab GPU runtime (Linux x86_64, CPython 3.12).

pip resolves for that target platform without installing anything (``--dry-run --only-binary=:all:``), so it
runs on any machine with PyPI access; it is skipped when PyPI cannot be reached. It takes about two minutes
(pip reads the metadata of ~230 wheels).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

REQUIREMENTS = Path(__file__).resolve().parents[1] / "requirements-colab.txt"
INDEX = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
# Colab runs Ubuntu 22.04 (glibc 2.35): wheels tagged for any glibc up to that are installable there.
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(35, 16, -1)] + ["manylinux2014_x86_64"]
PINNED = {
    "torch": "2.11.0",
    "vllm": "0.26.0",
    "unsloth": "2026.10.7",
    "trl": "1.15.0",
    "transformers": "5.17.0",
    "peft": "0.21.2",
    "bitsandbytes": "0.50.2",
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


@pytest.fixture(scope="module")
def resolved(tmp_path_factory) -> dict[str, str]:
    if not _pypi_reachable():
        pytest.skip(f"PyPI ({INDEX}) is not reachable")
    report = tmp_path_factory.mktemp("pip") / "report.json"
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--only-binary=:all:"]
    command += [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    command += ["--python-version", "3.12", "--implementation", "cp", "--quiet", "--report", str(report)]
    command += ["-r", str(REQUIREMENTS)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=_clean_pip_env())
    assert result.returncode == 0, f"requirements-colab.txt does not resolve:\n{result.stderr[-4000:]}"
    install = json.loads(report.read_text())["install"]
    return {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"] for item in install}


@pytest.mark.network
def test_requirements_colab_resolves_with_the_pinned_stack(resolved):
    for name, version in PINNED.items():
        assert resolved.get(name) == version, f"{name}: resolved {resolved.get(name)}, pinned {version}"
    for name in ("unsloth-zoo", "datasets", "accelerate", "math-verify", "gguf", "xformers", "torchvision"):
        assert name in resolved, f"{name} is missing from the resolved set"
    assert resolved["datasets"].startswith("4.8.")


def test_requirements_file_pins_what_vllm_pins():
    """vLLM pins torch exactly; the file must pin the same torch (checked offline against the file's comments)."""
    lines = [line.split("#")[0].strip() for line in REQUIREMENTS.read_text().splitlines()]
    pins = dict(line.split("==", 1) for line in lines if "==" in line and ";" not in line)
    assert pins["torch"] == PINNED["torch"] and pins["vllm"] == PINNED["vllm"]
    assert pins["unsloth"] == pins["unsloth_zoo"]
    header = REQUIREMENTS.read_text().split("\n\n", 1)[0]
    assert "restart" in header.lower() and "before" in header.lower()
