"""An optimizer column that sets options of its family: ``nadam β1=0.99`` is NAdam with
β1 = 0.99 (AsyncPP's setting). The setting is part of the optimizer's name, so a row
``xpipe (nadam β1=0.99)`` is judged against ``gpipe (nadam β1=0.99)`` by the rule every row
follows (its synchronous row under the same optimizer), while the family decides what a run
builds and what its update costs. Such a row answers a question in the report; the planner's
tables, keyed by family, leave it out."""

from __future__ import annotations

import math

from pipeoptim.errors import RuntimeConfigError

__all__ = ["OPTION_OF_SETTING", "family_of", "is_variant", "optimizer_options"]

OPTION_OF_SETTING = {"β1": "beta1", "β2": "beta2"}
"""A setting's name in an optimizer's name -> the option it sets (``OptimizerSpec.options``)."""


def optimizer_options(name: str) -> tuple[str, dict[str, float]]:
    """The family of an optimizer's ``name`` and the options its settings give:
    ``"nadam β1=0.99"`` -> ``("nadam", {"beta1": 0.99})``, ``"adamw"`` -> ``("adamw", {})``."""
    family, *settings = name.split(" ")
    options: dict[str, float] = {}
    for setting in settings:
        key, _, value = setting.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if key not in OPTION_OF_SETTING or not math.isfinite(number):
            raise RuntimeConfigError(
                f"cannot read the setting {setting!r} of optimizer {name!r}: write a family "
                f"and settings as 'nadam β1=0.99', each one of {', '.join(OPTION_OF_SETTING)} "
                f"with a number"
            )
        options[OPTION_OF_SETTING[key]] = number
    return family, options


def family_of(name: str) -> str:
    """The family an optimizer's ``name`` builds (``nadam`` for ``nadam β1=0.99``)."""
    return name.split(" ", 1)[0]


def is_variant(name: str | None) -> bool:
    """Whether the optimizer ``name`` sets options of its family."""
    return name is not None and family_of(name) != name
