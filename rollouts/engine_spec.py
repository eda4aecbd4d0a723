"""Engine flags shared by `rollouts worker`, `rollouts launch` and the lab's benchmarks, and what each engine takes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any

import typer

NO_MODEL = Path("synthetic")
"""The model of an engine run without `--model` (only the synthetic engine may be)."""

EngineOpt = Annotated[
    str,
    typer.Option(
        "--engine",
        help="Generation engine: torch, vllm, synthetic (no model: tokens at a set pace), or remote (a vLLM server "
        "someone else runs: --url).",
    ),
]
UrlOpt = Annotated[
    str | None,
    typer.Option(
        help="remote engine: the vLLM server, e.g. http://127.0.0.1:8000 (started with VLLM_SERVER_DEV_MODE=1 and "
        "--enable-scale-out; --model is then its config's directory)."
    ),
]
DtypeOpt = Annotated[str, typer.Option(help="Weights dtype: float32, bfloat16, float16.")]
DeviceOpt = Annotated[str, typer.Option(help="torch engine: device (cpu, cuda, cuda:1).")]
MaxBatchOpt = Annotated[
    int,
    typer.Option(help="torch and synthetic engines: largest decode batch (and the worker's default --max-inflight)."),
]
ThreadsOpt = Annotated[int | None, typer.Option(help="torch engine: CPU threads (default 1 for small CPU models).")]
MaxLenOpt = Annotated[int | None, typer.Option(help="Longest prompt + generation (default: the model's).")]
KvCacheOpt = Annotated[int | None, typer.Option(help="vllm engine: KV cache size in bytes.")]
TpOpt = Annotated[int, typer.Option(help="vllm engine: tensor-parallel size.")]
EagerOpt = Annotated[bool, typer.Option(help="vllm engine: no CUDA graphs / compilation.")]
MaxLorasOpt = Annotated[
    int | None,
    typer.Option(
        help="LoRA adapters held at once (more are loaded on demand, idle ones evicted); default 4 on torch, "
        "0 on vllm (no LoRA: pass it to serve adapters)."
    ),
]
EngineProcessOpt = Annotated[
    bool,
    typer.Option(
        help="torch, synthetic: run the engine in a process of its own (as vLLM's EngineCore), so that the worker's "
        "Python never holds the GIL its steps need."
    ),
]
SeedOpt = Annotated[int | None, typer.Option(help="Engine seed, for requests that carry none.")]
EngineArgsOpt = Annotated[
    str | None,
    typer.Option(
        help='vllm: extra AsyncEngineArgs as JSON, e.g. \'{"block_size": 32}\'; remote: \'{"staging_dir": DIR, '
        '"start_timeout_s": 600, "api_key": KEY}\'; synthetic: its pace and lengths, '
        'e.g. \'{"steps_per_s": 100, "lengths": "pareto:1.5", "min_tokens": 16}\'.'
    ),
]

ENGINE_OPTIONS: dict[str, Any] = {
    "engine": EngineOpt,
    "dtype": DtypeOpt,
    "device": DeviceOpt,
    "max_batch": MaxBatchOpt,
    "max_loras": MaxLorasOpt,
    "num_threads": ThreadsOpt,
    "max_model_len": MaxLenOpt,
    "kv_cache_bytes": KvCacheOpt,
    "tensor_parallel_size": TpOpt,
    "enforce_eager": EagerOpt,
    "seed": SeedOpt,
    "url": UrlOpt,
    "engine_args": EngineArgsOpt,
    "engine_process": EngineProcessOpt,
}
"""The engine's options by their parameter names, as `EngineSpec.from_flags` reads them (`rollouts.worker_flags`
adds them to `rollouts worker` and `rollouts launch`)."""


@dataclass
class EngineSpec:
    kind: str
    model: Path
    dtype: str = "float32"
    device: str = "cpu"
    max_batch: int = 64
    max_loras: int | None = None
    """None: the engine's default (torch 4, vllm 0)."""
    num_threads: int | None = None
    max_model_len: int | None = None
    kv_cache_bytes: int | None = None
    tensor_parallel_size: int = 1
    enforce_eager: bool = True
    seed: int | None = None
    url: str | None = None
    """remote: the vLLM server's URL."""
    engine_process: bool = False
    """Run the engine in a process of its own (`consumers.engines.process_engine`)."""
    engine_args: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_flags(cls, flags: dict[str, Any], model: Path) -> EngineSpec:
        """From a command's parsed flags (`typer.Context.params`): `--engine`, `--engine-args` and the rest by name."""
        known = {f.name for f in fields(cls)} - {"kind", "model", "engine_args"}
        chosen = {name: value for name, value in flags.items() if name in known}
        return cls(
            kind=flags["engine"], model=model, engine_args=cls.parse_engine_args(flags.get("engine_args")), **chosen
        )

    @staticmethod
    def parse_engine_args(text: str | None) -> dict[str, Any]:
        if not text:
            return {}
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--engine-args is not valid JSON ({exc.msg}): {text}") from None
        if not isinstance(value, dict):
            raise ValueError(f"--engine-args must be a JSON object, got {text}")
        return value

    def options(self) -> dict[str, Any]:
        """Keyword arguments of `create_engine` for this engine (each engine takes only its own)."""
        return self.in_process_options() | ({"process": True} if self.engine_process else {})

    def in_process_options(self) -> dict[str, Any]:
        """`options()` for the engine in the caller's process, whatever `engine_process` says."""
        common = {"dtype": self.dtype, "max_model_len": self.max_model_len, "seed": self.seed}
        if self.kind == "torch":
            torch_only = {"device": self.device, "max_batch": self.max_batch, "num_threads": self.num_threads}
            return common | torch_only | self._loras()
        if self.kind == "remote":  # the server has its own dtype, seed and cache; `staging_dir` etc. as --engine-args
            return {"url": self.url, "max_model_len": self.max_model_len} | self.engine_args
        if self.kind == "synthetic":  # its pace and lengths come as --engine-args
            paced = {"max_model_len": self.max_model_len, "seed": self.seed, "max_batch": self.max_batch}
            return paced | self.engine_args
        options = common | {
            "tensor_parallel_size": self.tensor_parallel_size,
            "enforce_eager": self.enforce_eager,
            "engine_args": self.engine_args,
        }
        if self.kv_cache_bytes is not None:
            options["kv_cache_bytes"] = self.kv_cache_bytes
        return options | self._loras()

    def _loras(self) -> dict[str, Any]:
        return {} if self.max_loras is None else {"max_loras": self.max_loras}

    def worker_args(self) -> list[str]:
        """The same choice as `rollouts worker` flags."""
        args = ["--engine", self.kind, "--dtype", self.dtype, "--device", self.device]
        args += ["--max-batch", str(self.max_batch), "--tensor-parallel-size", str(self.tensor_parallel_size)]
        args.append("--enforce-eager" if self.enforce_eager else "--no-enforce-eager")
        for flag, value in (
            ("--num-threads", self.num_threads),
            ("--max-model-len", self.max_model_len),
            ("--kv-cache-bytes", self.kv_cache_bytes),
            ("--seed", self.seed),
            ("--max-loras", self.max_loras),
            ("--url", self.url),
        ):
            if value is not None:
                args += [flag, str(value)]
        if self.engine_args:
            args += ["--engine-args", json.dumps(self.engine_args)]
        if self.engine_process:
            args.append("--engine-process")
        return args
