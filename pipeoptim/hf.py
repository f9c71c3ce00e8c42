"""Hugging Face causal language models cut into pipeline units, and exported back.

    model = GPT2LMHeadModel(GPT2Config(n_layer=12))
    cut = cut_causal_lm(model)
    pipe = Pipeline(cut, method="zb-h1", stages=4)   # the cut's loss and initialiser

A decoder layer of ``transformers`` takes the hidden states plus a causal mask, position ids
and rotary embeddings that the model's forward makes once for all layers. Each block unit
here makes those itself from the hidden states' shape, so only (B, T, D) hidden states cross
a stage boundary, and the units chained give the model's own logits.

A padded batch gives the first unit a dict, ``{"input_ids": ids, "attention_mask": mask}``
(and ``"position_ids"`` where the data sets them): the units then hand on
``{"hidden_states": h, "attention_mask": mask, "position_ids": ...}``, and each block makes
its causal mask from the padding mask as the model's forward does, so left and right padding
give the logits of the model called with the same ``attention_mask`` (and position ids).

The units are the model's own submodules (wrapped, never copied), so ``ModelUnits`` names
every unit tensor as the model's ``state_dict`` does, and :func:`save_pretrained_folder`
turns trained weights back into a folder ``from_pretrained`` loads.

Each attention module of the cut (GPT-2's, Llama's, Mistral's, Qwen2's) exposes its per-head
max logit for QK-Clip (:class:`HFAttentionLogits`): once a correction starts the recording,
the module reads its attention function through a wrapper registered in transformers'
``AttentionInterface`` (:data:`LOGITS_ATTENTION`), which records from the post-rotary query
and key and the module's scaling, then calls the model's own implementation (sdpa, eager...).
Qwen3 normalises q and k per head with weights shared by all heads (``q_norm``/``k_norm``), so
no per-head rescale of its projections moves its logits: its attention exposes none.

``transformers`` is imported only inside the functions, so this module imports without it.
"""

from __future__ import annotations

import copy
import inspect
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.hf_batches import BATCH_KEYS, Batch, TokenEmbeddings, batch_fields, hidden_fields
from pipeoptim.runtime.model.attention_logits import (
    AttentionLogits,
    HeadRows,
    attention_logits_of,
)
from pipeoptim.runtime.model.units import InitWeights, ModelUnits

__all__ = [
    "BATCH_KEYS",
    "IGNORE_INDEX",
    "KNOWN_MODELS",
    "LOGITS_ATTENTION",
    "CausalLMHead",
    "DecoderBlock",
    "GPT2Embeddings",
    "HFAttentionLogits",
    "TokenEmbeddings",
    "causal_lm_loss",
    "cut_causal_lm",
    "save_pretrained_folder",
]

GPT2_FAMILY = ("GPT2LMHeadModel",)
ROTARY_FAMILY = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
"""Decoder-only models laid out as Llama is (``model.embed_tokens``, ``model.layers``,
``model.norm``, ``model.rotary_emb``, ``lm_head``) whose layers take the same arguments; they
differ only in which layers use a sliding-window mask, read from the config."""

KNOWN_MODELS: tuple[str, ...] = GPT2_FAMILY + ROTARY_FAMILY
"""The ``transformers`` classes :func:`cut_causal_lm` cuts (subclasses included)."""

IGNORE_INDEX = -100
"""Target id the loss skips, as in ``transformers`` (padding, prompt tokens)."""

_INSTALL = "pip install pipeoptim[hf]"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as err:
        raise RuntimeConfigError(
            f"pipeoptim.hf needs the transformers package, which is not installed; "
            f"install it with `{_INSTALL}`"
        ) from err
    return transformers


def causal_lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean token cross-entropy of logits (B, T, V) against targets (B, T), skipping
    :data:`IGNORE_INDEX`. The targets come shifted by the data (``ids[:, 1:]`` for inputs
    ``ids[:, :-1]``), so unlike ``transformers``' own loss this one does not shift."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX
    )


def _positions(hidden: Tensor) -> Tensor:
    """Position ids (1, T) of an unpadded batch without a cache, as the models make them."""
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


class GPT2Embeddings(nn.Module):
    """GPT-2's input side: token plus position embedding, then dropout; ids (B, T) to
    hidden states (B, T, D)."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, batch: Batch) -> Batch:
        ids, mask, positions = batch_fields(batch)
        length = ids.shape[1]
        if length > self.wpe.num_embeddings:
            raise RuntimeConfigError(
                f"a sequence of {length} tokens is longer than the model's "
                f"{self.wpe.num_embeddings} positions (n_positions); cut the sequences or "
                f"build the model with a larger n_positions"
            )
        tokens: Tensor = self.wte(ids)
        at = _positions(tokens) if positions is None else positions
        hidden: Tensor = self.drop(tokens + self.wpe(at))
        return hidden if isinstance(batch, Tensor) else hidden_fields(hidden, mask, positions)


def _mask_arguments(make_mask: Callable[..., Any]) -> tuple[str, str, bool]:
    """The names ``make_mask`` takes its embeddings and its cache under, and whether it
    takes ``cache_position``: transformers 5.0 has ``input_embeds``, ``past_key_values`` and
    ``cache_position``; later 5.x ``inputs_embeds`` and ``cache``."""
    names = inspect.signature(make_mask).parameters
    embeds = "inputs_embeds" if "inputs_embeds" in names else "input_embeds"
    cache = "cache" if "cache" in names else "past_key_values"
    return embeds, cache, "cache_position" in names


class DecoderBlock(nn.Module):
    """One decoder layer as a unit: hidden states (B, T, D) in and out. The causal mask, the
    position ids and (with ``rotary_emb``) the rotary cos/sin are made here from the hidden
    states' shape, as the model's forward makes them for every layer; no KV cache. Given
    the dict of a padded batch, the mask is made from its ``attention_mask`` and its
    ``position_ids`` (where given), and the dict is handed on with the new hidden states."""

    def __init__(
        self,
        layer: nn.Module,
        config: Any,
        make_mask: Callable[..., Any],
        rotary_emb: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.rotary_emb = rotary_emb
        self.config = config
        self.make_mask = make_mask
        self.mask_arguments = _mask_arguments(make_mask)

    def forward(self, x: Batch) -> Batch:
        if isinstance(x, Tensor):
            hidden, padding, given = x, None, None
        else:
            found, padding, given = (
                x["hidden_states"],
                x.get("attention_mask"),
                x.get("position_ids"),
            )
            assert found is not None  # the dict of hidden_fields
            hidden = found
        steps = _positions(hidden)
        positions = steps if given is None else given
        embeds, cache, takes_cache_position = self.mask_arguments
        cache_position = {"cache_position": steps[0]} if takes_cache_position else {}
        mask = self.make_mask(
            config=self.config,
            attention_mask=padding,
            position_ids=positions,
            **{embeds: hidden, cache: None},
            **cache_position,
        )
        extra: dict[str, Any] = {}
        if self.rotary_emb is not None:
            extra["position_embeddings"] = self.rotary_emb(hidden, positions)
        # hidden positional: gradient checkpointing (use_reentrant) needs it so
        out = self.layer(
            hidden, attention_mask=mask, position_ids=positions, use_cache=False, **extra
        )
        # transformers 5.0's GPT-2 block returns (hidden, ...); later ones the tensor
        hidden_out: Tensor = out[0] if isinstance(out, tuple) else out
        return hidden_out if isinstance(x, Tensor) else {**x, "hidden_states": hidden_out}


LOGITS_ATTENTION = "pipeoptim-logits"
"""The name of the recording wrapper in transformers' ``AttentionInterface``: what a
recording attention module's config names as its implementation."""


class HFAttentionLogits(AttentionLogits):
    """The max-logit recorder of a ``transformers`` attention module.

    :meth:`start` gives the module a copy of its config that names :data:`LOGITS_ATTENTION`
    (the model's own config, which makes the masks, is untouched) and registers the wrapper;
    the wrapper records, then calls the implementation the model's config names now (so a
    later ``set_attn_implementation`` is followed). Until started the module is as it was."""

    source_config: Any = None
    """The model's config, whose implementation the wrapper calls (set by :meth:`start`)."""

    def start(self, module: nn.Module | None = None) -> None:
        if module is None:
            raise RuntimeConfigError(
                "a transformers attention records through its config: start its "
                "attention_logits with the module, attention_logits.start(module)"
            )
        hf: Any = module
        if getattr(hf.config, "_attn_implementation", None) != LOGITS_ATTENTION:
            source = hf.config
            implementation = getattr(source, "_attn_implementation", None)
            if getattr(hf, "reorder_and_upcast_attn", False) and implementation in (None, "eager"):
                raise RuntimeConfigError(
                    f"{type(module).__name__} with reorder_and_upcast_attn=True under eager "
                    f"attention computes its logits outside transformers' attention "
                    f"interface, where they cannot be recorded; build the model with "
                    f"reorder_and_upcast_attn=False or attn_implementation='sdpa'"
                )
            from transformers import AttentionInterface

            AttentionInterface.register(LOGITS_ATTENTION, _recording_attention)
            view = copy.copy(source)
            view._attn_implementation_internal = LOGITS_ATTENTION
            self.source_config = source
            hf.config = view
        super().start(module)

    def implementation(self, module: nn.Module) -> Callable[..., Any]:
        """The attention function the model's config names (its modeling file's eager
        attention for ``eager``)."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        name = getattr(self.source_config, "_attn_implementation", None) or "eager"
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if name == "eager":
            if eager is None:
                raise RuntimeConfigError(
                    f"{type(module).__name__}'s modeling file has no eager_attention_forward; "
                    f"use attn_implementation='sdpa'"
                )
            return eager  # type: ignore[no-any-return]
        found: Callable[..., Any] = ALL_ATTENTION_FUNCTIONS[name]
        return found


def _recording_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    **kwargs: Any,
) -> Any:
    """:data:`LOGITS_ATTENTION`: records the max logit of each head from the query and key
    the attention function receives (post-rotary, its scaling, its mask), then runs the
    model's own implementation on the same arguments."""
    logits = attention_logits_of(module)
    if not isinstance(logits, HFAttentionLogits):
        raise RuntimeConfigError(
            f"{type(module).__name__} names the {LOGITS_ATTENTION!r} attention but holds no "
            f"HFAttentionLogits; cut the model with pipeoptim.hf.cut_causal_lm"
        )
    if logits.active(module.training):
        causal = kwargs.get("is_causal")
        causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
        logits.record(query, key, kwargs.get("scaling"), attention_mask, causal=causal)
    return logits.implementation(module)(module, query, key, value, attention_mask, **kwargs)


def _linear_rows(proj: nn.Module, name: str, heads: int, head_dim: int) -> list[HeadRows]:
    rows = [HeadRows(f"{name}.weight", 0, 0, heads, head_dim)]
    if getattr(proj, "bias", None) is not None:
        rows.append(HeadRows(f"{name}.bias", 0, 0, heads, head_dim))
    return rows


def _expose_rotary_logits(attention: Any, config: Any) -> None:
    """A Llama-family attention's recorder: ``q_proj``'s and ``k_proj``'s output rows (and
    biases, Qwen2's), one block of ``head_dim`` per head; none where q and k are normalised
    (Qwen3's ``q_norm``)."""
    if hasattr(attention, "q_norm") or hasattr(attention, "k_norm"):
        return
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(attention.head_dim)
    attention.attention_logits = HFAttentionLogits(
        heads,
        _linear_rows(attention.q_proj, "q_proj", heads, head_dim),
        _linear_rows(attention.k_proj, "k_proj", kv_heads, head_dim),
        kv_heads=kv_heads,
    )


def _expose_gpt2_logits(attention: Any) -> None:
    """GPT-2's recorder: ``c_attn`` is a ``Conv1D`` of weight (D, 3D), so head h's query
    columns are ``h·d .. (h+1)·d`` on dim 1 and its key columns D further on (the bias alike
    on its one dim)."""
    heads, head_dim, dim = int(attention.num_heads), int(attention.head_dim), attention.embed_dim

    def rows(offset: int) -> Sequence[HeadRows]:
        return [
            HeadRows("c_attn.weight", 1, offset, heads, head_dim),
            HeadRows("c_attn.bias", 0, offset, heads, head_dim),
        ]

    attention.attention_logits = HFAttentionLogits(heads, rows(0), rows(dim))


class CausalLMHead(nn.Module):
    """The output side: final norm, then the LM head; hidden (B, T, D) to logits (B, T, V)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, x: Batch) -> Tensor:
        hidden = x if isinstance(x, Tensor) else x["hidden_states"]
        logits: Tensor = self.lm_head(self.norm(hidden))
        return logits


def _family(model: nn.Module) -> str:
    names = [c.__name__ for c in type(model).__mro__]
    for known in KNOWN_MODELS:
        if known in names:
            return known
    raise RuntimeConfigError(
        f"cut_causal_lm does not know {type(model).__name__}; it cuts "
        f"{', '.join(KNOWN_MODELS)} (and their subclasses). Cut another model by hand: "
        f"ModelUnits.from_model(model, [embedding, *blocks, head]) with units that each take "
        f"and return one tensor"
    )


def _gpt2_units(model: Any, masks: Any) -> list[nn.Module]:
    config = model.config
    if getattr(config, "add_cross_attention", False):
        raise RuntimeConfigError(
            "cut_causal_lm cuts GPT-2 without cross-attention (add_cross_attention=True "
            "needs encoder states, which do not cross a stage boundary); build the model "
            "with add_cross_attention=False"
        )
    body = model.transformer
    blocks = [DecoderBlock(block, config, masks.create_causal_mask) for block in body.h]
    for block in body.h:
        _expose_gpt2_logits(block.attn)
    return [
        GPT2Embeddings(body.wte, body.wpe, body.drop),
        *blocks,
        CausalLMHead(body.ln_f, model.lm_head),
    ]


def _mask_maker(config: Any, index: int, masks: Any) -> Callable[..., Any]:
    """The mask the model's forward gives layer ``index``: Qwen2/Qwen3 name each layer's
    kind in ``layer_types``; Mistral slides every layer when ``sliding_window`` is set."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        sliding = layer_types[index] == "sliding_attention"
    else:
        sliding = getattr(config, "sliding_window", None) is not None
    maker: Callable[..., Any] = (
        masks.create_sliding_window_causal_mask if sliding else masks.create_causal_mask
    )
    return maker


def _rotary_units(model: Any, masks: Any) -> list[nn.Module]:
    config = model.config
    body = model.model
    layers = list(body.layers)[: config.num_hidden_layers]
    for layer in layers:
        _expose_rotary_logits(layer.self_attn, config)
    blocks = [
        DecoderBlock(layer, config, _mask_maker(config, i, masks), body.rotary_emb)
        for i, layer in enumerate(layers)
    ]
    return [TokenEmbeddings(body.embed_tokens), *blocks, CausalLMHead(body.norm, model.lm_head)]


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    """Children before their parent, each module once: the order ``transformers`` applies
    ``_init_weights`` in, so a parent's rule (GPT-2's scaled ``c_proj``) overrides its
    children's defaults."""
    seen: set[int] = set()

    def walk(m: nn.Module) -> Iterator[nn.Module]:
        if id(m) in seen:
            return
        seen.add(id(m))
        for child in m.children():
            yield from walk(child)
        yield m

    yield from walk(module)


def _forget_initialised(module: nn.Module) -> None:
    """Drop ``transformers``' ``_is_hf_initialized`` marks, which make its init functions
    skip a tensor (a model loaded by ``from_pretrained`` carries them)."""
    for m in module.modules():
        marked: list[Any] = [m, *m.parameters(recurse=False), *m.buffers(recurse=False)]
        for item in marked:
            if getattr(item, "_is_hf_initialized", False):
                item._is_hf_initialized = False


def _apply_model_init(initializer: Any, module: nn.Module) -> None:
    from transformers import initialization

    _forget_initialised(module)
    with torch.no_grad(), initialization.guard_torch_init_functions():
        for m in _post_order(module):
            initializer._init_weights(m)


def _init_weights_of(model: Any) -> InitWeights:
    """``init_weights(index, unit)`` by the model class's own ``_init_weights``.

    ``_init_weights`` is a method of the model (it reads ``self.config``, and GPT-2's calls
    ``super()``), so it runs on a twin of the model built on the meta device at the first
    call: it holds no weights, and the closure keeps neither the user's model nor its
    tensors. Non-persistent buffers (rotary ``inv_freq``) are recomputed by the same
    function, since ``to_empty`` leaves them as garbage too."""
    model_class = type(model)
    config = copy.deepcopy(model.config)
    twin: list[Any] = []

    def init_weights(index: int, unit: nn.Module) -> None:
        if not twin:
            with torch.device("meta"):
                twin.append(model_class(copy.deepcopy(config)))
        _apply_model_init(twin[0], unit)

    return init_weights


def cut_causal_lm(model: nn.Module) -> ModelUnits:
    """Cut a ``transformers`` causal LM (one of :data:`KNOWN_MODELS`) into pipeline units:
    the embedding, one unit per decoder layer, and the head (final norm and LM head).

    The units hold the model's own modules, so training them trains ``model``, and a tied
    embedding stays one Parameter in the first and the last unit. The units use no KV cache
    (each block calls its layer with ``use_cache=False``: they train, they do not generate);
    the model's config is left as it is, so the model still generates with its cache, a
    second cut records the same source, and the export keeps the user's settings."""
    family = _family(model)
    _transformers()
    from transformers import masking_utils

    hf_model: Any = model
    source = {
        "library": "transformers",
        "class": type(model).__name__,
        "config": hf_model.config.to_dict(),
    }
    if any(p.is_meta for p in model.parameters()):
        hf_model.tie_weights()  # transformers 5.0 leaves a model built on meta untied
    if family in GPT2_FAMILY:
        units = _gpt2_units(hf_model, masking_utils)
    else:
        units = _rotary_units(hf_model, masking_utils)
    return ModelUnits.from_model(
        model,
        units,
        init_weights=_init_weights_of(hf_model),
        loss_fn=causal_lm_loss,
        source=source,
    )


def _model_from_source(source: dict[str, Any]) -> Any:
    """The source's model class built from its config on the meta device (no weights)."""
    transformers = _transformers()
    if source.get("library") != "transformers" or "class" not in source or "config" not in source:
        raise RuntimeConfigError(
            f"save_pretrained_folder takes the source that cut_causal_lm records "
            f"({{'library': 'transformers', 'class': ..., 'config': ...}}); got keys "
            f"{sorted(source)} with library {source.get('library')!r}"
        )
    name = source["class"]
    model_class: Any = getattr(transformers, name, None)
    if getattr(model_class, "config_class", None) is None:
        raise RuntimeConfigError(
            f"transformers {transformers.__version__} has no model class {name!r}; export "
            f"with the transformers version the model was cut with"
        )
    config = model_class.config_class.from_dict(copy.deepcopy(source["config"]))
    with torch.device("meta"):
        model = model_class(config)
    model.tie_weights()  # transformers 5.0 leaves a model built on meta untied
    return model


def _complete(model: Any, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state_dict`` with every key the model expects: a tied tensor given under one of its
    names is filled in under the others. Refuses missing, unexpected and tied-but-unequal
    tensors, naming them."""
    groups: dict[int, list[str]] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(key)
    expected = {key for keys in groups.values() for key in keys}
    unexpected = sorted(set(state_dict) - expected)
    missing: list[str] = []
    unequal: list[str] = []
    full = dict(state_dict)
    for keys in groups.values():
        given = [k for k in keys if k in state_dict]
        if not given:
            missing.append(" = ".join(keys))
            continue
        first = state_dict[given[0]]
        if any(not torch.equal(first, state_dict[k]) for k in given[1:]):
            unequal.append(" = ".join(given))
        full.update({k: first for k in keys})
    if missing or unexpected or unequal:
        problems = [
            f"missing {missing}" if missing else "",
            f"unexpected {unexpected}" if unexpected else "",
            f"tied but different {unequal}" if unequal else "",
        ]
        raise RuntimeConfigError(
            f"the state dict does not fit {type(model).__name__} "
            f"({'; '.join(p for p in problems if p)}); give every tensor of the model under "
            f"its state_dict name (tied tensors under one name, or under each with equal "
            f"values), as Pipeline.export collects them"
        )
    return full


def _materialise_buffers(model: Any) -> None:
    """Give the non-persistent buffers (rotary ``inv_freq``), which a state dict does not
    carry and so are still on the meta device, their values by the model's own init. The
    loaded tensors are marked initialised meanwhile, so that init leaves them as loaded."""
    from transformers import initialization

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    loaded: list[Any] = [t for t in (*model.parameters(), *model.buffers()) if not t.is_meta]
    for t in loaded:
        t._is_hf_initialized = True
    try:
        for module in model.modules():
            empty = [n for n, b in module.named_buffers(recurse=False) if b.is_meta]
            for name in empty:
                module._buffers[name] = torch.empty_like(module._buffers[name], device=device)
            if empty:
                with torch.no_grad(), initialization.guard_torch_init_functions():
                    model._init_weights(module)
    finally:
        for t in loaded:
            del t._is_hf_initialized
    left = [name for name, t in model.named_buffers() if t.is_meta]
    left += [name for name, t in model.named_parameters() if t.is_meta]
    if left:
        raise RuntimeConfigError(
            f"{type(model).__name__} still holds tensors without values after loading the "
            f"state dict ({left[:5]}); export from a model cut_causal_lm knows "
            f"({', '.join(KNOWN_MODELS)})"
        )


def save_pretrained_folder(
    source: dict[str, Any], state_dict: dict[str, Tensor], folder: str | Path
) -> Path:
    """Write ``state_dict`` (the source model's names) as a ``save_pretrained`` folder
    (config and safetensors) that ``from_pretrained`` loads. ``source`` is
    ``ModelUnits.source`` as :func:`cut_causal_lm` records it. The model is rebuilt on the
    meta device and takes the given tensors as they are (no copy, no random init)."""
    model = _model_from_source(source)
    full = _complete(model, state_dict)
    model.load_state_dict(full, strict=True, assign=True)
    model.tie_weights()  # assign gave each tied name its own Parameter: one again
    _materialise_buffers(model)
    path = Path(folder)
    model.save_pretrained(path)
    return path
