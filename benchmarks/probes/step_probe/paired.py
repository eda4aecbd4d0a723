"""Where the pipeline's time goes in `rollouts bench --paired`: both sides' requests on one engine, at once.

    STEP_PROBE=DIR PYTHONPATH=benchmarks/probes/step_probe rollouts bench --engine vllm --paired --rounds 9 > bench.json
    python benchmarks/probes/step_probe/paired.py DIR bench.json

In a paired round both sides ride the same engine steps, so what separates their times is what each does before
its last request reaches the engine (the **head**: from the side's start to its last `generate` call) and after its
last result comes back (the **tail**: from the last `generate` return to the side's end). The probe (`sitecustomize`
beside this file) records both sides' requests (`["request", side, called, returned]`), the trainer's submit and the
worker's reads of work; `rounds.py`'s records give each side's start and end and the client's reads. Everything is
on one clock (`perf_counter`, the host's monotonic clock) but the client's reads, which are wall time (the
trainer's `pipeline` record says how to convert).

Per round, on top of head and tail:
- the pipeline's head in parts: `submit_ms` (its start to `submit_prompts` returning), `read_ms` (its start to
  the worker's read of the round's entries returning: Redis answers the blocked reader before the submitter) and
  `to_engine_ms` (from that read to the last `generate` call: decoding, a task a sample, the engine's own calls);
- `last_in_gap_ms`: the pipeline's last request minus the direct side's (how much later its requests were all in);
- `last_out_gap_ms`: the same for the last results (do the two sides end at the same engine step?);
- the pipeline's tail in parts: `tail_worker` (its last `generate` return to the client's last read's rollouts'
  `finished`, i.e. until the worker had built the last rollout), `tail_delivery` (to the client's read that made the
  last group whole: publishing, Redis, reading, grouping), `tail_return` (to the round's end: the ack, the answer).

Rounds are grouped by which side went first (`rollouts bench --paired` alternates); JSON on stdout: medians in ms
by kind of round and over all rounds, and the difference pipeline - direct in head and tail.

    python benchmarks/probes/step_probe/paired.py DIR bench.json --timeline 3

prints instead the pipeline's tail of the last 3 rounds as a line of events each, in ms after its last result: how
many results came in the burst that ended it (`N ended`: within `BURST_S` of the last), each batch the worker's
publisher sent (`pub7>` called with 7 prompts, `<pub7` answered), each read of rollouts (`rr>` called, `<rr28`
returned with 28), each read that made groups whole (`take`), each collection in our processes (`gc PID:GEN:MS`)
and the side's end (`END`): where a burst's milliseconds went, batch by batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

Line = list[Any]


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def _within(lines: list[Line], kind: str, start: float, end: float, at: int = 1) -> list[Line]:
    return [line for line in lines if line[0] == kind and start <= line[at] <= end]


def round_parts(pipeline: Line, direct: Line, lines: list[Line]) -> dict[str, Any]:
    """One paired round: `pipeline`, `direct` are the sides' `[side, start, end, offset]` records."""
    (_, p_start, p_end, offset), (_, d_start, d_end, _) = pipeline, direct
    start, end = min(p_start, d_start), max(p_end, d_end)
    called = _within(lines, "request", start, end, at=2)
    requests = {side: [r for r in called if r[1] == side] for side in ("pipeline", "direct")}
    p_in, p_out = max(r[2] for r in requests["pipeline"]), max(r[3] for r in requests["pipeline"])
    d_in, d_out = max(r[2] for r in requests["direct"]), max(r[3] for r in requests["direct"])
    submitted = min(line[1] for line in _within(lines, "submitted", p_start, p_end))
    read = min(line[1] for line in _within(lines, "read", submitted - 0.05, p_end))  # a read may return as it ends
    parts = {
        "first": "pipeline" if p_start < d_start else "direct",
        "requests_pipeline": len(requests["pipeline"]),
        "requests_direct": len(requests["direct"]),
        "pipeline_s": p_end - p_start,
        "direct_s": d_end - d_start,
        "pipeline_head_ms": _ms(p_in - p_start),
        "direct_head_ms": _ms(d_in - d_start),
        "pipeline_tail_ms": _ms(p_end - p_out),
        "direct_tail_ms": _ms(d_end - d_out),
        "submit_ms": _ms(submitted - p_start),
        "read_ms": _ms(read - p_start),
        "to_engine_ms": _ms(p_in - read),
        "last_in_gap_ms": _ms(p_in - d_in),
        "last_out_gap_ms": _ms(p_out - d_out),
    }
    takes = _within(lines, "take", p_start + offset, p_end + offset)
    if takes:
        taken, finished = max(line[1:3] for line in takes)
        parts["tail_worker_ms"] = _ms(finished - offset - p_out)
        parts["tail_delivery_ms"] = _ms(taken - finished)
        parts["tail_return_ms"] = _ms(p_end + offset - taken)
    return parts


BURST_S = 0.005
"""Results within this of the pipeline's last one count as the burst that ended its round (one engine step's)."""


def tail_events(pipeline: Line, lines: list[Line]) -> str:
    """The pipeline's tail in round `pipeline` (`[side, start, end, offset]`), one line: see the module's doc."""
    _, start, end, offset = pipeline
    returned = [line[3] for line in _within(lines, "request", start, end, at=2) if line[1] == "pipeline"]
    last = max(returned)
    events = [(last, f"{sum(last - t <= BURST_S for t in returned)} ended")]
    for line in lines:
        kind = line[0]
        if kind == "publish" and last <= line[1] <= end:
            events += [(line[1], f"pub{line[3]}>"), (line[2], f"<pub{line[3]}")]
        elif kind == "rread" and last <= line[2] <= end:
            events += [(line[1], "rr>"), (line[2], f"<rr{line[3]}")]
        elif kind == "take" and last <= line[1] - offset <= end:
            events.append((line[1] - offset, "take"))
        elif kind == "gc" and last <= line[3] <= end:
            events.append((line[3], f"gc {line[1]}:{line[2]}:{line[4] * 1000:.2f}"))
    events.append((end, "END"))
    return " ".join(f"{(t - last) * 1000:+.2f} {what}" for t, what in sorted(events))


def pair_rounds(lines: list[Line]) -> list[tuple[Line, Line]]:
    """Each pipeline round with the direct round that overlaps it (the two sides of one paired round)."""
    directs = [line for line in lines if line[0] == "direct"]
    pairs = []
    for pipeline in (line for line in lines if line[0] == "pipeline"):
        overlapping = [d for d in directs if d[1] < pipeline[2] and pipeline[1] < d[2]]
        if overlapping:
            pairs.append((pipeline, overlapping[0]))
    return pairs


def medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    numbers = [key for key, value in rounds[0].items() if key != "first"]
    found = {key: round(statistics.median(r[key] for r in rounds if key in r), 3) for key in numbers}
    found["head_extra_ms"] = round(found["pipeline_head_ms"] - found["direct_head_ms"], 3)
    found["tail_extra_ms"] = round(found["pipeline_tail_ms"] - found["direct_tail_ms"], 3)
    return {"rounds": len(rounds)} | found


def main(probe_dir: str, bench_json: str, timeline: int | None = None) -> None:
    bench = json.loads(Path(bench_json).read_text())
    if not bench.get("paired"):
        sys.exit(f"{bench_json} is not a `rollouts bench --paired` run: use rounds.py for it")
    lines = [json.loads(line) for line in Path(probe_dir, "bench-rounds.jsonl").read_text().splitlines()]
    measured = len(bench["direct"]["seconds"])  # the rounds before them warmed up (their sides may not overlap)
    pairs = pair_rounds(lines)[-measured:]
    if timeline is not None:
        for pipeline, _ in pairs[-timeline:]:
            print(tail_events(pipeline, lines))
        return
    rounds = [round_parts(p, d, lines) for p, d in pairs]
    result: dict[str, Any] = {"all": medians(rounds)}
    for first in ("pipeline", "direct"):
        kind = [r for r in rounds if r["first"] == first]
        if kind:
            result[f"{first}_first"] = medians(kind)
    result["ratio"] = bench["ratio"]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Where the pipeline's time goes in `rollouts bench --paired`.")
    parser.add_argument("probe_dir", help="the probe's folder (STEP_PROBE)")
    parser.add_argument("bench_json", help="the bench's JSON")
    parser.add_argument("--timeline", type=int, metavar="ROUNDS", help="print the last ROUNDS rounds' tails instead")
    args = parser.parse_args()
    main(args.probe_dir, args.bench_json, args.timeline)
