"""`benchmarks/probes/rollout_mismatch.py`: the engine's logprobs against the trainer's, before and after a sync that
changes the weights (the torch engine here; vLLM with and without FP8 on the GPU machines)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(model: Path, dtype: str) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "probes" / "rollout_mismatch.py"), str(model), "--engine", "torch",
         "--dtype", dtype, "--prompts", "6", "--max-tokens", "16"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    got: dict[str, Any] = json.loads(result.stdout)
    return got


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_probe_sees_no_mismatch_where_engine_and_trainer_agree_and_some_where_they_do_not(
    tiny_model_dir: Path, dtype: str
) -> None:
    got = run(tiny_model_dir, dtype)
    versions = got["versions"]
    assert isinstance(versions, list) and [v["version"] for v in versions] == [0, 1]
    for row in versions:
        assert row["tokens"] > 0 and row["tokens_per_s"] > 0 and row["kl_k3"] >= 0
        if dtype == "float32":  # the same weights, the same dtype: the engine's logprobs are the forward pass's,
            assert row["max_abs"] < 1e-4, row  # after the sync too (the engine loaded what the trainer holds)
        else:  # a bf16 engine against an fp32 trainer: what FP8 rollouts make larger
            assert row["max_abs"] > 1e-3 and row["kl_k3"] > 0, row


def test_the_init_scale_of_the_probes_model_sets_its_weights_size(tmp_path: Path) -> None:
    """run_mismatch.sh builds its model at init scale 1: at the default 4 a hidden-2048 model is chaotic on the GPU."""
    from safetensors.torch import load_file

    from consumers.engines.tiny_model import INIT_SCALE, build_tiny_model

    stds = {}
    for scale in (1.0, INIT_SCALE):
        build_tiny_model(tmp_path / str(scale), hidden_size=64, init_scale=scale)
        stds[scale] = load_file(tmp_path / str(scale) / "model.safetensors")["model.layers.0.mlp.up_proj.weight"].std()
    assert float(stds[INIT_SCALE] / stds[1.0]) == pytest.approx(INIT_SCALE, rel=0.05)
