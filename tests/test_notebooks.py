"""The notebooks' imports and install cell, run; the Colab/Drive helpers they call (grpo_kit.colab); the curves.

Running every notebook top to bottom is ``pytest --nbmake notebooks`` (the Makefile's test target, with
GRPO_KIT_RECIPE=tests/smoke.yaml); 06 runs in tests/test_from_scratch.py when that module is collected too.
"""

from __future__ import annotations

import ast
import importlib
import re
import shutil
import subprocess
import sys
import types
from collections import namedtuple
from pathlib import Path

import nbformat
import pytest

from grpo_kit import colab, colab_install
from grpo_kit.errors import GrpoKitError

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
#: Modules a notebook may import that exist only on Colab or beside a CUDA GPU.
GPU_OR_COLAB_ONLY = {"google", "unsloth", "unsloth_zoo", "vllm"}
#: ``github.com/<owner>/<repo>/...`` or ``raw.githubusercontent.com/<owner>/<repo>/<branch>/<path>``.
REPO_LINK = re.compile(
    r"https://(?:colab\.research\.google\.com/github/|github\.com/|raw\.githubusercontent\.com/)"
    r"([\w.-]+/[\w.-]+)/(?:blob/)?([\w.-]+)/([^)\s]+)"
)


def code_cells(path: Path) -> list[str]:
    return [cell.source for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code"]


def ids(paths):
    return [path.stem for path in paths]


# ------------------------------------------------------------------------------------------------ the notebooks


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids(NOTEBOOKS))
def test_every_import_of_a_notebook_resolves(path):
    """Each module a code cell imports can be imported here, and each name it takes from one exists."""
    for source in code_cells(path):
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                wanted = [(alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                wanted = [(node.module, alias.name) for alias in node.names]
            else:
                continue
            for module, name in wanted:
                if module.split(".")[0] in GPU_OR_COLAB_ONLY:
                    continue
                imported = importlib.import_module(module)
                if name is not None and not hasattr(imported, name):
                    importlib.import_module(f"{module}.{name}")  # a submodule, e.g. `from grpo_kit import runs`


#: Saved with their outputs, which tests/test_teaching.py compares with a fresh run; the others train or download.
WITH_OUTPUTS = {"02_grpo_explained"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids(NOTEBOOKS))
def test_notebook_is_committed_valid_and_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    if path.stem in WITH_OUTPUTS:
        return
    assert [(cell.outputs, cell.execution_count) for cell in nb.cells if cell.cell_type == "code"] == [
        ([], None) for cell in nb.cells if cell.cell_type == "code"
    ]


def run_install_cell(path: Path, monkeypatch, *, on_colab: bool) -> list[list[str]]:
    """Execute the notebook's first code cell as a fresh Colab kernel would; the commands it runs are recorded."""
    calls = []
    with monkeypatch.context() as patch:
        if on_colab:
            patch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
        else:
            patch.delitem(sys.modules, "google.colab", raising=False)
        patch.setattr(importlib.util, "find_spec", lambda name, *args: None)  # the kit is not installed yet
        patch.setattr("os.path.isdir", lambda folder: False)  # nothing cloned yet
        patch.setattr(subprocess, "run", lambda command, **kwargs: calls.append(list(command)))
        exec(compile(code_cells(path)[0], str(path), "exec"), {})
    return calls


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids(NOTEBOOKS))
def test_install_cell_clones_the_kit_and_runs_the_colab_installer_only_on_colab(path, monkeypatch):
    assert run_install_cell(path, monkeypatch, on_colab=False) == []
    clone, install = run_install_cell(path, monkeypatch, on_colab=True)
    assert clone[:4] == ["git", "clone", "--depth", "1"]
    badge_repo = REPO_LINK.search(nbformat.read(path, as_version=4).cells[0].source).group(1)
    assert clone[4] == f"https://github.com/{badge_repo}" == project_url(REPO)  # its badge's, pyproject.toml's
    assert install[:3] == [sys.executable, "-m", "grpo_kit.colab_install"]
    seen = []
    monkeypatch.setattr(colab_install, "install", lambda repo, **kwargs: seen.append((repo, kwargs)))
    assert colab_install.main(install[3:]) == 0  # the installer accepts the cell's command line
    ((repo, kwargs),) = seen
    assert repo == clone[5] and kwargs["colab"] is True and not kwargs["dry_run"]
    assert "sys" in kwargs["loaded"]  # what the kernel has imported: the restart check needs it


def project_url(root: Path) -> str:
    import tomllib

    return tomllib.loads((root / "pyproject.toml").read_text())["project"]["urls"]["Repository"]


def test_a_fork_points_every_notebook_at_its_repository_with_one_command(tmp_path):
    for name in ("Makefile", "pyproject.toml", "notebooks"):
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy)(REPO / name, tmp_path / name)
    subprocess.run(["make", "-s", "-C", str(tmp_path), "fork-url", "REPO=someone/my-grpo"], check=True)
    assert project_url(tmp_path) == "https://github.com/someone/my-grpo"
    for path in (tmp_path / "notebooks").glob("*.ipynb"):
        text = path.read_text()
        repos = {match.group(1) for match in REPO_LINK.finditer(text)}
        assert repos == {"someone/my-grpo"}, path.name  # badge, images and clone
        assert '"https://github.com/someone/my-grpo\\"' in text  # the install cell clones it
    forked = {path: path.read_bytes() for path in [tmp_path / "pyproject.toml", *(tmp_path / "notebooks").iterdir()]}
    ran = tmp_path / "ran"
    for value in (
        "not a repo",
        f"a/b`touch {ran}`",
        f"a/b$(touch {ran})",
        f"$(shell touch {ran})",
        "a/..",
        "./.",
        'a/b"',
        "",
    ):
        refused = subprocess.run(["make", "-s", "-C", str(tmp_path), "fork-url", f"REPO={value}"], capture_output=True)
        assert refused.returncode == 2 and b"usage: make fork-url REPO=owner/name" in refused.stderr, value
        assert f"REPO={value!r}".encode() in refused.stderr  # the value as typed, not as a shell or make expanded it
        assert not ran.exists() and all(path.read_bytes() == data for path, data in forked.items()), value


def test_every_notebook_runs_the_same_install():
    first_cells = {code_cells(path)[0] for path in NOTEBOOKS}
    assert len(first_cells) == 1


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids(NOTEBOOKS))
def test_links_work_when_the_notebook_is_opened_from_colab(path):
    """Opened from its badge, a notebook has no folder around it: every link is absolute, a link into this
    repository names a file that exists, and the badge opens this very notebook."""
    cells = nbformat.read(path, as_version=4).cells
    for cell in cells:
        if cell.cell_type != "markdown":
            continue
        for target in re.findall(r"\]\(([^)\s]+)\)", cell.source):
            assert target.startswith(("https://", "http://")), f"{path.name}: relative link {target}"
            found = REPO_LINK.match(target)
            if found:
                assert (REPO / found.group(3)).exists(), f"{path.name}: {target} names no file of this repository"
    badge = REPO_LINK.search(cells[0].source)
    assert badge.group(3) == f"notebooks/{path.name}"


# ------------------------------------------------------------------------------------------------ grpo_kit.colab


@pytest.fixture
def fake_colab(monkeypatch, tmp_path):
    """A stand-in Colab: ``google.colab.drive.mount`` records its calls and makes ``MyDrive`` under ``tmp_path``."""
    mounts = []
    drive = types.SimpleNamespace(
        mount=lambda where: mounts.append(where) or (Path(where) / "MyDrive").mkdir(parents=True, exist_ok=True)
    )
    package = types.ModuleType("google.colab")
    package.drive = drive
    monkeypatch.setitem(sys.modules, "google.colab", package)
    monkeypatch.setattr(colab, "DRIVE_MOUNT", tmp_path / "drive")
    monkeypatch.delenv(colab.WORKSPACE_ENV, raising=False)
    return mounts


def test_off_colab_nothing_is_mounted_and_the_workspace_is_the_checkout(monkeypatch, tmp_path):
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    monkeypatch.delenv(colab.WORKSPACE_ENV, raising=False)
    assert colab.mount_drive() is None
    monkeypatch.chdir(REPO / "notebooks")  # where Jupyter runs a notebook
    assert colab.workspace() == REPO
    monkeypatch.chdir(tmp_path)  # no checkout around: the working directory
    assert colab.workspace() == tmp_path.resolve()
    monkeypatch.setenv(colab.WORKSPACE_ENV, str(tmp_path / "elsewhere"))
    assert colab.workspace() == tmp_path / "elsewhere"


def test_on_colab_the_workspace_is_on_drive_mounted_once(fake_colab, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = colab.workspace()
    assert folder == tmp_path / "drive" / "MyDrive" / "grpo-kit" and folder.is_dir()
    assert colab.workspace() == folder and fake_colab == [str(tmp_path / "drive")]  # the second call mounts nothing
    assert colab.workspace(drive=False) == tmp_path.resolve()  # exports: the runtime's own disk


def export_folder(tmp_path: Path, sizes: dict[str, int]) -> Path:
    folder = tmp_path / "exports" / "grpo-cpu"
    for name, size in sizes.items():
        target = folder / name / "weights.bin" if "." not in name else folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(b"x" * size)
    return folder


def test_copy_to_drive_copies_what_is_asked_and_sets_an_older_copy_aside(tmp_path):
    folder = export_folder(tmp_path, {"lora": 10, "gguf": 20, "README.md": 5})
    dest = tmp_path / "drive" / "exports"
    first = colab.copy_to_drive(folder, include=("lora", "README.md", "not-exported"), dest=dest)
    assert first == dest / "grpo-cpu" and sorted(p.name for p in first.iterdir()) == ["README.md", "lora"]
    second = colab.copy_to_drive(folder, dest=dest)
    assert sorted(p.name for p in second.iterdir()) == ["README.md", "gguf", "lora"]
    old = [p for p in dest.iterdir() if p.name.startswith("grpo-cpu.old-")]
    assert len(old) == 1 and sorted(p.name for p in old[0].iterdir()) == ["README.md", "lora"]  # kept, not deleted
    assert not [p for p in dest.iterdir() if p.name.endswith(".copying")]


def test_copy_to_drive_refuses_what_does_not_fit_and_names_what_would(tmp_path, monkeypatch):
    folder = export_folder(tmp_path, {"lora": 100, "gguf": 10_000, "README.md": 5})
    dest = tmp_path / "drive" / "exports"
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(colab.shutil, "disk_usage", lambda path: usage(0, 0, colab.SPACE_MARGIN + 1_000))
    with pytest.raises(GrpoKitError, match=r"include=\('README.md', 'lora'\)") as refused:
        colab.copy_to_drive(folder, dest=dest)
    assert "Nothing was copied" in str(refused.value) and "\n" not in str(refused.value)
    assert not dest.exists()  # not even the staging folder
    assert colab.copy_to_drive(folder, include=("README.md", "lora"), dest=dest).is_dir()  # the smaller choice fits


def test_copy_to_drive_off_colab_copies_nothing_and_a_missing_export_is_an_error(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    folder = export_folder(tmp_path, {"lora": 1})
    assert colab.copy_to_drive(folder) is None
    with pytest.raises(GrpoKitError, match="export first"):
        colab.copy_to_drive(tmp_path / "never-exported", dest=tmp_path / "drive")
    with pytest.raises(GrpoKitError, match="Nothing to copy"):
        colab.copy_to_drive(folder, include=("gguf",), dest=tmp_path / "drive")


def test_on_colab_copy_to_drive_goes_to_the_drive_folder(fake_colab, tmp_path):
    folder = export_folder(tmp_path, {"lora": 1})
    assert colab.copy_to_drive(folder) == tmp_path / "drive" / "MyDrive" / "grpo-kit" / "exports" / "grpo-cpu"


# ------------------------------------------------------------------------------------------------ grpo_kit.plots


def is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5_000


def test_training_curves_are_drawn_from_a_metrics_file(tmp_path):
    from grpo_kit.files import dumps_finite
    from grpo_kit.plots import plot_metrics

    rows = [
        {
            "step": s,
            "reward": 0.1 * s,
            "reward/format": 0.2 * s,
            "format_rate": 0.5,
            "frac_reward_zero_std": 0.25,
            "completions/mean_length": 30 + s,
        }
        for s in range(1, 4)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(dumps_finite(row) + "\n" for row in rows))
    assert is_png(plot_metrics(tmp_path / "metrics.jsonl"))
    assert (tmp_path / "plots" / "rewards.png").is_file()
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(GrpoKitError, match="train first"):
        plot_metrics(tmp_path / "empty" / "metrics.jsonl")
