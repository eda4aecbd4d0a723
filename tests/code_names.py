"""The names the repository's Python code defines, read with `ast` (nothing is imported), and the check of a name
that the docs cite against them: a module path (`pipeline.streams`, `consumers.engines.base.continuation_seed`), a
module's short form (`connections.async_twin`), `Class.member`, a function or a class.

What counts as a name of a module: its top-level classes, functions, assignments and imports, and its submodules.
What counts as a member of a class: its methods (properties too), class attributes (annotated ones too, so the
fields of a dataclass or a pydantic model, and the members of an enum), nested classes, the attributes its methods
set on `self`, and the members of its bases that are classes of this repository.
"""

from __future__ import annotations

import ast
import builtins
import gc
import re
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pipeline", "producers", "consumers", "staleness", "rollouts", "benchmarks", "tests", "examples")
"""Top-level folders whose .py files are indexed; a dotted name that starts with one of them is ours."""

FOREIGN_FIRST = frozenset({"verl", "trl", "vllm"})
"""First parts of dotted names and paths that are other libraries where a module of ours has the same base name
(`producers/integrations/verl.py`: `verl.plugins` is verl's) or that the docs cite paths of (`vllm/config/model.py`).
Other dotted names whose first part is neither ours nor a class of ours (`torch.cat`, `batch.staleness`) are not
checked."""

NOT_CODE = frozenset({"rollouts.commands"})
"""Dotted names rooted in a package of ours that name no code: the entry-point group through which other packages
add commands to `rollouts` (`rollouts.app.PLUGINS`)."""

NOT_MODULES = frozenset({"scoring", "sampling", "fleet"})
"""First parts that the docs use for a JSON key, not a module: `scoring.waiting` in `rollouts top --once --json`,
`sampling.top_logprobs` on the wire, `fleet.by_workers` in `bench-rl`'s report."""

FOREIGN_NAMES = frozenset(
    {
        # vLLM
        "CompletionOutput", "EngineCore", "Logprob", "ModelConfig", "NCCLWeightTransferEngine", "RequestOutput",
        "StatelessProcessGroup", "collective_rpc", "is_sleep_mode_available", "pause_generation",
        # TRL, verl, SkyRL
        "ActorRolloutRefWorker", "FullyAsyncLLMServerClient", "GlobalRequestLoadBalancer", "LLMServerClient",
        "RepeatSampler", "VLLMClient", "WeightUpdateManager", "get_per_tensor_param",
        # torch, redis-py, httpx, the standard library; PromQL; /proc/PID/status
        "PrefixStore", "ReadError", "RedisCluster", "RemoteProtocolError", "WriteError", "crc32", "state_dict",
        "rate", "VmHWM",
        # KEDA
        "ScaledObject",
    }
)  # fmt: skip
"""Names of other libraries that the docs cite bare, called or as `Class.member`, which no module of ours defines or
imports."""

INHERITED_FOREIGN = frozenset({"model_construct", "model_dump", "model_dump_json", "model_validate", "model_fields"})
"""Members that our classes get from a base of another library (pydantic's `BaseModel`)."""

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
CAMEL = re.compile(r"^_?[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*$")
"""A class-like name: `Worker`, `RolloutClient`, `VLLMClient` (not `XADD`, `ROLLOUTS_NS`, `VLLM_HTTP_TIMEOUT`)."""


@dataclass
class Module:
    names: set[str] = field(default_factory=set)
    classes: set[str] = field(default_factory=set)


@dataclass
class Class:
    members: set[str] = field(default_factory=set)
    bases: list[str] = field(default_factory=list)


@dataclass
class Index:
    modules: dict[str, Module] = field(default_factory=dict)
    classes: dict[str, list[Class]] = field(default_factory=lambda: defaultdict(list))
    functions: set[str] = field(default_factory=set)
    """Every function and method name, at any depth."""
    by_base_name: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    """A module's last part → the dotted names of the modules (and packages) that end with it."""
    files: set[str] = field(default_factory=set)
    """Every file path (relative, with `/`) of the tracked code folders."""
    tests: set[str] = field(default_factory=set)
    imported: set[str] = field(default_factory=set)
    """Names that our modules import from other libraries (`from vllm import SamplingParams`)."""

    def has_member(self, cls: str, member: str, seen: frozenset[str] = frozenset()) -> bool:
        """Whether a class of that name has `member`, its own or from a base that is a class of ours."""
        foreign_base = False
        for info in self.classes.get(cls, []):
            if member in info.members:
                return True
            for base in info.bases:
                if base in self.classes and base not in seen:
                    if self.has_member(base, member, seen | {cls}):
                        return True
                else:
                    foreign_base = True
        return foreign_base and member in INHERITED_FOREIGN


SELF_ASSIGNMENT = re.compile(r"^[ \t]*(self\.[^=\n]*?)(?<![=!<>])[-+*/%&|^@]?=(?!=)", re.MULTILINE)
"""A line that assigns to attributes of `self` (`self.x = ...`, `self.x: T = ...`, `self.a, self.b = ...`, `+=`)."""
DEF = re.compile(r"^[ \t]*(?:async[ \t]+)?def[ \t]+(\w+)", re.MULTILINE)


def _self_attributes(text: str) -> list[tuple[int, str]]:
    """(line, attribute) of each attribute that a line of `text` sets on `self`."""
    found = []
    for m in SELF_ASSIGNMENT.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        found += [(line, attr) for attr in re.findall(r"\bself\.(\w+)", m.group(1))]
    return found


def _assigned(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.Assign):
        return [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def _base_name(expr: ast.expr) -> str:
    if isinstance(expr, ast.Subscript):  # Generic[T], NamedTuple[...]
        expr = expr.value
    if isinstance(expr, ast.Attribute):
        return expr.attr
    return expr.id if isinstance(expr, ast.Name) else ""


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements of a body, with those under `if`/`try` (TYPE_CHECKING, optional imports) taken in."""
    out: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.If):
            out += _top_level(node.body) + _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            out += _top_level(node.body) + _top_level(node.orelse)
            for handler in node.handlers:
                out += _top_level(handler.body)
        else:
            out.append(node)
    return out


def _read_class(node: ast.ClassDef, index: Index, self_attributes: list[tuple[int, str]]) -> Class:
    info = Class(bases=[_base_name(b) for b in node.bases])
    end = node.end_lineno or node.lineno
    info.members.update(attr for line, attr in self_attributes if node.lineno <= line <= end)
    for item in _top_level(node.body):
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            info.members.add(item.name)
        elif isinstance(item, ast.ClassDef):
            info.members.add(item.name)
            index.classes[item.name].append(_read_class(item, index, self_attributes))
        else:
            info.members.update(_assigned(item))
    return info


def _module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def index() -> Index:
    """The index of every .py file under `PACKAGES` (the collector is off meanwhile: parsing makes many objects and
    frees none, and its passes would triple the time)."""
    gc.disable()
    try:
        return _build_index()
    finally:
        gc.enable()


def _build_index() -> Index:
    idx = Index()
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*")):
            rel = path.relative_to(ROOT)
            if "__pycache__" in rel.parts or rel.parts[:2] == ("benchmarks", "results") or not path.is_file():
                continue
            idx.files.add(rel.as_posix())
            if path.suffix != ".py":
                continue
            name = _module_name(rel)
            module = idx.modules.setdefault(name, Module())
            idx.by_base_name[name.rpartition(".")[2]].append(name)
            parent, _, child = name.rpartition(".")
            if parent:
                idx.modules.setdefault(parent, Module()).names.add(child)
            text = path.read_text()
            tree = ast.parse(text, filename=str(rel))
            defined = DEF.findall(text)
            idx.functions.update(defined)
            if rel.name.startswith("test_"):
                idx.tests.update(name for name in defined if name.startswith("test_"))
            self_attributes = _self_attributes(text)
            for node in _top_level(tree.body):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    module.names.add(node.name)
                elif isinstance(node, ast.ClassDef):
                    module.names.add(node.name)
                    module.classes.add(node.name)
                    idx.classes[node.name].append(_read_class(node, idx, self_attributes))
                elif isinstance(node, ast.Import):
                    module.names.update((a.asname or a.name).partition(".")[0] for a in node.names)
                elif isinstance(node, ast.ImportFrom):
                    module.names.update(a.asname or a.name for a in node.names)
                    if node.level == 0 and (node.module or "").partition(".")[0] not in PACKAGES:
                        idx.imported.update(a.asname or a.name for a in node.names)
                else:
                    module.names.update(_assigned(node))
    return idx


def _member_path(idx: Index, modules: list[str], rest: list[str], instance: bool) -> bool:
    """Whether `rest` names something in one of `modules`: a module-level name (then, when that is a class, its
    member), or, for an `instance` (a short form: `client.settle`), a member of a class the module defines."""
    for name in modules:
        module = idx.modules[name]
        if rest[0] in module.names:
            if len(rest) == 1 or rest[0] not in idx.classes:
                return True
            return idx.has_member(rest[0], rest[1])
    return instance and any(idx.has_member(cls, rest[0]) for name in modules for cls in idx.modules[name].classes)


def is_builtin(name: str) -> bool:
    return hasattr(builtins, name)


def missing(name: str, call: bool) -> str | None:
    """Why `name` (as cited: `a.b.c`, `Class.member`, `func`, with `call` when `()` followed it) is not in the
    code, or None when it is there, or is not ours to check."""
    idx = index()
    parts = name.split(".")
    first = parts[0]
    if name in NOT_CODE:
        return None
    if first in PACKAGES:
        for cut in range(len(parts), 0, -1):
            module = ".".join(parts[:cut])
            if module in idx.modules:
                rest = parts[cut:]
                if not rest or _member_path(idx, [module], rest, instance=False):
                    return None
                return f"`{module}` has no `{'.'.join(rest)}`"
        return "no such module"
    if len(parts) > 1:
        if first in idx.classes:
            return None if idx.has_member(first, parts[1]) else f"class `{first}` has no member `{parts[1]}`"
        if first in FOREIGN_NAMES or first in FOREIGN_FIRST or first in NOT_MODULES or first in idx.imported:
            return None
        if CAMEL.match(first):
            return f"no class `{first}` in the code (a foreign one? add it to FOREIGN_NAMES)"
        modules = idx.by_base_name.get(first)
        if modules and not _member_path(idx, modules, parts[1:], instance=True):
            return f"no `{'.'.join(parts[1:])}` in a module `{first}` ({', '.join(modules)})"
        return None
    if name in FOREIGN_NAMES or is_builtin(name) or (ROOT / name).is_file():  # Dockerfile
        return None
    if name.startswith("test_"):
        return None if name in idx.tests else "no such test"
    if call or CAMEL.match(name):
        known = name in idx.classes or name in idx.functions or any(name in m.names for m in idx.modules.values())
        return None if known else "not in the code (a foreign name? add it to FOREIGN_NAMES)"
    return None


def missing_file(path: str) -> bool:
    """Whether no file of the code folders is, or ends with, `path` (`worker.py`, `engines/base.py`); a path in
    another library (`vllm/config/model.py`) is not ours to check."""
    path = path.rstrip("/")
    if path.partition("/")[0] in FOREIGN_FIRST:
        return False
    return not any(f == path or f.endswith("/" + path) for f in index().files)
