"""Held-out accuracy before and after training (its statistics: ``grpo_kit.stats``), and chat.

The kit's protocol, stored as a sentence next to every number because the protocol alone moves GSM8K scores by many
points: the prompt exactly as training renders it (``data.build_messages`` + ``data.render_prompt`` + prefill), greedy
decoding, then **strict** = the ``correctness`` reward's verdict (number inside the last ``<answer>``) and **lenient** =
the last number anywhere, both normalized (``answers.answers_match``); the prefill counts as part of the answer text.
A model Unsloth loaded with ``fast_inference=True`` generates through its vLLM engine, with its LoRA adapter loaded
into the engine; any other model through the one transformers ``generate`` loop here.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from grpo_kit import data, models, runs
from grpo_kit.adapters import adapter_config, is_adapter
from grpo_kit.answers import answers_match, extract_last_number, extract_tagged_answer
from grpo_kit.errors import GrpoKitError
from grpo_kit.files import read_json, write_json, write_jsonl
from grpo_kit.rewards import REWARDS
from grpo_kit.stats import paired_difference

#: transformers fills every setting a GenerationConfig leaves unset from the model's own ``generation_config``
#: (Qwen2.5-Instruct ships ``repetition_penalty=1.05``, ``top_k=20``): pinned, so the protocol is the same for every
#: model.
PINNED_GENERATION = {
    "num_beams": 1,
    "top_k": 0,
    "top_p": 1.0,
    "typical_p": 1.0,
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
}


@dataclass(frozen=True)
class EvalResult:
    """Metrics of one evaluation (fractions in 0..1) plus per-question ``rows`` (saved beside it as ``.jsonl``)."""

    accuracy_strict: float
    accuracy_lenient: float
    format_rate: float
    mean_completion_tokens: float
    n: int
    seed: int
    protocol: str
    label: str = ""
    rows: tuple[dict, ...] = field(default=(), repr=False, compare=False)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "rows"}

    def save(self, path: str | os.PathLike) -> Path:
        """Metrics + protocol to ``path`` (a ``.json`` file), the rows to ``path`` with suffix ``.jsonl``; never over a
        file an earlier ``save`` did not write (``check_save_path``)."""
        write_jsonl(check_save_path(path).with_suffix(".jsonl"), self.rows)
        return write_json(path, self.to_dict())

    def summary(self) -> str:
        return (
            f"strict {100 * self.accuracy_strict:.1f} % | lenient {100 * self.accuracy_lenient:.1f} % | format "
            f"{100 * self.format_rate:.1f} % | {self.mean_completion_tokens:.0f} tokens | n={self.n}"
        )


def check_save_path(path: str | os.PathLike) -> Path:
    """``path``, where ``EvalResult.save`` may write it and its rows (``.jsonl`` beside it), else ``GrpoKitError`` with
    the fix: it must name a ``.json`` file, and neither file may lie under a file or be one that an earlier ``save``
    did not write (a user's questions, a run's ``metrics.jsonl``): those are left as they are."""
    path = Path(path)
    if path.is_dir() or path.suffix != ".json":
        example = path / "eval.json" if path.is_dir() else path.with_suffix(".json")
        raise GrpoKitError(f"--out {path}: name a .json file, e.g. --out {example}; its rows go beside it as .jsonl.")
    for target, saved_key in ((path, "accuracy_strict"), (path.with_suffix(".jsonl"), "extracted_strict")):
        if file := next((p for p in target.absolute().parents if p.is_file()), None):
            raise GrpoKitError(f"--out {path}: {file} is a file, not a folder; choose another path.")
        if target.exists() and not _saved_by_eval(target, saved_key):  # a folder named like the rows too
            raise GrpoKitError(
                f"--out {path} would overwrite {target}, which grpo-kit eval did not write (it writes {path.name} and "
                f"its rows {path.with_suffix('.jsonl').name}); it is left as it is. Choose another --out, e.g. "
                f"{path.with_name(path.stem + '-eval.json')}."
            )
    return path


def _saved_by_eval(path: Path, key: str) -> bool:
    """True when ``path`` starts as ``EvalResult.save`` writes it: a JSON object (the first line of the rows) with
    ``key``."""
    try:
        with open(path, encoding="utf-8") as handle:
            first = json.loads(handle.readline() if path.suffix == ".jsonl" else handle.read(1 << 20))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(first, dict) and key in first


def _score_row(completion: str, gold: str, prefill: str = "") -> dict:
    """One completion under both protocols; strict and format are the training rewards' own verdicts."""
    text = prefill + completion
    lenient = extract_last_number(text)
    return {
        "extracted_strict": extract_tagged_answer(text),
        "extracted_lenient": lenient,
        "correct_strict": REWARDS["correctness"]([text], answer=gold)[0] > 0,
        "correct_lenient": answers_match(lenient, gold),
        "in_format": REWARDS["format"]([text])[0] > 0,
    }


def build_prompts(
    questions: Sequence[str], tokenizer, *, few_shot: int = 0, prefill: str = "", system_prompt: str | None = None
) -> list[str]:
    """Prompt strings as training renders them (``system_prompt`` None = the kit's ``data.SYSTEM_PROMPT``)."""
    return [
        data.render_prompt(data.build_messages(q, system_prompt=system_prompt, few_shot=few_shot), tokenizer, prefill)
        for q in questions
    ]


# ------------------------------------------------------------------------------------------------ generation


def stop_token_ids(model, tokenizer) -> list[int]:
    """End-of-turn ids: the generation config's eos id(s) plus the tokenizer's eos id, each once."""
    ends = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ends = [*(ends if isinstance(ends, (list, tuple)) else [ends]), tokenizer.eos_token_id]
    return list(dict.fromkeys(int(token) for token in ends if token is not None))


def generate(
    model,
    tokenizer,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    batch_size: int = 8,
    num_samples: int = 1,
    temperature: float | None = None,
    seed: int = 0,
    progress: bool = True,
    desc: str = "generating",
    streamer=None,
) -> list[list[tuple[str, int]]]:
    """The kit's one generate loop: per prompt, ``num_samples`` ``(completion_text, n_tokens)``, seeded by ``seed``.

    A model with Unsloth's vLLM engine generates there, with its active LoRA adapter (``engine_lora_request``). Any
    other through transformers: left padding; greedy when ``temperature`` is None, else plain temperature sampling
    (``PINNED_GENERATION``); ``n_tokens`` counts up to and including the first stop token; dropout off (eval mode).
    """
    import torch
    from tqdm.auto import tqdm
    from transformers import GenerationConfig

    if _use_vllm(model):
        from vllm import SamplingParams  # GPU only

        params = SamplingParams(
            n=num_samples, temperature=temperature or 0.0, top_p=1.0, max_tokens=max_new_tokens, seed=seed
        )
        with engine_lora_request(model) as request:  # the engine holds the base weights: add the adapter
            outputs = model.fast_generate(list(prompts), sampling_params=params, lora_request=request, use_tqdm=False)
        return [[(o.text, len(o.token_ids)) for o in output.outputs] for output in outputs]
    torch.manual_seed(seed)
    stops = stop_token_ids(model, tokenizer)
    config = GenerationConfig(
        **PINNED_GENERATION,
        do_sample=bool(temperature),
        temperature=temperature or 1.0,
        max_new_tokens=max_new_tokens,
        num_return_sequences=num_samples,
        eos_token_id=stops,
        pad_token_id=tokenizer.pad_token_id,  # padding=True below refuses a tokenizer without one
    )
    results: list[list[tuple[str, int]]] = []
    model.eval()  # dropout off; a trainer puts the model back in train mode at every step (Trainer.training_step)
    for start in tqdm(range(0, len(prompts), batch_size), desc=desc, disable=not progress, unit="batch"):
        inputs = tokenizer(
            list(prompts[start : start + batch_size]), return_tensors="pt", padding=True, padding_side="left"
        ).to(model.device)
        # transformers' GenerationMixin.generate runs under @torch.no_grad() itself
        new = model.generate(**inputs, generation_config=config, streamer=streamer)[:, inputs["input_ids"].shape[1] :]
        lengths = [next((i + 1 for i, t in enumerate(row.tolist()) if t in stops), len(row)) for row in new]
        pairs = list(zip(tokenizer.batch_decode(new, skip_special_tokens=True), lengths, strict=True))
        results += [pairs[i : i + num_samples] for i in range(0, len(pairs), num_samples)]
    return results


def _use_vllm(model) -> bool:
    """True for an Unsloth model loaded with ``fast_inference=True``: it carries a vLLM engine (only ever on a GPU)."""
    return hasattr(model, "fast_generate") and getattr(model, "vllm_engine", None) is not None


@contextlib.contextmanager
def engine_lora_request(model):
    """The ``lora_request`` that makes Unsloth's vLLM engine generate with ``model``'s active LoRA adapter, else None.

    The engine holds only the base weights (it shares them with the trainer), so a ``fast_generate`` call without a
    request scores the base model. Unsloth's ``load_lora(folder, load_tensors=True)`` reads the adapter's live
    tensors (as its GRPO trainer does) and writes only ``adapter_config.json`` into a temporary folder, kept until
    generation ends. No active adapter (no LoRA, or inside ``disable_adapter()``): None, the base model.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    if not any(isinstance(m, BaseTunerLayer) and not m.disable_adapters for m in model.modules()):
        yield None
        return
    if getattr(model, "load_lora", None) is None:
        raise GrpoKitError(
            "This model's vLLM engine cannot load its LoRA adapter (no load_lora), so it would score the "
            "base model. Load it with Unsloth's FastLanguageModel + get_peft_model, or through "
            "grpo_kit.models.load_inference_model (transformers generate)."
        )
    with tempfile.TemporaryDirectory(prefix="grpo-kit-lora-") as folder:
        yield model.load_lora(folder, load_tensors=True)


# ------------------------------------------------------------------------------------------------ evaluate


def evaluate(
    model,
    tokenizer,
    dataset,
    *,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    few_shot: int = 0,
    prefill: str = "",
    system_prompt: str | None = None,
    seed: int = 0,
    progress: bool = True,
    label: str = "",
) -> EvalResult:
    """Greedy pass@1 of ``model`` on ``dataset`` (``question``/``answer`` columns; ``seed``: the one it was drawn with).

    About 1-2 s per question per 64 new tokens for the 135M embedded model on 2 CPU cores.
    """
    data._need_columns("evaluate's dataset (grpo_kit.data.load_gsm8k makes one)", dataset.column_names)
    if len(dataset) == 0:
        raise GrpoKitError("evaluate got no questions; load some with load_gsm8k('sample', 'test').")
    questions, golds = list(dataset["question"]), list(dataset["answer"])
    prompts = build_prompts(questions, tokenizer, few_shot=few_shot, prefill=prefill, system_prompt=system_prompt)
    greedy = generate(
        model,
        tokenizer,
        prompts,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        progress=progress,
        desc=f"eval {label}".strip(),
    )
    rows = [
        {
            "question": question,
            "gold": gold,
            "completion": completion,
            "completion_tokens": n_tokens,
            **_score_row(completion, gold, prefill),
        }
        for question, gold, [(completion, n_tokens)] in zip(questions, golds, greedy, strict=True)
    ]
    mean = lambda key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    protocol = (
        f"{dataset.info.description or 'GSM8K-format questions'}, n={len(rows)} "
        f"(seed {seed}); chat prompt: "
        f"{'grpo_kit.data.SYSTEM_PROMPT' if system_prompt is None else repr(system_prompt)}, "
        f"few_shot={few_shot}, prefill={prefill!r}; greedy decoding, max_new_tokens={max_new_tokens}; strict = number "
        "inside the last <answer></answer>, lenient = last number in the text, both normalized and compared exactly "
        "(grpo_kit.answers)"
    )
    return EvalResult(
        mean("correct_strict"),
        mean("correct_lenient"),
        mean("in_format"),
        mean("completion_tokens"),
        n=len(rows),
        seed=seed,
        protocol=protocol,
        label=label,
        rows=tuple(rows),
    )


def evaluate_before_after(
    model_id: str, adapter_dir: str | os.PathLike, dataset, **kwargs
) -> tuple[EvalResult, EvalResult]:
    """``(base, tuned)`` on the same questions. The model loads once with the adapter; "base" runs inside PEFT's
    ``disable_adapter()``, so both share exactly the same base weights. ``kwargs`` go to ``evaluate``."""
    model, tokenizer = models.load_inference_model(model_id, adapter_dir)
    with model.disable_adapter():
        base = evaluate(model, tokenizer, dataset, label="base", **kwargs)
    return base, evaluate(model, tokenizer, dataset, label="tuned", **kwargs)


def compare(base: EvalResult, tuned: EvalResult, names: tuple[str, str] = ("base", "tuned")) -> str:
    """Side-by-side table of two results, the paired strict-accuracy statistics when both hold rows for the same
    questions, and the protocol."""
    rows = [
        ("accuracy (strict)", "accuracy_strict"),
        ("accuracy (lenient)", "accuracy_lenient"),
        ("format rate", "format_rate"),
        ("mean length (tokens)", "mean_completion_tokens"),
    ]
    lines = [f"{'metric':<22}{names[0]:>10}{names[1]:>12}{'change':>9}"]
    for title, key in rows:
        left, right = getattr(base, key), getattr(tuned, key)
        if key == "mean_completion_tokens":
            lines.append(f"{title:<22}{left:>10.1f}{right:>12.1f}{right - left:>+9.1f}")
        else:
            lines.append(f"{title:<22}{100 * left:>8.1f} %{100 * right:>10.1f} %{100 * (right - left):>+9.1f}")
    lines.append(f"n = {base.n} / {tuned.n}")
    if base.rows and [r["question"] for r in base.rows] == [r["question"] for r in tuned.rows]:
        change = paired_difference([r["correct_strict"] for r in base.rows], [r["correct_strict"] for r in tuned.rows])
        lines.append("strict accuracy, paired:\n" + change.summary())
    if base.protocol == tuned.protocol:
        return "\n".join([*lines, f"protocol: {base.protocol}"])
    return "\n".join([*lines, f"protocol ({names[0]}): {base.protocol}", f"protocol ({names[1]}): {tuned.protocol}"])


# ------------------------------------------------------------------------------------------------ chat and the CLI


def _base_and_prompt(model: str | None, adapter: str | None) -> tuple[str, dict[str, Any]]:
    """``(base model, prompt settings)`` for ``eval`` and ``chat``: ``model``, else the base the adapter's run recorded,
    else embedded; and the prompt it trained with (``runs.Run.prompt``: its run's, or an export's ``prompt.json``)."""
    run = runs.Run.of(adapter or model or "embedded")
    return model or run.base_model or "embedded", run.prompt or runs.PLAIN_PROMPT


def ask(
    model,
    tokenizer,
    question: str,
    *,
    few_shot: int = 0,
    prefill: str = "",
    system_prompt: str | None = None,
    max_new_tokens: int = 256,
    temperature: float | None = None,
    stream: bool = True,
) -> str:
    """The model's reply to ``question`` with the training prompt (``prefill`` included, so it reads from ``<think>``).

    Greedy unless ``temperature`` is given. ``stream=True`` prints the reply as transformers generates it; a model
    with Unsloth's vLLM engine answers in one piece, printed at the end.
    """
    from transformers import TextStreamer

    prompt = build_prompts([question], tokenizer, few_shot=few_shot, prefill=prefill, system_prompt=system_prompt)
    vllm = _use_vllm(model)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream and not vllm else None
    if stream:
        print(prefill, end="", flush=True)
    text = generate(
        model,
        tokenizer,
        prompt,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        progress=False,
        streamer=streamer,
    )[0][0][0]
    if stream and vllm:
        print(text, flush=True)
    return prefill + text


def cli_chat(args) -> int:
    """``grpo-kit chat``: answer the question given as arguments; a conversation is ``ask`` called in a notebook."""
    question = " ".join(args.question).strip()
    if not question:
        raise GrpoKitError(
            f"{'The question is empty' if args.question else 'No question given'}. Ask one: "
            'grpo-kit chat "What is 17 + 25?". For a conversation, call `ask` in a notebook '
            '(notebooks/00_train_grpo_colab.ipynb, "Talk to it").'
        )
    if args.max_new_tokens < 1:  # transformers would refuse it only once the model has loaded
        raise GrpoKitError(f"--max-new-tokens must be at least 1 (got {args.max_new_tokens}); 256 is the default.")
    if args.temperature is not None and not 0 < args.temperature < math.inf:
        raise GrpoKitError(
            f"--temperature must be a number above 0, such as 0.7 (got {args.temperature}); leave it out for greedy."
        )
    models.set_torch_threads()
    base, settings = _base_and_prompt(args.model, args.adapter)
    model, tokenizer = models.load_inference_model(base, args.adapter)
    ask(model, tokenizer, question, max_new_tokens=args.max_new_tokens, temperature=args.temperature, **settings)
    print()
    return 0


def cli_eval(args) -> int:
    """``grpo-kit eval``: the kit's protocol on base, base+adapter or both (--compare); prints the metrics; --out
    saves the tuned (or only) result there, the base one as <stem>-base.json."""
    if min(args.batch_size, args.max_new_tokens) < 1:
        raise GrpoKitError(
            f"--batch-size and --max-new-tokens must be at least 1 (got {args.batch_size}, {args.max_new_tokens})."
        )
    export = Path(args.model).parent / "export.json"  # --model an export's merged16: the base it was merged from
    merged = read_json(export).get("lora_base") if export.is_file() else None
    trained_on = is_adapter(args.adapter or "") and adapter_config(args.adapter)
    if merged and (args.compare and not args.adapter or trained_on and trained_on.base_model_name_or_path == merged):
        raise GrpoKitError(
            f"{args.model} is {merged} with a LoRA merged in (export.json): an adapter trained on {merged} goes on "
            f"{merged} itself. Base against merged: --model {merged} --adapter ADAPTER --compare; the merge itself: "
            "grpo-kit export --adapter ADAPTER --format merged16 --check-answers N."
        )
    if args.compare and not args.adapter:
        raise GrpoKitError("--compare compares the base model with an adapter; pass --adapter DIR too.")
    out = Path(args.out) if args.out else None
    base_out = out.with_name(f"{out.stem}-base.json") if out and args.compare else None
    for path in (out, base_out):  # every file --out writes, checked before any question is evaluated
        if path:
            check_save_path(path)
    models.set_torch_threads()
    dataset = data.load_gsm8k(args.data, split="test", limit=args.limit, seed=args.seed)
    base, settings = _base_and_prompt(args.model, args.adapter)
    options = dict(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed, **settings)
    print(
        f"evaluating {base}{' + ' + args.adapter if args.adapter else ''} on {len(dataset)} questions "
        f"(few_shot={settings['few_shot']}, prefill={settings['prefill']!r})"
    )
    started = time.time()
    if args.compare:
        base_result, tuned = evaluate_before_after(base, args.adapter, dataset, **options)
        results = {"base": base_result, "tuned": tuned}
        print(compare(base_result, tuned))  # its last line: the protocol
    else:
        name = "tuned" if args.adapter else "base"
        model, tokenizer = models.load_inference_model(base, args.adapter)
        results = {name: evaluate(model, tokenizer, dataset, label=name, **options)}
        print(f"{results[name].summary()}\nprotocol: {results[name].protocol}")
    print(f"wall time {time.time() - started:.0f} s")
    for name, result in results.items() if out else ():
        print(f"wrote {result.save((base_out or out) if name == 'base' else out)}")
    return 0
