"""The weight-by-weight export checks: a true merge passes, a merge without the LoRA or a damaged tensor fails."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from grpo_kit.errors import GrpoKitError
from grpo_kit.verify import check_weights, lora_deltas


def _merge(base_dir, adapter_dir, out, *, with_lora=True, dtype=torch.bfloat16):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir)
    if with_lora:
        model = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    model.to(dtype).save_pretrained(out)
    return model


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, tiny_model_dir, make_adapter):
    return make_adapter(tiny_model_dir, tmp_path_factory.mktemp("run") / "adapter", std=0.2)


def test_lora_deltas_name_the_base_tensors(tiny_model_dir, adapter):
    deltas = lora_deltas(adapter)
    base = load_file(str(next(tiny_model_dir.glob("*.safetensors"))))
    assert deltas and set(deltas) <= set(base)
    for name, delta in deltas.items():
        assert delta().shape == base[name].shape and float(delta().abs().max()) > 0


def test_a_true_merge_passes_and_says_what_was_compared(tmp_path, tiny_model_dir, adapter):
    _merge(tiny_model_dir, adapter, tmp_path / "merged")
    result = check_weights("merged16", tmp_path / "merged", tiny_model_dir, adapter, "bfloat16")
    assert result.max_abs_diff <= result.tolerance
    assert result.mean_abs_diff < result.mean_abs_diff_base
    assert "compared with base + LoRA" in result.detail and result.lora_effect > 0


def test_a_merge_without_the_lora_fails(tmp_path, tiny_model_dir, adapter):
    _merge(tiny_model_dir, adapter, tmp_path / "plain", with_lora=False)
    with pytest.raises(GrpoKitError, match="LoRA is missing|limit"):
        check_weights("merged16", tmp_path / "plain", tiny_model_dir, adapter, "bfloat16")


def test_a_damaged_or_missing_tensor_fails(tmp_path, tiny_model_dir, adapter):
    _merge(tiny_model_dir, adapter, tmp_path / "merged")
    path = tmp_path / "merged" / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name] * 1.5
    del tensors["model.norm.weight"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(GrpoKitError) as error:
        check_weights("merged16", tmp_path / "merged", tiny_model_dir, adapter, "bfloat16")
    assert name in str(error.value) and "model.norm.weight is missing" in str(error.value)


@pytest.mark.parametrize("gguf_type", ["f16", "q8_0"])
def test_gguf_of_a_true_merge_passes_and_of_the_base_fails(tmp_path, tiny_model_dir, adapter, gguf_type):
    from gguf_stand_in import write_gguf

    merged = _merge(tiny_model_dir, adapter, tmp_path / "merged", dtype=torch.float32)
    good = write_gguf(merged, tmp_path / f"good-{gguf_type}.gguf", gguf_type)
    result = check_weights("gguf", good, tiny_model_dir, adapter, gguf_type)
    assert result.max_abs_diff <= result.tolerance and "first and last block" in result.detail
    assert result.mean_abs_diff < result.mean_abs_diff_base

    base = _merge(tiny_model_dir, adapter, tmp_path / "base", with_lora=False, dtype=torch.float32)
    bad = write_gguf(base, tmp_path / f"bad-{gguf_type}.gguf", gguf_type)
    with pytest.raises(GrpoKitError, match="LoRA is missing|limit"):
        check_weights("gguf", bad, tiny_model_dir, adapter, gguf_type)


def test_the_check_reads_blocks_of_rows_and_names_a_tensor_with_one_wrong_row(
    tmp_path, tiny_model_dir, adapter, monkeypatch
):
    """Blocks of 1024 values (the 49152 x 32 embedding in 1536 blocks, a 32 x 64 MLP weight in 2): one row off in the
    last block of a LoRA-adapted tensor is named; no weight matrix is read whole (the LoRA factors, rank 4, are)."""
    import grpo_kit.verify as verify

    monkeypatch.setattr(verify, "BLOCK_VALUES", 1024)
    _merge(tiny_model_dir, adapter, tmp_path / "merged")
    path = tmp_path / "merged" / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name][-1] += 0.1 * float(tensors[name].abs().max())
    save_file(tensors, str(path), metadata={"format": "pt"})
    reads = []
    original = verify._Stored.__getitem__
    monkeypatch.setattr(
        verify._Stored, "__getitem__", lambda self, rows: reads.append((self.shape, rows)) or original(self, rows)
    )
    with pytest.raises(GrpoKitError, match=f"{name}: max \\|d\\| .* exceeds the limit") as error:
        check_weights("merged16", tmp_path / "merged", tiny_model_dir, adapter, "bfloat16")
    assert "down_proj" not in str(error.value).replace(name, "")  # that one tensor, no other
    assert ((32, 64), slice(16, 32)) in reads and ((49152, 32), slice(49120, 49152)) in reads
    blocks = [
        (shape, rows) for shape, rows in reads if len(shape) == 2 and 4 not in shape
    ]  # not the rank-4 LoRA factors
    assert blocks and all(rows.stop - rows.start <= 1024 // shape[1] for shape, rows in blocks)
