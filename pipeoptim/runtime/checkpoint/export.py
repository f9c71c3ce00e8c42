"""One checkpoint out: a pipeline's per-stage checkpoint as one state dict in the model's names.

A run's checkpoint is one file per stage, keyed the way a stage holds its units
(``"0.weight"`` of the stage's first unit). Someone who trained a model wants it back as the
model: one ``state_dict`` whose keys are the model's own (``transformer.h.0.attn.c_attn.weight``),
loadable into the model they built, or for a Hugging Face model a folder that
``from_pretrained`` loads. The names come from the run (``ModelUnits.names``, recorded in every
checkpoint); a model given as plain units is named as an ``nn.Sequential`` of them names it.

A weight shared across stages has one copy per member stage (``ties.py``); they are equal, and
the export writes it under each of its names once, after checking the copies agree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pipeoptim.errors import OutputPathError, RuntimeConfigError
from pipeoptim.runtime.checkpoint.store import CheckpointStore, latest_step

_CHECKPOINT_NAMES = ("latest.json", ".lock")
"""What a checkpoint folder holds besides its ``step-*`` folders (``store.py``)."""

__all__ = [
    "EXPORT_FORMATS",
    "check_export_target",
    "export_checkpoint",
    "merge_stages",
    "write_export",
]

EXPORT_FORMATS = ("pt", "safetensors", "hf")
"""``.pt`` (torch.save of the state dict), ``.safetensors`` (needs the safetensors package), or
``hf``: a folder ``from_pretrained`` loads (a Hugging Face model; needs transformers)."""


def merge_stages(
    stage_states: Mapping[int, Mapping[str, Tensor]],
    bounds: Sequence[Sequence[int]],
    names: Sequence[Mapping[str, Sequence[str]]] | None,
) -> dict[str, Tensor]:
    """Every stage's module state (keys ``"{unit in stage}.{key}"``) as one state dict in the
    model's names. A name two stages give (a tied weight) must hold equal values."""
    merged: dict[str, Tensor] = {}
    where: dict[str, int] = {}
    for k in sorted(stage_states):
        first = int(bounds[k][0])
        for key, value in stage_states[k].items():
            local, _, rest = key.partition(".")
            unit = first + int(local)
            targets = names[unit].get(rest, [f"{unit}.{rest}"]) if names else [f"{unit}.{rest}"]
            for name in targets:
                held = merged.get(name)
                if held is None:
                    merged[name], where[name] = value, k
                elif not torch.equal(held, value):
                    raise RuntimeConfigError(
                        f"{name!r} is shared by stages {where[name]} and {k}, whose copies "
                        f"differ (largest difference {(held - value).abs().max().item():.3g}); "
                        f"the checkpoint was not written by one run of a synchronous method"
                    )
    return merged


def _format_of(out: Path, requested: str | None) -> str:
    if requested is not None:
        if requested not in EXPORT_FORMATS:
            raise RuntimeConfigError(
                f"unknown export format {requested!r}; use one of {', '.join(EXPORT_FORMATS)}"
            )
        return requested
    if out.suffix == ".safetensors":
        return "safetensors"
    if out.suffix in (".pt", ".pth", ".bin"):
        return "pt"
    raise RuntimeConfigError(
        f"cannot tell the export format from {str(out)!r}; name the file *.pt or "
        f"*.safetensors, or pass the format ({', '.join(EXPORT_FORMATS)}; hf writes a folder)"
    )


def check_export_target(
    out: str | Path, fmt: str | None, checkpoint_dir: str | Path | None = None
) -> str:
    """The format ``out`` is written in (``fmt``, or from the suffix), after refusing an
    output that cannot be written as that format, before any work: a folder where a file
    goes (``model.pt/``), a file where a folder goes (``--format hf`` onto a file, which
    ``save_pretrained`` would skip, writing nothing), a path under a file, and a path in
    ``checkpoint_dir`` that is the checkpoint's own (its ``latest.json``, a step's files,
    the folder itself): an export never writes over what it reads."""
    path = Path(out)
    text = str(out)
    try:
        if checkpoint_dir is not None:
            root = Path(checkpoint_dir).resolve()
            target = path.resolve()
            if target == root:
                raise OutputPathError(
                    f"the export output {text!r} is the checkpoint folder it reads; write "
                    f"the export elsewhere, e.g. {str(path / 'model.pt')!r}"
                )
            if target.is_relative_to(root):
                first = target.relative_to(root).parts[0]
                if first in _CHECKPOINT_NAMES or first.startswith("step-"):
                    raise OutputPathError(
                        f"the export output {text!r} would overwrite the checkpoint's own "
                        f"{first!r} in {str(checkpoint_dir)!r}, which the export reads; give "
                        f"a path outside it, e.g. {str(root.parent / 'model.pt')!r}"
                    )
        kind = _format_of(path, fmt)
        for parent in path.absolute().parents:
            if parent.exists():
                if not parent.is_dir():
                    raise OutputPathError(
                        f"the export output {text!r} lies under {str(parent)!r}, which is "
                        f"a file, not a folder; choose another path"
                    )
                break
        if kind == "hf" and path.exists() and not path.is_dir():
            raise OutputPathError(
                f"the export output {text!r} is a file, and the hf format writes a folder "
                f"(config.json and the weights, as save_pretrained does); give a folder "
                f"path, new or existing, e.g. {str(path.with_suffix('')) + '-hf'!r}"
            )
        if kind != "hf" and path.is_dir():
            raise OutputPathError(
                f"the export output {text!r} is a folder, and the {kind} format writes one "
                f"file; give a file path, e.g. {str(path / ('model.' + kind))!r}, or "
                f"the hf format (--format hf, fmt='hf') for a from_pretrained folder"
            )
    except OSError as err:
        raise OutputPathError(
            f"the export output {text!r} cannot be used ({err.strerror or err}); choose "
            f"another path"
        ) from None
    return kind


def write_export(
    state: dict[str, Tensor],
    out: str | Path,
    fmt: str | None,
    source: Mapping[str, Any],
    *,
    checkpoint_dir: str | Path | None = None,
) -> Path:
    """Write ``state`` to ``out`` as ``fmt`` (None: from the suffix), after
    :func:`check_export_target` (``checkpoint_dir``: a folder the output must not overwrite)."""
    path = Path(out)
    kind = check_export_target(path, fmt, checkpoint_dir)
    if kind == "hf":
        if source.get("library") != "transformers":
            raise RuntimeConfigError(
                "the hf format needs a Hugging Face model cut with pipeoptim.hf.cut_causal_lm "
                "(this run's units came from elsewhere, so there is no config to write); "
                "export to a .pt or .safetensors file instead"
            )
        from pipeoptim.hf import save_pretrained_folder

        try:
            written = save_pretrained_folder(dict(source), state, path)
        except OSError as err:
            raise OutputPathError(
                f"cannot write the export folder {str(path)!r}: {err.strerror or err}; "
                f"choose another path"
            ) from None
        if not (written / "config.json").is_file():  # save_pretrained only logs its refusals
            raise OutputPathError(
                f"the export folder {str(path)!r} holds no config.json after writing it: "
                f"nothing was written there; choose another folder"
            )
        return written
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "safetensors":
            try:
                from safetensors.torch import save_file
            except ImportError:
                raise RuntimeConfigError(
                    "writing .safetensors needs the safetensors package: pip install "
                    "'pipeoptim[hf]' (or safetensors), or export to a .pt file"
                ) from None
            # safetensors refuses two names over one storage: give each name its own tensor
            seen: set[int] = set()
            for k, v in tensors.items():
                if v.untyped_storage().data_ptr() in seen:
                    tensors[k] = v.clone()
                seen.add(tensors[k].untyped_storage().data_ptr())
            save_file(tensors, str(path))
        else:
            torch.save(tensors, path)
    except OSError as err:
        raise OutputPathError(
            f"cannot write the export {str(path)!r}: {err.strerror or err}; choose another path"
        ) from None
    return path


def export_checkpoint(
    checkpoint_dir: str | Path,
    out: str | Path,
    *,
    fmt: str | None = None,
    step: int | None = None,
) -> Path:
    """The checkpoint of ``step`` (default: the latest) in ``checkpoint_dir`` as one file (or
    an ``hf`` folder) at ``out``; returns the path written. The output is checked first
    (:func:`check_export_target`): nothing is read before it is known to be writable."""
    root = Path(checkpoint_dir)
    check_export_target(out, fmt, root)
    record = latest_step(root)
    if record is None:
        raise RuntimeConfigError(
            f"no checkpoint in {str(root)!r} (no latest.json); point --checkpoint-dir at the "
            f"folder a run with checkpoint_dir wrote"
        )
    config = record.get("config") if isinstance(record, dict) else None
    # the units of each stage: recorded beside the run's identity (whose boundaries are the
    # plan's, None for an even split); a checkpoint written before that holds only those
    bounds = record.get("boundaries") if isinstance(record, dict) else None
    if not isinstance(bounds, list) and isinstance(config, dict):
        bounds = config.get("boundaries")
    fields_ok = (
        isinstance(config, dict)
        and isinstance(record.get("step"), int)
        and isinstance(record.get("num_stages"), int)
        and isinstance(bounds, list)
        and len(bounds) == record["num_stages"]
    )
    if not fields_ok:
        raise RuntimeConfigError(
            f"{root / 'latest.json'} is damaged (it needs the step, the stage count and the "
            f"run's boundaries); point --checkpoint-dir at a folder a run wrote, or pass "
            f"--step of a checkpoint whose files are whole"
        )
    assert isinstance(config, dict)
    chosen = int(record["step"]) if step is None else step
    num_stages = int(record["num_stages"])
    store = CheckpointStore(root, config, num_stages=num_stages)
    if chosen not in store.steps():
        raise RuntimeConfigError(
            f"{root} has no checkpoint of step {chosen}; it has steps {sorted(store.steps())}"
        )
    payloads = [store.load(chosen, k, torch.device("cpu")) for k in range(num_stages)]
    states: dict[int, Mapping[str, Tensor]] = {}
    for k, payload in enumerate(payloads):
        module = payload.get("state", {}).get("module") if isinstance(payload, dict) else None
        if not isinstance(module, dict):
            raise RuntimeConfigError(
                f"the stage {k} file of step {chosen} in {root} holds no module weights; the "
                f"folder is damaged, export another --step"
            )
        states[k] = module
    model = payloads[0].get("model") or {}
    assert isinstance(bounds, list)
    merged = merge_stages(states, bounds, model.get("names"))
    return write_export(merged, out, fmt, model.get("source") or {}, checkpoint_dir=root)
