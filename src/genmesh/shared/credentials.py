"""How a genmesh process proves who it is to NATS, where its replies arrive, and how it
checks the server: credentials and TLS (docs/deploy.md, "Credentials").

Declared once, as the `auth` group of every role's config (`--nats-user`, ...,
`GENMESH_NATS_*`); `genmesh.shared.bus.connect` turns them into nats-py's options. This
module imports no NATS client, so that a command's --help stays quick.
"""

from __future__ import annotations

import re
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from genmesh.shared.settings import group, option, to_env


class NatsAuthError(ValueError):
    """Credentials or TLS settings that cannot be used (a missing file, a bad seed, ...)."""


# An nkey user seed: 'S' (seed) + 'U' (user), base32, 58 characters in all.
_USER_SEED = re.compile(r"^SU[A-Z2-7]{56}$")


def _read_secret(path: str, what: str) -> str:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise NatsAuthError(f"cannot read the {what} file {path}: {exc.strerror or exc}") from exc
    secret = text.strip()  # a trailing newline is no part of a secret
    if not secret:
        raise NatsAuthError(f"the {what} file {path} is empty")
    return secret


@dataclass(frozen=True, slots=True)
class NatsAuth:
    """How a service proves who it is to NATS, where its replies arrive, and how it checks
    the server (TLS).

    Every field is optional; the server decides which it needs. `password_file` and
    `token_file` are read when the connection is made (a secret mounted as a file never
    has to be in the environment); `nkey_seed` is a seed file, or the seed itself
    (`SU...`); `creds` is a JWT credentials file (operator mode). `inbox_prefix` replaces
    the role's own (`_INBOX_client`, ...): a secured mesh lets each user subscribe under
    its own prefix only, so that no one reads another's replies.
    """

    user: str | None = option(None, flag="--nats-user", help="NATS user name")
    password: str | None = option(
        None,
        flag="--nats-password",
        secret=True,
        help="NATS password (prefer --nats-password-file)",
    )
    password_file: str | None = option(
        None, flag="--nats-password-file", help="file holding the NATS password"
    )
    token: str | None = option(
        None, flag="--nats-token", secret=True, help="NATS token (prefer --nats-token-file)"
    )
    token_file: str | None = option(
        None, flag="--nats-token-file", help="file holding the NATS token"
    )
    nkey_seed: str | None = option(
        None,
        flag="--nats-nkey-seed",
        secret=True,
        help="nkey user seed file (or the seed itself, SU...)",
    )
    creds: str | None = option(
        None, flag="--nats-creds", help="NATS JWT credentials file (operator mode)"
    )
    tls_ca: str | None = option(
        None, flag="--nats-tls-ca", help="CA certificate(s) to verify the NATS server with"
    )
    tls_cert: str | None = option(
        None, flag="--nats-tls-cert", help="client certificate for NATS (mutual TLS)"
    )
    tls_key: str | None = option(None, flag="--nats-tls-key", help="private key of --nats-tls-cert")
    tls_handshake_first: bool = option(
        False,
        flag="--nats-tls-handshake-first",
        help="start TLS before the NATS greeting (server tls { handshake_first: true })",
    )
    inbox_prefix: str | None = option(
        None,
        flag="--nats-inbox-prefix",
        help="subject prefix of this connection's reply inboxes, where the NATS user may "
        "subscribe (default: the role's, e.g. _INBOX_client; see docs/deploy.md)",
    )

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca or self.tls_cert or self.tls_handshake_first)

    def check(self) -> None:
        """Refuse contradictory settings before connecting (one line each)."""
        if self.password and self.password_file:
            raise NatsAuthError("give --nats-password or --nats-password-file, not both")
        if self.token and self.token_file:
            raise NatsAuthError("give --nats-token or --nats-token-file, not both")
        if (self.password or self.password_file) and not self.user:
            raise NatsAuthError("a NATS password needs --nats-user")
        ways = [
            bool(self.user),
            bool(self.token or self.token_file),
            bool(self.nkey_seed),
            bool(self.creds),
        ]
        if sum(ways) > 1:
            raise NatsAuthError(
                "give one way to authenticate to NATS: a user and password, a token, "
                "an nkey seed or a creds file"
            )
        if bool(self.tls_cert) != bool(self.tls_key):
            raise NatsAuthError("--nats-tls-cert and --nats-tls-key go together")
        if self.inbox_prefix is not None and not _SUBJECT.fullmatch(self.inbox_prefix):
            raise NatsAuthError(
                f"--nats-inbox-prefix {self.inbox_prefix!r} is not a NATS subject "
                "(dot-separated tokens, no wildcards or spaces)"
            )

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for `nats.connect`."""
        self.check()
        options: dict[str, Any] = {}
        if self.user:
            options["user"] = self.user
            password = self.password
            if self.password_file:
                password = _read_secret(self.password_file, "NATS password")
            if password:
                options["password"] = password
        if self.token or self.token_file:
            token = self.token or _read_secret(str(self.token_file), "NATS token")
            options["token"] = token
        if self.nkey_seed:
            if _USER_SEED.match(self.nkey_seed.strip()):
                options["nkeys_seed_str"] = self.nkey_seed.strip()
            else:
                seed = _read_secret(self.nkey_seed, "nkey seed")
                if not _USER_SEED.match(seed):
                    raise NatsAuthError(f"{self.nkey_seed} does not hold an nkey user seed (SU...)")
                options["nkeys_seed_str"] = seed
        if self.creds:
            if not Path(self.creds).is_file():
                raise NatsAuthError(f"the NATS creds file {self.creds} does not exist")
            options["user_credentials"] = self.creds
        if self.tls:
            options["tls"] = self.ssl_context()
            if self.tls_handshake_first:
                options["tls_handshake_first"] = True
        return options

    def ssl_context(self) -> ssl.SSLContext:
        try:
            context = ssl.create_default_context(cafile=self.tls_ca or None)
            if self.tls_cert:
                context.load_cert_chain(self.tls_cert, self.tls_key)
        except (OSError, ssl.SSLError) as exc:
            raise NatsAuthError(f"cannot load the NATS TLS files: {exc}") from exc
        return context

    def to_env(self) -> dict[str, str]:
        """The GENMESH_NATS_* variables that give a child process these settings (secrets
        travel in its environment, never on its command line)."""
        return to_env(self)


NO_AUTH = NatsAuth()
_SUBJECT = re.compile(r"[^.*>\s]+(\.[^.*>\s]+)*")


def nats_auth_group() -> Any:
    """The `auth` field of every role's config: these options, under their own title."""
    return group(
        NO_AUTH,
        title="NATS credentials and TLS",
        description="Give one way to authenticate: a user and password, a token, an nkey "
        "seed or a creds file. Secrets are best given as files (--nats-password-file, ...).",
    )
