"""grpo-kit: teach and run GRPO (Group Relative Policy Optimization) on GSM8K.

The package is thin on purpose: it wires TRL's ``GRPOTrainer``, PEFT, Unsloth (GPU only, imported lazily),
bitsandbytes and ``datasets`` together, one concern per module (docs/DESIGN.md lists them): ``train.train()`` is
the path recipe -> model -> prompts -> rewards -> ``GRPOConfig`` -> ``GRPOTrainer`` that notebook 00 shows cell by cell.
"""

import logging

# bitsandbytes' CPU backend logs a warning when it is imported (PEFT imports it) on a CPU with AVX512-BF16 and without
# the optional `kernels` package, which fetches a faster 4-bit matmul from the Hugging Face Hub at run time. The kit
# does not use it (runs must not download code), so every command would otherwise start with that line.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
# datasets' file loaders log a parse failure, traceback included, before raising it; grpo_kit.data turns that error
# into one message naming the file and the shape it must have.
logging.getLogger("datasets.packaged_modules").setLevel(logging.CRITICAL)

__version__ = "0.1.0"
