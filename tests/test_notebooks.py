"""The notebooks: hygiene (stripped, valid, badge, guarded Colab cells) and grpo_kit.machinery.notebook's session helpers.

Running the notebooks themselves is ``pytest notebooks --nbmake`` (the Makefile's test target, in smoke mode).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest

from grpo_kit.errors import GrpoKitError
from grpo_kit.machinery import notebook as nbk
from grpo_kit.machinery.folders import set_aside
from grpo_kit.machinery.metrics import read_metrics
from grpo_kit.machinery.notebook import (
    NOTEBOOKS,
    SMOKE_OVERRIDES,
    NotebookPaths,
    NotebookSession,
    colab_badge_markdown,
    colab_badge_url,
    copy_to_drive,
    default_root,
    drive_root,
    find_project_root,
    find_trained_adapter,
    load_choice,
    load_finished_run,
    local_root,
    model_card_preview,
    prepare_run,
    run_sizes,
    run_status,
    save_choice,
    saved_evals,
    score_examples,
    session_paths,
    side_by_side_html,
    smoke_decision,
    train_session,
)
from grpo_kit.machinery.runtime import DeviceInfo
from grpo_kit.recipes import load_recipe

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = REPO / "notebooks"
CPU = DeviceInfo("cpu", "cpu", 0.0, False)
T4 = DeviceInfo("cuda", "Tesla T4", 14.74, False)
A100 = DeviceInfo("cuda", "NVIDIA A100-SXM4-80GB", 79.2, True)
#: Calls that only make sense on Colab: every use must sit under ``if in_colab():``.
COLAB_ONLY_CALLS = {"mount_drive_if_colab", "copy_to_drive"}


def _read(name: str):
    return nbformat.read(NOTEBOOK_DIR / name, as_version=4)


def _code_cells(nb):
    return [cell for cell in nb.cells if cell.cell_type == "code"]


# --------------------------------------------------------------------------------------------- hygiene


def test_the_notebook_folder_holds_exactly_the_numbered_path():
    assert sorted(p.name for p in NOTEBOOK_DIR.glob("*.ipynb")) == sorted(NOTEBOOKS)
    assert list(NOTEBOOKS) == sorted(NOTEBOOKS)  # the numbers give the reading order


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_valid_and_stripped(name):
    raw = json.loads((NOTEBOOK_DIR / name).read_text(encoding="utf-8"))  # plain JSON
    nb = _read(name)
    nbformat.validate(nb)
    assert nb.nbformat == 4
    assert nb.metadata["kernelspec"]["name"] == "python3"
    for cell in _code_cells(nb):
        assert cell.outputs == [], f"{name}: committed outputs in a cell starting {cell.source[:40]!r}"
        assert cell.execution_count is None, f"{name}: execution count committed"
    for cell in raw["cells"]:
        tags = cell.get("metadata", {}).get("tags", [])
        assert not {"skip-execution", "raises-exception"} & set(tags), f"{name}: a cell is tagged away from testing"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_opens_with_its_colab_badge_and_a_title(name):
    first = _read(name).cells[0]
    assert first.cell_type == "markdown"
    url = f"https://colab.research.google.com/github/grpo-kit/grpo-kit/blob/main/notebooks/{name}"
    assert url in first.source
    assert colab_badge_markdown(name) in first.source
    assert "\n# " in first.source  # a title follows the badge


#: Notebooks that train or export on a GPU, and so install the GPU stack; 02 (toy tensors) installs the kit only.
GPU_NOTEBOOKS = tuple(name for name in NOTEBOOKS if not name.startswith("02"))


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_install_cell_runs_first_and_only_on_colab(name):
    nb = _read(name)
    install = _code_cells(nb)[0]
    assert '"google.colab" not in sys.modules' in install.source
    assert "Restart" in install.source  # the restart caveat
    assert "grpo_kit" not in [n.split(".")[0] for n in _imported_modules(install.source)]
    if name in GPU_NOTEBOOKS:
        # The per-runtime installer runs in a child process, told what this kernel has imported (restart check).
        assert '"-m", "grpo_kit.machinery.colab_install", "--install"' in install.source and '"--loaded"' in install.source
    else:
        assert '"grpo_kit.machinery.colab_install"' not in install.source and "-r" not in install.source.split()
    # A markdown cell explains it before it runs.
    index = nb.cells.index(install)
    assert nb.cells[index - 1].cell_type == "markdown" and "Restart session" in nb.cells[index - 1].source


def _imported_modules(source: str) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append(node.module or "")
    return names


def _colab_only_calls_outside_guard(source: str) -> list[str]:
    """Names of Colab-only calls in ``source`` that are not inside ``if in_colab():``."""
    tree = ast.parse(source)
    bad = []

    def visit(node, guarded: bool):
        if isinstance(node, ast.If):
            test = node.test
            is_guard = isinstance(test, ast.Call) and getattr(test.func, "id", None) == "in_colab"
            for child in node.body:
                visit(child, guarded or is_guard)
            for child in node.orelse:
                visit(child, guarded)
            return
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in COLAB_ONLY_CALLS and not guarded:
            bad.append(node.func.id)
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(tree, False)
    return bad


def test_guard_checker_catches_an_unguarded_call():
    assert _colab_only_calls_outside_guard("mount_drive_if_colab()") == ["mount_drive_if_colab"]
    assert _colab_only_calls_outside_guard("if in_colab():\n    mount_drive_if_colab()") == []
    assert _colab_only_calls_outside_guard("if in_colab():\n    pass\nelse:\n    copy_to_drive(1, 2)") == ["copy_to_drive"]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_colab_only_cells_are_guarded_but_still_executed(name):
    for cell in _code_cells(_read(name)):
        assert _colab_only_calls_outside_guard(cell.source) == [], cell.source[:60]
        assert "google.colab import" not in cell.source  # Colab modules are used inside grpo_kit.machinery.notebook only


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_every_notebook_draws_a_plot_and_explains_before_code(name):
    nb = _read(name)
    calls = {
        node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
        for cell in _code_cells(nb)
        for node in ast.walk(ast.parse(cell.source))
        if isinstance(node, ast.Call)
    }
    assert any(call.startswith("plot_") for call in calls), f"{name} has no plot"
    markdown_words = sum(len(c.source.split()) for c in nb.cells if c.cell_type == "markdown")
    code_lines = sum(len(c.source.splitlines()) for c in _code_cells(nb))
    assert markdown_words > 3 * code_lines  # a tutorial, not a script
    for before, cell in zip(nb.cells, nb.cells[1:], strict=False):
        if cell.cell_type == "code" and before.cell_type == "code":
            assert len(cell.source.splitlines()) <= 25  # consecutive code cells stay short


def _package_function_names() -> set[str]:
    names = set()
    for module in (REPO / "grpo_kit").rglob("*.py"):
        tree = ast.parse(module.read_text(encoding="utf-8"))
        names |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    return names


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_cells_do_not_reimplement_the_package(name):
    """A cell may define a function of its own (a learner's reward, say), never a copy of one grpo_kit has."""
    package = _package_function_names()
    for cell in _code_cells(_read(name)):
        tree = ast.parse(cell.source)
        classes = [n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
        copies = [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name in package]
        assert classes == [] and copies == [], f"{name} defines {classes + copies}: call grpo_kit's instead"


# --------------------------------------------------------------------------------------------- Colab and paths


def test_badge_url_and_markdown():
    url = colab_badge_url("05_export.ipynb", repo="me/kit", branch="dev")
    assert url == "https://colab.research.google.com/github/me/kit/blob/dev/notebooks/05_export.ipynb"
    assert colab_badge_markdown("01_setup.ipynb").endswith(f"({colab_badge_url('01_setup.ipynb')})")


def test_colab_helpers_do_nothing_off_colab():
    assert nbk.mount_drive_if_colab() is None


def test_project_root_is_found_from_the_notebook_folder(tmp_path):
    assert find_project_root(NOTEBOOK_DIR) == REPO
    assert find_project_root(tmp_path) is None


def test_roots_env_checkout_and_drive(tmp_path, monkeypatch):
    monkeypatch.delenv(nbk.ROOT_ENV, raising=False)
    assert local_root(NOTEBOOK_DIR) == REPO / "runs" / "notebook"
    assert local_root(tmp_path) == tmp_path.resolve() / "runs" / "notebook"
    mount = tmp_path / "drive"
    assert drive_root(mount) is None
    assert default_root(NOTEBOOK_DIR, mount=mount) == REPO / "runs" / "notebook"
    (mount / "MyDrive").mkdir(parents=True)
    assert drive_root(mount) == mount / "MyDrive" / "grpo-kit" / "notebook"
    assert default_root(NOTEBOOK_DIR, mount=mount) == mount / "MyDrive" / "grpo-kit" / "notebook"
    monkeypatch.setenv(nbk.ROOT_ENV, str(tmp_path / "scratch"))
    assert default_root(NOTEBOOK_DIR, mount=mount) == (tmp_path / "scratch").resolve()


def test_session_paths_layout(tmp_path, monkeypatch):
    paths = session_paths("t4-16gb", tmp_path)
    assert paths.run_dir == tmp_path / "t4-16gb" / "train"
    assert paths.eval_dir == tmp_path / "t4-16gb" / "eval"
    assert paths.export_dir == tmp_path / "t4-16gb" / "exports"
    assert not paths.on_drive and paths.drive_export_dir is None
    # On Drive, exports stay on the local disk and are copied to Drive on request.
    monkeypatch.setattr(nbk, "DRIVE_MOUNT", tmp_path / "drive")
    drive = tmp_path / "drive" / "MyDrive" / "grpo-kit" / "notebook"
    on_drive = session_paths("cpu", drive, local=tmp_path / "local")
    assert on_drive.on_drive
    assert on_drive.run_dir == drive / "cpu" / "train"
    assert on_drive.export_dir == tmp_path / "local" / "cpu" / "exports"
    assert on_drive.drive_export_dir == drive / "cpu" / "exports"


def test_copy_to_drive_copies_selected_entries_and_keeps_old_copies(tmp_path):
    export = tmp_path / "local" / "grpo-cpu"
    (export / "lora").mkdir(parents=True)
    (export / "lora" / "adapter_model.safetensors").write_bytes(b"w")
    (export / "merged16").mkdir()
    (export / "merged16" / "model.safetensors").write_bytes(b"big")
    (export / "README.md").write_text("card")
    paths = NotebookPaths(tmp_path, tmp_path / "r", tmp_path / "e", tmp_path / "local", tmp_path / "drive")
    assert copy_to_drive(export, dataclasses.replace(paths, drive_export_dir=None)) is None
    target = copy_to_drive(export, paths, include=("lora", "README.md"))
    assert target == tmp_path / "drive" / "grpo-cpu"
    assert sorted(p.name for p in target.iterdir()) == ["README.md", "lora"]
    assert (target / "lora" / "adapter_model.safetensors").read_bytes() == b"w"
    (export / "README.md").write_text("card v2")
    copy_to_drive(export, paths)
    assert (target / "README.md").read_text() == "card v2" and (target / "merged16").is_dir()
    assert len(list((tmp_path / "drive").glob("grpo-cpu.old-*"))) == 1  # the first copy was set aside


def test_choice_round_trip_and_bad_files(tmp_path):
    assert load_choice(tmp_path) is None
    save_choice(tmp_path, "l4-24gb", {"max_steps": 50})
    assert load_choice(tmp_path) == {"preset": "l4-24gb", "overrides": {"max_steps": 50}}
    (tmp_path / nbk.SESSION_FILE).write_text("{not json")
    assert load_choice(tmp_path) is None
    (tmp_path / nbk.SESSION_FILE).write_text('["cpu"]')
    assert load_choice(tmp_path) is None


# --------------------------------------------------------------------------------------------- smoke switch


@pytest.mark.parametrize(
    ("env", "device", "expected", "because"),
    [
        ("1", T4, True, "GRPO_KIT_SMOKE=1"),
        ("true", CPU, True, "GRPO_KIT_SMOKE=1"),
        ("0", CPU, False, "GRPO_KIT_SMOKE=0"),
        (None, CPU, True, "no GPU found"),
        (None, T4, False, "GPU found (Tesla T4)"),
        ("", T4, False, "GPU found (Tesla T4)"),
    ],
)
def test_smoke_decision_says_what_decided_it(monkeypatch, env, device, expected, because):
    if env is None:
        monkeypatch.delenv("GRPO_KIT_SMOKE", raising=False)
    else:
        monkeypatch.setenv("GRPO_KIT_SMOKE", env)
    smoke, reason = smoke_decision(device)
    assert smoke is expected
    assert reason.startswith(because), reason  # the notebook prints it: the env variable or the device decided


def test_run_sizes():
    cpu, t4 = load_recipe("cpu"), load_recipe("t4-16gb")
    smoke = run_sizes(cpu, smoke=True, on_gpu=False)
    assert (smoke.max_steps, smoke.eval_questions, smoke.train_data) == (nbk.SMOKE_STEPS, nbk.SMOKE_EVAL_QUESTIONS, "sample")
    full_cpu = run_sizes(cpu, smoke=False, on_gpu=False)
    assert full_cpu.max_steps == cpu.max_steps and full_cpu.eval_data == "sample"
    gpu = run_sizes(t4, smoke=False, on_gpu=True)
    assert (gpu.train_data, gpu.eval_data, gpu.max_new_tokens) == ("gsm8k", "gsm8k", t4.max_completion_length)


# --------------------------------------------------------------------------------------------- session


def test_smoke_session_is_the_shrunken_cpu_recipe(tmp_path):
    session = NotebookSession.open("a100-80gb", root=tmp_path, smoke=True, device=A100)
    preset = session.preset
    assert preset.name == "cpu"
    assert preset.max_steps == nbk.SMOKE_STEPS == session.sizes.max_steps
    for key, value in SMOKE_OVERRIDES.items():
        assert getattr(preset, key) == value
    assert session.paths.run_dir == tmp_path / "cpu" / "train"
    assert session.save_choice() is None and load_choice(tmp_path) is None
    assert "SMOKE" in session.summary() and "cpu" in session.summary()


def test_session_picks_auto_then_saved_then_named(tmp_path):
    auto = NotebookSession.open(root=tmp_path, smoke=False, device=T4)
    assert auto.preset == load_recipe("t4-16gb") and "T4" in auto.reason
    save_choice(tmp_path, "l4-24gb", {"max_steps": 7})
    saved = NotebookSession.open(root=tmp_path, smoke=False, device=A100)
    assert saved.preset == load_recipe("l4-24gb", max_steps=7) and "notebook 01" in saved.reason
    named = NotebookSession.open("a100-80gb", root=tmp_path, smoke=False, device=A100)
    assert named.preset.name == "a100-80gb"
    forced_auto = NotebookSession.open("auto", root=tmp_path, smoke=False, device=A100)
    assert forced_auto.preset.name == "a100-80gb"


def test_a_saved_choice_that_no_longer_fits_is_flagged(tmp_path):
    save_choice(tmp_path, "a100-80gb")
    session = NotebookSession.open(root=tmp_path, smoke=False, device=T4)
    assert session.preset.name == "a100-80gb"
    assert "Warning" in session.reason


def test_adapted_auto_preset_survives_save_and_reopen(tmp_path):
    small = DeviceInfo("cuda", "small GPU", 8.0, False)
    first = NotebookSession.open(root=tmp_path, smoke=False, device=small)
    assert first.preset.model_id != load_recipe("t4-16gb").model_id  # the 1.5B fallback
    first.save_choice()
    assert load_choice(tmp_path)["overrides"]["model"] == first.preset.model_id
    again = NotebookSession.open(root=tmp_path, smoke=False, device=small)
    assert again.preset == first.preset


def test_unknown_preset_name_is_a_user_error(tmp_path):
    with pytest.raises(GrpoKitError, match="Unknown recipe"):
        NotebookSession.open("t5-16gb", root=tmp_path, smoke=False, device=T4)


# --------------------------------------------------------------------------------------------- runs


def _fake_adapter(run_dir: Path) -> Path:
    adapter = run_dir / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text("{}")
    return adapter


def test_run_status(tmp_path, fake_checkpoint):
    run = tmp_path / "train"
    assert run_status(run, 2) == "new"
    fake_checkpoint(run, 1)
    assert run_status(run, 2) == "partial"
    fake_checkpoint(run, 2)
    assert run_status(run, 2) == "partial"  # no final adapter yet
    _fake_adapter(run)
    assert run_status(run, 2) == "done"
    assert run_status(run, 4) == "partial"  # asked for more steps: resume


def test_load_finished_run_reads_the_files(tmp_path, fake_checkpoint):
    run = tmp_path / "train"
    with pytest.raises(GrpoKitError, match="notebook 03"):
        load_finished_run(run)
    fake_checkpoint(run, 2)
    _fake_adapter(run)
    rows = [{"step": 1, "reward": 0.0, "step_time": 3.0}, {"step": 2, "reward": 1.0, "step_time": 4.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = load_finished_run(run)
    assert (result.steps, result.seconds, result.reward_first, result.reward_last) == (2, 7.5, 0.0, 1.0)
    assert result.adapter_dir == run / "adapter" and result.history == rows


def test_set_aside_renames_and_never_deletes(tmp_path):
    assert set_aside(tmp_path / "missing") is None
    folder = tmp_path / "train"
    folder.mkdir()
    (folder / "keep.txt").write_text("x")
    first = set_aside(folder)
    folder.mkdir()
    second = set_aside(folder)
    assert first != second and not folder.exists()
    assert (first / "keep.txt").read_text() == "x" and second.is_dir()


@pytest.fixture
def smoke_session(tmp_path):
    return NotebookSession.open(root=tmp_path, smoke=True, device=CPU)


@pytest.fixture
def fake_train(monkeypatch, fake_checkpoint):
    """Replace grpo_kit.train.train with a recorder that writes a finished run."""
    calls = []

    def train(preset, *, output_dir, resume, overrides, **kwargs):
        max_steps = overrides["max_steps"]
        calls.append({"preset": preset, "output_dir": Path(output_dir), "resume": resume, "max_steps": max_steps, **kwargs})
        run = Path(output_dir)
        run.mkdir(parents=True, exist_ok=True)
        if not (run / f"checkpoint-{max_steps}").exists():
            fake_checkpoint(run, max_steps)
        if not (run / "adapter").exists():
            _fake_adapter(run)
        return SimpleNamespace(adapter_dir=run / "adapter", run_dir=run)

    monkeypatch.setattr("grpo_kit.train.train", train)
    return calls


def test_train_session_trains_resumes_loads_and_restarts(smoke_session, fake_train):
    run = smoke_session.paths.run_dir
    train_session(smoke_session)
    assert fake_train[-1]["resume"] is False and fake_train[-1]["data"] == "sample"
    assert fake_train[-1]["preset"] == smoke_session.preset and fake_train[-1]["output_dir"] == run
    assert train_session(smoke_session).adapter_dir == run / "adapter"  # done: loaded, not retrained
    assert len(fake_train) == 1
    shutil.rmtree(run / "adapter")
    train_session(smoke_session)  # a checkpoint but no adapter: resume
    assert fake_train[-1]["resume"] is True
    train_session(smoke_session, restart=True)
    assert fake_train[-1]["resume"] is False
    assert len(list(run.parent.glob("train.old-*"))) == 1


def test_train_session_keeps_a_run_that_died_before_its_first_checkpoint(smoke_session, fake_train):
    run = smoke_session.paths.run_dir
    run.mkdir(parents=True)
    (run / "run.json").write_text("{}")
    train_session(smoke_session)
    assert fake_train[-1]["resume"] is False
    assert (next(run.parent.glob("train.old-*")) / "run.json").is_file()


def test_find_trained_adapter_never_trains_unless_asked(smoke_session, fake_train, capsys):
    with pytest.raises(GrpoKitError, match="TRAIN_IF_MISSING = True") as error:
        find_trained_adapter(smoke_session)
    assert "00_train_grpo_colab.ipynb" in str(error.value) and fake_train == []
    adapter = find_trained_adapter(smoke_session, train_if_missing=True)
    assert adapter == smoke_session.paths.run_dir / "adapter" and len(fake_train) == 1
    assert "TRAIN_IF_MISSING" in capsys.readouterr().out
    assert find_trained_adapter(smoke_session) == adapter and len(fake_train) == 1  # found, not trained again


def test_find_trained_adapter_reads_folders_run_export_or_adapter(smoke_session, tmp_path, fake_train):
    run = tmp_path / "elsewhere" / "run"
    _fake_adapter(run)
    export = tmp_path / "export"
    (export / "lora").mkdir(parents=True)
    (export / "lora" / "adapter_config.json").write_text("{}")
    assert find_trained_adapter(smoke_session, str(run)) == run / "adapter"
    assert find_trained_adapter(smoke_session, str(run / "adapter")) == run / "adapter"
    assert find_trained_adapter(smoke_session, str(export)) == export / "lora"
    with pytest.raises(GrpoKitError, match="no LoRA adapter"):
        find_trained_adapter(smoke_session, str(tmp_path))
    with pytest.raises(GrpoKitError, match="does not exist"):
        find_trained_adapter(smoke_session, str(tmp_path / "missing" / "deeper"))
    assert fake_train == []


def test_find_trained_adapter_downloads_a_hub_repo_with_the_token(smoke_session, tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    def snapshot_download(repo_id, token=None):
        calls.append((repo_id, token))
        (tmp_path / "hub" / "lora").mkdir(parents=True, exist_ok=True)
        (tmp_path / "hub" / "lora" / "adapter_config.json").write_text("{}")
        return str(tmp_path / "hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.chdir(tmp_path)  # "me/grpo-model" must not exist as a local folder
    assert find_trained_adapter(smoke_session, "me/grpo-model") == tmp_path / "hub" / "lora"
    assert calls == [("me/grpo-model", "hf_secret")]

    def offline(repo_id, token=None):
        raise OSError("offline hf_secret")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(GrpoKitError, match="Could not download me/grpo-model") as error:
        find_trained_adapter(smoke_session, "me/grpo-model")
    assert "hf_secret" not in str(error.value)


def test_prepare_run_resumes_cuts_metrics_and_reports_done(smoke_session, fake_checkpoint):
    run = smoke_session.paths.run_dir
    assert prepare_run(smoke_session) == ("new", None)
    fake_checkpoint(run, 1)
    rows = [{"step": 1, "reward": 0.0}, {"step": 2, "reward": 1.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    status, checkpoint = prepare_run(smoke_session)
    assert (status, checkpoint) == ("partial", run / "checkpoint-1")
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1]  # step 2 will be logged again
    fake_checkpoint(run, nbk.SMOKE_STEPS)
    _fake_adapter(run)
    assert prepare_run(smoke_session) == ("done", None)
    assert prepare_run(smoke_session, restart=True) == ("new", None) and not run.exists()
    assert len(list(run.parent.glob("train.old-*"))) == 1


# --------------------------------------------------------------------------------------------- data, eval, export


def test_score_examples_orders_the_examples_like_the_rewards_should():
    table = score_examples(load_recipe("cpu").rewards, prefill=load_recipe("cpu").prefill)
    totals = table["weighted total"].tolist()
    assert totals == sorted(totals) and totals[0] == 0.0 and totals[-1] > totals[-2]
    assert list(table.columns) == ["tag_progress", "correctness", "weighted total"]
    weighted = score_examples([("correctness", 3.0)], prefill="<think>\n")
    assert weighted["weighted total"].iloc[-1] == 3 * weighted["correctness"].iloc[-1]


def test_score_examples_follow_the_presets_prefill():
    """A GPU tier has no prefill: its model writes ``<think>`` itself, and the examples must score as such."""
    t4 = load_recipe("t4-16gb")
    assert t4.prefill == ""
    table = score_examples(t4.rewards, prefill=t4.prefill)
    full = table.loc["full format, right number"]
    assert (full["format"], full["tag_count"], full["correctness"]) == (0.5, 1.0, 2.0)
    assert table.equals(score_examples(t4.rewards, prefill="<think>\n"))


def test_preview_prompt_is_what_training_sends(embedded_dir):
    text = nbk.preview_prompt(load_recipe("cpu"))
    assert text.endswith("<|im_start|>assistant\n<think>\n")  # generation prompt + prefill
    assert text.count("<|im_start|>user") == load_recipe("cpu").few_shot + 1  # worked examples + the question


def test_evaluate_session_passes_the_training_prompt_and_saves(smoke_session, monkeypatch):
    from grpo_kit.evaluate import EvalResult

    seen = {}

    def fake(model_id, adapter_dir, dataset, **kwargs):
        seen.update(model=model_id, adapter=adapter_dir, n=len(dataset), **kwargs)
        result = EvalResult(0.0, 0.25, 0.5, 30.0, n=len(dataset), seed=0, protocol="p")
        return result, dataclasses.replace(result, format_rate=1.0)

    monkeypatch.setattr("grpo_kit.evaluate.evaluate_before_after", fake)
    before, after = nbk.evaluate_session(smoke_session, "adapter-dir")
    preset = smoke_session.preset
    assert seen["n"] == nbk.SMOKE_EVAL_QUESTIONS and seen["max_new_tokens"] == nbk.SMOKE_NEW_TOKENS
    assert (seen["few_shot"], seen["prefill"], seen["model"]) == (preset.few_shot, preset.prefill, preset.model_id)
    assert saved_evals(smoke_session.paths) == {
        "before": smoke_session.paths.eval_dir / "before.json",
        "after": smoke_session.paths.eval_dir / "after.json",
    }
    assert json.loads((smoke_session.paths.eval_dir / "after.json").read_text())["format_rate"] == 1.0


def test_saved_evals_needs_both(tmp_path):
    paths = session_paths("cpu", tmp_path)
    paths.eval_dir.mkdir(parents=True)
    (paths.eval_dir / "before.json").write_text("{}")
    assert saved_evals(paths) is None


def test_side_by_side_html_escapes_tags_and_marks_results():
    row = {"question": "Is 2 < 3?", "gold": "1", "completion": "yes</think><answer>1</answer>", "correct_strict": True}
    before = SimpleNamespace(rows=({**row, "completion": "no", "correct_strict": False},) * 4)
    after = SimpleNamespace(rows=(row,) * 4)
    page = side_by_side_html(before, after, n=2, prefill="<think>\n")
    assert "&lt;think&gt;" in page and "&lt;/answer&gt;" in page and "<think>" not in page
    assert "Is 2 &lt; 3?" in page and "<b>(1)</b>" in page
    assert page.count("<tr>") == 3  # header + n rows
    assert "&#10008; wrong" in page and "&#10004; right" in page


def test_model_card_preview_drops_the_front_matter(tmp_path):
    (tmp_path / "README.md").write_text("---\ntags:\n  - grpo\n---\n\n# grpo-cpu\n\nbody\n")
    assert model_card_preview(tmp_path) == "# grpo-cpu\n\nbody\n"
    (tmp_path / "README.md").write_text("# plain\n")
    assert model_card_preview(tmp_path) == "# plain\n"


def _export_results(tmp_path):
    from grpo_kit.machinery.export_checks import ExportResult

    lora = tmp_path / "x" / "lora"
    lora.mkdir(parents=True)
    (lora / "adapter_model.safetensors").write_bytes(b"0" * 2_000_000)
    gguf = tmp_path / "x" / "gguf" / "x-q8_0.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"0" * 1_000_000)
    return [
        ExportResult("lora", lora, "adapter", 0.0, 5e-4, 0.0, 0.3),
        ExportResult("gguf", gguf, "GGUF q8_0", 1.0, 6.4, 0.1, 0.3),
    ]


def test_exports_table(tmp_path):
    table = nbk.exports_table(_export_results(tmp_path), folder=tmp_path / "x")
    assert table.loc["lora", "size (MB)"] == 2.0 and table.loc["gguf", "path"] == "gguf/x-q8_0.gguf"
    assert table["verified"].all()


def test_plots_draw_without_a_display(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from grpo_kit.machinery.planner import estimate_vram
    from grpo_kit.recipes import RECIPES

    estimates = {name: estimate_vram(preset) for name, preset in RECIPES.items()}
    ax = nbk.plot_vram_plans(estimates, highlight="cpu", show=False)
    assert [t.get_text() for t in ax.get_yticklabels()][0] == "cpu *"
    assert len(ax.patches) == 6 * len(RECIPES)  # one segment per part per preset
    fig = nbk.plot_exports(_export_results(tmp_path), show=False)
    assert len(fig.axes) == 2
    plt.close("all")


def test_strip_notebook_removes_outputs_and_counts(tmp_path):
    path = tmp_path / "run.ipynb"
    shutil.copy(NOTEBOOK_DIR / NOTEBOOKS[1], path)
    assert nbk.strip_notebook(path) is False  # committed notebooks are already clean
    nb = nbformat.read(path, as_version=4)
    cell = _code_cells(nb)[0]
    cell.execution_count = 3
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="hi\n")]
    cell.metadata["execution"] = {"iopub.status.busy": "2026-11-22"}
    nbformat.write(nb, path)
    assert nbk.strip_notebook(path) is True
    cleaned = _code_cells(nbformat.read(path, as_version=4))[0]
    assert (cleaned.outputs, cleaned.execution_count, "execution" in cleaned.metadata) == ([], None, False)


def test_a_run_made_with_another_recipe_is_set_aside_not_reused(smoke_session, fake_train, fake_checkpoint, capsys):
    run = smoke_session.paths.run_dir
    fake_checkpoint(run, nbk.SMOKE_STEPS)
    _fake_adapter(run)
    recorded = smoke_session.preset.with_overrides(learning_rate=1e-3, max_steps=99).to_dict()
    (run / "run.json").write_text(json.dumps({"recipe": recorded}, default=str))
    assert nbk.recipe_mismatch(run, smoke_session.preset) == ["learning_rate"]  # max_steps may change on resume
    train_session(smoke_session)
    assert len(fake_train) == 1 and fake_train[-1]["resume"] is False
    assert "different recipe" in capsys.readouterr().out
    assert (next(run.parent.glob("train.old-*")) / "run.json").is_file()


def test_recipe_mismatch_is_empty_for_the_same_recipe_or_no_record(tmp_path, smoke_session):
    assert nbk.recipe_mismatch(tmp_path, smoke_session.preset) == []
    (tmp_path / "run.json").write_text(json.dumps({"recipe": smoke_session.preset.to_dict()}, default=str))
    assert nbk.recipe_mismatch(tmp_path, smoke_session.preset) == []


def test_score_examples_takes_a_reward_written_in_a_cell():
    def shows_work(completions, **kwargs):
        return [0.5 if "=" in c else 0.0 for c in completions]

    table = score_examples([("correctness", 2.0), (shows_work, 3.0)], prefill="<think>\n")
    assert list(table.columns) == ["correctness", "shows_work", "weighted total"]
    last = table.iloc[-1]
    assert last["weighted total"] == 2.0 * last["correctness"] + 3.0 * last["shows_work"] == 5.5


# --------------------------------------------------------------------------------------------- the main notebook


def test_model_choice_swaps_the_model_in_the_tiers_form(tmp_path):
    t4 = NotebookSession.open("auto", root=tmp_path, smoke=False, device=T4, model_choice="Qwen2.5-Math-7B")
    assert t4.preset.name == "t4-16gb" and t4.preset.model_id == "unsloth/Qwen2.5-Math-7B-Instruct-bnb-4bit"
    big = NotebookSession.open("a100-80gb", root=tmp_path, smoke=False, device=A100, model_choice="Qwen2.5-1.5B")
    assert big.preset.model_id == "unsloth/Qwen2.5-1.5B-Instruct"  # a 16-bit tier loads the 16-bit upload
    smoke = NotebookSession.open("auto", root=tmp_path, smoke=True, device=CPU, model_choice="Llama-3.1-8B")
    assert smoke.preset.model_id == load_recipe("cpu").model_id  # the CPU keeps its embedded model
    with pytest.raises(GrpoKitError, match="Qwen2.5-1.5B"):
        NotebookSession.open("auto", root=tmp_path, smoke=False, device=T4, model_choice="GPT-5")


def test_the_model_choice_is_saved_for_the_deep_dive_notebooks(tmp_path):
    chosen = NotebookSession.open("auto", root=tmp_path, smoke=False, device=T4, model_choice="Qwen2.5-1.5B",
                                  max_steps=20)
    chosen.save_choice()
    reopened = NotebookSession.open(root=tmp_path, smoke=False, device=T4)  # 04 / 05 opened alone
    assert reopened.preset == chosen.preset and reopened.paths.run_dir == chosen.paths.run_dir


def test_every_tier_has_a_time_figure_and_no_gpu_figure_claims_a_measurement():
    from grpo_kit.recipes import RECIPES

    table = nbk.expected_time_table()
    assert list(table.index) == list(RECIPES)
    assert set(table["figure"]) <= {"measured", "estimated"}
    gpu_tiers = [name for name, preset in RECIPES.items() if preset.vram_gb > 0]
    assert (table.loc[gpu_tiers, "figure"] == "estimated").all()
    t4 = table.loc["t4-16gb"]
    assert t4["min / whole run"] == pytest.approx(t4["min / 10 steps"] * t4["steps"] / 10, rel=0.05)
    assert "estimated" in nbk.expected_minutes(load_recipe("l4-24gb")) and nbk.expected_minutes(load_recipe("cpu"), 8)


def test_the_visible_grpo_config_matches_what_train_builds(tmp_path):
    """The main notebook writes GRPOConfig(...) in a cell; its recipe fields must be the ones train() would use."""
    from grpo_kit.train import build_grpo_config

    preset = load_recipe("cpu")
    reference = build_grpo_config(preset, tmp_path, on_cpu=True)
    for key, value in preset.grpo.items():  # the notebook passes **preset.grpo: the same values train() uses
        assert getattr(reference, key) == value, key
    source = "\n".join(c.source for c in _code_cells(_read("00_train_grpo_colab.ipynb")))
    assert "**preset.grpo" in source and "trl.GRPOConfig(" in source


def test_save_run_record_lets_chat_and_the_resume_check_read_the_run(tmp_path, smoke_session):
    from grpo_kit.machinery.eval_report import run_prompt_settings

    preset = smoke_session.preset
    nbk.save_run_record(tmp_path, preset, data="sample", reward_names=["tag_progress", "shows_calculation"])
    assert run_prompt_settings(tmp_path / "adapter") == {"few_shot": preset.few_shot, "prefill": preset.prefill}
    assert nbk.recipe_mismatch(tmp_path, preset) == []
    assert nbk.recipe_mismatch(tmp_path, preset.with_overrides(learning_rate=1.0)) == ["learning_rate"]


def test_load_adapter_weights_restores_a_finished_run(tiny_model_dir, tmp_path):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    def fresh():
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))

    trained = fresh()
    with torch.no_grad():
        for name, param in trained.named_parameters():
            if "lora_B" in name:
                param.add_(0.5)
    trained.save_pretrained(tmp_path / "adapter")
    model = fresh()
    nbk.load_adapter_weights(model, tmp_path / "adapter")
    theirs = dict(trained.named_parameters())
    assert all(torch.equal(p, theirs[n]) for n, p in model.named_parameters() if "lora_" in n)
    with pytest.raises(GrpoKitError, match="RESTART"):
        nbk.load_adapter_weights(model, tmp_path)


# --------------------------------------------------------------------------------------------- Colab, with a stand-in


@pytest.fixture
def fake_colab(monkeypatch):
    """A stand-in ``google.colab`` (drive.mount, userdata.get) in sys.modules: what ``in_colab()`` looks for."""
    import sys
    import types

    mounted, secrets = [], {"HF_TOKEN": "hf_from_colab"}

    def mount(path):
        mounted.append(path)
        (Path(path) / "MyDrive").mkdir(parents=True, exist_ok=True)

    google = types.ModuleType("google")
    colab = types.ModuleType("google.colab")
    colab.drive = SimpleNamespace(mount=mount)
    colab.userdata = SimpleNamespace(get=lambda key: secrets[key])
    google.colab = colab
    monkeypatch.setitem(sys.modules, "google", google)
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    return SimpleNamespace(mounted=mounted, secrets=secrets)


def test_on_colab_drive_is_mounted_and_the_session_lives_there(fake_colab, tmp_path, monkeypatch):
    monkeypatch.delenv(nbk.ROOT_ENV, raising=False)
    mount = tmp_path / "drive"
    root = nbk.mount_drive_if_colab(mount)
    assert fake_colab.mounted == [str(mount)] and root == mount / "MyDrive" / "grpo-kit" / "notebook"
    assert root.is_dir() and default_root(tmp_path, mount=mount) == root


def test_on_colab_the_hub_token_comes_from_the_secret(fake_colab, monkeypatch):
    from grpo_kit.machinery.hub import hub_token

    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert hub_token() == "hf_from_colab"
    fake_colab.secrets.clear()  # the secret missing, or access not granted
    assert hub_token() is None


_FIND_SPEC = importlib.util.find_spec


def _run_install_cell(name, monkeypatch, *, installed: bool):
    """Execute notebook ``name``'s install cell with subprocess and find_spec replaced; returns the commands run."""
    import subprocess as sp

    commands = []
    monkeypatch.setattr(sp, "run", lambda cmd, **kwargs: commands.append(list(cmd)))
    monkeypatch.setattr(importlib.util, "find_spec", lambda mod, *a: (
        _FIND_SPEC(mod, *a) if installed or mod not in ("grpo_kit", "trl") else None))
    monkeypatch.setattr("os.path.isdir", lambda path: False)
    exec(compile(_code_cells(_read(name))[0].source, name, "exec"), {})
    return commands


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_install_cell_on_colab_installs_what_the_notebook_needs(name, fake_colab, monkeypatch, capsys):
    commands = _run_install_cell(name, monkeypatch, installed=False)
    flat = [" ".join(command) for command in commands]
    if name in GPU_NOTEBOOKS:
        assert flat[0].startswith("git clone") and "grpo_kit.machinery.colab_install --install" in flat[1]
        loaded = commands[1][commands[1].index("--loaded") + 1].split(",")
        assert "sys" in loaded and "google" in loaded  # the kernel's imports, for the restart decision
    else:
        assert len(commands) == 1 and "pip install" in flat[0] and "git+https://github.com/grpo-kit/grpo-kit" in flat[0]
        assert not any(word in flat[0] for word in ("unsloth", "vllm", "bitsandbytes", "colab_install"))
    assert _run_install_cell(name, monkeypatch, installed=True) == []  # installed: nothing runs again
    assert "already installed" in capsys.readouterr().out


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_install_cell_off_colab_does_nothing(name, monkeypatch, capsys):
    assert _run_install_cell(name, monkeypatch, installed=False) == []
    assert "Not on Colab" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------- the notebooks' cells


def _sources(name: str) -> str:
    return "\n".join(cell.source for cell in _code_cells(_read(name)))


def test_main_notebook_shows_the_wiring_in_its_cells():
    code = _sources(NOTEBOOKS[0])
    for visible in ("FastLanguageModel.from_pretrained(", "FastLanguageModel.get_peft_model(", "get_peft_model(base",
                    "trl.GRPOConfig(", "trl.GRPOTrainer(", "trainer.train(", "CompletionSamples(", "evaluate(model",
                    "ask(model", "export(adapter_dir", "copy_to_drive("):
        assert visible in code, visible
    tree = ast.parse(code)
    own = [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    assert own == ["shows_calculation"] and "(shows_calculation, " in code  # a reward of its own, used in training
    # Unsloth is imported (prepare_backend) before the first TRL / transformers / PEFT import.
    order = [line.strip() for line in code.splitlines()]
    first_heavy = min(i for i, line in enumerate(order) if re.match(r"(import|from) (trl|transformers|peft)\b", line))
    assert min(i for i, line in enumerate(order) if "prepare_backend(preset)" in line) < first_heavy


@pytest.mark.parametrize("name", ["04_evaluate.ipynb", "05_export.ipynb"])
def test_evaluate_and_export_notebooks_do_not_train_by_themselves(name):
    code = _sources(name)
    assert "train_session(" not in code and "ensure_trained_run" not in code and "trainer.train(" not in code
    assert "find_trained_adapter(session, ADAPTER, train_if_missing=TRAIN_IF_MISSING or smoke_mode())" in code
    assert "TRAIN_IF_MISSING = False" in code


@pytest.mark.slow
def test_main_notebook_runs_in_smoke_mode_and_shows_sampled_completions(tmp_path, monkeypatch):
    import nbclient

    monkeypatch.setenv("GRPO_KIT_SMOKE", "1")
    monkeypatch.setenv(nbk.ROOT_ENV, str(tmp_path / "runs"))
    nb = _read(NOTEBOOKS[0])
    nbclient.NotebookClient(nb, timeout=600, resources={"metadata": {"path": str(NOTEBOOK_DIR)}}).execute()
    text = "\n".join(
        str(output.get("text", "")) + str(output.get("data", {}).get("text/plain", ""))
        for cell in _code_cells(nb) for output in cell.outputs
    )
    assert "sampled completions and their rewards" in text and "shows_calculation=" in text
    assert (tmp_path / "runs" / "cpu" / "train" / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "runs" / "cpu" / "eval" / "after.json").is_file()
