"""Who may do what (issue 12 item 5): ACL roles on a real Redis 7, TLS with a test CA, passwords kept out of sight."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from pipeline.codec import for_redis
from pipeline.local import RedisServer, TlsFiles
from pipeline.processes import start_worker, stop_process, wait_for_worker
from pipeline.wire import Keys, Rollout
from producers.client import RolloutClient
from tests.fixtures import FAST

SECRETS = {"worker": "w-s3cret-1", "trainer": "t-s3cret-2", "inspector": "i-s3cret-3"}


def rollouts(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollouts", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "400", **(env or {})},
    )


def with_user(url: str, user: str, password: str) -> str:
    return url.replace("://", f"://{user}:{password}@", 1)


@pytest.fixture
def users(installed_redis: RedisServer, ns: str) -> Iterator[dict[str, str]]:
    """A worker, a trainer and an inspector of `ns`, made with `rollouts acl --apply` as a person would."""
    names = {role: f"{role}-{ns}" for role in SECRETS}
    for role, name in names.items():
        made = rollouts(
            "acl", "--role", role, "--user", name, "--ns", ns, "--apply", "--redis", installed_redis.url,
            env={"ROLLOUTS_ACL_PASSWORD": SECRETS[role]},
        )  # fmt: skip
        assert made.returncode == 0, made.stderr
        assert SECRETS[role] not in made.stdout + made.stderr
    yield {role: with_user(installed_redis.url, name, SECRETS[role]) for role, name in names.items()}
    admin = redis.Redis.from_url(installed_redis.url)
    admin.execute_command("ACL", "DELUSER", *names.values())
    admin.close()


def test_each_role_gets_its_namespace_and_what_it_needs_there_only(users: dict[str, str], ns: str) -> None:
    keys, other = Keys(ns), Keys(f"other-{ns}")
    worker = redis.Redis.from_url(users["worker"])
    worker.hget(keys.state, "version")  # reads the policy state (the adapters' too)...
    worker.hget(keys.state_of("a"), "version")
    worker.smembers(keys.adapters)
    worker.xrevrange(keys.bell(0), count=1)  # and its doorbell...
    for forbidden in (
        lambda: worker.hset(keys.state, "version", 99),  # ...but cannot move it,
        lambda: worker.hset(keys.state_of("a"), "version", 99),  # nor an adapter's,
        lambda: worker.xadd(keys.control, {"cmd": "resume"}),  # nor command the workers,
        lambda: worker.xadd(keys.bell(0), {"cmd": "resume"}),  # nor ring them,
        lambda: worker.set(keys.weights_manifest(1), b"{}"),  # nor replace weights,
        lambda: worker.xrange(other.prompts),  # nor see another namespace,
        lambda: worker.config_get("*"),  # nor administer the server.
        lambda: worker.flushall(),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            forbidden()
    worker.xadd(keys.dead, {"v": "1", "error": "a worker may write dead letters"})
    worker.incr(keys.alone(keys.prompts, b"1-0"))  # and count an entry's runs alone
    trainer = redis.Redis.from_url(users["trainer"])
    trainer.hset(keys.state, "max_staleness", 2)
    with pytest.raises(redis.exceptions.NoPermissionError):
        trainer.xrange(other.rollouts)
    inspector = redis.Redis.from_url(users["inspector"])
    assert inspector.xlen(keys.dead) == 1 and inspector.hget(keys.state, "max_staleness") == b"2"
    for forbidden in (
        lambda: inspector.xadd(keys.prompts, {"v": "1"}),
        lambda: inspector.delete(keys.dead),
        lambda: inspector.xlen(other.dead),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            forbidden()
    for client in (worker, trainer, inspector):
        client.close()


def test_a_pipeline_runs_on_its_roles_credentials_and_no_password_shows(
    users: dict[str, str], ns: str, tiny_model_dir: Path, tiny_model_dir_v1: Path, tmp_path: Path
) -> None:
    """A worker on worker credentials serves and loads published weights; the trainer submits, receives and
    publishes on its own; `top` runs as the inspector. No password in the logs, heartbeats, `top` or errors."""
    log = tmp_path / "worker.log"
    worker = start_worker(users["worker"], ns, tiny_model_dir, "acl-w", *FAST, log_file=log)
    try:
        trainer = RolloutClient(users["trainer"], ns)
        wait_for_worker(trainer.streams.redis, ns, "acl-w", worker, timeout_s=120)
        ids = [trainer.submit(tokens=[5, 6, 7], n=2, max_tokens=8, seed=k) for k in range(3)]
        assert sorted(g.prompt_id for g in trainer.collect(3, timeout=60)) == sorted(ids)
        assert trainer.publish_weights(tiny_model_dir_v1, transport="redis://", ack_timeout_s=60) == 1
        assert not trainer.last_sync.evicted  # type: ignore[union-attr]  # publish_weights set it
        later = trainer.submit(tokens=[8, 9], n=1, max_tokens=4)
        [group] = trainer.collect(1, timeout=60)
        assert group.prompt_id == later and group.rollouts[0].version == 1
        top = rollouts("top", "--once", "--json", "--redis", users["inspector"], "--ns", ns)
        assert top.returncode == 0, top.stderr
        assert json.loads(top.stdout)["workers"]["acl-w"]["version"] == "1"
        heartbeat = trainer.streams.redis.hgetall(Keys(ns).worker("acl-w"))
    finally:
        stop_process(worker)
    wrong = rollouts("top", "--once", "--redis", "redis://x:n0t-the-pass@" + users["trainer"].split("@")[1])
    assert wrong.returncode == 2 and "refused the credentials" in wrong.stderr, wrong.stderr
    assert "n0t-the-pass" not in wrong.stdout + wrong.stderr and "x:***@" in wrong.stderr
    seen = log.read_text() + top.stdout + top.stderr + wrong.stderr + repr(heartbeat)
    for secret in SECRETS.values():
        assert secret not in seen


def make_ca(folder: Path) -> TlsFiles:
    """A test CA and a server certificate it signed for 127.0.0.1 (EC P-256, valid for a day)."""
    now = datetime.datetime.now(datetime.UTC)

    def certificate(
        subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, signer: ec.EllipticCurvePrivateKey, ca: bool
    ):
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            names = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rollouts test CA")])
    ca_cert = certificate("rollouts test CA", ca_key, ca_name, ca_key, ca=True)
    server_cert = certificate("127.0.0.1", server_key, ca_name, ca_key, ca=False)
    files = TlsFiles(folder / "server.pem", folder / "server.key", folder / "ca.pem")
    files.cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    files.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(
        server_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return files


def test_tls_with_rediss_urls_and_a_test_ca(
    installed_redis: RedisServer, ns: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Workers, the trainer and the CLI speak TLS to a TLS-only server; a plain or unverified client is refused."""
    tls = make_ca(tmp_path)
    with RedisServer(binary=installed_redis.binary, tls=tls) as server:
        assert server.url.startswith("rediss://")
        log = tmp_path / "worker.log"
        worker = start_worker(server.url, ns, tiny_model_dir, "tls-w", *FAST, log_file=log)
        try:
            trainer = RolloutClient(server.url, ns)
            wait_for_worker(trainer.streams.redis, ns, "tls-w", worker, timeout_s=120)
            pid = trainer.submit(tokens=[4, 5, 6], n=2, max_tokens=6)
            [group] = trainer.collect(1, timeout=60)
            assert group.prompt_id == pid and len(group.rollouts) == 2
            top = rollouts("top", "--once", "--json", "--redis", server.url, "--ns", ns)
            assert top.returncode == 0 and "tls-w" in json.loads(top.stdout)["workers"], top.stderr
        finally:
            stop_process(worker)
        plain = rollouts("top", "--once", "--redis", f"redis://127.0.0.1:{server.port}/0", "--ns", ns)
        assert plain.returncode == 2 and "cannot reach Redis" in plain.stderr
        (tmp_path / "other").mkdir()
        other_ca = make_ca(tmp_path / "other")
        unverified = f"rediss://127.0.0.1:{server.port}/0?ssl_ca_certs={other_ca.ca}"
        refused = rollouts("top", "--once", "--redis", unverified, "--ns", ns)
        assert refused.returncode == 2 and "certificate verify failed" in refused.stderr.lower(), refused.stderr


def test_the_scorer_role_runs_the_scoring_stage_and_rq_workers(installed_redis: RedisServer, ns: str) -> None:
    """RQ keeps its queues, jobs and workers under `rq:*` and tells workers what to do on `rq:pubsub:*`."""
    made = rollouts(
        "acl", "--role", "scorer", "--user", f"scorer-{ns}", "--ns", ns, "--apply", "--redis", installed_redis.url,
        env={"ROLLOUTS_ACL_PASSWORD": "sc-pw"},
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    url = with_user(installed_redis.url, f"scorer-{ns}", "sc-pw")
    trainer = RolloutClient(installed_redis.url, ns)
    trainer.streams.scoring.ensure_scoring_group()
    scored = Rollout(
        prompt_id="p", sample=0, n=1, version=0, version_end=0, finish_reason="stop", worker="w", prompt_tokens=[1],
        tokens=[2, 3], logprobs=[-1.0, -1.0], spans=[(0, 0, 2)], reward_fn="tests.rewards:even_share",
    )  # fmt: skip
    trainer.streams.redis.xadd(trainer.streams.keys.scoring, for_redis(scored.to_fields()))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    stage = [
        subprocess.Popen([sys.executable, "-m", "rollouts", *args], env=env, stdout=subprocess.DEVNULL)
        for args in (["score-worker", "--redis", url], ["scorer", "--rq", "--redis", url, "--ns", ns])
    ]
    try:
        [group] = trainer.collect(1, timeout=60)
        assert group.reward_error is None and group.rewards == [0.5]
    finally:
        for proc in stage:
            stop_process(proc)
    admin = redis.Redis.from_url(installed_redis.url)
    admin.execute_command("ACL", "DELUSER", f"scorer-{ns}")
    admin.close()
