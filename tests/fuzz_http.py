"""The HTTP side of the fuzz campaigns: hostile requests to both generate formats over a
raw socket (so that anything a client can put on the wire gets there: odd methods, header
bytes, bodies that are not JSON), and the check of each answer."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from tests.fuzz_kit import JSON_VALUES, TEXT, Campaign, Hostile, hazards, mutated, to_json
from tests.http_util import raw_exchange

# Statuses a client may get that are documented (protocol.md §7, §9.5): 503 not ready,
# overloaded, unavailable or no worker; 504 past X-Request-Timeout. Any other 5xx is a bug.
DOCUMENTED_5XX = {503, 504}
ANSWER_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Format:
    name: str
    path: str
    valid: dict[str, Any]
    fields: dict[str, list[str]]  # known keys per sub-map ("" = top level)
    client_id_field: str


SGLANG = Format(
    "sglang",
    "/generate",
    {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 16}},
    {
        "": [
            "input_ids",
            "sampling_params",
            "rid",
            "stream",
            "return_logprob",
            "logprob_start_len",
            "top_logprobs_num",
            "token_ids_logprob",
            "return_routed_experts",
            "routed_dp_rank",
            "priority",
            "lora_path",
        ],
        "sampling_params": [
            "max_new_tokens",
            "min_new_tokens",
            "temperature",
            "top_p",
            "top_k",
            "stop_token_ids",
            "ignore_eos",
            "logit_bias",
            "n",
            "sampling_seed",
            "regex",
        ],
    },
    "rid",
)
VLLM = Format(
    "vllm",
    "/inference/v1/generate",
    {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 16}},
    {
        "": [
            "token_ids",
            "sampling_params",
            "request_id",
            "stream",
            "model",
            "stream_options",
            "features",
            "cache_salt",
            "priority",
            "kv_transfer_params",
        ],
        "sampling_params": [
            "max_tokens",
            "min_tokens",
            "temperature",
            "top_p",
            "top_k",
            "stop_token_ids",
            "ignore_eos",
            "logit_bias",
            "n",
            "seed",
            "logprobs",
            "prompt_logprobs",
            "detokenize",
            "stop",
        ],
    },
    "request_id",
)


@dataclass
class HttpCase:
    hostile: Hostile
    method: str
    path: str
    headers: list[tuple[str, bytes]]
    body: bytes
    disconnect_after: int | None  # bytes of the answer read before hanging up

    @property
    def malformed(self) -> bool:
        return any(_malformed(value) for _, value in self.headers)

    def raw(self) -> bytes:
        head = [
            f"{self.method} {self.path} HTTP/1.1".encode(),
            b"Host: fuzz",
            b"Connection: close",
            b"Content-Length: %d" % len(self.body),
        ]
        head += [name.encode() + b": " + value for name, value in self.headers]
        return b"\r\n".join(head) + b"\r\n\r\n" + self.body

    def __repr__(self) -> str:
        return f"{self.method} {self.path} {self.headers} {self.body[:200]!r}"


# Header values as bytes; CR/LF would end the header itself, so they are left out (an
# attacker who sends them sends another header, which the parser sees as such).
HEADER_VALUES = st.one_of(
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40).map(str.encode),
    st.binary(max_size=40).map(lambda v: v.replace(b"\r", b"").replace(b"\n", b"")),
    st.sampled_from([b"9" * 5000, b"-1", b"1e9", b"0x10", b" 3 ", b"x" * 100_000]),
)


def _malformed(value: bytes) -> bool:
    """A header value aiohttp's parser refuses before any route sees the request (a plain
    400, as tests/test_malformed_http.py has it): control bytes, or past its 8,190 bytes."""
    return len(value) > 8190 or any((b < 0x20 and b != 0x09) or b == 0x7F for b in value)


# The headers the formats read, and the issue 15 item an odd value of each may provoke:
# an X-Request-Id echoed unchecked (item 4), an X-data-parallel-rank past the int-digit
# limit (item 5). X-Request-Timeout has no known failure.
HEADER_ITEMS = {"X-Request-Id": 4, "X-Request-Timeout": None, "X-data-parallel-rank": 5}


def _odd_header(value: bytes) -> bool:
    return len(value) > 1024 or any(b < 0x20 or b > 0x7E for b in value)


def _odd_client_id(cid: Any) -> bool:
    return cid is not None and (
        not isinstance(cid, str) or len(cid) > 1024 or not cid.isprintable()
    )


valid_bodies = {fmt.name: mutated(fmt.valid, fmt.fields) for fmt in (SGLANG, VLLM)}


def http_cases(fmt: Format) -> st.SearchStrategy[HttpCase]:
    @st.composite
    def draw(draw_: st.DrawFn) -> HttpCase:
        hostile = Hostile()
        shape = draw_(st.integers(0, 9))
        if shape == 0:  # any bytes at all
            body = draw_(st.binary(max_size=300))
        else:  # any JSON value, or mostly the valid body with a few fields changed
            value = draw_(JSON_VALUES if shape == 1 else valid_bodies[fmt.name])
            if isinstance(value, dict):
                if draw_(st.booleans()):
                    value["stream"] = True
                if draw_(st.integers(0, 4)) == 0:
                    value[fmt.client_id_field] = draw_(TEXT)
                if _odd_client_id(value.get(fmt.client_id_field)):
                    hostile.items.add(4)  # a client ID echoed into headers unchecked
            hostile.items |= hazards(value)
            body = to_json(value).encode("utf-8", "surrogatepass")
        headers: list[tuple[str, bytes]] = []
        content_type = draw_(
            st.sampled_from([b"application/json", b"application/json", b"text/plain", b"", None])
        )
        if content_type is not None:
            headers.append(("Content-Type", content_type))
        for name, item in HEADER_ITEMS.items():
            if draw_(st.integers(0, 3)) == 0:
                value = draw_(HEADER_VALUES)
                if item is not None and _odd_header(value):
                    hostile.items.add(item)
                headers.append((name, value))
        method = draw_(st.sampled_from(["POST"] * 8 + ["PUT", "GET", "DELETE", "PATCH"]))
        if method in ("GET", "DELETE", "PATCH") or (method == "PUT" and fmt.name == "vllm"):
            hostile.items.add(6)  # 405 answered in text/plain
        disconnect = draw_(st.one_of(st.none(), st.none(), st.integers(0, 400)))
        return HttpCase(hostile, method, fmt.path, headers, body, disconnect)

    return draw()


@dataclass
class HttpAnswer:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


def _parse(data: bytes) -> HttpAnswer | None:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        return None
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().decode("latin-1").lower()] = value.strip().decode("latin-1")
    if headers.get("transfer-encoding") == "chunked":
        body = _dechunk(body)
    return HttpAnswer(int(parts[1]), headers, body)


def _dechunk(data: bytes) -> bytes:
    out = bytearray()
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        try:
            size = int(size_line.split(b";")[0], 16)
        except ValueError:
            break
        if size == 0:
            break
        out += rest[:size]
        data = rest[size + 2 :]
    return bytes(out)


async def check_http(port: int, case: HttpCase, campaign: Campaign) -> None:
    """Send `case`; its answer must come, be no undocumented 5xx, and an error's body must
    be JSON (both formats answer errors in JSON shapes)."""
    url = f"http://127.0.0.1:{port}"
    limit = None if case.disconnect_after is None else case.disconnect_after + 1
    try:
        data = await raw_exchange(url, case.raw(), timeout=ANSWER_TIMEOUT_S, limit=limit)
    except TimeoutError:
        campaign.fail(case.hostile, f"no answer within {ANSWER_TIMEOUT_S:g} s", case)
        return
    except ConnectionRefusedError as exc:  # not the input's doing: the frontend is gone
        campaign.fail(Hostile(), f"cannot connect: {exc}", case)
        return
    except OSError as exc:  # the server dropped us before answering
        campaign.fail(case.hostile, f"connection broken: {type(exc).__name__}", case)
        return
    if limit is not None:
        campaign.outcomes["disconnected"] += 1
        return
    answer = _parse(data)
    if answer is None:
        campaign.fail(case.hostile, "no HTTP answer", (case, data[:200]))
        return
    campaign.outcomes[str(answer.status)] += 1
    if answer.status >= 500 and answer.status not in DOCUMENTED_5XX:
        campaign.fail(case.hostile, f"HTTP {answer.status}", (case, answer.body[:200]))
    elif answer.status == 400 and case.malformed:
        campaign.outcomes["400 malformed HTTP"] += 1
    elif answer.status >= 400:
        try:
            json.loads(answer.body)
        except ValueError:
            campaign.fail(case.hostile, f"HTTP {answer.status} not JSON", (case, answer.body[:200]))
