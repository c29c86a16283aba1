"""Watch GRPO learn: every N steps, a few of the step's sampled completions with the score each reward gave them.

A loss near 0 says nothing in GRPO (with one update per batch the loss value is ``-mean(advantage)``); what shows
learning is *what the model writes* and how the rewards score it. ``CompletionSamples`` records each reward
function's scores on the latest generation batch (it wraps the functions, keeping their names, so TRL's metric names
are unchanged) and, as a ``TrainerCallback``, prints a small table at the end of every N-th optimizer step::

    samples = CompletionSamples(every=5)
    trainer = GRPOTrainer(..., reward_funcs=samples.wrap(reward_funcs), callbacks=[samples])

``grpo-kit train --show-completions N`` does this; notebooks display ``samples.rows()`` as a DataFrame.
"""

from __future__ import annotations

from transformers import TrainerCallback


class CompletionSamples(TrainerCallback):
    """Record the latest batch's completions and reward scores; print a table every ``every`` steps (0 = never)."""

    def __init__(self, every: int, rows: int = 4, printer=print):
        self.every = every
        self.max_rows = rows
        self.printer = printer
        self.completions: list = []
        self.questions: list = []
        self.scores: dict[str, list] = {}

    def wrap(self, funcs) -> list:
        """The reward functions, each recording its scores here; TRL sees the same names and results."""
        import inspect

        # Reward models (nn.Module) and async functions are called differently by TRL: they pass unrecorded.
        def plain(fn) -> bool:
            return hasattr(fn, "__name__") and not hasattr(fn, "forward") and not inspect.iscoroutinefunction(fn)

        return [_Recorded(fn, self) if plain(fn) else fn for fn in funcs]

    def record(self, name: str, kwargs: dict, scores) -> None:
        completions = kwargs.get("completions") or []
        if completions is not self.completions:  # a new generation batch: forget the previous one's scores
            self.completions = completions
            self.questions = list(kwargs.get("question") or kwargs.get("prompts") or [""] * len(completions))
            self.scores = {}
        self.scores[name] = list(scores)

    def rows(self) -> list[dict]:
        """Up to ``rows`` completions spread over the batch (so different questions show): question, excerpt, scores."""
        n = len(self.completions)
        picked = list(range(0, n, max(1, n // self.max_rows)))[: self.max_rows]
        return [
            {"question": _excerpt(_text(self.questions[i]), head=60, tail=0), "completion": _excerpt(_text(self.completions[i])),
             **{name: scores[i] for name, scores in self.scores.items()}}
            for i in picked
        ]

    def table(self, step: int) -> str:
        rows = self.rows()
        if not rows:
            return f"step {step}: no completions recorded yet"
        names = [key for key in rows[0] if key not in ("question", "completion")]
        lines = [f"step {step}: sampled completions and their rewards"]
        for row in rows:
            scores = "  ".join(f"{name}={_number(row[name])}" for name in names)
            lines.append(f"  Q: {row['question']}\n  A: {row['completion']}\n     {scores}")
        return "\n".join(lines)

    def on_step_end(self, args, state, control, **kwargs):
        if self.every and state.global_step % self.every == 0 and state.is_world_process_zero:
            self.printer(self.table(state.global_step))


class _Recorded:
    """A reward function that also hands its scores to a ``CompletionSamples``; same name, same result."""

    def __init__(self, fn, sink: CompletionSamples):
        self.fn = fn
        self.sink = sink
        self.__name__ = fn.__name__

    def __call__(self, *args, **kwargs):
        scores = self.fn(*args, **kwargs)
        self.sink.record(self.__name__, kwargs, scores)
        return scores


def _text(item) -> str:
    """Plain text of a completion or prompt: a string, or the last message of a chat list."""
    if isinstance(item, list) and item and isinstance(item[-1], dict):
        return str(item[-1].get("content", ""))
    return str(item)


def _excerpt(text: str, head: int = 40, tail: int = 70) -> str:
    """One line: the start and the end of ``text`` (where the answer tag is), newlines shown as ``⏎``.

    >>> _excerpt("<think>\\n2+2=4\\n</think>\\n<answer>4</answer>")
    '<think>⏎2+2=4⏎</think>⏎<answer>4</answer>'
    >>> _excerpt("x" * 50 + "<answer>4</answer>", head=5, tail=20)
    'xxxxx … xx<answer>4</answer>'
    """
    flat = text.replace("\n", "⏎")
    if len(flat) <= head + tail + 3:
        return flat
    return flat[:head] + " … " + (flat[-tail:] if tail else "")


def _number(value) -> str:
    return "n/a" if value is None else f"{value:g}" if isinstance(value, (int, float)) else str(value)
