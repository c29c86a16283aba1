"""Scaling out, the GPU side that CPU can check: vLLM server mode wiring and the choice of model loader.

No GPU and no vLLM here, so these tests check the kit's part: which settings reach TRL's GRPOConfig, which loader
runs with which arguments (Unsloth replaced by a recording fake), and the server check against a real local HTTP
server that answers like ``trl vllm-serve``.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from grpo_kit import models
from grpo_kit.errors import GrpoKitError
from grpo_kit.machinery.backend import resolve_backend, zero3_launch
from grpo_kit.machinery.vllm_server import check_server, serve_command, server_url
from grpo_kit.recipes import load_recipe
from grpo_kit.train import build_grpo_config

MODEL = "unsloth/Meta-Llama-3.1-8B-Instruct"


# ------------------------------------------------------------------------------------------------ preset fields


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"vllm_mode": "remote"}, "vllm_mode 'remote' is not one of colocate, server"),
        ({"use_vllm": False, "vllm_mode": "server"}, "use_vllm is off"),
        ({"vllm_mode": "server", "vllm_server_base_url": "localhost:8000"}, "http://HOST:PORT"),
        ({"backend": "vllm"}, "backend 'vllm' is not one of auto, unsloth, transformers"),
    ],
)
def test_bad_server_and_backend_settings_are_refused_with_the_fix(changes, message):
    with pytest.raises(GrpoKitError, match=message):
        load_recipe("a100-80gb", **changes)


# ------------------------------------------------------------------------------------------------ GRPOConfig


def _vllm_cpu_preset(**changes):
    """The cpu preset with vLLM switched on: GRPOConfig can be built on CPU for it (bf16/fp16 presets cannot)."""
    return load_recipe("cpu", use_vllm=True, **changes)


def test_server_mode_reaches_grpo_config_with_the_servers_url(tmp_path):
    preset = _vllm_cpu_preset(vllm_mode="server", vllm_server_base_url="http://10.0.0.7:8001/")
    config = build_grpo_config(preset, tmp_path, on_cpu=True)
    assert config.use_vllm is True and config.vllm_mode == "server"
    assert config.vllm_server_base_url == "http://10.0.0.7:8001"


def test_default_server_url_is_the_one_the_kit_checks(tmp_path):
    config = build_grpo_config(_vllm_cpu_preset(vllm_mode="server"), tmp_path, on_cpu=True)
    assert config.vllm_server_base_url == "http://localhost:8000"


def test_colocate_mode_leaves_the_server_url_alone(tmp_path):
    config = build_grpo_config(_vllm_cpu_preset(), tmp_path, on_cpu=True)
    assert config.vllm_mode == "colocate" and config.vllm_server_base_url is None


# ------------------------------------------------------------------------------------------------ backend choice


@pytest.mark.parametrize(
    ("backend", "cuda", "zero3", "expected"),
    [
        ("auto", True, False, "unsloth"),
        ("auto", True, True, "transformers"),
        ("auto", False, False, "transformers"),
        ("transformers", True, False, "transformers"),
        ("unsloth", True, False, "unsloth"),
    ],
)
def test_resolve_backend(backend, cuda, zero3, expected):
    preset = load_recipe("a100-80gb", backend=backend)
    assert resolve_backend(preset, cuda=cuda, zero3=zero3) == expected


def test_unsloth_under_zero3_is_refused_with_the_alternatives():
    with pytest.raises(GrpoKitError, match="backend=transformers"):
        resolve_backend(load_recipe("a100-80gb", backend="unsloth"), cuda=True, zero3=True)


def test_unsloth_without_a_gpu_is_refused_before_importing_it():
    with pytest.raises(GrpoKitError, match="needs a CUDA GPU"):
        models.load_model(load_recipe("cpu", backend="unsloth"))


def test_zero3_is_read_from_accelerates_environment():
    assert zero3_launch({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"})
    assert not zero3_launch({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"})


def test_transformers_kwargs_place_each_process_on_its_gpu_except_under_zero3(monkeypatch):
    a100 = load_recipe("a100-80gb")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert models.transformers_load_kwargs(a100, cuda=True) == {"dtype": "bfloat16", "device_map": {"": 3}}
    assert models.transformers_load_kwargs(a100, cuda=True, zero3=True) == {"dtype": "bfloat16"}


def test_transformers_kwargs_for_4bit_store_nf4_in_the_compute_dtype():
    t4 = load_recipe("t4-16gb")
    kwargs = models.transformers_load_kwargs(t4, cuda=True, zero3=True)
    assert kwargs["dtype"] == "float16"
    assert kwargs["quantization_config"] == {
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True,
        "bnb_4bit_compute_dtype": "float16",
        "bnb_4bit_quant_storage": "float16",  # what lets ZeRO-3 shard 4-bit weights
    }


class _Stop(Exception):
    pass


@pytest.fixture
def fake_gpu(monkeypatch):
    """CUDA reported available, and a fake ``unsloth`` module that records what it was asked to load."""
    import torch

    calls: dict = {}

    class FastLanguageModel:
        @staticmethod
        def from_pretrained(**kwargs):
            calls["from_pretrained"] = kwargs
            raise _Stop

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "unsloth", types.SimpleNamespace(FastLanguageModel=FastLanguageModel))
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return calls


def test_unsloth_starts_its_own_vllm_only_when_colocated(fake_gpu):
    with pytest.raises(_Stop):
        models.load_model(load_recipe("a100-80gb"))
    assert fake_gpu["from_pretrained"]["fast_inference"] is True
    assert fake_gpu["from_pretrained"]["gpu_memory_utilization"] == 0.4
    with pytest.raises(_Stop):
        models.load_model(load_recipe("a100-80gb", vllm_mode="server"))
    assert fake_gpu["from_pretrained"]["fast_inference"] is False  # the server generates: no second copy here


def test_unsloth_loads_onto_the_launchers_local_rank(fake_gpu, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(_Stop):
        models.load_model(load_recipe("t4-16gb"))
    assert fake_gpu["from_pretrained"]["device_map"] == {"": 1}


def test_zero3_launch_loads_with_transformers_and_lets_deepspeed_place_the_weights(fake_gpu, monkeypatch):
    seen = []

    def record(cls, model_id, **kwargs):
        seen.append((cls.__name__, model_id, kwargs))
        if cls.__name__ != "AutoTokenizer":
            raise _Stop
        return types.SimpleNamespace(pad_token="<pad>", eos_token="<eos>", padding_side="right")

    monkeypatch.setattr(models, "_from_pretrained", record)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(_Stop):
        models.load_model(load_recipe("a100-80gb"))
    assert "from_pretrained" not in fake_gpu  # Unsloth was not used
    import torch

    (_, tok_id, _), (cls, model_id, kwargs) = seen
    assert (cls, model_id, tok_id) == ("AutoModelForCausalLM", MODEL, MODEL)
    assert kwargs["dtype"] is torch.bfloat16 and "device_map" not in kwargs
    assert kwargs["trust_remote_code"] is False


def test_transformers_backend_builds_a_bitsandbytes_config_for_4bit(fake_gpu, monkeypatch):
    seen = []

    def record(cls, model_id, **kwargs):
        if cls.__name__ == "AutoTokenizer":
            return types.SimpleNamespace(pad_token="<pad>", eos_token="<eos>", padding_side="right")
        seen.append(kwargs)
        raise _Stop

    monkeypatch.setattr(models, "_from_pretrained", record)
    with pytest.raises(_Stop):
        models.load_model(load_recipe("t4-16gb", backend="transformers"))
    import torch
    from transformers import BitsAndBytesConfig

    (kwargs,) = seen
    quant = kwargs["quantization_config"]
    assert isinstance(quant, BitsAndBytesConfig) and quant.load_in_4bit and quant.bnb_4bit_quant_type == "nf4"
    assert quant.bnb_4bit_compute_dtype is torch.float16 and kwargs["device_map"] == {"": 0}


def test_gpu_presets_without_a_gpu_say_what_to_do():
    with pytest.raises(GrpoKitError, match="--preset cpu"):
        models.load_model(load_recipe("a100-80gb", vllm_mode="server"))


# ------------------------------------------------------------------------------------------------ the server check


class _FakeServer:
    """A local HTTP server answering ``/health`` and ``/v1/models`` the way vLLM's server does."""

    def __init__(self, served: list[str] | None, port: int = 0):
        served_ids = served

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                if self.path == "/health":
                    body, status = b"", 200
                elif self.path == "/v1/models" and served_ids is not None:
                    body, status = json.dumps({"data": [{"id": i} for i in served_ids]}).encode(), 200
                else:
                    body, status = b"not found", 404
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def start(self) -> _FakeServer:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_check_server_accepts_a_server_for_the_trained_model():
    server = _FakeServer([MODEL]).start()
    try:
        preset = load_recipe("a100-80gb", vllm_mode="server", vllm_server_base_url=server.url)
        assert check_server(preset, wait=5) == server.url
        # A local copy of the same model is the same model.
        assert check_server(preset, model="/data/Meta-Llama-3.1-8B-Instruct", wait=5) == server.url
    finally:
        server.stop()


def test_check_server_refuses_a_server_holding_another_model():
    server = _FakeServer(["Qwen/Qwen2.5-7B-Instruct"]).start()
    try:
        preset = load_recipe("a100-80gb", vllm_mode="server", vllm_server_base_url=server.url)
        with pytest.raises(GrpoKitError, match=f"serves Qwen/Qwen2.5-7B-Instruct, but this run trains {MODEL}"):
            check_server(preset, wait=5)
    finally:
        server.stop()


def test_check_server_warns_when_the_server_does_not_list_its_model():
    server = _FakeServer(None).start()
    try:
        preset = load_recipe("a100-80gb", vllm_mode="server", vllm_server_base_url=server.url)
        with pytest.warns(UserWarning, match="did not list its model"):
            assert check_server(preset, wait=5) == server.url
    finally:
        server.stop()


def test_no_server_is_reported_with_the_command_that_starts_one():
    url = _closed_port_url()
    preset = load_recipe("a100-80gb", vllm_mode="server", vllm_server_base_url=url)
    with pytest.raises(GrpoKitError) as error:
        check_server(preset, wait=0)
    message = str(error.value)
    assert f"No vLLM server answers at {url}" in message
    assert f"trl vllm-serve --model {MODEL} --port {url.rsplit(':', 1)[1]} --max-model-len 1280" in message


def test_check_server_waits_for_a_server_that_is_still_starting():
    url = _closed_port_url()
    preset = load_recipe("a100-80gb", vllm_mode="server", vllm_server_base_url=url)
    started = []

    def start_later():
        started.append(_FakeServer([MODEL], port=int(url.rsplit(":", 1)[1])).start())

    timer = threading.Timer(1.0, start_later)  # connections are refused for the first second
    timer.start()
    try:
        assert check_server(preset, wait=15, poll=0.2) == url
    finally:
        timer.join()
        for server in started:
            server.stop()


def test_serve_command_and_url_follow_the_preset():
    preset = load_recipe("l4-24gb", vllm_mode="server", vllm_server_base_url="http://gpu-box:9000")
    assert server_url(preset) == "http://gpu-box:9000"
    command = serve_command(preset, gpu="2", model="my/model")
    assert command[:5] == ["CUDA_VISIBLE_DEVICES=2", "trl", "vllm-serve", "--model", "my/model"]
    assert command[command.index("--port") + 1] == "9000"


def test_train_checks_the_server_before_any_weights_load(monkeypatch, tmp_path):
    import grpo_kit.train as train_module

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were loaded before the server check")

    monkeypatch.setattr("grpo_kit.machinery.planner.check_device", lambda preset, device: None)  # pretend this is a GPU box
    monkeypatch.setattr(models, "load_model", no_weights)
    preset = _vllm_cpu_preset(vllm_mode="server", vllm_server_base_url=_closed_port_url())
    run_dir = tmp_path / "run"
    with pytest.raises(GrpoKitError, match="No vLLM server answers"):
        train_module.train(preset, data="sample", output_dir=run_dir, overrides={"vllm_server_timeout": 0})
    assert not run_dir.exists()


def test_cli_set_keys_select_server_mode(monkeypatch):
    import grpo_kit.train as train_module
    from grpo_kit.cli import main

    seen = {}

    def fake_train(preset, **kwargs):
        seen["preset"] = preset.with_overrides(kwargs["overrides"])
        raise _Stop

    monkeypatch.setattr(train_module, "train", fake_train)
    with pytest.raises(_Stop):
        main(["train", "--preset", "a100-80gb", "--set", "use_vllm=true", "--set", "vllm_mode=server", "--set",
              "vllm_server_base_url=http://gpu0:8000", "--set", "backend=transformers"])
    preset = seen["preset"]
    assert (preset.use_vllm, preset.vllm_mode, preset.vllm_server_base_url) == (True, "server", "http://gpu0:8000")
    assert preset.backend == "transformers"
