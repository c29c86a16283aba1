"""Reliability, issue 16: the defects a new user still hit (one regression test or more per numbered item).

1. NaN exports "verified"; 2. non-finite settings and adapters; 3. ``--resume`` of a finished run; 4. a lock per run
folder; 5. checkpoints without optimizer state; 6. tracebacks (torn adapters, adapters of another base, typed
``--set`` values). The broader table of faults lives in tests/test_faults.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from grpo_kit.cli import main
from grpo_kit.errors import GrpoKitError
from grpo_kit.export import Reference, check_logits

NAN, INF = float("nan"), float("inf")


def _cli_error(capsys, argv) -> str:
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2, f"exit {code}\nstdout: {captured.out[-2000:]}\nstderr: {captured.err[-2000:]}"
    assert "Traceback" not in captured.err + captured.out
    return captured.err


def _strict_json(text: str):
    """``json.loads`` that refuses NaN/Infinity, as every non-Python JSON reader does."""
    def refuse(token):
        raise ValueError(f"invalid JSON token {token}")

    return json.loads(text, parse_constant=refuse)


def _poison(adapter_dir, value=NAN):
    """Set one LoRA tensor of a saved adapter to ``value`` (what a diverged run leaves)."""
    from safetensors.torch import load_file, save_file

    path = adapter_dir / "adapter_model.safetensors"
    tensors = load_file(str(path))
    name = sorted(n for n in tensors if "lora_B" in n)[0]
    tensors[name] = torch.full_like(tensors[name], value)
    save_file(tensors, str(path))
    return name


# ------------------------------------------------------------------------------------------------ 1. NaN exports


def _reference(tuned, base):
    return Reference(prompts=((1, 2),), tuned=(tuned,), base=(base,))


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_non_finite_export_logits_fail_verification(bad, tmp_path):
    tuned, base = torch.randn(2, 5), torch.randn(2, 5)
    candidate = tuned.clone()
    candidate[0, 0] = bad
    with pytest.raises(GrpoKitError, match="NaN/inf.*Nothing was written"):
        check_logits("lora", "lora", (candidate,), _reference(tuned, base), path=tmp_path, detail="test")


def test_nan_reference_fails_verification_even_when_the_export_matches_it(tmp_path):
    tuned = torch.full((2, 5), NAN)
    with pytest.raises(GrpoKitError, match="NaN/inf"):
        check_logits("merged16", "merged16:bfloat16", (tuned.clone(),), _reference(tuned, torch.randn(2, 5)),
                     path=tmp_path, detail="test")


@pytest.mark.parametrize("fmt", ["lora", "merged16"])
def test_export_refuses_an_adapter_with_nan_weights(fmt, tiny_model_dir, make_adapter, tmp_path, capsys):
    adapter = make_adapter(tiny_model_dir, tmp_path / "run" / "adapter")
    tensor = _poison(adapter)
    before = (adapter / "adapter_model.safetensors").read_bytes()
    err = _cli_error(capsys, ["export", "--adapter", str(adapter), "--model", str(tiny_model_dir), "--format", fmt,
                              "--out-dir", str(tmp_path / "exports")])  # fmt: skip
    assert "NaN/inf weights" in err and tensor in err and "--learning-rate" in err
    assert not (tmp_path / "exports" / "run").exists()
    assert (adapter / "adapter_model.safetensors").read_bytes() == before  # nothing lost


def test_export_json_is_strict_json(tiny_model_dir, make_adapter, tmp_path):
    from grpo_kit.export import export

    adapter = make_adapter(tiny_model_dir, tmp_path / "run" / "adapter")
    export(adapter, "lora", base_model=str(tiny_model_dir), out_dir=tmp_path / "exports")
    info = _strict_json((tmp_path / "exports" / "run" / "export.json").read_text())
    assert info["formats"][0]["format"] == "lora" and math.isfinite(info["formats"][0]["max_abs_diff"])


def test_json_safe_writes_null_for_non_finite():
    from grpo_kit.guards import dumps_finite

    assert _strict_json(dumps_finite({"a": NAN, "b": [INF, 1.0]})) == {"a": None, "b": [None, 1.0]}
