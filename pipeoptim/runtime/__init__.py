"""Torch runtime: stages, weight prediction, transport and the executor that runs a plan."""
