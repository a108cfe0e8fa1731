"""SGLang's prefill/decode pairing as the `sglang` adapter speaks it (engine-apis.md §C.1,
C.2; docs/disaggregation.md, "SGLang"): the prefill server's bootstrap address (a worker
option), the ticket both halves share, and the halves' routed-expert rows.

A module of its own without aiohttp, so that `genmesh worker --help` can read the options.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from genmesh.shared.errors import ErrorCode, MeshError
from genmesh.shared.settings import option, positive_int

# ServerArgs.disaggregation_bootstrap_port's default.
DEFAULT_BOOTSTRAP_PORT = 8998
# sglang/srt/disaggregation/utils.py FAKE_BOOTSTRAP_HOST: a prefill server given this host
# "transfers" the KV to nobody at once (prefill.py, PrefillBootstrapQueue.add picks the fake
# sender; SGLang's own warm-up uses it). A prefill with nothing to decode sends it, so that
# no KV waits for a decode server that will never come.
FAKE_BOOTSTRAP_HOST = "2.2.2.2"
BOOTSTRAP_KEYS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


@dataclass(frozen=True, slots=True)
class BootstrapConfig:
    """Where an SGLang prefill server's bootstrap server listens: what its decode servers
    are told (the worker card's `disagg`)."""

    host: str | None = option(
        None,
        flag="--engine-bootstrap-host",
        help="P/D, SGLang prefill: the host decode servers reach its bootstrap server on; "
        "unset: the --engine-url's host",
    )
    port: int | None = option(
        None,
        flag="--engine-bootstrap-port",
        parse=positive_int,
        help="P/D, SGLang prefill: its --disaggregation-bootstrap-port; unset: the port its "
        f"/server_info reports, else SGLang's default {DEFAULT_BOOTSTRAP_PORT}",
    )

    def address(self, engine_url: str, server_info: dict[str, Any]) -> tuple[str, int]:
        """The bootstrap server's host and port, for the prefill server at `engine_url`."""
        host = self.host or urlsplit(engine_url).hostname or "127.0.0.1"
        reported = server_info.get("disaggregation_bootstrap_port")
        if self.port is not None:
            return host, self.port
        if isinstance(reported, int) and not isinstance(reported, bool) and reported > 0:
            return host, reported
        return host, DEFAULT_BOOTSTRAP_PORT


def new_ticket(prefill: dict[str, Any]) -> dict[str, Any]:
    """The bootstrap triple for one generation paired with the prefill worker whose card's
    `disagg` is `prefill`: its bootstrap address and a fresh random room in [0, 2^63), as
    sgl-model-gateway does (src/routers/http/pd_router.rs `inject_bootstrap_into_value`, one
    room per item of a batch; pd_types.rs `generate_room_id`: `rand & i64::MAX`). genmesh
    sends every item of a batch or `n > 1` as its own envelope, so each gets its own."""
    host, port = prefill.get("bootstrap_host"), prefill.get("bootstrap_port")
    if not isinstance(host, str) or not isinstance(port, int):
        raise MeshError(
            ErrorCode.UNAVAILABLE,
            f"the prefill worker's card gives no SGLang bootstrap address: {prefill}",
        )
    return {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": secrets.randbits(63)}


def bootstrap_fields(ticket: dict[str, Any], *, nothing_to_decode: bool) -> dict[str, Any]:
    """The fields both halves' bodies get from `ticket`; a prefill with nothing to decode
    names the fake host, so that the prefill server does not wait for a decode."""
    fields = {key: ticket.get(key) for key in BOOTSTRAP_KEYS}
    if nothing_to_decode:
        fields["bootstrap_host"] = FAKE_BOOTSTRAP_HOST
    return fields


def expert_rows(values: list[int] | None, total: int, keep: int) -> list[list[int]] | None:
    """The last `keep` of the `total` routed-expert rows in SGLang's flat blob `values`,
    or None when the blob is invalid (None) or does not hold `total` rows of one width.

    SGLang's blob covers positions [routed_experts_start_len, seqlen - 1) with no header,
    so its row width (layers x top-k) is only known from how many rows it must hold."""
    if values is None or total < 0:
        return None
    if total == 0:
        return [] if not values else None
    width, rest = divmod(len(values), total)
    if rest or not width:
        return None
    return [values[i : i + width] for i in range((total - keep) * width, len(values), width)]
