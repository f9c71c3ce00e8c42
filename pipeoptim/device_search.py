"""Kept so that ``from pipeoptim.device_search import ...`` still works: the search over
P x D factorisations lives in :mod:`pipeoptim.planning.devices`."""

from pipeoptim.planning.devices import (
    DeviceSearch,
    Factorisation,
    factorisations,
    search_devices,
    steady_mini_batches,
)
from pipeoptim.planning.explain_devices import Shares, explain_devices, shares

__all__ = [
    "DeviceSearch",
    "Factorisation",
    "Shares",
    "explain_devices",
    "factorisations",
    "search_devices",
    "shares",
    "steady_mini_batches",
]
