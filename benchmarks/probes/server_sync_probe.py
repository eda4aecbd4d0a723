"""Time each call a remote-engine weight sync makes on a vLLM server, with and without generations in flight.

The remote engine's sync is `/pause` (keep) → `/weight_info` → `/collective_rpc` `reload_weights` →
`/update_weight_version` → `/reset_prefix_cache` → `/resume`. This makes those calls itself, `--rounds` times idle and
`--rounds` times with `--busy` clients generating, and prints the median milliseconds of each as JSON: what the
server's part of a sync costs, to set against the stall a worker reports (`sync_stall_s` in the GRPO trainer's lines).

    python benchmarks/probes/server_sync_probe.py --url http://127.0.0.1:8000 --model MODEL --rounds 6 --busy 16

The server must run with `VLLM_SERVER_DEV_MODE=1` and `--enable-scale-out`, serving `--model` (a directory it sees),
and nothing else should be using it: the probe relabels it `1`, `2`, ... and leaves it at the last label.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from typing import Any

import httpx

CALLS = ("pause", "weight_info", "reload", "relabel", "reset_cache", "resume")


def one_sync(client: httpx.Client, model: str, label: int) -> dict[str, float]:
    """One sync's calls, in the remote engine's order; milliseconds each."""
    requests: list[tuple[str, str, dict[str, Any]]] = [
        ("POST", "/pause", {"params": {"mode": "keep"}}),
        ("GET", "/weight_info", {}),
        ("POST", "/collective_rpc", {"json": {"method": "reload_weights", "kwargs": {"weights_path": model}}}),
        ("POST", "/update_weight_version", {"json": {"new_version": str(label)}}),
        ("POST", "/reset_prefix_cache", {"params": {"reset_running_requests": "true"}}),
        ("POST", "/resume", {}),
    ]
    took = {}
    for name, (verb, path, kwargs) in zip(CALLS, requests, strict=True):
        started = time.perf_counter()
        client.request(verb, path, **kwargs).raise_for_status()
        took[name] = (time.perf_counter() - started) * 1000
    return took


def generate_until(url: str, stop: threading.Event) -> None:
    """One busy client: 200-token generations back to back on the token endpoint."""
    body = {"token_ids": [11, 12, 13, 14, 15], "sampling_params": {"max_tokens": 200, "ignore_eos": True}}
    with httpx.Client(base_url=url, timeout=300) as client:
        while not stop.is_set():
            client.post("/inference/v1/generate", json=body | {"request_id": f"probe-{threading.get_ident()}"})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="The vLLM server, http://HOST:PORT.")
    parser.add_argument("--model", required=True, help="The checkpoint directory it serves (reloaded each round).")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--busy", type=int, default=16, help="Clients generating during the busy rounds.")
    args = parser.parse_args(argv)
    report: dict[str, dict[str, float]] = {}
    stop = threading.Event()
    label = 0
    with httpx.Client(base_url=args.url, timeout=120) as client:
        for phase in ("idle", "busy"):
            if phase == "busy":
                for _ in range(args.busy):
                    threading.Thread(target=generate_until, args=(args.url, stop), daemon=True).start()
                time.sleep(2.0)  # let the generations start
            rounds = []
            for _ in range(args.rounds):
                label += 1
                rounds.append(one_sync(client, args.model, label))
            report[phase] = {name: round(statistics.median(r[name] for r in rounds), 1) for name in CALLS}
            report[phase]["total"] = round(sum(report[phase][name] for name in CALLS), 1)
    stop.set()
    print(json.dumps({"rounds": args.rounds, "busy_clients": args.busy, "median_ms": report}))


if __name__ == "__main__":
    main()
