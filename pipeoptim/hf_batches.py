"""What the first unit of a cut Hugging Face decoder (``pipeoptim.hf``) takes and what its
units hand on: token ids (B, T), or a padded batch's dict of ids, ``attention_mask`` and
``position_ids``, handed on as ``{"hidden_states", "attention_mask", "position_ids"}`` so
every block makes its causal mask from the padding mask. No ``transformers`` import.
"""

from __future__ import annotations

from typing import TypeAlias

from torch import Tensor, nn

from pipeoptim.errors import RuntimeConfigError

__all__ = ["BATCH_KEYS", "Batch", "TokenEmbeddings", "batch_fields", "hidden_fields"]

BATCH_KEYS = ("input_ids", "attention_mask", "position_ids")
"""The keys a dict batch of a cut model may hold (``attention_mask``, ``position_ids``: as
the model's forward takes them; None or left out: none)."""

Batch: TypeAlias = Tensor | dict[str, Tensor | None]
"""What the first unit takes: token ids (B, T), or a dict of :data:`BATCH_KEYS`."""


def batch_fields(batch: Batch) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(ids, attention_mask, position_ids) of what the first unit takes."""
    if isinstance(batch, Tensor):
        return batch, None, None
    odd = sorted(set(batch) - set(BATCH_KEYS))
    ids = batch.get("input_ids")
    if odd or ids is None:
        raise RuntimeConfigError(
            f"a cut causal LM takes token ids, or a dict with 'input_ids' and optionally "
            f"'attention_mask' and 'position_ids'; this batch's dict holds {sorted(batch)}"
            f"{f' ({odd} unknown)' if odd else ''}: keep the labels out of the input (the "
            f"targets, the second item of each (input, target) pair)"
        )
    return ids, batch.get("attention_mask"), batch.get("position_ids")


def hidden_fields(hidden: Tensor, mask: Tensor | None, positions: Tensor | None) -> Batch:
    """What a unit of a dict batch hands on (None travels as nothing)."""
    return {"hidden_states": hidden, "attention_mask": mask, "position_ids": positions}


class TokenEmbeddings(nn.Module):
    """A Llama-style model's ``embed_tokens`` as the first unit: ids (B, T) to hidden states
    (B, T, D), or a dict batch to the dict of :func:`hidden_fields`."""

    def __init__(self, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    @property
    def weight(self) -> Tensor:
        """The embedding matrix (what a tied LM head shares)."""
        return self.embed_tokens.weight

    def forward(self, batch: Batch) -> Batch:
        ids, mask, positions = batch_fields(batch)
        hidden: Tensor = self.embed_tokens(ids)
        return hidden if isinstance(batch, Tensor) else hidden_fields(hidden, mask, positions)
