"""Envelope.from_wire / to_wire: the single gate where untrusted maps become typed values."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from genmesh.codecs import get_codec
from genmesh.shared.envelope import (
    MAX_TOKEN_ID,
    PROTOCOL_VERSION,
    Continuation,
    Envelope,
    EnvelopeError,
    OutputOptions,
    Routing,
    Sampling,
    peek_id,
)

pytestmark = pytest.mark.unit

# ---------------------------------------------------------------- strategies

token_ids = st.integers(min_value=0, max_value=MAX_TOKEN_ID)
finite = st.floats(allow_nan=False, allow_infinity=False)
int64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
opt_text = st.none() | st.text(max_size=12)
json_scalars = st.none() | st.booleans() | int64 | finite | st.text(max_size=10)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def samplings(draw: st.DrawFn) -> Sampling:
    max_tokens = draw(st.none() | st.integers(min_value=0, max_value=100_000))
    upper = 100_000 if max_tokens is None else max_tokens
    return Sampling(
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(min_value=0, max_value=upper)),
        temperature=draw(st.none() | finite),
        top_p=draw(st.none() | finite),
        top_k=draw(st.none() | int64),
        min_p=draw(st.none() | finite),
        seed=draw(st.none() | int64),
        stop_token_ids=draw(st.lists(token_ids, max_size=4)),
        ignore_eos=draw(st.booleans()),
    )


@st.composite
def envelopes(draw: st.DrawFn) -> Envelope:
    prompt = draw(st.lists(token_ids, min_size=1, max_size=20))
    start = draw(st.none() | st.integers(min_value=0, max_value=len(prompt) - 1))
    continuation = draw(
        st.none()
        | st.builds(
            Continuation,
            attempt=st.integers(min_value=1, max_value=10),
            delivered=st.integers(min_value=0, max_value=10_000),
            prompt_len=st.integers(min_value=0, max_value=10_000),
            max_tokens=st.none() | st.integers(min_value=0, max_value=10_000),
        )
    )
    return Envelope(
        id=draw(st.text(min_size=1, max_size=20)),
        token_ids=prompt,
        format=draw(st.text(max_size=10)),
        model=draw(opt_text),
        client_id=draw(opt_text),
        sampling=draw(samplings()),
        output=OutputOptions(
            logprobs=draw(st.booleans()),
            top_logprobs=draw(st.integers(min_value=0, max_value=20)),
            prompt_logprobs_start=start,
        ),
        routing=Routing(
            worker=draw(opt_text),
            exclude=draw(st.lists(st.text(max_size=8), max_size=3)),
            dp_rank=draw(st.none() | st.integers(min_value=0, max_value=64)),
            priority=draw(st.none() | int64),
            cache_salt=draw(opt_text),
            session=draw(opt_text),
        ),
        engine=draw(st.dictionaries(st.text(max_size=8), json_values, max_size=4)),
        continuation=continuation,
        deadline=draw(st.none() | finite),
    )


def base_wire(**overrides: Any) -> dict[str, Any]:
    wire: dict[str, Any] = {"v": PROTOCOL_VERSION, "id": "req-1", "token_ids": [1, 2, 3]}
    wire.update(overrides)
    return wire


# ---------------------------------------------------------------- round trips


@settings(max_examples=150, deadline=None)
@given(envelopes())
def test_round_trip_through_wire_map(env: Envelope) -> None:
    wire = env.to_wire()
    assert wire["v"] == PROTOCOL_VERSION
    assert Envelope.from_wire(wire) == env


@settings(max_examples=100, deadline=None)
@given(envelopes(), st.sampled_from(["msgpack", "json"]))
def test_round_trip_through_codecs(env: Envelope, codec_name: str) -> None:
    codec = get_codec(codec_name)
    decoded = Envelope.from_wire(codec.decode(codec.encode(env.to_wire())))
    assert decoded == env
    # A second trip changes nothing either: the wire form is canonical.
    assert decoded.to_wire() == env.to_wire()


def test_minimal_wire_gets_defaults() -> None:
    env = Envelope.from_wire(base_wire())
    assert env.id == "req-1"
    assert env.token_ids == [1, 2, 3]
    assert env.format == ""
    assert env.model is None
    assert env.client_id is None
    assert env.sampling == Sampling()
    assert env.output == OutputOptions()
    assert env.routing == Routing()
    assert env.engine == {}
    assert env.continuation is None
    assert env.deadline is None


def test_to_wire_omits_unset_optionals() -> None:
    wire = Envelope(id="x", token_ids=[5]).to_wire()
    assert wire == {
        "v": 1,
        "id": "x",
        "token_ids": [5],
        "format": "",
        "sampling": {"min_tokens": 0, "ignore_eos": False},
    }


def test_integers_accepted_for_float_fields() -> None:
    env = Envelope.from_wire(base_wire(sampling={"temperature": 1, "top_p": 0}, deadline=5))
    assert env.sampling.temperature == 1.0
    assert isinstance(env.sampling.temperature, float)
    assert isinstance(env.sampling.top_p, float)
    assert isinstance(env.deadline, float)


def test_token_id_bounds_inclusive() -> None:
    env = Envelope.from_wire(base_wire(token_ids=[0, MAX_TOKEN_ID]))
    assert env.token_ids == [0, MAX_TOKEN_ID]


def test_null_fields_mean_default() -> None:
    env = Envelope.from_wire(
        base_wire(
            sampling={"min_tokens": None, "ignore_eos": None, "stop_token_ids": None},
            output=None,
            routing={"exclude": None},
            engine=None,
            continuation=None,
            model=None,
        )
    )
    assert env.sampling == Sampling()
    assert env.output == OutputOptions()
    assert env.routing == Routing()
    assert env.engine == {}


def test_min_tokens_unbounded_when_max_tokens_unset() -> None:
    env = Envelope.from_wire(base_wire(sampling={"min_tokens": 500}))
    assert env.sampling.min_tokens == 500
    assert env.sampling.max_tokens is None


def test_min_tokens_equal_to_max_tokens_is_fine() -> None:
    env = Envelope.from_wire(base_wire(sampling={"min_tokens": 4, "max_tokens": 4}))
    assert (env.sampling.min_tokens, env.sampling.max_tokens) == (4, 4)


def test_prompt_logprobs_start_last_position_is_fine() -> None:
    env = Envelope.from_wire(base_wire(output={"prompt_logprobs_start": 2}))
    assert env.output.prompt_logprobs_start == 2


def test_continuation_defaults() -> None:
    env = Envelope.from_wire(base_wire(continuation={"delivered": 3}))
    assert env.continuation == Continuation(attempt=1, delivered=3, prompt_len=0, max_tokens=None)


def test_unknown_fields_ignored_at_every_level() -> None:
    wire = base_wire(
        future_top_level={"x": 1},
        sampling={"max_tokens": 4, "frobnicate": True},
        output={"logprobs": True, "new_option": [1]},
        routing={"worker": "w1", "affinity": "x"},
        continuation={"attempt": 2, "why": "worker died"},
    )
    env = Envelope.from_wire(wire)
    assert env.sampling.max_tokens == 4
    assert env.output.logprobs is True
    assert env.routing.worker == "w1"
    assert env.continuation is not None
    assert env.continuation.attempt == 2
    assert "future_top_level" not in env.to_wire()


def test_from_wire_does_not_mutate_input() -> None:
    wire = base_wire(sampling={"max_tokens": 4}, output={"logprobs": True}, engine={"a": [1]})
    before = copy.deepcopy(wire)
    Envelope.from_wire(wire)
    assert wire == before


# ---------------------------------------------------------------- validation errors

# (wire, substring the message must contain: the field it names)
ERROR_CASES: list[tuple[Any, str]] = [
    # the envelope itself
    ([1, 2], "envelope: expected a map, got list"),
    ("text", "envelope: expected a map, got str"),
    (None, "envelope: expected a map, got NoneType"),
    # version
    ({"id": "a", "token_ids": [1]}, "v: unsupported protocol version None"),
    (base_wire(v=2), "v: unsupported protocol version 2"),
    (base_wire(v="1"), "v: unsupported protocol version '1'"),
    (base_wire(v=True), "v: unsupported protocol version True"),
    (base_wire(v=1.0), "v: unsupported protocol version 1.0"),
    # id
    ({"v": 1, "token_ids": [1]}, "id: required"),
    (base_wire(id=""), "id: required"),
    (base_wire(id=None), "id: required"),
    (base_wire(id=7), "id: expected a string, got int"),
    # token ids
    ({"v": 1, "id": "a"}, "token_ids: required"),
    (base_wire(token_ids=None), "token_ids: expected a list of token ids, got NoneType"),
    (base_wire(token_ids="1 2 3"), "token_ids: expected a list of token ids, got str"),
    (base_wire(token_ids=[]), "token_ids: must not be empty"),
    (base_wire(token_ids=[1, True]), "token_ids[1]"),
    (base_wire(token_ids=[1, 2, 3.0]), "token_ids[2]"),
    (base_wire(token_ids=[-1]), "token_ids[0]"),
    (base_wire(token_ids=[MAX_TOKEN_ID + 1]), "token_ids[0]"),
    (base_wire(token_ids=["1"]), "token_ids[0]"),
    # plain strings
    (base_wire(format=1), "format: expected a string, got int"),
    (base_wire(model=["m"]), "model: expected a string, got list"),
    (base_wire(client_id=3), "client_id: expected a string, got int"),
    # sampling
    (base_wire(sampling=[1]), "sampling: expected a map, got list"),
    (base_wire(sampling={"max_tokens": -1}), "sampling.max_tokens: must be >= 0, got -1"),
    (
        base_wire(sampling={"max_tokens": True}),
        "sampling.max_tokens: expected an integer, got bool",
    ),
    (
        base_wire(sampling={"max_tokens": 4.0}),
        "sampling.max_tokens: expected an integer, got float",
    ),
    (base_wire(sampling={"max_tokens": "4"}), "sampling.max_tokens: expected an integer, got str"),
    (base_wire(sampling={"min_tokens": -2}), "sampling.min_tokens: must be >= 0, got -2"),
    (
        base_wire(sampling={"min_tokens": False}),
        "sampling.min_tokens: expected an integer, got bool",
    ),
    (
        base_wire(sampling={"min_tokens": 5, "max_tokens": 3}),
        "sampling.min_tokens (5) exceeds sampling.max_tokens (3)",
    ),
    (base_wire(sampling={"temperature": "hot"}), "sampling.temperature: expected a finite number"),
    (base_wire(sampling={"temperature": True}), "sampling.temperature: expected a finite number"),
    (base_wire(sampling={"temperature": float("inf")}), "sampling.temperature"),
    (base_wire(sampling={"top_p": float("nan")}), "sampling.top_p: expected a finite number"),
    (base_wire(sampling={"min_p": [0.1]}), "sampling.min_p: expected a finite number"),
    (base_wire(sampling={"top_k": True}), "sampling.top_k: expected an integer, got bool"),
    (base_wire(sampling={"top_k": 1.5}), "sampling.top_k: expected an integer, got float"),
    (base_wire(sampling={"seed": "42"}), "sampling.seed: expected an integer, got str"),
    (base_wire(sampling={"seed": True}), "sampling.seed: expected an integer, got bool"),
    (base_wire(sampling={"stop_token_ids": 7}), "sampling.stop_token_ids: expected a list"),
    (base_wire(sampling={"stop_token_ids": [1, True]}), "sampling.stop_token_ids[1]"),
    (base_wire(sampling={"stop_token_ids": [-5]}), "sampling.stop_token_ids[0]"),
    (base_wire(sampling={"ignore_eos": 1}), "sampling.ignore_eos: expected a boolean, got int"),
    (
        base_wire(sampling={"ignore_eos": "true"}),
        "sampling.ignore_eos: expected a boolean, got str",
    ),
    # output
    (base_wire(output="all"), "output: expected a map, got str"),
    (base_wire(output={"logprobs": 1}), "output.logprobs: expected a boolean, got int"),
    (base_wire(output={"top_logprobs": -1}), "output.top_logprobs: must be >= 0, got -1"),
    (
        base_wire(output={"top_logprobs": True}),
        "output.top_logprobs: expected an integer, got bool",
    ),
    (
        base_wire(output={"prompt_logprobs_start": -1}),
        "output.prompt_logprobs_start: must be >= 0, got -1",
    ),
    (
        base_wire(output={"prompt_logprobs_start": False}),
        "output.prompt_logprobs_start: expected an integer, got bool",
    ),
    (
        base_wire(output={"prompt_logprobs_start": 3}),
        "output.prompt_logprobs_start (3) must be below the prompt length (3)",
    ),
    (
        base_wire(output={"prompt_logprobs_start": 10}),
        "output.prompt_logprobs_start (10) must be below the prompt length (3)",
    ),
    # routing
    (base_wire(routing=["w"]), "routing: expected a map, got list"),
    (base_wire(routing={"worker": 1}), "routing.worker: expected a string, got int"),
    (base_wire(routing={"exclude": "w1"}), "routing.exclude: expected a list of strings"),
    (base_wire(routing={"exclude": ["w1", 2]}), "routing.exclude: expected a list of strings"),
    (base_wire(routing={"dp_rank": -1}), "routing.dp_rank: must be >= 0, got -1"),
    (base_wire(routing={"dp_rank": True}), "routing.dp_rank: expected an integer, got bool"),
    (base_wire(routing={"priority": "high"}), "routing.priority: expected an integer, got str"),
    (base_wire(routing={"priority": True}), "routing.priority: expected an integer, got bool"),
    (base_wire(routing={"cache_salt": 5}), "routing.cache_salt: expected a string, got int"),
    (base_wire(routing={"session": {}}), "routing.session: expected a string, got dict"),
    # engine
    (base_wire(engine=[1]), "engine: expected a map, got list"),
    (base_wire(engine="x"), "engine: expected a map, got str"),
    # continuation
    (base_wire(continuation="x"), "continuation: expected a map, got str"),
    (base_wire(continuation={"attempt": 0}), "continuation.attempt: must be >= 1, got 0"),
    (base_wire(continuation={"attempt": True}), "continuation.attempt: expected an integer"),
    (base_wire(continuation={"delivered": -1}), "continuation.delivered: must be >= 0, got -1"),
    (base_wire(continuation={"prompt_len": "3"}), "continuation.prompt_len: expected an integer"),
    (base_wire(continuation={"max_tokens": -1}), "continuation.max_tokens: must be >= 0, got -1"),
    # deadline
    (base_wire(deadline="soon"), "deadline: expected a finite number, got 'soon'"),
    (base_wire(deadline=float("inf")), "deadline: expected a finite number, got inf"),
    (base_wire(deadline=True), "deadline: expected a finite number, got True"),
]


@pytest.mark.parametrize(("wire", "message"), ERROR_CASES)
def test_validation_errors_name_the_field(wire: Any, message: str) -> None:
    with pytest.raises(EnvelopeError) as info:
        Envelope.from_wire(wire)
    assert message in str(info.value)


def test_envelope_error_is_a_value_error() -> None:
    assert issubclass(EnvelopeError, ValueError)


def test_first_bad_token_is_reported() -> None:
    with pytest.raises(EnvelopeError, match=r"token_ids\[2\].*got -4"):
        Envelope.from_wire(base_wire(token_ids=[1, 2, -4, -5]))


@pytest.mark.parametrize("value", [0, False, [], ""])
def test_falsy_non_map_continuation_rejected(value: Any) -> None:
    with pytest.raises(EnvelopeError, match=r"^continuation: expected a map"):
        Envelope.from_wire(base_wire(continuation=value))


@pytest.mark.parametrize("where", ["deadline", "temperature"])
def test_huge_integer_in_float_field_is_an_envelope_error(where: str) -> None:
    huge = b"1" + b"0" * 400
    if where == "deadline":
        raw = b'{"v":1,"id":"a","token_ids":[1],"deadline":' + huge + b"}"
    else:
        raw = b'{"v":1,"id":"a","token_ids":[1],"sampling":{"temperature":' + huge + b"}}"
    wire = get_codec("json").decode(raw)
    with pytest.raises(EnvelopeError, match=where):
        Envelope.from_wire(wire)


# ---------------------------------------------------------------- peek_id


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        ({"id": "abc"}, "abc"),
        ({"id": "abc", "v": 99, "token_ids": "garbage"}, "abc"),
        ({"id": ""}, None),
        ({"id": 12}, None),
        ({"id": None}, None),
        ({}, None),
        (["id", "abc"], None),
        ("abc", None),
        (None, None),
        (b"\x81\xa2id\xa3abc", None),
    ],
)
def test_peek_id(obj: Any, expected: str | None) -> None:
    assert peek_id(obj) == expected


def test_peek_id_recovers_id_of_rejected_envelope() -> None:
    wire = base_wire(id="req-77", token_ids=[])
    with pytest.raises(EnvelopeError):
        Envelope.from_wire(wire)
    assert peek_id(wire) == "req-77"
