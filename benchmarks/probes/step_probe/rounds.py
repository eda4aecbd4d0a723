"""Split `rollouts bench --engine vllm`'s rounds into the engine's own time and the time around it.

    STEP_PROBE=DIR PYTHONPATH=benchmarks/probes/step_probe rollouts bench --engine vllm --rounds 9 > bench.json
    python benchmarks/probes/step_probe/rounds.py DIR bench.json

A round of the bench runs from the first request to the last result, on either side. The probe (`sitecustomize`
beside this file) times each `EngineCore.step` of both sides' engines, so each round splits into the **engine's
span** (its first step's start to its last step's end: the same requests, the same tokens, on both sides) and the
time **outside the engine** (the bench's round minus that span: sending the requests to the engine, and its
results back to the bench; for the pipeline side also Redis, the worker and the trainer's client). Rounds on one
machine move by several per cent with the engine's own span; the pipeline's cost is what it adds outside the
engine, and whether its engine's steps are slower. The probe also records when each round of the bench began and
ended, on the steps' clock, which splits the time outside the engine into before its first step (`head_s`) and
after its last (`tail_s`). On the pipeline side, the trainer client's reads split the tail once more with the
rollouts' own `timing["finished"]` (when the worker had the sample): `tail_worker_s`, from the engine's last step
to the worker having the round's last sample; `tail_delivery_s`, from there to the client making its group whole
(building, publishing, Redis, reading, grouping); `tail_return_s`, from there to the round's end. JSON on stdout:
per side the medians, and the per-round figures. With `--one-engine` there is one engine file, and each of its
rounds belongs to the side whose round of the bench it began in.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

GAP_S = 0.5
"""A pause this long between two steps ends a round (the bench settles 1.5 s between sides for vLLM)."""


def engine_rounds(path: Path) -> tuple[str, list[list[list[float]]]]:
    """The side of one engine's probe file ('pipeline' if its parent is the worker) and its steps, split by round."""
    lines = path.read_text().splitlines()
    side = "pipeline" if "worker" in json.loads(lines[0])["parent"].split() else "direct"
    rounds: list[list[list[float]]] = []
    for step in (json.loads(line) for line in lines[1:]):
        if not rounds or step[0] - (rounds[-1][-1][0] + rounds[-1][-1][1]) > GAP_S:
            rounds.append([])
        rounds[-1].append(step)
    return side, rounds


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def summary(
    seconds: list[float], rounds: list[list[list[float]]], bench: list[list[float]], takes: list[list[float]]
) -> dict[str, Any]:
    """Medians over the bench's measured rounds (the probe's first round is the bench's warm-up)."""
    rounds, bench = rounds[-len(seconds) :], bench[-len(seconds) :]
    spans = [r[-1][0] + r[-1][1] - r[0][0] for r in rounds]
    outside = [took - span for took, span in zip(seconds, spans, strict=True)]
    step_ms = [s[1] * 1e3 for r in rounds for s in r]
    timed = list(zip(rounds, bench, strict=True)) if bench else []  # none from a probe that did not time them
    tail_parts: dict[str, list[float]] = {"tail_worker_s": [], "tail_delivery_s": [], "tail_return_s": []}
    for steps, (start, end, *offset) in timed:
        last = [t for t in takes if offset and start + offset[0] <= t[0] <= end + offset[0]]
        if last:
            taken, finished = max(last)
            tail_parts["tail_worker_s"].append(finished - (steps[-1][0] + steps[-1][1] + offset[0]))
            tail_parts["tail_delivery_s"].append(taken - finished)
            tail_parts["tail_return_s"].append(end + offset[0] - taken)
    return {
        "head_s": _median([r[0][0] - start for r, (start, *_) in timed]),
        "tail_s": _median([end - (r[-1][0] + r[-1][1]) for r, (_, end, *_) in timed]),
        **{name: _median(values) for name, values in tail_parts.items() if values},
        "round_s": round(statistics.median(seconds), 4),
        "engine_span_s": round(statistics.median(spans), 4),
        "outside_engine_s": round(statistics.median(outside), 4),
        "steps": statistics.median(len(r) for r in rounds),
        "step_ms": round(statistics.median(step_ms), 3),
        "step_cpu_ms": round(statistics.median(s[2] * 1e3 for r in rounds for s in r), 3),
        "per_round": {"span_s": [round(s, 4) for s in spans], "outside_s": [round(o, 4) for o in outside]},
    }


def by_round(rounds: list[list[list[float]]], lines: list[list[Any]]) -> dict[str, list[list[list[float]]]]:
    """One engine for both sides (`rollouts bench --one-engine`): each run of steps goes to the side whose round of
    the bench it began in."""
    sides: dict[str, list[list[list[float]]]] = {"direct": [], "pipeline": []}
    for steps in rounds:
        side = next((line[0] for line in lines if line[0] in sides and line[1] <= steps[0][0] <= line[2]), None)
        if side is not None:
            sides[side].append(steps)
    return sides


def main(probe_dir: str, bench_json: str) -> None:
    bench = json.loads(Path(bench_json).read_text())
    engines = [engine_rounds(p) for p in sorted(Path(probe_dir).glob("[0-9]*.jsonl")) if p.stat().st_size]
    timed = Path(probe_dir, "bench-rounds.jsonl")
    lines = [json.loads(line) for line in timed.read_text().splitlines()] if timed.exists() else []
    sides = by_round(engines[0][1], lines) if bench.get("one_engine") else dict(engines)
    takes = [line[1:] for line in lines if line[0] == "take"]
    result = {
        name: summary(bench[name]["seconds"], sides[name], [line[1:] for line in lines if line[0] == name], takes)
        for name in ("direct", "pipeline")
    }
    direct, pipeline = result["direct"], result["pipeline"]
    result["ratio"] = bench["ratio"]
    result["span_ratio"] = round(direct["engine_span_s"] / pipeline["engine_span_s"], 4)
    result["outside_extra_pct"] = round(
        100 * (pipeline["outside_engine_s"] - direct["outside_engine_s"]) / direct["round_s"], 2
    )
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:3])
