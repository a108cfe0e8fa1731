"""Client codecs: alternative encodings of a format's fields on the client's side of HTTP.

A client codec decodes request fields a client sent encoded (before the format binds the
request) and encodes record fields on the way out (before SSE and before folding), with
its own joiners for the `delta` fields it encodes: two Base64 chunks join by
decode-concatenate-encode, not by string concatenation. The answer mirrors the request:
encoded if the client sent its fields encoded (`encodes_answer`), else the format's own,
untouched. `GENMESH_GENERATE_FORMAT=sglang+b64zstd` wraps the `sglang` format in the
`b64zstd` client codec.

Client codecs register through the entry-point group `genmesh.client_codecs`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

from genmesh.formats.base import Bound, Exchange, GenerateFormat, Record, RequestRejected, Route
from genmesh.formats.merge import Joiner, Rule
from genmesh.shared.engine_info import NO_ENGINES, EngineCatalog
from genmesh.shared.errors import MeshError
from genmesh.shared.frames import OutputFrame

ENTRY_POINT_GROUP = "genmesh.client_codecs"


class ClientCodecError(ValueError):
    """A field the client encoded that does not decode; the message names it."""


@runtime_checkable
class ClientCodec(Protocol):
    name: str
    # Names of the formats this codec knows the fields of.
    formats: frozenset[str]
    joiners: Mapping[str, Joiner]

    def decode_request(self, request: Any) -> Any:
        """The parsed request with encoded fields decoded; raise ClientCodecError."""
        ...

    def encodes_answer(self, request: Any) -> bool:
        """Whether the answer to the parsed request (as the client sent it) is encoded:
        True when the client encoded some of its fields, so that a client that sent
        plain values gets the format's own answer."""
        ...

    def encode_record(self, record: Record) -> Record:
        """`record` with the codec's fields encoded."""
        ...


@dataclass(frozen=True, slots=True)
class _CodecOptions:
    """`Bound.options` of a request bound by a `CodecFormat`: the inner format's own, and
    whether its answer is encoded."""

    inner: Any
    encoded: bool


class _CodecExchange(Exchange):
    def __init__(self, inner: Exchange, codec: ClientCodec, joiners: Mapping[str, Joiner]) -> None:
        self.inner = inner
        self.codec = codec
        self.joiners = joiners

    def render(self, index: int, frame: OutputFrame) -> Record:
        return self.codec.encode_record(self.inner.render(index, frame))

    def sse(self, index: int, record: Record) -> list[Any]:
        return self.inner.sse(index, record)

    def new_attempt(self, index: int) -> None:
        self.inner.new_attempt(index)

    def sse_end(self) -> list[Any]:
        return self.inner.sse_end()

    def body(self, items: list[Record]) -> Any:
        return self.inner.body(items)

    def error(self, error: MeshError, status: int) -> Any:
        return self.inner.error(error, status)


class CodecFormat(GenerateFormat):
    """A format wrapped in a client codec; everything else is the inner format's."""

    name = ""  # set per instance: "<format>+<codec>"

    def __init__(self, inner: GenerateFormat, codec: ClientCodec) -> None:
        super().__init__(inner.routes)
        self.inner = inner
        self.codec = codec
        self.name = f"{inner.name}+{codec.name}"
        self.merge_rules: Mapping[str, Rule] = inner.merge_rules
        self.joiners = inner.joiners  # a plain answer's; an encoded one's: `_CodecExchange`
        self._encoded_joiners = {**inner.joiners, **codec.joiners}

    @classmethod
    def default_routes(cls) -> tuple[Route, ...]:
        raise NotImplementedError("a CodecFormat takes its routes from the format it wraps")

    def parse(self, body: bytes) -> Any:
        return self.inner.parse(body)

    def bind(
        self, request: Any, headers: Mapping[str, str], engines: EngineCatalog = NO_ENGINES
    ) -> Bound:
        try:
            decoded = self.codec.decode_request(request)
        except ClientCodecError as exc:
            message = f"{self.codec.name}: {exc}"
            raise RequestRejected(400, self.inner.error_body(400, message), message) from None
        bound = self.inner.bind(decoded, headers, engines)
        encoded = self.codec.encodes_answer(request)
        return replace(bound, options=_CodecOptions(bound.options, encoded))

    def new_public_id(self) -> str:
        return self.inner.new_public_id()

    def exchange(self, bound: Bound, public_id: str, received_at: float) -> Exchange:
        options: _CodecOptions = bound.options
        inner = self.inner.exchange(replace(bound, options=options.inner), public_id, received_at)
        if not options.encoded:
            return inner
        return _CodecExchange(inner, self.codec, self._encoded_joiners)

    def error_body(self, status: int, message: str) -> Any:
        return self.inner.error_body(status, message)
