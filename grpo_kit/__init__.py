"""grpo-kit: teach and run GRPO (Group Relative Policy Optimization) on GSM8K.

The package is thin on purpose: it wires TRL's ``GRPOTrainer``, PEFT, Unsloth (GPU only, imported lazily)
and ``datasets`` together, and keeps every piece small enough to read in one sitting.

Modules, one concern each:

- ``answers``  -- pull the final number out of text and compare numbers ("$1,000" == "1000.0").
- ``data``     -- GSM8K loading (Hub, local file, bundled sample) and prompt formatting.
- ``rewards``  -- reward functions in a registry chosen by name (``REWARDS``).
- ``models``   -- the embedded CPU model and ``load_model(preset)``.
- ``presets``  -- one frozen recipe per VRAM tier, ``auto_recipe()`` and the VRAM planner.
- ``train``    -- ``GRPOConfig`` from a preset, the trainer, metrics and resume.
- ``evaluate`` -- held-out accuracy, before/after.
- ``export``   -- LoRA / merged 16-bit / GGUF exports, each verified by reloading it.
- ``cli``      -- the ``grpo-kit`` command.
"""

__version__ = "0.1.0"
