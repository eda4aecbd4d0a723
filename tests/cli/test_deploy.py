"""`compose.yaml` and the `Dockerfile`, checked structurally (Docker is not on these machines).

The file must parse; Redis must keep an append-only file on a named volume behind a health check;
workers must reserve a GPU, restart, outwait their drain and wait for a healthy Redis; and every
service's command must be a `rollouts` command line that the real CLI parses (options, types and
required values), with its settings where the CLI reads them.
"""

from __future__ import annotations

import itertools
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from typer.main import get_command

from rollouts import app

ROOT = Path(__file__).resolve().parents[2]
UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
"""The CLI's own usage error (typer vendors click), which a wrong, mistyped or missing option raises."""


def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's `${VAR:-default}` and `${VAR}`, from `env`."""

    def one(match: re.Match[str]) -> str:
        return env.get(match.group(1)) or (match.group(3) or "")

    return re.sub(r"\$\{(\w+)(:-([^}]*))?\}", one, value)


def rollouts_services() -> dict[str, dict[str, Any]]:
    return {name: s for name, s in compose()["services"].items() if s.get("image", "").startswith("${ROLLOUTS_IMAGE")}


def parse_with_the_cli(args: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> typer.Context:
    """Parse `rollouts ARGS` as the CLI would (environment variables included), without running it."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    group = get_command(app)
    parent = group.make_context("rollouts", list(args))
    command = group.get_command(parent, args[0])  # type: ignore[attr-defined]  # typer's app is a click Group
    assert command is not None, f"rollouts has no command {args[0]!r}"
    return command.make_context(args[0], args[1:], parent=parent)


def test_redis_keeps_an_append_only_file_on_a_named_volume_behind_a_health_check() -> None:
    spec = compose()
    redis = spec["services"]["redis"]
    assert re.fullmatch(r"redis:7(\.\d+)*", redis["image"])
    command = redis["command"]
    assert command[0] == "redis-server"
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--appendfsync") + 1] == "everysec"
    volume, target = redis["volumes"][0].split(":")[:2]
    assert target == "/data" and volume in spec["volumes"], "the data lives on a named volume"
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    assert redis["restart"] == "unless-stopped"
    assert all(port.startswith("127.0.0.1:") for port in redis["ports"]), "no Redis without a password on 0.0.0.0"


def test_workers_reserve_a_gpu_restart_outwait_their_drain_and_wait_for_redis() -> None:
    worker = compose()["services"]["worker"]
    assert worker["command"][:3] == ["worker", "--engine", "vllm"]
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and device["count"] == 1
    assert interpolate(str(worker["deploy"]["replicas"]), {}) == "1"
    assert interpolate(str(worker["deploy"]["replicas"]), {"ROLLOUTS_WORKERS": "8"}) == "8"
    assert worker["restart"] == "unless-stopped"
    assert int(worker["stop_grace_period"].rstrip("s")) > 30, "longer than the worker's 30 s drain"
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
    manager = compose()["services"]["manager"]
    assert manager["command"][0] == "manager" and manager["restart"] == "unless-stopped"
    assert manager["depends_on"]["redis"]["condition"] == "service_healthy"


def test_every_service_runs_a_command_line_the_cli_accepts(monkeypatch: pytest.MonkeyPatch) -> None:
    services = rollouts_services()
    assert {"manager", "worker", "scorer", "score-worker", "exporter", "tiny-model", "submit", "top"} <= set(services)
    for name, service in services.items():
        env = {k: interpolate(str(v), {}) for k, v in service["environment"].items()}
        assert env["ROLLOUTS_REDIS"] == "redis://redis:6379/0" and env["ROLLOUTS_NS"] == "exp1", name
        args = [interpolate(arg, {}) for arg in service["command"]]
        ctx = parse_with_the_cli(args, env, monkeypatch)
        if "redis_url" in ctx.params:  # read from ROLLOUTS_REDIS / ROLLOUTS_NS, as the containers do
            assert ctx.params["redis_url"] == env["ROLLOUTS_REDIS"], name
        if "ns" in ctx.params:  # all but the RQ score-worker, which serves a queue, not a namespace
            assert ctx.params["ns"] == env["ROLLOUTS_NS"], name
        if "model" in ctx.params:
            assert str(ctx.params["model"]) == "/models/tiny", name
    assert parse_with_the_cli(["worker", "--model", "/m", "--engine", "vllm"], {}, monkeypatch).params["engine"]


def test_the_exporter_is_on_loopback_and_workers_and_the_manager_serve_metrics(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prometheus: the exporter published on 127.0.0.1 at the port it listens on; workers and the manager
    serve `--metrics-port` on the compose network (not published: worker replicas would clash)."""
    services = compose()["services"]
    exporter = parse_with_the_cli(services["exporter"]["command"], {}, monkeypatch).params
    (published,) = services["exporter"]["ports"]
    host, port, target = interpolate(published, {}).split(":")
    assert host == "127.0.0.1" and target == str(exporter["port"]) == port == "9650"
    assert interpolate(published, {"ROLLOUTS_EXPORTER_PORT": "19650"}) == "127.0.0.1:19650:9650"
    assert services["exporter"]["restart"] == "unless-stopped"
    for name in ("worker", "manager"):
        args = [interpolate(arg, {}) for arg in services[name]["command"]]
        port = parse_with_the_cli(args, {}, monkeypatch).params["metrics_port"]
        assert services[name]["expose"] == [str(port)] and "ports" not in services[name], name


def test_a_command_the_cli_refuses_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: a wrong option, a wrong type or a missing required option is refused."""
    for args in (["submit", "--ns", "exp1"], ["worker", "--model", "/m", "--max-inflight", "many"], ["top", "-x"]):
        with pytest.raises(UsageError):
            parse_with_the_cli(args, {}, monkeypatch)
    with pytest.raises(AssertionError, match="no command"):
        parse_with_the_cli(["serve"], {}, monkeypatch)


def test_the_profiles_keep_one_shot_tools_out_of_up_and_the_model_is_shared() -> None:
    services = compose()["services"]
    assert services["tiny-model"]["profiles"] == ["tiny"] and services["tiny-model"]["depends_on"] == {}
    assert services["submit"]["profiles"] == services["top"]["profiles"] == ["tools"]
    for name in ("worker", "tiny-model", "submit"):
        assert "models:/models" in services[name]["volumes"], name
    assert services["submit"]["volumes"][1].endswith(":/data/prompts.jsonl:ro")


def test_the_dockerfile_installs_this_package_and_runs_rollouts() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert dockerfile.startswith("#") and re.search(r"^FROM python:3\.1[1-9]", dockerfile, re.MULTILINE)
    copied = re.findall(r"^COPY (.+) \S+$", dockerfile, re.MULTILINE)
    for sources in copied:
        for source in sources.split():
            assert (ROOT / source).exists(), f"the Dockerfile copies {source}, which is not in the repository"
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {p.rstrip("*") for p in packages} <= {s for line in copied for s in line.split()}
    extras = re.search(r"^ARG EXTRAS=(\S+)$", dockerfile, re.MULTILINE)
    assert extras is not None
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(extras.group(1).split(",")) <= set(declared)
    assert 'ENTRYPOINT ["rollouts"]' in dockerfile
    assert "tests" in (ROOT / ".dockerignore").read_text().split()


def test_the_sentinel_override_gives_every_service_the_sentinels_and_runs_a_primary_two_replicas_and_three(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`compose.sentinel.yaml` over `compose.yaml`: three Sentinels that watch `redis` (quorum 2), two replicas of it,
    every server with the append-only file and `min-replicas-to-write 1`, and every rollouts service given a Sentinel
    URL (the replica-acked mode by default) that the CLI takes and that names those Sentinels."""
    from pipeline.durability import split_url
    from pipeline.sentinel import parse_sentinel_url

    override = yaml.safe_load((ROOT / "compose.sentinel.yaml").read_text())["services"]
    sentinels = {name for name in override if name.startswith("sentinel-")}
    assert len(sentinels) == 3
    for name in sentinels:
        script = " ".join(override[name]["command"])
        assert "sentinel monitor rollouts redis 6379 2" in script and "--sentinel" in script, name
    for name in ("redis", "redis-replica-1", "redis-replica-2"):
        args = override[name]["command"]
        setting = {args[i]: args[i + 1] for i in range(1, len(args) - 1) if args[i].startswith("--")}
        assert setting["--appendonly"] == "yes" and setting["--min-replicas-to-write"] == "1", name
        assert setting["--replica-announce-ip"] == name, name
        assert (name == "redis") == ("--replicaof" not in setting), name
    for name, service in rollouts_services().items():
        env = {k: interpolate(str(v), {}) for k, v in override[name]["environment"].items()}
        url, durability = split_url(env["ROLLOUTS_REDIS"])
        target = parse_sentinel_url(url)
        assert {host for host, _ in target.sentinels} == sentinels and target.service == "rollouts", name
        assert durability.mode == "replica", name
        ctx = parse_with_the_cli([interpolate(arg, {}) for arg in service["command"]], env, monkeypatch)
        if "redis_url" in ctx.params:
            assert ctx.params["redis_url"] == env["ROLLOUTS_REDIS"], name


def cluster_seed(url: str) -> tuple[str, int]:
    """The node that `connect(url, ns=...)` asks first where its namespace's slot is served, read as `connect` reads
    `url` (`split_url`, then redis-py's `from_url`, as `_connect_one` calls it, unconnected); `ValueError` for a URL
    that it would not follow a slot from: a Sentinel URL, a Unix socket (one node, not in `cluster.FOLLOWING`), or a
    database other than 0 (a cluster has no other)."""
    import redis

    from pipeline import cluster
    from pipeline.durability import split_url
    from pipeline.sentinel import is_sentinel_url

    plain, _ = split_url(url)
    if is_sentinel_url(plain):
        raise ValueError(f"{url}: a Sentinel URL, not a node of a cluster")
    pool = redis.Redis.from_url(plain).connection_pool
    if pool.connection_class not in cluster.FOLLOWING:
        raise ValueError(f"{url}: {pool.connection_class.__name__} cannot follow a slot")
    if pool.connection_kwargs.get("db", 0) != 0:
        raise ValueError(f"{url}: a cluster has database 0 only")
    return pool.connection_kwargs["host"], pool.connection_kwargs["port"]


def test_the_cluster_override_joins_six_nodes_into_three_primaries_with_a_replica_each_before_any_service_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`compose.cluster.yaml` over `compose.yaml`: six `redis-server`s with cluster support and the append-only file,
    each announcing its compose name and keeping nodes.conf on a volume of its own behind the health check; a one-shot
    init service that waits for all six and `redis-cli --cluster create`s them with one replica each (three primaries);
    every rollouts service that takes a Redis URL given a URL of one of those nodes that `connect` follows a slot from,
    and started once the init service has finished; the scorer inline and no score-worker (RQ's keys span slots)."""
    from pipeline.durability import split_url

    base = compose()
    spec = yaml.safe_load((ROOT / "compose.cluster.yaml").read_text())
    override = spec["services"]
    nodes = {name for name, service in override.items() if service.get("command", [""])[0] == "redis-server"}
    assert len(nodes) == 6 and "redis" in nodes, "compose.yaml's redis is a node too: the fleet waits for it"
    volumes = set()
    for name in nodes:
        service = {**base["services"].get(name, {}), **override[name]}
        args = service["command"]
        setting = {args[i]: args[i + 1] for i in range(1, len(args) - 1) if args[i].startswith("--")}
        assert setting["--cluster-enabled"] == "yes" and setting["--cluster-config-file"] == "nodes.conf", name
        assert setting["--appendonly"] == "yes" and setting["--appendfsync"] == "everysec", name
        assert setting["--cluster-announce-hostname"] == name, name
        assert setting["--cluster-preferred-endpoint-type"] == "hostname", name
        assert re.fullmatch(r"redis:7(\.\d+)*", service["image"]), "cluster-announce-hostname: Redis 7"
        (volume,) = (v.split(":")[0] for v in service["volumes"] if v.split(":")[1] == "/data")
        assert volume in {**base["volumes"], **spec["volumes"]}, name
        volumes.add(volume)
        assert service["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"], name
        assert service["restart"] == "unless-stopped", name
    assert len(volumes) == 6, "each node its own nodes.conf"

    (init,) = (name for name, service in override.items() if "--cluster create" in " ".join(service.get("command", [])))
    words = " ".join(override[init]["command"]).split()
    start = words.index("create") + 1
    assert words[start - 2] == "--cluster"
    addresses = list(itertools.takewhile(lambda word: not word.startswith("--"), words[start:]))
    assert sorted(a.rpartition(":")[0] for a in addresses) == sorted(nodes), "every node, once"
    assert {a.rpartition(":")[2] for a in addresses} == {"6379"}
    options = words[start + len(addresses) :]
    replicas = int(options[options.index("--cluster-replicas") + 1])
    assert replicas == 1 and "--cluster-yes" in options and len(addresses) // (1 + replicas) == 3, "three primaries"
    assert override[init]["image"] == "redis:7.2" and override[init]["restart"] == "no"
    assert override[init]["depends_on"] == {name: {"condition": "service_healthy"} for name in nodes}

    for name, service in rollouts_services().items():
        env = {k: interpolate(str(v), {}) for k, v in override[name]["environment"].items()}
        host, port = cluster_seed(env["ROLLOUTS_REDIS"])
        assert host in nodes and port == 6379, name
        assert split_url(env["ROLLOUTS_REDIS"])[1].mode == "default", "no durability mode on a cluster yet"
        args = [interpolate(arg, {}) for arg in override[name].get("command", service["command"])]
        ctx = parse_with_the_cli(args, env, monkeypatch)
        if "redis_url" in ctx.params:
            assert ctx.params["redis_url"] == env["ROLLOUTS_REDIS"], name
            assert override[name]["depends_on"][init] == {"condition": "service_completed_successfully"}, name
        if "ns" in ctx.params:
            assert ctx.params["ns"] == env["ROLLOUTS_NS"] == "exp1", name
        assert not ctx.params.get("rq"), f"{name}: RQ's keys span slots"
    assert override["score-worker"]["deploy"]["replicas"] == 0


def test_a_url_that_connect_would_follow_no_cluster_slot_from_is_caught() -> None:
    """The check above can fail: a mistyped scheme or durability mode, a Sentinel URL, a socket, database 1."""
    assert cluster_seed("redis://redis-node-2:6379/0") == ("redis-node-2", 6379)
    for url in (
        "redsi://redis:6379/0",
        "redis://redis:6379/0?durability=replcia",
        "redis+sentinel://redis:26379/rollouts",
        "unix:///data/redis.sock",
        "redis://redis:6379/1",
    ):
        with pytest.raises(ValueError):
            cluster_seed(url)


def test_the_keda_recipe_scales_the_workers_on_the_fleets_need_or_the_prompts_lag() -> None:
    """`keda.yaml`: a KEDA ScaledObject whose Prometheus trigger asks for `rollouts_workers_needed` replicas (the
    exporter's gauge, threshold 1) and whose Redis Streams trigger reads the lag of the workers' group on the prompts
    stream, by the names the pipeline gives them; only fields of KEDA's triggers (their docs, 2.13+)."""
    from pipeline.wire import GENERATORS, Keys

    recipe = yaml.safe_load((ROOT / "keda.yaml").read_text())
    assert (recipe["apiVersion"], recipe["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    spec = recipe["spec"]
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"] and spec["scaleTargetRef"]["name"]
    triggers = {t["type"]: t["metadata"] for t in spec["triggers"]}
    assert set(triggers) == {"prometheus", "redis-streams"}
    prometheus = triggers["prometheus"]
    assert set(prometheus) <= {"serverAddress", "query", "threshold", "activationThreshold", "namespace"}
    assert 'rollouts_workers_needed{ns="exp1"}' in prometheus["query"] and prometheus["threshold"] == "1"
    assert "rollouts_workers_needed" in exporter_names()
    streams = triggers["redis-streams"]
    known = {
        "address", "host", "port", "stream", "consumerGroup", "pendingEntriesCount", "streamLength", "lagCount",
        "activationLagCount", "databaseIndex", "enableTLS", "unsafeSsl", "usernameFromEnv", "passwordFromEnv",
    }  # fmt: skip
    assert set(streams) <= known
    assert streams["stream"] == Keys("exp1").prompts and streams["consumerGroup"] == GENERATORS
    assert int(streams["lagCount"]) >= 1 and all(isinstance(v, str) for v in streams.values())


def exporter_names() -> set[str]:
    """The metric names `pipeline.exporter.families` gives for a pipeline with work waiting and one worker."""
    from pipeline.exporter import families

    snap = {
        "ns": "exp1", "ts": 0.0, "policy": dict.fromkeys(
            ("version", "epoch", "submitted", "stale", "used", "capacity", "free", "max_staleness", "batch_size"), 0
        ) | {"paused": False},
        "streams": {"prompts": {"length": 3, "groups": {"generators": {"lag": 3, "pending": 1, "consumers": 1}}}},
        "workers": {"w": {"status": "serving", "held": "1", "room": "1"}},
    }  # fmt: skip
    return {family.name for family in families(snap)}
