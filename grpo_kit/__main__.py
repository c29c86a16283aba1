"""``python -m grpo_kit`` is the same as the ``grpo-kit`` command."""

from grpo_kit.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
