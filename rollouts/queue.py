"""`rollouts submit`, `rollouts top` and `rollouts publish-weights`: what a person does to a running pipeline."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.live import Live
from rich.markup import escape

from pipeline.wire import PAUSE_MODES, is_pause_mode
from rollouts.app import (
    DEFAULT_NS,
    DEFAULT_REDIS,
    NsOpt,
    RedisOpt,
    app,
    check_tokenizer_dir,
    console,
    fail,
    open_streams,
    print_wide,
    require,
    sync_report,
    user_errors,
)


@app.command()
def submit(
    file: Annotated[Path, typer.Option("--file", help="JSONL: one prompt object a line.")],
    redis_url: RedisOpt = DEFAULT_REDIS,
    ns: NsOpt = DEFAULT_NS,
    model: Annotated[Path | None, typer.Option(help="Model directory whose tokenizer reads text prompts.")] = None,
) -> None:
    """Queue prompts from a JSONL file: `id`, `prompt` (text) or `tokens`, `n`, `max_tokens`,
    `temperature`, `top_p`, `stop_token_ids`, `seed`, `top_k`, `min_p`, `repetition_penalty`, `presence_penalty`,
    `frequency_penalty`, `min_tokens` (vLLM's meanings), `meta`, `reward_fn`, `adapter` (a LoRA adapter's name).
    Nothing is queued unless every line is valid."""
    from producers.prompts_file import read_prompts_file

    if not file.is_file():
        fail(f"no prompts file at {file}")
    if model is not None:
        model = check_tokenizer_dir(model, purpose="rollouts submit --model")
    with user_errors(redis_url):
        from producers.client import RolloutClient
        from staleness.admission import SUBMISSION_TTL_S

        client = RolloutClient(redis_url, ns, tokenizer=model)
        prompts = read_prompts_file(file, client)
        queued = client.submit_prompts(prompts)
        scored = sum(1 for p in prompts if p.reward_fn)
        unscored = scored > 0 and not client.streams.scoring.scorer_alive()
        unserved = queued > 0 and not client.streams.registry.live_worker_names()
    samples = sum(p.n for p in prompts)
    if queued < len(prompts):
        console.print(
            f"[bold yellow]queued {queued} prompts:[/] {len(prompts) - queued} of {len(prompts)} were already "
            f"submitted under the same ids within the last {SUBMISSION_TTL_S // 60} minutes on "
            f"{client.streams.keys.prompts} (a repeat is never queued twice); give them new ids to queue them again",
            soft_wrap=True,
        )
    else:
        console.print(f"queued {len(prompts)} prompts ({samples} samples) on {client.streams.keys.prompts}")
    if unserved:
        keys = client.streams.keys
        console.print(
            f"[bold yellow]warning:[/] no worker is alive on namespace {escape(keys.ns)}: the prompts wait on "
            f"{escape(keys.prompts)} until one starts (`rollouts worker --ns {escape(keys.ns)} ...`)",
            soft_wrap=True,
        )
    if unscored:
        keys = client.streams.keys
        console.print(
            f"[bold yellow]warning:[/] {scored} of these prompts name a reward_fn and no scorer is alive on namespace "
            f"{escape(keys.ns)}: their rollouts will wait on {escape(keys.scoring)} until `rollouts scorer --ns "
            f"{escape(keys.ns)}` runs",
            soft_wrap=True,  # one line, however long
        )


@app.command()
def top(
    redis_url: RedisOpt = DEFAULT_REDIS,
    ns: NsOpt = DEFAULT_NS,
    once: Annotated[bool, typer.Option(help="Print one snapshot and exit.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="With --once: print the snapshot as JSON.")] = False,
    interval: Annotated[float, typer.Option(help="Refresh period in seconds.")] = 1.0,
) -> None:
    """Live view of stream depth, group lag and pending, and workers; `--once --json` for scripts."""
    from pipeline.top import render, snapshot

    streams = open_streams(redis_url, ns)
    with user_errors(redis_url):
        if once:
            snap = snapshot(streams)
            if as_json:
                print(json.dumps(snap, indent=2))
            else:
                print_wide(render(snap))
            return
        with Live(render(snapshot(streams)), console=Console(), refresh_per_second=4) as live:
            try:
                while True:
                    time.sleep(interval)
                    live.update(render(snapshot(streams)))
            except KeyboardInterrupt:
                pass


@app.command("publish-weights")
def publish_weights(
    source: Annotated[Path, typer.Option("--from", help="Checkpoint directory (safetensors) of the new policy.")],
    redis_url: RedisOpt = DEFAULT_REDIS,
    ns: NsOpt = DEFAULT_NS,
    transport: Annotated[
        str,
        typer.Option(
            help="redis (chunks in this Redis), fs://DIR (shared storage) or nccl://HOST:PORT (broadcast from "
            "this process, which the workers reach at HOST:PORT)."
        ),
    ] = "redis",
    mode: Annotated[
        str,
        typer.Option(
            help="Pause mode: abort (samples end and continue as new requests), keep (they freeze; their KV cache is "
            "recomputed by the new weights) or inflight (they freeze and go on with the KV cache they have)."
        ),
    ] = "abort",
    ack_timeout_s: Annotated[float, typer.Option(help="Evict a worker that has not loaded it by then.")] = 60.0,
    adapter: Annotated[
        str | None,
        typer.Option(
            help="A LoRA adapter's name: --from is a PEFT directory (adapter_model.safetensors + "
            "adapter_config.json), and only this adapter moves to its next version (only its requests pause)."
        ),
    ] = None,
) -> None:
    """Make a checkpoint the next policy version on every worker (pause → load → ack → resume); JSON out."""
    from producers.client import RolloutClient

    if not is_pause_mode(mode):
        fail(f"--mode must be one of {', '.join(PAUSE_MODES)}, not {mode!r}")
    if not any(source.glob("*.safetensors")):
        fail(f"no safetensors checkpoint in {source}")
    if adapter is not None and not (source / "adapter_config.json").is_file():
        fail(f"--adapter {adapter}: {source} has no adapter_config.json (a PEFT adapter directory has)")
    require("torch", "safetensors", purpose="rollouts publish-weights")
    spec = "redis://" if transport in ("redis", "redis://") else transport
    with user_errors(redis_url):
        client = RolloutClient(redis_url, ns)
        version = client.publish_weights(
            source,
            transport=spec,
            mode=mode,
            ack_timeout_s=ack_timeout_s,
            adapter=adapter,
        )
    of = {} if adapter is None else {"adapter": adapter}
    print(json.dumps({"version": version} | of | sync_report(client.last_sync)))
