"""The torch engine across transformers releases: the KV cache goes by the name the model's `forward` takes.

transformers 5.2x renamed `past_key_values` to `cache` (argument and output) and warns on the old name, once per
process: on every worker's first step, in every worker log. The pinned release (constraints.txt) has only the old
name; `cache_name` asks the model. (Checked by hand on transformers 5.25.0 in a venv over this one: the tiny model's
greedy tokens equal 5.19's, and no warning.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from consumers.engines.torch_scheduler import cache_name


def test_a_model_whose_forward_takes_past_key_values_gets_its_cache_by_that_name(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert cache_name(model) == "past_key_values"
    out = model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True)
    assert getattr(out, cache_name(model)) is not None


def test_a_model_whose_forward_takes_cache_gets_it_by_the_new_name() -> None:
    class Renamed(torch.nn.Module):  # transformers 5.2x's signature
        def forward(self, input_ids: Any = None, cache: Any = None, use_cache: bool = False) -> Any: ...

    assert cache_name(Renamed()) == "cache"
