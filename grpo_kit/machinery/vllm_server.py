"""TRL's vLLM server mode: generation on its own GPU, training on the others.

With ``vllm_mode='server'`` the trainer sends its prompts to a vLLM server that TRL's ``trl vllm-serve`` started
(``vllm serve`` with the weight-transfer endpoints on), and after every optimizer step pushes the updated weights
(LoRA merged in) to it over NCCL. This module holds the kit's side of that: the URL a preset points at, the command
that starts a matching server, and a check, run before any weights load, that a server is up and serves the model
being trained (a server holding another model would receive weights it cannot use).

>>> from grpo_kit.recipes import load_recipe
>>> preset = load_recipe("a100-80gb", vllm_mode="server")
>>> server_url(preset)
'http://localhost:8000'
>>> print(" ".join(serve_command(preset, gpu="0")))
CUDA_VISIBLE_DEVICES=0 trl vllm-serve --model unsloth/Meta-Llama-3.1-8B-Instruct --port 8000 --max-model-len 1280 --gpu-memory-utilization 0.9
"""

from __future__ import annotations

import json
import time
import urllib.request
import warnings
from urllib.parse import urlparse

from grpo_kit.errors import GrpoKitError

DEFAULT_URL = "http://localhost:8000"
#: A server on a card of its own can take most of it (``trl vllm-serve``'s default too).
SERVER_GPU_MEMORY_UTILIZATION = 0.9


def server_url(preset) -> str:
    """The server the preset talks to: ``vllm_server_base_url``, or ``http://localhost:8000`` (the serve default)."""
    return (preset.get("vllm_server_base_url") or DEFAULT_URL).rstrip("/")


def serve_command(preset, *, gpu: str = "0", model: str | None = None) -> list[str]:
    """The shell words that start a server for ``preset`` on GPU ``gpu`` (port taken from the preset's URL)."""
    port = urlparse(server_url(preset)).port or 8000
    return [
        f"CUDA_VISIBLE_DEVICES={gpu}",
        "trl",
        "vllm-serve",
        "--model",
        model or preset.model_id,
        "--port",
        str(port),
        "--max-model-len",
        str(preset.max_seq_length),
        "--gpu-memory-utilization",
        str(SERVER_GPU_MEMORY_UTILIZATION),
    ]


def check_weight_sync(preset) -> None:
    """Refuse server mode with 4-bit weights (before any weights load): the server would receive packed bytes.

    After each step TRL sends every parameter's ``param.data`` (LoRA merged in) to the server. On a bitsandbytes
    4-bit layer that is the packed uint8 storage without its quantization state, which the server cannot read back
    as weights, so generation would silently use garbage. Colocated vLLM (Unsloth shares the weights) and 16-bit
    weights both work.

    >>> from grpo_kit.recipes import load_recipe
    >>> check_weight_sync(load_recipe("a100-80gb", vllm_mode="server"))  # 16-bit weights: fine
    >>> check_weight_sync(load_recipe("t4-16gb", vllm_mode="server"))
    Traceback (most recent call last):
    ...
    grpo_kit.errors.GrpoKitError: vllm_mode='server' cannot train 4-bit weights ...
    """
    if preset.vllm_server and preset.load_in_4bit:
        raise GrpoKitError(
            f"vllm_mode='server' cannot train 4-bit weights (preset '{preset.name}' has load_in_4bit): TRL sends the "
            "server each layer's raw data, which for a 4-bit layer is packed bytes without its quantization state. "
            "Use colocated vLLM on the training GPU (drop --set vllm_mode=server), or 16-bit weights "
            "(--set load_in_4bit=false, or a 16-bit preset such as a100-40gb), which need more GPU memory."
        )


def served_models(url: str, *, timeout: float = 5.0) -> list[str]:
    """Ids the server at ``url`` lists under ``/v1/models`` after answering ``/health``; raises ``OSError`` if down."""
    with urllib.request.urlopen(f"{url}/health", timeout=timeout) as response:
        if response.status != 200:
            raise OSError(f"/health answered HTTP {response.status}")
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=timeout) as response:
            payload = json.loads(response.read().decode("utf-8"))
    except (OSError, ValueError):
        return []  # up, but not saying what it serves: nothing to compare
    return [str(row.get("id", "")) for row in payload.get("data", []) if isinstance(row, dict)]


def same_model(served: str, trained: str) -> bool:
    """Whether a served id names the trained model: equal, or the same last path part (a Hub id vs a local copy).

    >>> same_model("unsloth/Llama-3.2-1B", "/models/Llama-3.2-1B/"), same_model("Qwen/Qwen2.5-1.5B", "Qwen/Qwen2.5-7B")
    (True, False)
    """
    return served == trained or served.rstrip("/").split("/")[-1] == trained.rstrip("/").split("/")[-1]


def check_server(preset, *, model: str | None = None, wait: float = 240.0, poll: float = 2.0) -> str:
    """Wait up to ``wait`` seconds for the preset's vLLM server; return its URL, or raise ``GrpoKitError``.

    The error names the URL and the command that starts a matching server. A server that serves a different model
    than the one being trained is refused too: TRL would push this model's weights into it.
    """
    url = server_url(preset)
    trained = model or preset.model_id
    deadline = time.monotonic() + wait
    announced = False
    while True:
        try:
            served = served_models(url)
            break
        except OSError as error:  # URLError, refused connections and timeouts are all OSErrors
            if time.monotonic() >= deadline:
                raise GrpoKitError(
                    f"No vLLM server answers at {url} ({_reason(error)}); vllm_mode='server' needs one running before "
                    f"training starts. Start it on a GPU the trainer does not use, e.g.\n    "
                    f"{' '.join(serve_command(preset, model=trained))}\n"
                    "then train on the other GPUs (CUDA_VISIBLE_DEVICES=1 grpo-kit train ...). Another address: "
                    "--set vllm_server_base_url=http://HOST:PORT. No second GPU: drop vllm_mode=server (colocate)."
                ) from None
            if not announced:
                print(f"waiting up to {wait:.0f} s for the vLLM server at {url} ...", flush=True)
                announced = True
            time.sleep(poll)
    if served and not any(same_model(name, trained) for name in served):
        raise GrpoKitError(
            f"The vLLM server at {url} serves {', '.join(served)}, but this run trains {trained}. TRL would push the "
            f"trained weights into a different model. Restart the server with --model {trained}."
        )
    if not served:
        warnings.warn(f"The vLLM server at {url} did not list its model; check that it serves {trained}.", stacklevel=2)
    return url


def _reason(error: BaseException) -> str:
    reason = getattr(error, "reason", None) or error
    return str(reason).strip() or type(error).__name__
