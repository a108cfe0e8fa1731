"""The codec registry and the two built-in codecs."""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import msgpack
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import genmesh.codecs as codecs_mod
from genmesh.codecs import (
    DEFAULT_CODEC,
    ENTRY_POINT_GROUP,
    Codec,
    CodecError,
    UnknownCodecError,
    available_codecs,
    get_codec,
    register_codec,
)
from genmesh.codecs.builtin import JsonCodec, MsgpackCodec
from tests.equality import same

pytestmark = pytest.mark.unit

# ---------------------------------------------------------------- strategies

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
json_like = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(), inner, max_size=6),
    max_leaves=30,
)


def decode_error(codec: Codec, data: bytes) -> str | None:
    """None if `data` decodes; else the CodecError message's prefix. Other exceptions escape."""
    try:
        codec.decode(data)
    except CodecError as exc:
        return str(exc).split(":", 1)[0]
    return None


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty registry cache; monkeypatch puts the original back afterwards."""
    monkeypatch.setattr(codecs_mod, "_registry", None)


# ---------------------------------------------------------------- round trips


@settings(max_examples=200, deadline=None)
@given(json_like)
@example({"": [None, True, False, 0, -(2**63), 2**64 - 1, -0.0, 1e308, "é\x00"]})
def test_msgpack_round_trip(value: Any) -> None:
    codec = MsgpackCodec()
    data = codec.encode(value)
    assert isinstance(data, bytes)
    assert same(codec.decode(data), value)


@settings(max_examples=200, deadline=None)
@given(json_like)
@example({"a": [None, True, 0, 2**64 - 1, -0.0, 5e-324, '\u2603\n"'], "b": {}})
def test_json_round_trip(value: Any) -> None:
    codec = JsonCodec()
    data = codec.encode(value)
    assert isinstance(data, bytes)
    assert same(codec.decode(data), value)


def test_json_encoding_is_compact_utf8() -> None:
    assert JsonCodec().encode({"a": [1, 2], "b": "é"}) == '{"a":[1,2],"b":"é"}'.encode()


def test_json_decodes_what_other_json_writers_produce() -> None:
    data = json.dumps({"x": [1, 2.5, None]}, indent=2).encode()
    assert JsonCodec().decode(data) == {"x": [1, 2.5, None]}


def test_msgpack_is_plain_msgpack() -> None:
    assert msgpack.unpackb(MsgpackCodec().encode({"t": "out", "seq": 3})) == {"t": "out", "seq": 3}
    assert MsgpackCodec().decode(msgpack.packb({"id": "x"})) == {"id": "x"}


# ---------------------------------------------------------------- garbage in


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
@example(b"\xc1")  # a byte msgpack never uses
@example(b"\x92\x01")  # truncated array
@example(b"\x01\x02")  # extra data after a complete value
@example(b"\xdd\xff\xff\xff\xff")  # array header claiming 4G items
@example(b"\x91" * 100_000)  # nested too deep
@example(b"\x81\x90\x01")  # map with a list as key
def test_msgpack_garbage_raises_only_codec_error(data: bytes) -> None:
    assert decode_error(MsgpackCodec(), data) in (None, "not valid msgpack")


@pytest.mark.parametrize(
    "data", [b"", b"\xc1", b"\x92\x01", b"\x01\x02", b"\x91" * 100_000, b"\x81\x90\x01"]
)
def test_msgpack_known_garbage_raises(data: bytes) -> None:
    with pytest.raises(CodecError, match="not valid msgpack"):
        MsgpackCodec().decode(data)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64) | st.text(max_size=32).map(str.encode))
@example(b"[" * 100_000)  # nested too deep
@example(b"\xff\xfe\x00")  # not UTF-8
@example(b"1" * 5000)  # more digits than int() allows
def test_json_garbage_raises_only_codec_error(data: bytes) -> None:
    assert decode_error(JsonCodec(), data) in (None, "not valid JSON")


@pytest.mark.parametrize(
    "data", [b"", b"{", b"[1,]", b"{'a': 1}", b"\xff", b"[" * 100_000, b"1" * 5000, b"nul"]
)
def test_json_known_garbage_raises(data: bytes) -> None:
    with pytest.raises(CodecError, match="not valid JSON"):
        JsonCodec().decode(data)


class Opaque:
    pass


@pytest.mark.parametrize("value", [Opaque(), {"x": {1, 2}}, 2**64, -(2**63) - 1])
def test_msgpack_unencodable_raises_codec_error(value: Any) -> None:
    with pytest.raises(CodecError, match="msgpack cannot encode"):
        MsgpackCodec().encode(value)


def test_json_unencodable_raises_codec_error() -> None:
    circular: list[Any] = []
    circular.append(circular)
    for value in (Opaque(), {"x": b"bytes"}, circular, "\ud800"):
        with pytest.raises(CodecError, match="json cannot encode"):
            JsonCodec().encode(value)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, {"lp": [-math.inf]}])
def test_json_refuses_non_finite_floats(value: Any) -> None:
    # NaN / Infinity are not JSON: other languages' parsers would choke on them.
    with pytest.raises(CodecError, match="json cannot encode"):
        JsonCodec().encode(value)


def test_msgpack_carries_non_finite_floats() -> None:
    codec = MsgpackCodec()
    assert codec.decode(codec.encode([math.inf, -math.inf])) == [math.inf, -math.inf]
    assert math.isnan(codec.decode(codec.encode(math.nan)))


def test_codec_error_is_a_value_error() -> None:
    assert issubclass(CodecError, ValueError)


# ---------------------------------------------------------------- registry


def test_default_codec_is_msgpack() -> None:
    assert DEFAULT_CODEC == "msgpack"
    assert isinstance(get_codec(None), MsgpackCodec)
    assert isinstance(get_codec(""), MsgpackCodec)
    assert get_codec(None) is get_codec("msgpack")


def test_json_codec_by_name() -> None:
    assert isinstance(get_codec("json"), JsonCodec)
    assert get_codec("json").name == "json"


def test_builtins_satisfy_the_protocol() -> None:
    assert isinstance(MsgpackCodec(), Codec)
    assert isinstance(JsonCodec(), Codec)


def test_unknown_codec_lists_installed_codecs() -> None:
    with pytest.raises(UnknownCodecError) as info:
        get_codec("cbor")
    assert info.value.name == "cbor"
    message = str(info.value)
    assert "'cbor'" in message
    installed = message.split("installed codecs: ", 1)[1]
    assert installed.split(", ") == available_codecs()
    assert {"json", "msgpack"} <= set(installed.split(", "))
    assert isinstance(info.value, LookupError)


def test_available_codecs_sorted_and_has_builtins() -> None:
    names = available_codecs()
    assert names == sorted(names)
    assert {"json", "msgpack"} <= set(names)


class UpperJson:
    """A toy third-party codec."""

    name = "upper-json"

    def encode(self, obj: Any) -> bytes:
        return json.dumps(obj).upper().encode()

    def decode(self, data: bytes) -> Any:
        return json.loads(data.decode().lower())


def test_register_codec(fresh_registry: None) -> None:
    with pytest.raises(UnknownCodecError):
        get_codec("upper-json")
    codec = UpperJson()
    register_codec(codec)
    assert get_codec("upper-json") is codec
    assert "upper-json" in available_codecs()
    assert get_codec("upper-json").decode(get_codec("upper-json").encode({"a": 1})) == {"a": 1}
    # The built-ins are still there.
    assert isinstance(get_codec(None), MsgpackCodec)


def test_register_codec_can_replace_a_codec(fresh_registry: None) -> None:
    class OtherJson(JsonCodec):
        pass

    replacement = OtherJson()
    register_codec(replacement)
    assert get_codec("json") is replacement


def test_registry_is_loaded_once(fresh_registry: None, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def fake_entry_points(*, group: str) -> list[Any]:
        calls.append(group)
        return []

    monkeypatch.setattr(codecs_mod, "entry_points", fake_entry_points)
    get_codec("json")
    get_codec(None)
    available_codecs()
    assert calls == [ENTRY_POINT_GROUP]


# ---------------------------------------------------------------- entry points


class FakeEntryPoint:
    """Just what `_load` uses of importlib.metadata.EntryPoint."""

    def __init__(self, name: str, value: str, target: Any = None, error: Exception | None = None):
        self.name = name
        self.value = value
        self.target = target
        self.error = error
        self.loaded = 0

    def load(self) -> Any:
        self.loaded += 1
        if self.error is not None:
            raise self.error
        return self.target


def use_entry_points(monkeypatch: pytest.MonkeyPatch, eps: list[FakeEntryPoint]) -> list[str]:
    groups: list[str] = []

    def fake_entry_points(*, group: str) -> list[FakeEntryPoint]:
        groups.append(group)
        return eps

    monkeypatch.setattr(codecs_mod, "entry_points", fake_entry_points)
    return groups


def test_entry_point_class_is_instantiated(
    fresh_registry: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    ep = FakeEntryPoint("upper-json", "acme.codecs:UpperJson", UpperJson)
    groups = use_entry_points(monkeypatch, [ep])
    codec = get_codec("upper-json")
    assert isinstance(codec, UpperJson)
    assert groups == ["genmesh.codecs"]
    assert available_codecs() == ["json", "msgpack", "upper-json"]


def test_entry_point_instance_is_used_as_is(
    fresh_registry: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    instance = UpperJson()
    use_entry_points(monkeypatch, [FakeEntryPoint("upper-json", "acme:CODEC", instance)])
    assert get_codec("upper-json") is instance


def test_entry_point_name_wins_over_codec_name_attribute(
    fresh_registry: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_entry_points(monkeypatch, [FakeEntryPoint("shouty", "acme:UpperJson", UpperJson)])
    assert isinstance(get_codec("shouty"), UpperJson)


def test_builtin_entry_points_are_not_loaded_again(
    fresh_registry: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    eps = [
        FakeEntryPoint("msgpack", "genmesh.codecs.builtin:MsgpackCodec", error=RuntimeError("no")),
        FakeEntryPoint("json", "genmesh.codecs.builtin:JsonCodec", error=RuntimeError("no")),
    ]
    use_entry_points(monkeypatch, eps)
    assert isinstance(get_codec("msgpack"), MsgpackCodec)
    assert isinstance(get_codec("json"), JsonCodec)
    assert [ep.loaded for ep in eps] == [0, 0]


def test_third_party_entry_point_may_override_a_builtin_name(
    fresh_registry: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_entry_points(monkeypatch, [FakeEntryPoint("json", "acme.fastjson:Codec", UpperJson)])
    assert isinstance(get_codec("json"), UpperJson)


def test_broken_entry_point_is_logged_and_skipped(
    fresh_registry: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class Exploding:
        name = "exploding"

        def __init__(self) -> None:
            raise RuntimeError("constructor failed")

    eps = [
        FakeEntryPoint("broken", "missing.module:Codec", error=ImportError("No module 'missing'")),
        FakeEntryPoint("exploding", "acme:Exploding", Exploding),
        FakeEntryPoint("upper-json", "acme.codecs:UpperJson", UpperJson),
    ]
    use_entry_points(monkeypatch, eps)
    with caplog.at_level(logging.ERROR, logger="genmesh.codecs"):
        names = available_codecs()
    assert names == ["json", "msgpack", "upper-json"]
    messages = [r.getMessage() for r in caplog.records if r.name == "genmesh.codecs"]
    assert any("broken" in m and "missing.module:Codec" in m and "skipped" in m for m in messages)
    assert any("exploding" in m and "skipped" in m for m in messages)
    broken_record = next(r for r in caplog.records if "broken" in r.getMessage())
    assert broken_record.exc_info is not None  # logged with the traceback
    with pytest.raises(UnknownCodecError):
        get_codec("broken")


def test_entry_point_without_codec_methods_is_skipped(
    fresh_registry: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class NotACodec:
        name = "nope"

        def encode(self, obj: Any) -> bytes:
            return b""

    use_entry_points(monkeypatch, [FakeEntryPoint("nope", "acme:NotACodec", NotACodec)])
    with (
        caplog.at_level(logging.ERROR, logger="genmesh.codecs"),
        pytest.raises(UnknownCodecError) as info,
    ):
        get_codec("nope")
    assert "installed codecs: json, msgpack" in str(info.value)
    assert any("nope" in r.getMessage() and "skipped" in r.getMessage() for r in caplog.records)


def test_real_installed_entry_points_give_the_builtins(fresh_registry: None) -> None:
    # The package metadata declares msgpack and json under genmesh.codecs.
    assert {"json", "msgpack"} <= set(available_codecs())
    assert isinstance(get_codec("msgpack"), MsgpackCodec)
