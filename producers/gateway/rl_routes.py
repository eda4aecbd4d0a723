"""vLLM's RL routes on the gateway, so that a framework pointed at "a vLLM server" (SkyRL's `RemoteInferenceClient`,
TRL's vLLM client) gets a fleet behind a durable queue. Shapes as vLLM 0.32's server answers them.

Always on (the data plane): `POST /inference/v1/generate`, `POST /tokenize`, `POST /detokenize`, `POST
/finish_session`, `GET /get_world_size`, `GET /is_paused`, `GET /weight_info` (and `max_model_len` in `/v1/models`).
With `rollouts gateway --rl-control` (the control plane, as vLLM keeps it behind `VLLM_SERVER_DEV_MODE=1`): `POST
/pause`, `/resume`, `/reset_prefix_cache`, `/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update`, `/shutdown_weight_transfer_engine`. Without it they answer 404 saying how to turn them on.
vLLM routes the gateway does not serve answer 404 with the reason (`NOT_SERVED`).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Body, FastAPI, Header, Query

from producers.gateway.openai_api import OpenAIError
from producers.gateway.placement import candidates
from producers.gateway.rl_control import clear_hold, pause_mode, read_hold, set_hold
from producers.gateway.service import Gateway
from producers.gateway.vllm_api import DetokenizeRequest, GenerateRequest, TokenizeRequest

NOT_SERVED = {
    "/sleep": "workers own their GPUs (`rollouts worker --lazy` frees an idle one)",
    "/wake_up": "workers own their GPUs (`rollouts worker --lazy` frees an idle one)",
    "/is_sleeping": "workers own their GPUs (`rollouts worker --lazy` frees an idle one)",
    "/collective_rpc": "the workers' engines take no remote calls from callers",
    "/abort_requests": "a queued call is not aborted from outside (a sync continues it; a client that gives up "
    "leaves it to finish)",
    "/inference/v1/abort_requests": "a queued call is not aborted from outside (a sync continues it)",
    "/fetch_weights": "SkyRL's `delta` weight sync is not read by the gateway: send tensors to /update_weights",
    "/start_draft_weight_update": "no speculative-decoding drafter is served",
    "/skyrl/v1/generate": "SkyRL's packed side channels (routed experts, sample support) are not produced: turn "
    "them off (enable_return_routed_experts, enable_return_sample_support_set)",
    "/skyrl/v1/load_lora_adapter": "LoRA adapters are published by the trainer (publish_weights(adapter=...))",
    "/v1/load_lora_adapter": "LoRA adapters are published by the trainer (publish_weights(adapter=...))",
    "/v1/unload_lora_adapter": "LoRA adapters are published by the trainer (publish_weights(adapter=...))",
    "/v1/chat/completions/render": "multimodal rendering is not served (text only)",
    "/server_info": "this is not a vLLM server; `GET /v1/models` has the model and its max_model_len",
}
"""vLLM (and SkyRL) routes the gateway does not serve, with the reason its 404 gives."""


def add_vllm_routes(app: FastAPI, gateway: Gateway) -> None:
    settings = gateway.settings
    updates = gateway.weights

    def control(route: str) -> None:
        if not settings.rl_control:
            raise OpenAIError(
                404,
                f"POST {route} is off: it pauses calls or publishes weights for the whole namespace; start the gateway "
                "with `rollouts gateway --rl-control` to serve vLLM's RL control routes",
                code="rl_control_off",
            )

    # -- the data plane -------------------------------------------------------------------------------------

    @app.post("/inference/v1/generate")
    async def generate(request: GenerateRequest, x_session_id: str | None = Header(default=None)) -> dict[str, Any]:
        return await gateway.generate_tokens(request, x_session_id)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> dict[str, Any]:
        return await gateway.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> dict[str, Any]:
        vocab = len(gateway.renderer.tokenizer)
        if any(not 0 <= t < vocab for t in request.tokens):
            raise OpenAIError(400, f"tokens must be ids of the model's vocabulary (0 to {vocab - 1})", param="tokens")
        return {"prompt": gateway.renderer.decode(request.tokens)}

    @app.post("/finish_session")
    async def finish_session(session_id: Annotated[str, Query()]) -> dict[str, Any]:
        released = await gateway.finish_session(session_id)
        return {"status": "ok", "released": released}

    @app.get("/get_world_size")
    async def get_world_size(include_dp: Annotated[bool, Query()] = True) -> dict[str, int]:
        """The live workers (each one engine here, whatever its GPUs); `include_dp=false`: one engine's, 1."""
        live = await gateway.live_workers()
        return {"world_size": len(candidates(live)) if include_dp else 1}

    @app.get("/is_paused")
    async def is_paused() -> dict[str, bool]:
        return {"is_paused": await gateway.is_paused()}

    @app.get("/weight_info")
    async def weight_info() -> dict[str, str]:
        return {"weight_version": str(await gateway.policy_version())}

    # -- the control plane (--rl-control) -------------------------------------------------------------------

    @app.post("/pause")
    async def pause(
        mode: Annotated[str, Query()] = "abort", clear_cache: Annotated[bool, Query()] = True
    ) -> dict[str, str]:
        """A hold on new calls; `mode` is the next weight sync's (`clear_cache`: every abort or keep sync resets the
        workers' prefix caches; an inflight one salts them by version)."""
        control("/pause")
        ours = pause_mode(mode)
        await gateway.run(set_hold, gateway.streams, ours, settings.name, settings.rl_pause_ttl_s)
        return {"status": "paused", "mode": ours}

    @app.post("/resume")
    async def resume() -> dict[str, str]:
        control("/resume")
        await gateway.run(clear_hold, gateway.streams)
        return {"status": "resumed"}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(
        reset_running_requests: Annotated[bool, Query()] = False, reset_external: Annotated[bool, Query()] = False
    ) -> dict[str, Any]:
        """Nothing to do: a weight sync in `abort` or `keep` mode resets every worker's prefix cache as it loads, and
        `inflight` salts it by version, so no call ever reuses a cache of another version (what callers reset it for
        after a weight update). A reset outside a sync (to measure a cold cache) is not offered."""
        control("/reset_prefix_cache")
        return {
            "success": True,
            "note": "each weight sync resets the workers' prefix caches (inflight: salts them by version)",
        }

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(init_info: Annotated[dict[str, Any], Body(embed=True)]) -> dict[str, str]:
        control("/init_weight_transfer_engine")
        updates.init(init_info)
        return {"message": "Weight transfer initialized", "transport": updates.transport}

    @app.post("/start_weight_update")
    async def start_weight_update() -> dict[str, str]:
        control("/start_weight_update")
        await updates.start()
        return {"message": "Weight update started"}

    @app.post("/update_weights")
    async def update_weights(update_info: Annotated[dict[str, Any], Body(embed=True)]) -> dict[str, Any]:
        control("/update_weights")
        held = await updates.update(update_info)
        return {"message": "Weights updated", "tensors": held}

    @app.post("/finish_weight_update")
    async def finish_weight_update(
        weight_version: Annotated[str | None, Body(embed=True)] = None,
    ) -> dict[str, Any]:
        """Publish the update as the next policy version: the workers pause in the held mode (`POST /pause`'s), else
        `--weights-mode`, load it, ack and resume."""
        control("/finish_weight_update")
        hold = await gateway.run(read_hold, gateway.streams)
        return await updates.finish(weight_version, hold.mode if hold else settings.weights_mode)

    @app.post("/shutdown_weight_transfer_engine")
    async def shutdown_weight_transfer_engine() -> dict[str, str]:
        control("/shutdown_weight_transfer_engine")
        await updates.shutdown()
        return {"message": "Weight transfer shut down"}

    @app.post("/update_weight_version")
    async def update_weight_version() -> dict[str, str]:
        raise OpenAIError(
            400,
            "policy versions are assigned by the publishes (+1 each; GET /weight_info has the current one), not named "
            "by callers",
            param="new_version",
        )
