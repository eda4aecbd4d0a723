"""Checkpoint names for a transformers module whose parameters are fused.

transformers 5 loads some checkpoints into fewer, larger parameters than they hold: a mixture of experts' per-expert
projections (`mlp.experts.3.up_proj.weight`, ...) become one tensor per layer (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`). Checkpoints, vLLM and the wire name each expert's. `to_checkpoint` gives a module's state
dict the checkpoint's names (what `save_pretrained` writes, views of the fused tensors: nothing is copied);
`to_module` turns tensors of checkpoint names into the module's (what `from_pretrained` does). Both use the module's
own conversion (transformers' `conversion_mapping`); a module without one (a dense Qwen2, any plain torch module)
passes through unchanged. `routers` finds the same models' expert routers, which the torch engine reads (routed
experts on the wire) and a trainer replays (`producers.routing`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from copy import deepcopy
from typing import Any

import torch


def _conversions(module: torch.nn.Module) -> list[Any]:
    """The module's weight conversions (empty: its names are the checkpoint's)."""
    if "transformers" not in sys.modules:  # not imported: the module is none of its models (and stays cheap to publish)
        return []
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:  # no transformers, or transformers 4: it loads checkpoints as they are
        return []
    if not isinstance(module, PreTrainedModel):  # a plain module, a PEFT wrapper: its names are its own
        return []
    conversions = getattr(module, "_weight_conversions", None)
    if conversions is None:  # built, not loaded: the model type's default (a prefix change only applies to a load)
        conversions = get_model_conversion_mapping(module, add_legacy=False)
        conversions = [c for c in conversions if not isinstance(c, PrefixChange)]
    return list(conversions)


def is_fused(module: torch.nn.Module) -> bool:
    """Whether the module's parameter names differ from its checkpoint's."""
    return bool(_conversions(module))


def to_checkpoint(module: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (the module's names) in the checkpoint's names."""
    if not is_fused(module):
        return dict(state)
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(module, dict(state)))  # type: ignore[arg-type]


def to_module(module: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` (checkpoint names: every tensor a fused parameter is made of) in the module's names."""
    conversions = _conversions(module)
    if not conversions:
        return dict(tensors)
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    pending: dict[str, Any] = {}
    for name, tensor in sorted(tensors.items(), key=lambda item: dot_natural_key(item[0])):
        renamed, pattern = rename_source_key(name, renamings, converters)
        if pattern is None:
            pending.setdefault(renamed, WeightRenaming(name, renamed)).add_tensor(renamed, name, name, tensor)
        else:  # one converter per fused target: it gathers its sources, then merges them
            pending.setdefault(renamed, deepcopy(by_pattern[pattern])).add_tensor(renamed, name, pattern, tensor)
    out: dict[str, torch.Tensor] = {}
    config = getattr(module, "config", None)
    for target, transform in pending.items():
        for name, value in transform.convert(target, model=module, config=config).items():
            out[name] = value[0] if isinstance(value, list) else value
    return out


ROUTERS = frozenset({"Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "MixtralTopKRouter", "OlmoeTopKRouter"})
"""transformers' mixture-of-experts routers whose forward takes the hidden states alone and returns `(logits, scores,
indices)`, the scores a softmax's top-k (renormalized, or not, as the model says): the ones routed experts are read
from and replayed into. Other `*TopKRouter`s differ (the indices first, a sigmoid, a second argument)."""
ROUTER_MODELS = "Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE"


def routers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The module's expert routers (`ROUTERS`), in layer order; empty for a model without them."""
    return [m for m in module.modules() if type(m).__name__ in ROUTERS]
