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


class TokenEmbeddings(nn.Embedding):
    """A Llama-style model's ``embed_tokens`` as the first unit: ids (B, T) to hidden states
    (B, T, D), or a dict batch to the dict of :func:`hidden_fields`. An ``nn.Embedding``
    holding the model's own matrix, so its state-dict key stays ``weight`` (checkpoints
    written before dict batches load) and the model's initialiser, which picks modules by
    type, materialises it from the meta device."""

    def __init__(self, embed_tokens: nn.Embedding) -> None:
        nn.Module.__init__(self)  # nn.Embedding's own would allocate a second matrix
        self.num_embeddings = embed_tokens.num_embeddings
        self.embedding_dim = embed_tokens.embedding_dim
        self.padding_idx = embed_tokens.padding_idx
        self.max_norm = embed_tokens.max_norm
        self.norm_type = embed_tokens.norm_type
        self.scale_grad_by_freq = embed_tokens.scale_grad_by_freq
        self.sparse = embed_tokens.sparse
        self.weight = embed_tokens.weight

    def forward(self, batch: Batch) -> Batch:  # type: ignore[override]
        ids, mask, positions = batch_fields(batch)
        hidden: Tensor = super().forward(ids)
        return hidden if isinstance(batch, Tensor) else hidden_fields(hidden, mask, positions)
