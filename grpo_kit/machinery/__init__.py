"""Machinery most learners never open: what keeps a run safe and a GPU honest, kept apart from the core.

The core (``grpo_kit.answers``, ``data``, ``rewards``, ``recipes``, ``models``, ``train``, ``evaluate``, ``export``,
``cli``) reads top to bottom; these modules do the tested, boring parts it calls: run folders and resume
(``runs``), metrics files (``metrics``), numeric and data guards (``guards``), the VRAM planner (``planner``), and
the rest listed in docs/DESIGN.md.
"""
