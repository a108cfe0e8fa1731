"""The vLLM `/inference/v1/generate` format (token ids in, token ids out)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from genmesh.formats.base import Bound, Exchange, GenerateFormat, Route
from genmesh.formats.merge import Rule
from genmesh.formats.vllm import request
from genmesh.formats.vllm.response import MERGE_RULES, VllmExchange
from genmesh.shared.engine_info import NO_ENGINES, EngineCatalog


class VllmFormat(GenerateFormat):
    name = "vllm"
    merge_rules: Mapping[str, Rule] = MERGE_RULES

    @classmethod
    def default_routes(cls) -> tuple[Route, ...]:
        return (Route("POST", "/inference/v1/generate"),)

    def parse(self, body: bytes) -> Any:
        return request.parse(body)

    def bind(
        self, body: Any, headers: Mapping[str, str], engines: EngineCatalog = NO_ENGINES
    ) -> Bound:
        return request.bind(body, headers, engines)

    def new_public_id(self) -> str:
        """vLLM's `random_uuid()`: a UUID4 as 32 hex digits (the generate route's default
        `request_id`, which the response shows as `generate-tokens-<id>`)."""
        return uuid.uuid4().hex

    def exchange(self, bound: Bound, public_id: str, received_at: float) -> Exchange:
        assert isinstance(bound.options, request.VllmOptions)
        return VllmExchange(bound.options, public_id, bound.items[0].token_ids, len(bound.items))

    def error_body(self, status: int, message: str) -> Any:
        return request.error(message, status)
