"""grpo-kit: teach and run GRPO (Group Relative Policy Optimization) on GSM8K.

The package is thin on purpose: it wires TRL's ``GRPOTrainer``, PEFT, Unsloth (GPU only, imported lazily)
and ``datasets`` together, and keeps every piece small enough to read in one sitting.

The core, one concern per module (machinery most learners never open is in ``grpo_kit.machinery``):

- ``answers``  -- pull the final number out of text and compare numbers ("$1,000" == "1000.0").
- ``data``     -- GSM8K loading (Hub, local file, bundled sample, synthetic arithmetic) and prompt formatting.
- ``rewards``  -- reward functions in a registry chosen by name (``REWARDS``), or your own functions.
- ``recipes``  -- ``recipes/*.yaml`` (one per VRAM tier) as ``Recipe`` objects; ``--set`` overrides.
- ``models``   -- ``load_model(recipe)`` (Unsloth on GPU, transformers + PEFT otherwise), models for evaluation.
- ``train``    -- one linear path: recipe -> model -> prompts -> rewards -> ``GRPOConfig`` -> ``GRPOTrainer``.
- ``evaluate`` -- held-out accuracy, before/after.
- ``export``   -- LoRA / merged 16-bit / GGUF exports, each verified by reloading it.
- ``cli``      -- the ``grpo-kit`` command.
"""

__version__ = "0.1.0"
