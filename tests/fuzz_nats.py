"""The NATS side of the fuzz campaigns: hostile messages on the subjects a client's role may
publish to (protocol.md §2): envelopes to the router and to a worker, cancels, pings, and
the discovery subjects, each in any codec or none."""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Any

import msgpack
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from genmesh.codecs import get_codec
from genmesh.shared.subjects import Subjects
from tests.fuzz_kit import Campaign, Hostile

STREAM_TIMEOUT_S = 5.0  # the fuzz mesh's mock is instant and its context short
PING_TIMEOUT_S = 2.0
CODECS = [None, None, None, "msgpack", "json", "b64zstd", "", "nope"]

# msgpack can hold these; bigger integers cannot be encoded at all.
_MSGPACK_INT = st.integers(-(2**63), 2**64 - 1)


def values(depth: int = 2) -> st.SearchStrategy[Any]:
    """Any msgpack value: what a hostile client in any language can encode."""
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        _MSGPACK_INT,
        st.sampled_from([0, -1, 2**31, 2**63 - 1, 2**64 - 1]),
        st.floats(),
        st.text(max_size=20),
        st.sampled_from(["", "a b", "*", ">", "x" * 5000, "\x00", "genmesh.x.router.generate"]),
        st.binary(max_size=20),
    )
    if depth == 0:
        return scalars
    inner = values(depth - 1)
    return st.one_of(
        scalars,
        st.lists(inner, max_size=4),
        st.dictionaries(st.text(max_size=10), inner, max_size=4),
    )


VALUES = values()


@dataclass
class Message:
    """One message to publish: its payload as a value (encoded by `codec`) or raw bytes."""

    hostile: Hostile
    value: Any
    raw: bytes | None
    codec: str | None

    def payload(self) -> bytes:
        if self.raw is not None:
            return self.raw
        if self.codec == "json":
            return json.dumps(self.value, default=repr).encode()
        return msgpack.packb(self.value, use_bin_type=True)  # type: ignore[no-any-return]

    def headers(self) -> dict[str, str] | None:
        return None if self.codec is None else {"genmesh-codec": self.codec}


def messages(
    valid: st.SearchStrategy[dict[str, Any]], fields: dict[str, list[str]]
) -> st.SearchStrategy[Message]:
    """A valid message with fields set to anything, any map, or any bytes; in any codec
    header (one the receiver lacks included)."""

    @st.composite
    def draw(draw_: st.DrawFn) -> Message:
        hostile = Hostile()
        codec = draw_(st.sampled_from(CODECS))
        shape = draw_(st.integers(0, 7))
        if shape == 0:
            return Message(hostile, None, draw_(st.binary(max_size=200)), codec)
        if shape == 1:
            return Message(hostile, draw_(VALUES), None, codec)
        value = draw_(valid)
        for _ in range(draw_(st.integers(0, 3))):
            where = draw_(st.sampled_from(sorted(fields)))
            target = value if where == "" else value.setdefault(where, {})
            if not isinstance(target, dict):
                continue
            key = draw_(st.one_of(st.sampled_from(fields[where]), st.text(max_size=8)))
            if draw_(st.integers(0, 4)) == 0:
                target.pop(key, None)
            else:
                target[key] = draw_(VALUES)
        return Message(hostile, value, None, codec)

    return draw()


ENVELOPE_FIELDS = {
    "": [
        "v",
        "id",
        "token_ids",
        "format",
        "model",
        "client_id",
        "sampling",
        "output",
        "routing",
        "engine",
        "continuation",
        "deadline",
        "disagg",
    ],
    "sampling": [
        "max_tokens",
        "min_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop_token_ids",
        "ignore_eos",
    ],
    "output": [
        "logprobs",
        "top_logprobs",
        "prompt_logprobs_start",
        "routed_experts_start",
        "logprob_token_ids",
    ],
    "routing": ["worker", "exclude", "dp_rank", "priority", "cache_salt", "session"],
    "engine": ["sampling_params", "lora_path", "features"],
}


def envelopes() -> st.SearchStrategy[Message]:
    """Envelopes with a fresh id each (a reused one is refused, which is right but dull)."""
    valid = st.builds(
        lambda: {
            "v": 1,
            "id": uuid.uuid4().hex,
            "token_ids": [1, 2, 3],
            "sampling": {"max_tokens": 4},
        }
    )
    return messages(valid, ENVELOPE_FIELDS)


def cancels() -> st.SearchStrategy[Message]:
    valid = st.builds(lambda: {"id": uuid.uuid4().hex, "reason": "fuzz"})
    return messages(valid, {"": ["id", "reason"]})


async def check_envelope(nc: Client, subject: str, message: Message, campaign: Campaign) -> None:
    """Every envelope, however bad, is answered: frames ending in exactly one `end` or
    `err`, then the empty terminator (protocol.md §6.8, §6.10)."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        await nc.publish(subject, message.payload(), reply=inbox, headers=message.headers())
        terminal: str | None = None
        async with asyncio.timeout(STREAM_TIMEOUT_S):
            while True:
                msg = await sub.next_msg(timeout=STREAM_TIMEOUT_S)
                if not msg.data:
                    break
                terminal = _frame_type(msg.data, msg.headers) or terminal
    except (TimeoutError, NatsTimeout):
        campaign.fail(message.hostile, "no terminator within 5 s", message.value or message.raw)
        return
    finally:
        await sub.unsubscribe()
    campaign.outcomes[f"ended {terminal}"] += 1
    if terminal not in ("end", "err"):
        campaign.fail(message.hostile, f"stream ended without end/err ({terminal})", message)


def _frame_type(data: bytes, headers: dict[str, str] | None) -> str | None:
    """The frame's type if terminal; a frame is in its request's codec, or JSON."""
    frame = get_codec((headers or {}).get("genmesh-codec")).decode(data)
    kind = frame.get("t") if isinstance(frame, dict) else None
    return kind if kind in ("end", "err") else None


async def check_ping(nc: Client, subject: str, payload: bytes, campaign: Campaign) -> None:
    """A ping, whatever its payload, is answered "" or `not running` (protocol.md §2)."""
    try:
        answer = await nc.request(subject, payload, timeout=PING_TIMEOUT_S)
    except (NatsTimeout, NoRespondersError) as exc:
        campaign.fail(Hostile(), f"ping unanswered: {type(exc).__name__}", payload[:100])
        return
    campaign.outcomes[repr(answer.data)] += 1
    if answer.data not in (b"", b"not running"):
        campaign.fail(Hostile(), "ping answered otherwise", (payload[:100], answer.data))


async def publish(nc: Client, subject: str, message: Message, campaign: Campaign) -> None:
    """Fire and forget (cancel and discovery subjects answer nothing); the mesh's health
    after the campaign is what is checked."""
    await nc.publish(subject, message.payload(), headers=message.headers())
    campaign.outcomes["sent"] += 1


def discovery_messages(
    subjects: Subjects, real_worker: str
) -> st.SearchStrategy[tuple[str, Message]]:
    """Forged worker cards, leaves and router presences: ids from a small set (so that
    cards and leaves meet), subjects that are no worker's, numbers out of range."""
    ids = st.one_of(st.sampled_from([f"fz{i}" for i in range(5)]), st.text(max_size=8), values(0))
    card = st.builds(
        lambda wid, subject: {
            "v": 1,
            "id": wid,
            "subject": subject,
            "engine": "mock",
            "inflight": 0,
            "capacity": 4,
            "heartbeat_s": 1.0,
            "formats": ["*"],
            "model": "genmesh-mock",
            "role": "both",
        },
        ids,
        st.sampled_from(
            [
                "",
                "a b",
                subjects.router_generate,
                subjects.worker_generate("fz0"),
                subjects.worker_generate(real_worker),
                subjects.cancel,
                "_INBOX.x",
            ]
        ),
    )
    presence = st.builds(lambda rid: {"id": rid, "policy": "round_robin", "heartbeat_s": 1.0}, ids)
    leave = st.builds(lambda wid: {"id": wid}, ids)
    card_fields = {
        "": [
            "id",
            "subject",
            "inflight",
            "capacity",
            "heartbeat_s",
            "formats",
            "model",
            "role",
            "disagg",
            "queued",
            "kv_blocks_used",
            "kv_blocks_total",
            "engine_info",
            "max_model_len",
        ]
    }

    others = {"": ["id", "heartbeat_s", "leaving", "policy", "draining"]}
    by_subject = {
        subjects.announce: messages(card, card_fields),
        subjects.leave: messages(leave, others),
        subjects.router_presence: messages(presence, others),
        subjects.query: messages(st.builds(dict), others),
    }
    return st.one_of(
        *(strategy.map(lambda m, s=subject: (s, m)) for subject, strategy in by_subject.items())
    )
