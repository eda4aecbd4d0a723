"""LoRA adapters as the engines see them: PEFT-named tensors and config, checked against a model's Linear layers.

An adapter file as PEFT writes it (and vLLM loads): tensors `base_model.model.<module>.lora_A.weight`
of shape `[r, in_features]` and `base_model.model.<module>.lora_B.weight` of shape `[out_features, r]`
for each adapted `nn.Linear`, and an `adapter_config.json` with `r`, `lora_alpha` and `target_modules`.
The adapted layer computes `W x + scale * B (A x)` with `scale = lora_alpha / r` (`lora_alpha / sqrt(r)`
under `use_rslora`), i.e. the weight `W + scale * B @ A` (`merged_state_dict`).

Everything is checked before an engine touches its model, with messages that name the tensor or field at
fault: an adapter that fits half way would otherwise serve tokens of a model nobody trained.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

PEFT_NAME = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])\.weight")
"""A LoRA tensor's name in a PEFT adapter file (the adapter's own name is not part of a saved file's names)."""

_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "modules_to_save": "fully trained modules (modules_to_save)",
}
"""PEFT config fields that change what the tensors mean; set (truthy), they are refused rather than ignored."""


@dataclass(frozen=True, eq=False)
class LoraModule:
    """One adapted `nn.Linear`: its output gains `scale * (x @ a.T) @ b.T`."""

    a: torch.Tensor
    """`[r, in_features]`"""
    b: torch.Tensor
    """`[out_features, r]`"""
    scale: float

    def delta_weight(self) -> torch.Tensor:
        """`scale * B @ A` in float32, the change to the layer's `[out, in]` weight."""
        return self.scale * (self.b.float() @ self.a.float())


@dataclass(frozen=True, eq=False)
class ParsedAdapter:
    """A checked adapter: its rank, alpha and the `LoraModule` of each adapted module path."""

    rank: int
    alpha: float
    modules: Mapping[str, LoraModule]
    """Module path in the model (`model.layers.0.self_attn.o_proj`) -> its A, B and scale."""

    def to(self, device: torch.device | str, dtype: torch.dtype) -> ParsedAdapter:
        """A copy with its tensors where (and in the precision) the engine's model runs: the caller's tensors may
        change after a load, the engine's must not."""
        modules = {
            path: LoraModule(_copy_to(m.a, device, dtype), _copy_to(m.b, device, dtype), m.scale)
            for path, m in self.modules.items()
        }
        return ParsedAdapter(self.rank, self.alpha, MappingProxyType(modules))


def _copy_to(tensor: torch.Tensor, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(device=device, dtype=dtype, copy=True).contiguous()


def linear_shapes(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """Every `nn.Linear` of `model` by module path, with its weight's `(out_features, in_features)`."""
    return {
        name: (module.out_features, module.in_features)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    }


def module_types(model: torch.nn.Module) -> dict[str, str]:
    """Every module of `model` by path, with its class name: lets `parse_adapter` say what a non-Linear target is."""
    return {name: type(module).__name__ for name, module in model.named_modules()}


def parse_adapter(
    tensors: Mapping[str, Any],
    config: Mapping[str, Any],
    linears: Mapping[str, tuple[int, int]],
    *,
    modules: Mapping[str, str] | None = None,
) -> ParsedAdapter:
    """Check a PEFT LoRA adapter against a model and return it parsed; `ValueError` naming what is wrong.

    `linears` maps the model's `nn.Linear` paths to `(out_features, in_features)` (`linear_shapes`);
    `modules` (optional, `module_types`) lets a tensor aimed at a module of another kind say so.
    Tensors may be torch tensors or numpy arrays.
    """
    rank, alpha, scale, targets = _parse_config(config)
    pairs = _pair_tensors(tensors, targets, linears, modules or {})
    parsed = {}
    for module, (a_name, b_name) in sorted(pairs.items()):
        a, b = _as_tensor(a_name, tensors[a_name]), _as_tensor(b_name, tensors[b_name])
        out_features, in_features = linears[module]
        _check_shape(a_name, a, (rank, in_features), f"[r={rank}, in_features={in_features}]")
        _check_shape(b_name, b, (out_features, rank), f"[out_features={out_features}, r={rank}]")
        parsed[module] = LoraModule(a, b, scale)
    return ParsedAdapter(rank, alpha, MappingProxyType(parsed))


def merged_state_dict(base: Mapping[str, torch.Tensor], adapter: ParsedAdapter) -> dict[str, torch.Tensor]:
    """`base` with every adapted weight replaced by `W + scale * B @ A`: the adapter merged in, as a plain model.

    The independent reference for an engine's per-row LoRA (tests load it into a plain transformers
    model), and what a trainer publishes to serve a merged policy. `base` is not modified.
    """
    merged = dict(base)
    for path, module in adapter.modules.items():
        key = f"{path}.weight"
        if key not in base:
            raise ValueError(f"the base state dict has no {key!r} for the adapter's module {path!r}")
        weight = base[key]
        merged[key] = (weight.float() + module.delta_weight().to(weight.device)).to(weight.dtype)
    return merged


def _parse_config(config: Mapping[str, Any]) -> tuple[int, float, float, tuple[str, ...] | str]:
    """`r`, `lora_alpha`, the scale they give, and `target_modules` (suffixes, or one regex as PEFT allows)."""
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ValueError(f"adapter config: peft_type must be 'LORA', got {peft_type!r}")
    for field_name, what in _UNSUPPORTED.items():
        if config.get(field_name):
            raise ValueError(f"adapter config: {what} is not supported, got {field_name}={config[field_name]!r}")
    if config.get("bias", "none") not in ("none", None):
        raise ValueError(f"adapter config: bias must be 'none' (LoRA biases are not supported), got {config['bias']!r}")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"adapter config: r must be an integer >= 1, got {rank!r}")
    alpha = config.get("lora_alpha")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ValueError(f"adapter config: lora_alpha must be a finite number, got {alpha!r}")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        target_spec: tuple[str, ...] | str = targets
    elif isinstance(targets, (list, tuple, set, frozenset)) and targets and all(isinstance(t, str) for t in targets):
        target_spec = tuple(targets)
    else:
        raise ValueError(f"adapter config: target_modules must be a non-empty list of module names, got {targets!r}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(alpha), float(scale), target_spec


def is_target(module: str, targets: tuple[str, ...] | str) -> bool:
    """PEFT's rule: a regex must match the whole path; a name matches the path or its last dotted parts."""
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith(f".{t}") for t in targets)


def _pair_tensors(
    tensors: Mapping[str, Any],
    targets: tuple[str, ...] | str,
    linears: Mapping[str, tuple[int, int]],
    modules: Mapping[str, str],
) -> dict[str, tuple[str, str]]:
    """Module path -> (its lora_A name, its lora_B name), refusing names, modules and halves that do not fit."""
    if not tensors:
        raise ValueError("the adapter has no tensors")
    halves: dict[str, dict[str, str]] = {}
    for name in tensors:
        match = PEFT_NAME.fullmatch(name)
        if match is None:
            raise ValueError(
                f"tensor {name!r} is not named like a PEFT LoRA tensor "
                "('base_model.model.<module>.lora_A.weight' or '...lora_B.weight')"
            )
        module = match["module"]
        if module not in linears:
            if module in modules:
                raise ValueError(f"tensor {name!r}: module {module!r} is a {modules[module]}, not an nn.Linear")
            raise ValueError(f"tensor {name!r}: the model has no module {module!r}")
        if not is_target(module, targets):
            raise ValueError(f"tensor {name!r}: module {module!r} is not among target_modules {targets!r}")
        halves.setdefault(module, {})[match["which"]] = name
    for module, pair in halves.items():
        for have, lack in (("A", "B"), ("B", "A")):
            if lack not in pair:
                raise ValueError(
                    f"tensor {pair[have]!r} has no matching "
                    f"'base_model.model.{module}.lora_{lack}.weight' (LoRA needs both A and B)"
                )
    return {module: (pair["A"], pair["B"]) for module, pair in halves.items()}


def _as_tensor(name: str, value: Any) -> torch.Tensor:
    """A float32 torch tensor from a torch tensor or numpy array (LoRA math is done in the engine's dtype later)."""
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(np.ascontiguousarray(value))
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"tensor {name!r} is a {type(value).__name__}, not a torch tensor or numpy array")
    if not value.is_floating_point():
        raise ValueError(f"tensor {name!r} has dtype {value.dtype}; LoRA weights are floating point")
    return value.detach().to(torch.float32)


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, int], described: str) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"tensor {name!r} has shape {list(tensor.shape)}, expected {described}")


def save_adapter(tensors: dict[str, torch.Tensor], config: dict[str, Any], out_dir: Path) -> Path:
    """Write an adapter as PEFT (and vLLM's LoRA loader) read it: `adapter_model.safetensors` and
    `adapter_config.json` in `out_dir`. Returns `out_dir`."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir
