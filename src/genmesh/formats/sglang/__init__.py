"""The SGLang `/generate` format."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from genmesh.formats.base import Bound, Exchange, GenerateFormat, RequestRejected, Route
from genmesh.formats.merge import Joiner, Rule
from genmesh.formats.sglang import errors, request
from genmesh.formats.sglang.response import JOINERS, MERGE_RULES, SglangExchange
from genmesh.shared.engine_info import NO_ENGINES, EngineCatalog


class SglangFormat(GenerateFormat):
    name = "sglang"
    merge_rules: Mapping[str, Rule] = MERGE_RULES
    joiners: Mapping[str, Joiner] = JOINERS

    @classmethod
    def default_routes(cls) -> tuple[Route, ...]:
        return (Route("POST", "/generate"), Route("PUT", "/generate"))

    def parse(self, body: bytes) -> Any:
        return request.parse(body)

    def bind(
        self, body: Any, headers: Mapping[str, str], engines: EngineCatalog = NO_ENGINES
    ) -> Bound:
        return request.bind(body, headers, engines)

    def exchange(self, bound: Bound, public_id: str, received_at: float) -> Exchange:
        assert isinstance(bound.options, request.SglangOptions)
        prompts = [item.token_ids for item in bound.items]
        return SglangExchange(bound.options, public_id, prompts, received_at)

    def error_body(self, status: int, message: str) -> Any:
        return errors.error(message, status)

    def duplicate_id(self, client_id: str) -> RequestRejected:
        # SGLang's tokenizer manager refuses a rid already in its rid_to_state.
        return errors.duplicate_rid(client_id)
