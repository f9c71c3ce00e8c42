"""Delay corrections: how a stage's update changes with its delay τ (docs/design.md, "Delay
corrections").

A correction is one file here implementing :class:`~.protocol.DelayCorrection` and one line in
:data:`~.registry.CORRECTIONS`; ``plan/methods/registry.py`` registers the methods that name
it. Each is the rule of one paper, written from the paper's formula and its public code, with the
defaults they use, and pinned by a test against a literal reference of that rule."""
