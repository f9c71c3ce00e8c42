"""Per-layer costs of a model: the input of the partitioner and of the simulator.

A :class:`Profile` is what the planner knows about a model without touching torch: for each
layer (in pipeline order) how long its forward and backward take and how many bytes its
output activation, parameters and optimizer state occupy. The runtime profiler
(``pipeoptim.runtime.profiling.profiler``) measures one; :meth:`Profile.uniform` and
:meth:`Profile.from_costs` build synthetic ones for planning experiments and tests. Profiles
save to and load from a versioned JSON file, so measuring (on a GPU machine) and planning
(anywhere) can happen on different machines.

Beyond the layers a profile may say where it was measured: ``meta["machine"]`` (the host's
cores, the ranks that will share it, each rank's threads: :class:`~pipeoptim.plan.machine.
Machine`) and ``runtime_costs`` (the runtime's fixed work per message and per action on that
host: :class:`~pipeoptim.plan.runtime_costs.RuntimeCosts`), which the offline cost model
charges (:mod:`pipeoptim.sim.host`). Both are optional in format version 1: a file without
them (an older one) loads as it always did and costs nothing beyond its layers.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, StrictStr, with_config
from typing_extensions import Required, TypedDict

from pipeoptim.errors import PlanError
from pipeoptim.filecheck import NonNegativeNumber, PositiveWhole, Whole, check
from pipeoptim.jsonfile import read_json
from pipeoptim.plan.limits import MAX_LAYER_BYTES
from pipeoptim.plan.machine import Machine
from pipeoptim.plan.optimizer_families import FAMILIES, find_family
from pipeoptim.plan.runtime_costs import RuntimeCosts

_REMEDY = "regenerate it with `pipeoptim profile` or Profile.save"

__all__ = [
    "OPTIMIZER_STATE_FACTORS",
    "PROFILE_FORMAT",
    "PROFILE_VERSION",
    "LayerFile",
    "LayerProfile",
    "Profile",
    "ProfileFile",
    "conditions_warning",
    "optimizer_state_factor",
    "threads_per_rank",
]

PROFILE_FORMAT = "pipeoptim.profile"
PROFILE_VERSION = 1

OPTIMIZER_STATE_FACTORS: dict[str, tuple[int, int]] = {
    name: family.state_copies for name, family in FAMILIES.items() if family.state_copies
}
"""Optimizer state size in multiples of the parameter bytes, without and with momentum (each
family's ``state_copies``, ``plan.optimizer_families``)."""


def optimizer_state_factor(optimizer: str, *, momentum: bool | None = None) -> int:
    """How many parameter-sized state tensors ``optimizer`` keeps per parameter.

    SGD keeps its momentum buffer (1, or 0 with ``momentum=False``); Adam and AdamW keep the
    two moments (2); RMSprop keeps the square average (1) plus a momentum buffer when
    ``momentum=True`` (2). ``momentum=None`` takes the usual setting: SGD with momentum,
    RMSprop without.
    """
    family = find_family(optimizer)
    if family is None:
        valid = ", ".join(sorted(OPTIMIZER_STATE_FACTORS))
        raise PlanError(
            f"unknown optimizer {optimizer!r}: the state size is known for {valid}; "
            "pick one of them or give optimizer_state_bytes explicitly"
        )
    return family.state_factor(momentum=momentum)


def threads_per_rank(ranks: int, cores: int | None = None) -> int:
    """CPU threads each of ``ranks`` processes gets on a machine of ``cores`` (default: this
    one's) when they share it evenly, as ``pipeoptim train --transport dist`` does."""
    return max(1, (cores if cores is not None else os.cpu_count() or 1) // max(1, ranks))


def conditions_warning(device: str, threads: object, ranks: int) -> str | None:
    """Why costs profiled on ``device`` with ``threads`` CPU threads may mispredict a run of
    ``ranks`` processes on this machine, or None: on CPU, a thread count other than each
    rank will get (a profile without a recorded count is not judged)."""
    if not device.startswith("cpu") or not isinstance(threads, int):
        return None
    expected = threads_per_rank(ranks)
    if threads == expected:
        return None
    return (
        f"warning: the profile was taken with {threads} CPU thread(s), but {ranks} rank(s) "
        f"on this machine get {expected} each; its times may be off by the difference. "
        f"Re-profile with `pipeoptim profile --ranks {ranks}` (or --threads {expected})"
    )


def _check_nonnegative_number(where: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlanError(f"{where} must be a number of seconds >= 0, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise PlanError(f"{where} must be a finite number of seconds >= 0, got {value!r}")
    return float(value)


def _check_nonnegative_int(where: str, value: object) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{where} must be a whole number >= 0, got {value!r}")
    if value < 0:
        raise PlanError(f"{where} must be >= 0, got {value}")
    return value


@dataclass(frozen=True)
class LayerProfile:
    """Measured (or assumed) costs of one layer, for the profile's batch size."""

    name: str
    """Human-readable layer name, e.g. ``"3:Linear"``; only used in output."""

    forward_s: float
    """Forward time of the layer, in seconds."""

    backward_s: float
    """Backward time of the layer (input and weight gradients), in seconds."""

    activation_bytes: int
    """Bytes of the layer's output activation for one batch of ``Profile.batch_size``
    samples; what crosses a stage boundary after this layer, and what the backward keeps."""

    param_bytes: int
    """Bytes of the layer's parameters (one weight copy). Gradients take as much again."""

    optimizer_state_bytes: int
    """Bytes of optimizer state for the layer's parameters (momentum, Adam moments...)."""

    param_count: int
    """Number of parameter elements (``param_bytes / dtype_bytes`` for one dtype)."""

    update_s: float = 0.0
    """Optimizer step time for the layer's parameters, in seconds (0: not measured)."""

    predict_s: float = 0.0
    """Time to write the layer's predicted weights for a forward (PipeOptim's prediction
    with the profile's optimizer), in seconds (0: not measured): each write, where
    :attr:`prediction_setup_s` is measured; else the first write after an update, Δ
    included (files from before the split)."""

    forward_fixed_s: float = 0.0
    """The part of ``forward_s`` that does not shrink with the batch (per call), fitted
    from several batch sizes; a batch of b samples takes ``forward_fixed_s + (forward_s -
    forward_fixed_s) * b / batch_size``. 0: times scale in proportion to the batch."""

    backward_fixed_s: float = 0.0
    """As ``forward_fixed_s``, for the backward."""

    saved_bytes: int | None = None
    """Bytes the layer's forward saves for its backward other than its output, for one batch
    of ``Profile.batch_size`` samples, counted as the runtime counts them (each storage's
    saved span once, weights left out): a transformer block's attention probabilities and
    MLP hidden, a max-pool's indices, a Linear's input. The output is booked where it is kept
    (``plan/kept_bytes.py``). None (files from before it was measured): the memory model
    books ``activation_bytes`` instead."""

    prediction_setup_s: float | None = None
    """Seconds to compute, once per update, the direction Δ a predictor keeps for its
    writes until the next update (Muon's Newton–Schulz, basis rotation's rotations: the
    runtime computes it at the end of the update, ``Stage._prepare_deltas``), measured as
    the first prediction after a step less a second one. None: not measured (files from
    before it, whose :attr:`predict_s` includes it; the simulator charges none)."""

    weight_grad_fraction: float = 0.5
    """Share of ``backward_s`` that computes the weight gradient (W), in [0, 1]; the rest
    computes the input gradient (I). A zero-bubble schedule runs the two apart. The
    profiler measures it (``torch.autograd.grad`` for the input only, then for the weights
    only); a layer without trainable parameters has 0. The default 0.5 (files and synthetic
    profiles without it) is the zero-bubble paper's T_I = T_W."""

    def __post_init__(self) -> None:
        where = f"layer {self.name!r}"
        if not isinstance(self.name, str):
            raise PlanError(f"a layer name must be a string, got {self.name!r}")
        object.__setattr__(
            self, "forward_s", _check_nonnegative_number(f"{where} forward_s", self.forward_s)
        )
        object.__setattr__(
            self, "backward_s", _check_nonnegative_number(f"{where} backward_s", self.backward_s)
        )
        for name in ("activation_bytes", "param_bytes", "optimizer_state_bytes", "param_count"):
            value = _check_nonnegative_int(f"{where} {name}", getattr(self, name))
            object.__setattr__(self, name, value)
        if self.saved_bytes is not None:
            saved = _check_nonnegative_int(f"{where} saved_bytes", self.saved_bytes)
            object.__setattr__(self, "saved_bytes", saved)
        for name in ("update_s", "predict_s", "forward_fixed_s", "backward_fixed_s"):
            number = _check_nonnegative_number(f"{where} {name}", getattr(self, name))
            object.__setattr__(self, name, number)
        if self.prediction_setup_s is not None:
            setup = _check_nonnegative_number(
                f"{where} prediction_setup_s", self.prediction_setup_s
            )
            object.__setattr__(self, "prediction_setup_s", setup)
        share = self.weight_grad_fraction
        if (
            isinstance(share, bool)
            or not isinstance(share, (int, float))
            or not 0.0 <= share <= 1.0
        ):
            raise PlanError(
                f"{where} weight_grad_fraction must be a number in [0, 1], the share of its "
                f"backward that computes the weight gradient (got {share!r}); give a value "
                "between 0 and 1 (0 for a layer without parameters), or re-profile"
            )
        object.__setattr__(self, "weight_grad_fraction", float(share))
        for part, total in (("forward", self.forward_s), ("backward", self.backward_s)):
            if getattr(self, f"{part}_fixed_s") > total:
                raise PlanError(
                    f"{where} {part}_fixed_s ({getattr(self, f'{part}_fixed_s')}) exceeds "
                    f"{part}_s ({total}): the fixed part of a time cannot exceed the time"
                )

    def time_at(self, samples: float, batch_size: int) -> tuple[float, float]:
        """Forward and backward seconds for a batch of ``samples``, from the time at
        ``batch_size`` and the fixed part (see ``forward_fixed_s``)."""
        scale = samples / batch_size
        return (
            self.forward_fixed_s + (self.forward_s - self.forward_fixed_s) * scale,
            self.backward_fixed_s + (self.backward_s - self.backward_fixed_s) * scale,
        )

    @property
    def weight_grad_s(self) -> float:
        """Seconds of the backward's weight-gradient part W:
        ``weight_grad_fraction * backward_s``."""
        return self.weight_grad_fraction * self.backward_s

    @property
    def compute_s(self) -> float:
        """Forward plus backward time, in seconds."""
        return self.forward_s + self.backward_s


LayerBytes = Annotated[int, Whole(ge=0, le=MAX_LAYER_BYTES)]


@with_config(ConfigDict(extra="allow"))
class LayerFile(TypedDict, total=False):
    """One layer of a profile file (the fields of :class:`LayerProfile`)."""

    name: Required[StrictStr]
    forward_s: Required[NonNegativeNumber]
    backward_s: Required[NonNegativeNumber]
    activation_bytes: Required[LayerBytes]
    param_bytes: Required[LayerBytes]
    optimizer_state_bytes: Required[LayerBytes]
    param_count: Required[LayerBytes]
    update_s: NonNegativeNumber
    predict_s: NonNegativeNumber
    prediction_setup_s: NonNegativeNumber
    forward_fixed_s: NonNegativeNumber
    backward_fixed_s: NonNegativeNumber
    weight_grad_fraction: NonNegativeNumber
    saved_bytes: LayerBytes


@with_config(ConfigDict(title="profile", extra="allow"))
class ProfileFile(TypedDict, total=False):
    """A profile file; unknown keys are allowed (and ignored), for newer files."""

    format: Literal["pipeoptim.profile"]
    version: Required[Annotated[int, Whole(one_of=(PROFILE_VERSION,))]]
    batch_size: Required[PositiveWhole]
    optimizer: Required[StrictStr]
    device: Required[StrictStr]
    dtype_bytes: PositiveWhole
    meta: dict[str, Any]
    layers: Required[list[LayerFile]]
    runtime_costs: dict[str, Any]


def _layer_args(raw: LayerFile) -> dict[str, Any]:
    """The :class:`LayerProfile` arguments in a checked layer (newer files' keys left out)."""
    return {key: value for key, value in raw.items() if key in _LAYER_FIELDS}


_LAYER_FIELDS = frozenset(f.name for f in fields(LayerProfile))
_OPTIONAL = frozenset({"saved_bytes", "prediction_setup_s"})
"""Layer fields the format gained since, left out of a file where not measured (None)."""


@dataclass(frozen=True)
class Profile:
    """Per-layer costs of a model split into an ordered list of layers."""

    layers: tuple[LayerProfile, ...]
    """The layers in pipeline order; a partition cuts this list into contiguous stages."""

    batch_size: int
    """Samples per batch the times and activation bytes were measured with (the size of one
    pipeline unit: the micro-batch for micro-batched methods, the mini-batch otherwise)."""

    optimizer: str
    """Optimizer family the state bytes assume (``sgd``, ``adam``, ``adamw``, ``rmsprop``...)."""

    device: str
    """Where it was measured, e.g. ``"cuda:0"``, ``"cpu"`` or ``"synthetic"``."""

    dtype_bytes: int = 4
    """Bytes per parameter element (4 for fp32, 2 for fp16/bf16)."""

    meta: dict[str, Any] = field(default_factory=dict)
    """Free-form JSON-able details (tool versions, repeats, device name, input shape...);
    ``meta["machine"]``, where present, is the host's record (checked: :attr:`machine`)."""

    runtime_costs: RuntimeCosts | None = None
    """The runtime's fixed costs on the host it was measured on, per message and per action
    (None: not measured, i.e. none)."""

    def __post_init__(self) -> None:
        layers = tuple(self.layers)
        if not layers:
            raise PlanError(
                "a profile needs at least one layer, got none; profile a model "
                "with at least one module or build one with Profile.uniform"
            )
        for index, layer in enumerate(layers):
            if not isinstance(layer, LayerProfile):
                raise PlanError(f"layers[{index}] must be a LayerProfile, got {layer!r}")
        object.__setattr__(self, "layers", layers)
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int):
            raise PlanError(f"batch_size must be a whole number >= 1, got {self.batch_size!r}")
        if self.batch_size < 1:
            raise PlanError(f"batch_size must be >= 1, got {self.batch_size}")
        if isinstance(self.dtype_bytes, bool) or not isinstance(self.dtype_bytes, int):
            raise PlanError(f"dtype_bytes must be a whole number >= 1, got {self.dtype_bytes!r}")
        if self.dtype_bytes < 1:
            raise PlanError(f"dtype_bytes must be >= 1, got {self.dtype_bytes}")
        if not isinstance(self.meta, dict):
            raise PlanError(f"meta must be a dict, got {type(self.meta).__name__}")
        if "machine" in self.meta:
            Machine.from_dict(self.meta["machine"], "the profile's machine record (meta.machine)")
        if self.runtime_costs is not None and not isinstance(self.runtime_costs, RuntimeCosts):
            raise PlanError(
                f"runtime_costs must be a RuntimeCosts or None, got {self.runtime_costs!r}; "
                "build one with RuntimeCosts.from_dict"
            )

    @property
    def machine(self) -> Machine | None:
        """The host the profile was taken for (``meta["machine"]``), None where unrecorded."""
        if "machine" not in self.meta:
            return None
        return Machine.from_dict(self.meta["machine"], "the profile's machine record")

    @property
    def planned_ranks(self) -> int | None:
        """How many pipeline ranks the profile was taken to share its host (``pipeoptim
        profile --ranks``), None where it does not say."""
        ranks = self.meta.get("ranks")
        return ranks if isinstance(ranks, int) and not isinstance(ranks, bool) else None

    # ----------------------------------------------------------------- constructors
    @classmethod
    def uniform(
        cls,
        num_layers: int,
        forward_s: float = 1.0,
        backward_s: float = 2.0,
        activation_bytes: int = 0,
        param_bytes: int = 0,
        *,
        optimizer: str = "sgd",
        optimizer_state_bytes: int | None = None,
        batch_size: int = 1,
        dtype_bytes: int = 4,
        device: str = "synthetic",
    ) -> Profile:
        """A synthetic profile of ``num_layers`` identical layers.

        ``optimizer_state_bytes`` defaults to ``param_bytes`` times the optimizer's state
        factor (:func:`optimizer_state_factor`).
        """
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise PlanError(f"a uniform profile needs num_layers >= 1, got {num_layers!r}")
        return cls.from_costs(
            forward_s=[forward_s] * num_layers,
            backward_s=[backward_s] * num_layers,
            activation_bytes=[activation_bytes] * num_layers,
            param_bytes=[param_bytes] * num_layers,
            optimizer_state_bytes=(
                None if optimizer_state_bytes is None else [optimizer_state_bytes] * num_layers
            ),
            optimizer=optimizer,
            batch_size=batch_size,
            dtype_bytes=dtype_bytes,
            device=device,
        )

    @classmethod
    def from_costs(
        cls,
        forward_s: Sequence[float],
        backward_s: Sequence[float],
        activation_bytes: Sequence[int],
        param_bytes: Sequence[int],
        *,
        optimizer_state_bytes: Sequence[int] | None = None,
        names: Sequence[str] | None = None,
        optimizer: str = "sgd",
        batch_size: int = 1,
        dtype_bytes: int = 4,
        device: str = "synthetic",
        meta: Mapping[str, Any] | None = None,
    ) -> Profile:
        """A profile from per-layer cost lists (all of one length, one entry per layer).

        ``optimizer_state_bytes`` defaults to ``param_bytes`` times the optimizer's state
        factor; ``names`` default to ``"layer0"``, ``"layer1"``...; ``param_count`` is
        ``param_bytes // dtype_bytes``.
        """
        count = len(forward_s)
        lengths = {
            "forward_s": count,
            "backward_s": len(backward_s),
            "activation_bytes": len(activation_bytes),
            "param_bytes": len(param_bytes),
        }
        if optimizer_state_bytes is not None:
            lengths["optimizer_state_bytes"] = len(optimizer_state_bytes)
        if names is not None:
            lengths["names"] = len(names)
        if len(set(lengths.values())) != 1:
            raise PlanError(
                f"per-layer cost lists must all have one entry per layer, got lengths {lengths}; "
                "pass lists of equal length"
            )
        if isinstance(dtype_bytes, bool) or not isinstance(dtype_bytes, int) or dtype_bytes < 1:
            raise PlanError(f"dtype_bytes must be a whole number >= 1, got {dtype_bytes!r}")
        if optimizer_state_bytes is None:
            factor = optimizer_state_factor(optimizer)
            optimizer_state_bytes = [factor * int(b) for b in param_bytes]
        layers = tuple(
            LayerProfile(
                name=f"layer{i}" if names is None else names[i],
                forward_s=forward_s[i],
                backward_s=backward_s[i],
                activation_bytes=activation_bytes[i],
                param_bytes=param_bytes[i],
                optimizer_state_bytes=optimizer_state_bytes[i],
                param_count=int(param_bytes[i]) // dtype_bytes,
            )
            for i in range(count)
        )
        return cls(
            layers=layers,
            batch_size=batch_size,
            optimizer=optimizer,
            device=device,
            dtype_bytes=dtype_bytes,
            meta=dict(meta or {}),
        )

    # ----------------------------------------------------------------- totals
    @property
    def num_layers(self) -> int:
        """Number of layers."""
        return len(self.layers)

    @property
    def total_forward_s(self) -> float:
        """Sum of the layers' forward times, in seconds."""
        return math.fsum(layer.forward_s for layer in self.layers)

    @property
    def total_backward_s(self) -> float:
        """Sum of the layers' backward times, in seconds."""
        return math.fsum(layer.backward_s for layer in self.layers)

    @property
    def total_compute_s(self) -> float:
        """Forward plus backward time of the whole model (one device, no pipeline), seconds."""
        return self.total_forward_s + self.total_backward_s

    @property
    def total_param_bytes(self) -> int:
        """Bytes of all parameters (one copy)."""
        return sum(layer.param_bytes for layer in self.layers)

    @property
    def total_optimizer_state_bytes(self) -> int:
        """Bytes of all optimizer state."""
        return sum(layer.optimizer_state_bytes for layer in self.layers)

    @property
    def total_activation_bytes(self) -> int:
        """Bytes of all layers' output activations for one batch."""
        return sum(layer.activation_bytes for layer in self.layers)

    @property
    def total_param_count(self) -> int:
        """Number of parameter elements of the whole model."""
        return sum(layer.param_count for layer in self.layers)

    # ----------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict with a ``format`` and ``version`` field (``runtime_costs`` only
        where measured)."""
        out = {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "batch_size": self.batch_size,
            "optimizer": self.optimizer,
            "device": self.device,
            "dtype_bytes": self.dtype_bytes,
            "meta": self.meta,
            # a layer without saved_bytes (prediction_setup_s) is written as older files had it
            "layers": [
                {k: v for k, v in asdict(layer).items() if k not in _OPTIONAL or v is not None}
                for layer in self.layers
            ],
        }
        if self.runtime_costs is not None:
            out["runtime_costs"] = self.runtime_costs.to_dict()
        return out

    def to_json(self, *, indent: int | None = 2) -> str:
        """The profile as JSON text (see :meth:`to_dict`)."""
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON to ``path``."""
        Path(path).write_text(self.to_json() + "\n", encoding="utf-8")

    @classmethod
    def from_dict(cls, data: object, *, source: str = "profile") -> Profile:
        """Build a profile from :meth:`to_dict` output; :class:`PlanError` names what is wrong."""
        checked = check(ProfileFile, data, source=source, remedy=_REMEDY, error=PlanError)
        try:
            layers = tuple(LayerProfile(**_layer_args(raw)) for raw in checked["layers"])
            runtime = checked.get("runtime_costs")
            return cls(
                layers=layers,
                batch_size=checked["batch_size"],
                optimizer=checked["optimizer"],
                device=checked["device"],
                dtype_bytes=checked.get("dtype_bytes", 4),
                meta=checked.get("meta", {}),
                runtime_costs=None if runtime is None else RuntimeCosts.from_dict(runtime),
            )
        except PlanError as exc:
            raise PlanError(f"{source}: {exc}; {_REMEDY}") from None

    @classmethod
    def from_json(cls, text: str, *, source: str = "profile") -> Profile:
        """Parse JSON text written by :meth:`to_json`."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(
                f"{source} is not valid JSON ({exc.msg} at line {exc.lineno} column "
                f"{exc.colno}); {_REMEDY}"
            ) from None
        return cls.from_dict(data, source=source)

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read a profile JSON file written by :meth:`save`."""
        data = read_json(path, what="profile file", remedy=_REMEDY, error=PlanError)
        return cls.from_dict(data, source=f"profile file {str(path)!r}")
