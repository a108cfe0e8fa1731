"""The SGLang `/generate` format."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from genmesh.formats.base import Bound, Exchange, GenerateFormat, Route
from genmesh.formats.merge import Rule
from genmesh.formats.sglang.request import SglangOptions, bind, error
from genmesh.formats.sglang.response import MERGE_RULES, SglangExchange


class SglangFormat(GenerateFormat):
    name: ClassVar[str] = "sglang"
    merge_rules: ClassVar[Mapping[str, Rule]] = MERGE_RULES

    @classmethod
    def default_routes(cls) -> tuple[Route, ...]:
        return (Route("POST", "/generate"), Route("PUT", "/generate"))

    def bind(self, body: bytes, headers: Mapping[str, str]) -> Bound:
        return bind(body, headers)

    def exchange(self, bound: Bound, public_id: str, received_at: float) -> Exchange:
        assert isinstance(bound.options, SglangOptions)
        return SglangExchange(bound.options, public_id, bound.envelope.token_ids, received_at)

    def error_body(self, status: int, message: str) -> Any:
        return error(message)
