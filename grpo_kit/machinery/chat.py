"""Talk to a model: ask your own question and read its ``<think>``/``<answer>`` reply as it is written.

The question is rendered exactly as training rendered its questions (system prompt, the run's worked examples and
prefill, read from ``<run>/run.json`` next to the adapter), so the model sees the kind of prompt it learned on.
Generation is greedy unless a temperature is given. On a model that carries Unsloth's vLLM engine (a notebook's
trained GPU model) the reply comes from vLLM in one piece; otherwise transformers' ``generate`` streams it token by
token (the CPU path, and any GPU model loaded with transformers).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def ask(model, tokenizer, question: str, *, few_shot: int = 0, prefill: str = "", max_new_tokens: int = 256,
        temperature: float | None = None, stream: bool = True, lora_request=None) -> str:
    """The model's reply to ``question`` (``prefill`` included, so the text reads from ``<think>``).

    ``stream=True`` prints the reply to stdout while it is generated (transformers path only).
    """
    from transformers import TextStreamer

    from grpo_kit.evaluate import build_prompts
    from grpo_kit.machinery.generation import _use_vllm, engine_lora_request, generate_hf, generate_vllm

    if not question.strip():
        return ""
    prompt = build_prompts([question], tokenizer, few_shot=few_shot, prefill=prefill)[0]
    if _use_vllm(model):  # GPU + Unsloth fast_inference: not run on a GPU yet
        with engine_lora_request(model, lora_request) as request:  # the engine holds base weights: add the adapter
            text = generate_vllm(model, [prompt], max_new_tokens=max_new_tokens, temperature=temperature,
                                 lora_request=request)[0][0][0]
        if stream:
            print(prefill + text, flush=True)
        return prefill + text
    streamer = None
    if stream:
        print(prefill, end="", flush=True)
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    text = generate_hf(model, tokenizer, [prompt], max_new_tokens=max_new_tokens, temperature=temperature,
                       progress=False, streamer=streamer)[0][0][0]
    return prefill + text


def load_chat_model(model: str | None, adapter: str | os.PathLike | None):
    """``(model, tokenizer, settings)``: base (``model``, else the adapter's recorded base, else embedded) + adapter,
    and the ``few_shot``/``prefill`` the adapter was trained with."""
    from grpo_kit.machinery.eval_report import run_prompt_settings
    from grpo_kit.machinery.export_info import read_run_info, resolve_base_model
    from grpo_kit.models import load_inference_model

    if adapter is not None and not model:
        adapter_dir = Path(adapter)
        if (adapter_dir / "adapter_config.json").is_file():
            model = resolve_base_model(adapter_dir, None, read_run_info(adapter_dir))
    loaded, tokenizer = load_inference_model(model or "embedded", adapter)
    return loaded, tokenizer, run_prompt_settings(adapter)


def cli_chat(args) -> int:
    """``grpo-kit chat``: answer the questions given as arguments, else read one question per line until EOF."""
    from grpo_kit.machinery.runtime import set_torch_threads

    set_torch_threads()
    model, tokenizer, settings = load_chat_model(args.model, args.adapter)
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, **settings)
    questions = [" ".join(args.question)] if args.question else None
    interactive = questions is None and sys.stdin.isatty()
    if interactive:
        print("Ask a question (an empty line or Ctrl-D ends).")
    for question in questions or _read_questions(interactive):
        if interactive is False and questions is None:
            print(f"Q: {question}")
        ask(model, tokenizer, question, **options)
        print()
    return 0


def _read_questions(interactive: bool):
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            return
        if not line.strip():
            if interactive:
                return
            continue
        yield line.strip()
