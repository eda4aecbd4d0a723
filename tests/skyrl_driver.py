"""SkyRL 0.4.0's own client code against `rollouts gateway`: run by tests/producers/test_skyrl_client.py in a Python
3.12 venv that has `skyrl` installed without its dependencies, plus what its client modules import (not torch: see
below).

It drives a generate → pause → weights → resume cycle with SkyRL's classes, unmodified:
`RemoteInferenceClient` (the data plane and the fanned-out control plane: `get_world_size`, `generate`, `sample`,
`pause`, `resume`, `reset_prefix_cache`, `finish_session`), its `RemoteGenerateClient` (one generate, whose raw answer
keeps vLLM's `weight_versions`) and `SkyrlWeightSyncClient` (the four weight-transfer routes, as SkyRL's trainer-side
engines call them). It talks to the test over stdin/stdout, one JSON object a line: it says `started` once its first
request is in flight and waits for `go` (the test has seen a worker generate it), then prints what came back.

torch: SkyRL's client module imports torch (for Megatron and sample-support helpers it never calls on these paths).
The only torch wheel for Python 3.12 here is a CUDA build that cannot import without its CUDA libraries, so this
script puts a stand-in `torch` module in `sys.modules` first: it hands the names those modules evaluate at import
time, and once the import is done any use of torch raises. The client code on the paths driven here never touches it.

No import of the project: the venv has none of its dependencies.
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import sys
import types
from pathlib import Path
from typing import Any


class _TorchStandIn(types.ModuleType):
    armed = False

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if self.armed:
            raise RuntimeError(f"SkyRL's client used torch.{name} at run time (this venv has a stand-in torch)")
        return type(name, (), {})  # a name evaluated at import: a type annotation, a dtype constant


torch = _TorchStandIn("torch")
sys.modules["torch"] = torch
from skyrl.backends.skyrl_train.inference_servers.base import InferenceEngineInput  # noqa: E402
from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import (  # noqa: E402
    RemoteGenerateClient,
    RemoteInferenceClient,
)
from skyrl.backends.skyrl_train.weight_sync.control_plane import SkyrlWeightSyncClient  # noqa: E402

torch.armed = True

SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64"}


def read_tensors(model_dir: Path) -> list[tuple[str, str, list[int], bytes]]:
    """(name, dtype, shape, raw little-endian bytes) of each tensor in the checkpoint: the framework's side."""
    out = []
    for path in sorted(model_dir.glob("*.safetensors")):
        blob = path.read_bytes()
        (size,) = struct.unpack("<Q", blob[:8])
        header = json.loads(blob[8 : 8 + size])
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            start, end = (8 + size + offset for offset in entry["data_offsets"])
            out.append((name, SAFETENSORS_DTYPES[entry["dtype"]], entry["shape"], blob[start:end]))
    return out


def skyrl_sampling_params(max_tokens: int) -> dict[str, Any]:
    """What SkyRL's generator sends (`get_vllm_sampling_params` in skyrl 0.4.0), its defaults unchanged: `logprobs=1`
    among them (one alternative a token, which the gateway reports as vLLM does; SkyRL reads the sampled token's)."""
    return {
        "min_tokens": 1,
        "skip_special_tokens": True,
        "include_stop_str_in_output": True,
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "logprobs": 1,
        "stop": None,
    }


def say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


async def main(config: dict[str, Any]) -> None:
    url, model, prompt = config["url"], config["model"], config["prompt"]
    client = RemoteInferenceClient(proxy_url=url, server_urls=[url], data_parallel_size=1, model_name=model)
    out: dict[str, Any] = {"world_size": list(await client.get_world_size())}

    # Long generations (n of them: SkyRL's `sample` asks vLLM for n too), in flight across the sync.
    first = RemoteGenerateClient(proxy_url=url)
    long = asyncio.create_task(
        first.generate(
            prompt_token_ids=prompt,
            sampling_params=skyrl_sampling_params(config["long_tokens"]) | {"n": config["long_samples"]},
            session_id="traj-0",
            model=model,
        )
    )
    say(event="started")
    line = await asyncio.to_thread(sys.stdin.readline)
    assert json.loads(line)["event"] == "go", line

    # Pause: vLLM's wait mode has no counterpart (refused); keep, SkyRL's default, holds new calls.
    try:
        await client.pause(mode="wait")
        out["wait"] = "accepted"
    except Exception as exc:  # aiohttp.ClientResponseError, with the gateway's message
        out["wait"] = f"{type(exc).__name__}: {getattr(exc, 'status', '')} {getattr(exc, 'message', exc)}"
    await client.pause(mode="keep")
    out["paused"] = (await client._call_all_servers("/is_paused", method="GET"))[url]["body"]
    # A call made during the pause: SkyRL's generate (it detokenizes through the gateway's /detokenize).
    during = asyncio.create_task(
        client.generate(
            InferenceEngineInput(
                prompt_token_ids=[prompt], sampling_params=skyrl_sampling_params(config["short_tokens"])
            )
        )
    )

    # Weights, as SkyRL's trainer-side engines drive the routes: its NCCL rendezvous is refused ...
    sync = SkyrlWeightSyncClient([url])
    nccl = {"master_address": "127.0.0.1", "master_port": 29999, "rank_offset": 1, "world_size": 2, "packed": True}
    try:
        await asyncio.to_thread(sync.init_weight_transfer_engine, nccl)
        out["nccl"] = "accepted"
    except RuntimeError as exc:
        out["nccl"] = str(exc)
    try:
        await asyncio.to_thread(sync.fetch_weights, 1, "/tmp/nowhere")
        out["delta"] = "accepted"
    except RuntimeError as exc:
        out["delta"] = str(exc)
    # ... and the tensors themselves go through: vLLM's names/dtype_names/shapes, with the bytes, in two updates.
    tensors = read_tensors(Path(config["weights_dir"]))
    await asyncio.to_thread(sync.init_weight_transfer_engine, {"transport": "redis://"})
    await asyncio.to_thread(sync.start_weight_update)
    half = len(tensors) // 2
    for part in (tensors[:half], tensors[half:]):
        update_info = {
            "names": [t[0] for t in part],
            "dtype_names": [t[1] for t in part],
            "shapes": [t[2] for t in part],
            "data": [base64.b64encode(t[3]).decode() for t in part],
        }
        await asyncio.to_thread(sync.update_weights, update_info)
    await asyncio.to_thread(sync.finish_weight_update)
    sync.close()
    out["reset"] = (await client.reset_prefix_cache())[url]["body"]
    out["during_done_before_resume"] = during.done()
    await client.resume()

    result = await long
    out["long"] = {
        "choices": result.raw_response["choices"],
        "response_ids": result.response_ids,
        "response_logprobs": result.response_logprobs,
        "stop_reason": result.stop_reason,
    }
    held = await during
    out["during"] = {k: held[k] for k in ("response_ids", "response_logprobs", "stop_reasons", "responses")}
    sampled = await client.sample(
        {"json": {"prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]}, "num_samples": 2,
                  "sampling_params": {"max_tokens": config["short_tokens"], "seed": 7}}}
    )  # fmt: skip
    out["sample"] = sampled["sequences"]
    await client.finish_session("traj-0")
    await first.aclose()
    await client.teardown()
    say(event="done", **out)


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
