"""`rollouts bench-rl --model smollm2`: bench-rl on the real model, to a held-out accuracy target chosen from the base.

One short run of each of sync and async (2 steps of 2 prompts x 2 samples, replies capped at 16 tokens) checks what a
user reads in the report: the base policy's held-out accuracy, the target chosen from it and stated, each run's
curve from the base at step 0 through the evaluated snapshots, and the figures only a real model has (the share of
groups with all rewards equal, generation tokens/s, the engine called directly). Learning itself is the device
grid's and the CPU study's to show (`benchmarks/results/2026-12-06-bench-rl-real-cpu.md`): two steps of 135M
parameters on two cores say nothing about it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.bench_rl import load_trainer
from benchmarks.bench_rl_real import TARGET_CAP, TextHeldOut, choose_target
from benchmarks.tests.test_lab_cli_errors import assert_refused_in_one_line, lab_here

BENCH = [sys.executable, "-m", "benchmarks", "bench-rl"]
SUMMARY = Path(__file__).resolve().parents[1] / "device" / "bench_rl_real_summary.py"


@pytest.mark.timeout(300)
@pytest.mark.long(
    "bench-rl's machinery: test_bench_rl.py on the tiny model; the real model trained a step: "
    "test_a_grpo_step_of_the_real_model_is_published_and_each_version_answers_the_held_out_sums"
)
def test_sync_and_async_on_the_real_model_each_give_a_held_out_curve_from_the_base_to_a_stated_target(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    args = ["--model", "smollm2", "--task", "arithmetic:sum-1d", "--modes", "sync,async:1", "--seeds", "0"]
    args += ["--steps", "2", "--prompts-per-step", "2", "--n", "2", "--max-tokens", "16", "--eval-every", "2"]
    args += ["--eval-prompts", "4", "--eval-samples", "2", "--plot", str(tmp_path / "rl.png")]
    result = subprocess.run([*BENCH, *args], capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    real, base = report["real"], report["real"]["base"]["accuracy"]
    assert real["model"] == str(smollm2_dir) and real["tasks"] == ["arithmetic:sum-1d"]
    assert real["held_out"] == {"problems": {"arithmetic:sum-1d": 4}, "samples": 2, "max_tokens": 16,
                                "temperature": 1.0}  # fmt: skip
    assert real["target"] == choose_target(base, 0.25) == report["settings"]["target"], "stated, from the base"
    assert real["target_rule"] == f"base {base} + 0.25, capped at {TARGET_CAP}"
    runs = {run["mode"]: run for run in report["runs"]}
    assert list(runs) == ["sync", "async:1"]
    for run in runs.values():
        assert run["curve"][0] == [0, 0.0, base], "every curve starts at the base policy's accuracy"
        assert [point[0] for point in run["curve"]] == [0, 2] and 0 <= run["final_eval_reward"] <= 1
        assert run["curve_by_task"][-1] == [2, run["final_by_task"]] and list(run["final_by_task"]) == [
            "arithmetic:sum-1d"
        ]
        assert run["steps"] == 2 and len(run["step_tokens"]) == 2 and 0 <= run["flat_group_share"] <= 1
        assert run["tokens"]["trained"] > 0 and 0 < run["tokens"]["trained_share"] <= 1
        assert run["trainer_step_s_median"] > 0 and run["sync_stall_s_median"] >= 0
        assert run["generation_tokens_per_s"] > 0
    assert runs["sync"]["staleness_token_mean"] == 0 and runs["async:1"]["staleness_first_max"] <= 1
    modes = report["summary"]["modes"]
    assert set(modes["async:1"]) >= {"flat_group_share", "generation_tokens_per_s", "final_by_task", "trained_share"}
    direct = real["direct"]
    assert direct["engine"] == "torch" and direct["samples"] == 2 * 2 and direct["tokens_per_s"] > 0
    pipeline = real["against_direct"]["pipeline"]["1"]
    assert pipeline["tokens"] == runs["sync"]["step_tokens"][0] and pipeline["over_direct"] > 0
    assert (tmp_path / "rl.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "rl.json").write_text(result.stdout)
    summary = subprocess.run([sys.executable, str(SUMMARY), str(tmp_path / "rl.json")], capture_output=True, text=True)
    assert summary.returncode == 0 and f"target {real['target']}" in summary.stdout, summary.stderr
    assert "W 1 async:1" in summary.stdout and "W 1 sync" in summary.stdout, summary.stdout


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (["--task", "arithmetic:sum-1d"], "--task and --target-gain are for a real model: add --model smollm2"),
        (["--target-gain", "0.2"], "--task and --target-gain are for a real model"),
        (["--model", "/no/such/folder"], "--model /no/such/folder: not a model folder"),
        (["--trainer-dtype", "float16"], "--trainer-dtype float16: use float32 or bfloat16"),
        (["--worker-dtype", "int8"], "--worker-dtype int8: use float32 or bfloat16"),
        (["--model", "smollm2", "--task", "arithmetic:sum-9d"], "unknown task 'arithmetic:sum-9d'"),
        (["--model", "smollm2", "--target", "0.5", "--target-gain", "0.2"], "not both"),
        (["--model", "smollm2", "--target-gain", "1.5"], "--target-gain 1.5: between 0 and 1"),
        (["--model", "smollm2", "--length-alpha", "1.5"], "--length-alpha and --stop-set are the token-set task's"),
        (["--model", "smollm2", "--eval-samples", "0"], "--eval-samples 0: at least 1"),
        (["--model", "smollm2", "--curriculum", "zigzag"], "--curriculum zigzag: use mix or staged"),
    ],
)
def test_bad_real_model_flags_say_what_to_fix_in_one_line(bad: list[str], says: str, smollm2_dir: Path) -> None:
    """In this process, as bench-rl's command line runs it (`lab_here`); the command line itself is checked in
    test_bench_rl.py."""
    assert_refused_in_one_line(lab_here("bench-rl", *bad), says)


def test_text_prompts_are_the_same_sequence_in_every_mode_and_a_staged_curriculum_brings_tasks_in_by_stage() -> None:
    trainer = load_trainer()
    names = "arithmetic:sum-1d,arithmetic:times-table,arithmetic:sum-2d"
    config = trainer.TrainConfig(task=names, steps=30, groups_per_step=4, curriculum="staged")
    assert not config.problems()
    prompts = trainer.TextPrompts(config)
    again = trainer.TextPrompts(replace(config, mode="sync"))
    assert [prompts.problem(i).id for i in range(200)] == [again.problem(i).id for i in range(200)]
    stages = [{prompts.task_of(i) for i in range(s * 40, (s + 1) * 40)} for s in range(3)]  # 10 steps a stage
    assert stages == [{0}, {0, 1}, {0, 1, 2}], stages
    mixed = trainer.TextPrompts(replace(config, curriculum="mix"))
    assert {mixed.task_of(i) for i in range(40)} == {0, 1, 2}
    window = [p.id for p in (prompts.problem(i) for i in range(32)) if p.meta["level"] == "sum-1d"]
    assert len(window) == len(set(window)), "distinct within a window"
    assert all(p.meta["level"] in ("sum-1d", "times-table", "sum-2d") for p in map(prompts.problem, range(120)))
    other_seed = trainer.TextPrompts(replace(config, seed=1))
    assert [prompts.problem(i).id for i in range(8)] != [other_seed.problem(i).id for i in range(8)]


def test_the_trainer_refuses_what_a_text_task_does_not_take() -> None:
    trainer = load_trainer()
    says = trainer.TrainConfig(task="arithmetic:sum-1d", length_alpha=1.5, scoring="inline").problems()
    assert any("token-set task's" in line for line in says) and any("--scoring" in line for line in says), says
    assert any("unknown task" in line for line in trainer.TrainConfig(task="arithmetic:nope").problems())
    assert not trainer.TrainConfig().problems() and not trainer.TrainConfig().text_tasks


def test_the_target_is_the_base_plus_the_gain_capped_and_the_held_out_split_is_a_levels_whole_at_most() -> None:
    assert choose_target(0.29, 0.25) == 0.54 and choose_target(0.8, 0.25) == TARGET_CAP
    held_out = TextHeldOut.make(["arithmetic:sum-1d", "arithmetic:times-table"], 20, samples=3, max_tokens=64)
    assert held_out.describe()["problems"] == {"arithmetic:sum-1d": 16, "arithmetic:times-table": 20}
    assert all(p.meta["level"] in ("sum-1d", "times-table") for p in held_out.problems)
    train = load_trainer().TextPrompts(load_trainer().TrainConfig(task="arithmetic:sum-1d", steps=100))
    trained = {train.problem(i).id for i in range(500)}
    assert not trained & {p.id for p in held_out.problems}, "the trainer never sees a held-out problem"
