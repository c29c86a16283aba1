"""Regression tests for the GPU path, run on CPU with the GPU libraries faked or their calls recorded."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from grpo_kit import runtime


@pytest.fixture
def fake_t4(monkeypatch):
    """torch.cuda as a T4 shows it: sm75, and ``is_bf16_supported()`` True because it counts emulation."""
    props = SimpleNamespace(name="Tesla T4", total_memory=int(14.7 * 2**30), major=7, minor=5)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: props)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (7, 5))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    return props


def test_t4_is_not_reported_as_bf16(fake_t4):
    device = runtime.detect_device()
    assert (device.kind, device.bf16) == ("cuda", False)
    assert runtime.half_dtype_name() == "float16"


def test_ampere_is_bf16(fake_t4, monkeypatch):
    fake_t4.major, fake_t4.minor = 8, 0
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (8, 0))
    assert runtime.detect_device().bf16 is True
    assert runtime.half_dtype_name() == "bfloat16"
