"""SGLang's P/D at the API level (reference `engine-apis.md` §C.1): the bootstrap triple a
request brings, and the scheduler's words when a disaggregated request cannot run.

Sources: sgl-project/sglang python/sglang/srt/managers/scheduler.py
(`handle_generate_request`: a request without a room is aborted with 400 before it is
queued; older releases spelt it "boostrap"),
python/sglang/srt/disaggregation/decode.py (`pop_transferred`: "Decode transfer failed
...", 500), python/sglang/srt/disaggregation/prefill.py (`process_disagg_prefill_inflight_
queue`: "Prefill transfer failed ...", 500; a finished transfer ends the request with
`FINISH_LENGTH(length=0)`; `PrefillBootstrapQueue.add`: a request whose bootstrap host is
`FAKE_BOOTSTRAP_HOST` gets the fake sender, which transfers to nobody at once),
disaggregation/mooncake/conn.py (`KVTransferError`'s text).
The KV handle travels between the two mock servers through `genmesh.testkit.pd`.
"""

from __future__ import annotations

from dataclasses import dataclass

from genmesh.engines.sglang_pd import DEFAULT_BOOTSTRAP_PORT
from genmesh.testkit.sglang.request import JSON, is_int

# The prefill's reply once its KV has been transferred.
PREFILL_FINISH: JSON = {"type": "length", "length": 0}


@dataclass(frozen=True, slots=True)
class Bootstrap:
    """Where a decode finds its prefill's KV, and the room that pairs the two."""

    host: str
    port: int
    room: int


def bootstrap_of(body: JSON, index: int) -> Bootstrap | None:
    """Item `index`'s triple (`bootstrap_*` are a value, or one per item of a batch);
    None without a room."""

    def pick(name: str) -> object:
        value = body.get(name)
        if isinstance(value, list):
            return value[index] if index < len(value) else None
        return value

    room, host, port = pick("bootstrap_room"), pick("bootstrap_host"), pick("bootstrap_port")
    if not is_int(room):
        return None
    return Bootstrap(
        host=host if isinstance(host, str) else "127.0.0.1",
        port=port if is_int(port) else DEFAULT_BOOTSTRAP_PORT,
        room=room,
    )


def missing_room(rid: str) -> str:
    return f"Invalid request: Disaggregated request received without bootstrap room id. {rid=}"


def _transfer_error(room: int, reason: str) -> str:
    return f"KVTransferError(bootstrap_room={room}): {reason}"


def decode_failed(rid: str, room: int, reason: str) -> str:
    return (
        f"Decode transfer failed for request rank=0 decode_req.req.rid={rid!r} "
        f"decode_req.req.bootstrap_room={room} with exception {_transfer_error(room, reason)}"
    )


def prefill_failed(rid: str, room: int, reason: str) -> str:
    return (
        f"Prefill transfer failed for request rank=0 req.rid={rid!r} "
        f"req.bootstrap_room={room} with exception {_transfer_error(room, reason)}"
    )
