"""Checkpoints: the per-stage store a run resumes from (:mod:`.store`), the format a stage's
state is written in (:mod:`.formats`; a new format is a new class there), the checks that a
saved state fits a stage, and the export of a whole model's state dict."""
