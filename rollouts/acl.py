"""`rollouts acl`: a Redis user for one role on one namespace (see `pipeline.acl`)."""

from __future__ import annotations

import os
import shlex
from typing import Annotated

import typer

from pipeline.acl import ROLES, acl_rules
from pipeline.connections import connect, server_version
from pipeline.sentinel import every_server, is_sentinel_url
from rollouts.app import DEFAULT_NS, DEFAULT_REDIS, NsOpt, RedisOpt, app, console, fail, user_errors


@app.command()
def acl(
    role: Annotated[str, typer.Option(help=f"One of {', '.join(ROLES)}.")],
    user: Annotated[str, typer.Option(help="The Redis user name to create or reset.")],
    ns: NsOpt = DEFAULT_NS,
    password_env: Annotated[
        str, typer.Option(help="Environment variable that holds the user's password (never on the command line).")
    ] = "ROLLOUTS_ACL_PASSWORD",
    apply: Annotated[bool, typer.Option(help="Run ACL SETUSER on --redis (an admin URL); default: print it.")] = False,
    redis_url: RedisOpt = DEFAULT_REDIS,
) -> None:
    """Print (or apply) the `ACL SETUSER` that gives USER the rights of ROLE on namespace NS, and nothing else.

    The password is stored as its SHA-256 hash, so the printed line carries no secret."""
    password = os.environ.get(password_env, "")
    if not password:
        fail(f"set the user's password in the environment variable {password_env} (or name another: --password-env)")
    if not user or any(c.isspace() for c in user):
        fail(f"--user {user!r} must be a non-empty name without spaces")
    redis_7 = True
    if apply:
        with user_errors(redis_url):
            client = connect(redis_url)
            version = server_version(client)
            redis_7 = version is None or version >= (7, 0, 0)
    try:
        rules = acl_rules(ns, role, password, redis_7=redis_7)
    except ValueError as exc:
        fail(str(exc))
    if not apply:
        print(shlex.join(["ACL", "SETUSER", user, *rules]))
        return
    with user_errors(redis_url):
        # ACL users are each server's own (no replica copies them): behind Sentinel, every server gets the user, so
        # that a replica promoted by a failover lets the role in too.
        servers = every_server(redis_url) if is_sentinel_url(redis_url) else [client]
        for server in servers:
            server.execute_command("ACL", "SETUSER", user, *rules)
    where = f" on the {len(servers)} servers the Sentinels know" if is_sentinel_url(redis_url) else ""
    console.print(f"user {user!r} now has the {role} role on namespace {ns!r}{where}")
