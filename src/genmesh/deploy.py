"""Secrets for a secured mesh (docs/deploy.md): random passwords and nkeys per user.

    python -m genmesh.deploy env [--cluster]   an .env file for deploy/compose.yaml (stdout)
    python -m genmesh.deploy nkeys --dir DIR   one nkey seed per user in DIR/<user>.nk, and
                                               the public keys, as NATS_<USER>_NKEY=U...
                                               lines for mesh-nkeys.conf (stdout)

Needs nothing but Python and genmesh's dependencies (nkeys comes with nats-py[nkeys]); no
Go tooling (nk, nsc).
"""

from __future__ import annotations

import argparse
import os
import secrets
import string
import sys
from collections.abc import Sequence
from pathlib import Path

# The NATS users of a secured mesh (deploy/nats/permissions.conf): one per service role,
# and one per client application, each reading its replies under its own inbox prefix.
# `decode`: decode workers (--role decode), which send prefill stages to other workers.
USERS = ("frontend", "router", "worker", "decode", "client", "client2", "admin")


_LETTERS = string.ascii_letters
_ALNUM = string.ascii_letters + string.digits


def new_password(length: int = 32) -> str:
    """Letters and digits, a letter first: nats-server parses a substituted variable like
    config text, so `123` would become a number and `a b` two tokens."""
    return secrets.choice(_LETTERS) + "".join(secrets.choice(_ALNUM) for _ in range(length - 1))


def make_env(*, cluster: bool = False) -> str:
    """Lines for deploy/.env: a random password per user (and the route password)."""
    lines = ["# genmesh compose secrets (python -m genmesh.deploy env); keep this file private"]
    lines += [f"NATS_{user.upper()}_PASSWORD={new_password()}" for user in USERS]
    lines.append(f"NATS_CLUSTER_PASSWORD={new_password()}")
    if cluster:
        lines += [
            "# the 3-node cluster profile: node 1 runs cluster.conf, services use all three",
            "COMPOSE_PROFILES=cluster",
            "NATS_CONF=cluster.conf",
            "GENMESH_NATS_URL=nats://nats:4222,nats://nats-2:4222,nats://nats-3:4222",
        ]
    return "\n".join(lines) + "\n"


def make_nkey() -> tuple[str, str]:
    """A new nkey user: (seed, public key)."""
    import nkeys

    seed: bytes = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    pair = nkeys.from_seed(bytearray(seed))
    public: bytes = pair.public_key
    return seed.decode(), public.decode()


def write_nkeys(directory: Path, users: Sequence[str] = USERS) -> dict[str, str]:
    """A seed file `<user>.nk` (mode 0600) per user; returns each user's public key."""
    directory.mkdir(parents=True, exist_ok=True)
    public: dict[str, str] = {}
    for user in users:
        seed, key = make_nkey()
        path = directory / f"{user}.nk"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(seed + "\n")
        public[user] = key
    return public


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m genmesh.deploy",
        description="Make secrets for a secured genmesh mesh (see docs/deploy.md).",
    )
    actions = parser.add_subparsers(dest="action", required=True)
    env = actions.add_parser("env", help="print an .env file with a random password per user")
    env.add_argument("--cluster", action="store_true", help="also switch on the cluster profile")
    keys = actions.add_parser("nkeys", help="make an nkey seed per user; print the public keys")
    keys.add_argument("--dir", required=True, type=Path, help="where the seed files go")
    keys.add_argument(
        "--user", action="append", choices=USERS, help="only these users (default: all)"
    )
    args = parser.parse_args(argv)
    if args.action == "env":
        sys.stdout.write(make_env(cluster=args.cluster))
        return 0
    public = write_nkeys(args.dir, args.user or USERS)
    print(f"# seeds in {args.dir}/<user>.nk (keep them private); public keys for the server:")
    for user, key in public.items():
        print(f"NATS_{user.upper()}_NKEY={key}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
