"""Measuring a model for the planner: per-layer time and memory into a plan Profile."""
