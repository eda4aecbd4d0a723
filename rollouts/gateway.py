"""`rollouts gateway`: the OpenAI-compatible HTTP endpoint for agent code, over the queue."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Annotated

import typer

from pipeline.registry import default_name
from rollouts.app import (
    DEFAULT_NS,
    DEFAULT_REDIS,
    LogLevelOpt,
    NsOpt,
    RedisOpt,
    app,
    check_port,
    check_tokenizer_dir,
    console,
    fail,
    open_streams,
    setup_logging,
    user_errors,
)


@app.command()
def gateway(
    model: Annotated[Path, typer.Option(help="Model directory: its tokenizer and chat template (the workers' model).")],
    redis_url: RedisOpt = DEFAULT_REDIS,
    ns: NsOpt = DEFAULT_NS,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    served_model_name: Annotated[
        str | None, typer.Option(help="The `model` callers name; default the model directory's name.")
    ] = None,
    placement: Annotated[
        str, typer.Option(help="Where sessions run: sticky (least-loaded), hash or random.")
    ] = "sticky",
    session_ttl_s: Annotated[float, typer.Option(help="A session idle this long is released (and dropped).")] = 600.0,
    pause_timeout_s: Annotated[
        float, typer.Option(help="A call during a weight sync waits this long for the resume, then gets a 503.")
    ] = 60.0,
    request_timeout_s: Annotated[float, typer.Option(help="A queued call waits this long, then gets a 504.")] = 600.0,
    max_model_len: Annotated[
        int | None, typer.Option(help="Longest prompt + reply; default the smallest the live workers report.")
    ] = None,
    name: Annotated[str | None, typer.Option(help="This replica's name (its reply stream); default host-pid.")] = None,
    rl_control: Annotated[
        bool,
        typer.Option(
            "--rl-control",
            help="Serve vLLM's RL control routes: /pause, /resume, /reset_prefix_cache and the weight-transfer routes "
            "(they hold every call and publish weights for the namespace).",
        ),
    ] = False,
    rl_pause_ttl_s: Annotated[
        float, typer.Option(help="A POST /pause not resumed within this long is lifted (its caller died).")
    ] = 600.0,
    weights_transport: Annotated[
        str, typer.Option(help="How the weight-transfer routes publish: redis://, fs:///DIR or nccl://HOST:PORT.")
    ] = "redis://",
    weights_mode: Annotated[
        str, typer.Option(help="Pause mode of a weight update finished without POST /pause: abort, keep, inflight.")
    ] = "abort",
    log_level: LogLevelOpt = "info",
) -> None:
    """Serve /v1/chat/completions, /v1/completions and /v1/models over the queue; X-Session-ID makes a call a turn
    of a session pinned to one worker, POST /v1/sessions/{id}/finish sends its trajectory to the trainer. vLLM's RL
    routes too: POST /inference/v1/generate (token ids in and out), /tokenize, /detokenize, /finish_session, GET
    /get_world_size, /is_paused, /weight_info; with --rl-control /pause, /resume and the weight-transfer routes."""
    from pipeline.wire import PAUSE_MODES
    from producers.gateway.placement import PLACEMENTS
    from staleness.weights.base import takes_host_tensors

    if placement not in PLACEMENTS:
        fail(f"--placement must be one of {', '.join(PLACEMENTS)}, not {placement!r}")
    if weights_mode not in PAUSE_MODES:
        fail(f"--weights-mode must be one of {', '.join(PAUSE_MODES)}, not {weights_mode!r}")
    if not takes_host_tensors(weights_transport):
        fail(f"--weights-transport must be redis://, fs:///DIR or nccl://HOST:PORT, not {weights_transport!r}")
    check_port(port)
    model = check_tokenizer_dir(model, purpose="rollouts gateway")
    setup_logging(log_level)
    streams = open_streams(redis_url, ns)
    import uvicorn
    from prometheus_client import disable_created_metrics
    from transformers import AutoTokenizer

    from producers.gateway.app import create_app
    from producers.gateway.chat import ChatRenderer
    from producers.gateway.service import Gateway, GatewaySettings

    disable_created_metrics()  # type: ignore[no-untyped-call]  # unannotated; the `_created` series are noise
    with user_errors(redis_url):
        renderer = ChatRenderer(AutoTokenizer.from_pretrained(str(model)))
        settings = GatewaySettings(
            served_model_name=served_model_name or model.resolve().name,
            name=name or f"gateway-{default_name()}",
            placement=placement,
            session_ttl_s=session_ttl_s,
            pause_timeout_s=pause_timeout_s,
            request_timeout_s=request_timeout_s,
            max_model_len=max_model_len,
            rl_control=rl_control,
            rl_pause_ttl_s=rl_pause_ttl_s,
            weights_transport=weights_transport,
            weights_mode=weights_mode,
            model_dir=model,
        )
        streams.redis.ping()
    try:  # bound here, so that a port in use is one line, and port 0 prints the port it got
        listening = socket.create_server((host, port))
    except OSError as exc:
        fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}. Pass another --port (0: a free one).")
    port = listening.getsockname()[1]
    console.print(f"gateway {settings.name}: model {settings.served_model_name!r} on http://{host}:{port}/v1 ({ns})")
    config = uvicorn.Config(create_app(Gateway(streams, renderer, settings)), log_level=log_level.lower())
    uvicorn.Server(config).run(sockets=[listening])
