"""NATS credentials and TLS settings: options, files, checks, and how they travel."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from genmesh.cli import parse_command
from genmesh.deploy import make_nkey
from genmesh.shared.bus import redact, server_list
from genmesh.shared.credentials import NatsAuth, NatsAuthError

pytestmark = pytest.mark.unit


def test_the_cli_options_and_their_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GENMESH_NATS_USER", "worker")
    monkeypatch.setenv("GENMESH_NATS_PASSWORD_FILE", "/run/secrets/worker")
    monkeypatch.setenv("GENMESH_NATS_TLS_HANDSHAKE_FIRST", "true")
    monkeypatch.setenv("GENMESH_NATS_INBOX_PREFIX", "_INBOX_w")
    _, config = parse_command(["worker", "--nats-tls-ca", "ca.pem"])
    auth = config.auth
    assert auth == NatsAuth(
        user="worker",
        password_file="/run/secrets/worker",
        tls_ca="ca.pem",
        tls_handshake_first=True,
        inbox_prefix="_INBOX_w",
    )
    assert NatsAuth(inbox_prefix="_INBOX_client2.app-1").connect_options() == {}
    # to_env is what `genmesh up` gives its children: the same settings again.
    for key, value in auth.to_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("GENMESH_NATS_TLS_HANDSHAKE_FIRST")
    monkeypatch.setenv(
        "GENMESH_NATS_TLS_HANDSHAKE_FIRST", auth.to_env()["GENMESH_NATS_TLS_HANDSHAKE_FIRST"]
    )
    again = parse_command(["router"])[1].auth
    assert again == auth


@pytest.mark.parametrize("command", ["frontend", "router", "worker", "up", "request"])
def test_every_networked_command_takes_credentials(command: str) -> None:
    _, config = parse_command([command, "--nats-user", "u", "--nats-password", "p"])
    assert (config.auth.user, config.auth.password) == ("u", "p")


@pytest.mark.process
def test_help_never_shows_a_secret() -> None:
    env = {"GENMESH_NATS_PASSWORD": "hunter2-secret", "GENMESH_NATS_TOKEN": "tok-secret",
           "PATH": "/usr/bin:/bin"}  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "genmesh", "router", "--help"],
        capture_output=True, text=True, env=env, timeout=30,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "hunter2-secret" not in out.stdout
    assert "tok-secret" not in out.stdout
    assert "GENMESH_NATS_PASSWORD; set]" in out.stdout


def test_secret_files_are_read_and_stripped(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("s3cret\n")
    (tmp_path / "token").write_text("tok\n")
    assert NatsAuth(user="u", password_file=str(tmp_path / "pw")).connect_options() == {
        "user": "u",
        "password": "s3cret",
    }
    assert NatsAuth(token_file=str(tmp_path / "token")).connect_options() == {"token": "tok"}
    with pytest.raises(NatsAuthError, match="cannot read the NATS password file"):
        NatsAuth(user="u", password_file=str(tmp_path / "missing")).connect_options()
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(NatsAuthError, match="is empty"):
        NatsAuth(token_file=str(tmp_path / "empty")).connect_options()


def test_an_nkey_seed_is_a_file_or_the_seed_itself(tmp_path: Path) -> None:
    seed, _public = make_nkey()
    assert NatsAuth(nkey_seed=seed).connect_options() == {"nkeys_seed_str": seed}
    (tmp_path / "u.nk").write_text(seed + "\n")
    assert NatsAuth(nkey_seed=str(tmp_path / "u.nk")).connect_options() == {"nkeys_seed_str": seed}
    (tmp_path / "bad.nk").write_text("not a seed")
    with pytest.raises(NatsAuthError, match="does not hold an nkey user seed"):
        NatsAuth(nkey_seed=str(tmp_path / "bad.nk")).connect_options()


def test_contradictions_are_refused_before_connecting(tmp_path: Path) -> None:
    cases = [
        (NatsAuth(password="p"), "needs --nats-user"),
        (NatsAuth(user="u", password="p", password_file="f"), "not both"),
        (NatsAuth(token="t", token_file="f"), "not both"),
        (NatsAuth(user="u", token="t"), "one way to authenticate"),
        (NatsAuth(nkey_seed="x", creds="y"), "one way to authenticate"),
        (NatsAuth(tls_cert="c.pem"), "go together"),
        (NatsAuth(creds=str(tmp_path / "none.creds")), "does not exist"),
        (NatsAuth(tls_ca=str(tmp_path / "none.pem")), "cannot load the NATS TLS files"),
        (NatsAuth(inbox_prefix="_INBOX_a.>"), "is not a NATS subject"),
        (NatsAuth(inbox_prefix="_INBOX a"), "is not a NATS subject"),
        (NatsAuth(inbox_prefix="_INBOX_a."), "is not a NATS subject"),
        (NatsAuth(inbox_prefix=""), "is not a NATS subject"),
    ]
    for auth, message in cases:
        with pytest.raises(NatsAuthError, match=message):
            auth.connect_options()


def test_a_creds_file_goes_to_nats_py(tmp_path: Path) -> None:
    creds = tmp_path / "user.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\n...\n")
    assert NatsAuth(creds=str(creds)).connect_options() == {"user_credentials": str(creds)}


def test_server_lists_and_redaction() -> None:
    assert server_list("nats://a:4222, nats://b:4222,") == ["nats://a:4222", "nats://b:4222"]
    with pytest.raises(ValueError, match="no NATS server"):
        server_list(" , ")
    assert redact("nats://u:pw@a:4222,nats://tok@b:4222") == "nats://***@a:4222,nats://***@b:4222"
    assert redact("nats://a:4222") == "nats://a:4222"
