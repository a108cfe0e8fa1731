"""A minimal third-party format: POST /echo/generate {"tokens": [...], "max": n}.

It answers {"tokens": [...generated...], "done": "<finish reason>"}; SSE events carry the
new tokens. Written only against genmesh's public format contract.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from genmesh.formats.base import Bound, Exchange, GenerateFormat, Record, RequestRejected, Route
from genmesh.formats.merge import Rule
from genmesh.shared.envelope import Envelope, Sampling
from genmesh.shared.errors import MeshError
from genmesh.shared.frames import Frame


def _error(status: int, message: str) -> RequestRejected:
    return RequestRejected(status, {"problem": message}, message)


class EchoExchange(Exchange):
    def render(self, index: int, frame: Frame) -> Record:
        finish = frame.get("finish")
        return {"tokens": frame.get("tokens") or [], "done": finish and finish["reason"]}

    def sse(self, index: int, record: Record) -> list[Any]:
        return [record]

    def body(self, items: list[Record]) -> Any:
        return items[0]

    def error(self, error: MeshError, status: int) -> Any:
        return {"problem": error.message}


class EchoFormat(GenerateFormat):
    name = "echo"
    merge_rules: Mapping[str, Rule] = {"tokens": Rule.DELTA, "done": Rule.LAST}

    @classmethod
    def default_routes(cls) -> tuple[Route, ...]:
        return (Route("POST", "/echo/generate"),)

    def parse(self, body: bytes) -> Any:
        try:
            return json.loads(body)
        except ValueError as exc:
            raise _error(400, f"not JSON: {exc}") from None

    def bind(self, request: Any, headers: Mapping[str, str], engines: Any) -> Bound:
        if not isinstance(request, dict) or not isinstance(request.get("tokens"), list):
            raise _error(400, "send {'tokens': [...], 'max': n}")
        envelope = Envelope(
            id="",
            token_ids=request["tokens"],
            format="echo",
            sampling=Sampling(max_tokens=int(request.get("max", 4)), ignore_eos=True),
        )
        return Bound(items=[envelope], stream=bool(request.get("stream")), client_id=None)

    def exchange(self, bound: Bound, public_id: str, received_at: float) -> Exchange:
        return EchoExchange()

    def error_body(self, status: int, message: str) -> Any:
        return {"problem": message}
