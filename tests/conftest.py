"""Shared fixtures: a real redis-server per test session on a free port, fakeredis, the tiny model."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import fakeredis
import pytest
import redis

from pipeline.local import RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One real redis-server for the session (CI installs it; a missing one is an error, not a skip)."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def real_redis(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture
def ns() -> str:
    """A fresh namespace per test, so tests sharing one server never see each other's keys."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture(params=["fakeredis", "redis-server"])
def any_redis(request: pytest.FixtureRequest) -> Iterator[redis.Redis]:
    """The stream layer's unit tests run on both fakeredis and the real server."""
    if request.param == "fakeredis":
        client = fakeredis.FakeRedis()
        yield client
        client.close()
    else:
        yield request.getfixturevalue("real_redis")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny local model, weights seed 0 (policy version 0 in the tests)."""
    from consumers.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-v0"), seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir_v1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture and tokenizer, other weights (seed 1): a second policy version."""
    from consumers.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-v1"), seed=1)
