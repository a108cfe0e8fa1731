"""vLLM /inference/v1/generate: `parse` + `bind` (request -> one envelope per sample) and
`VllmExchange` (frames -> records, SSE payloads, unary bodies)."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import re
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict

from genmesh.engines.execute import output_frame
from genmesh.engines.mock import MockConfig, MockEngine
from genmesh.formats.base import Bound, RequestRejected
from genmesh.formats.catalog import installed_formats, load_generate_formats
from genmesh.formats.client_codec import CodecFormat
from genmesh.formats.merge import Merger, fold
from genmesh.formats.vllm import VllmFormat
from genmesh.formats.vllm.request import (
    MAX_N,
    VllmOptions,
    error,
    error_type,
)
from genmesh.formats.vllm.response import (
    MERGE_RULES,
    VllmExchange,
    clamp,
    finish_reason,
    prompt_logprobs,
    top_entries,
)
from genmesh.shared import frames
from genmesh.shared.engine_info import NO_ENGINES, EngineCatalog, EngineInfo
from genmesh.shared.envelope import Envelope
from genmesh.shared.errors import ErrorCode, MeshError

pytestmark = pytest.mark.unit

JSON = {"content-type": "application/json"}
SP = "sampling_params."
FORMAT = VllmFormat()


def raw(**fields: Any) -> bytes:
    return json.dumps({"token_ids": [1, 2, 3], "sampling_params": {}, **fields}).encode()


def bind_raw(data: bytes, headers: Any = None) -> Bound:
    """What the handler does: parse the bytes, then bind the JSON value."""
    return FORMAT.bind(FORMAT.parse(data), JSON if headers is None else headers)


def bind(headers: Any = None, **fields: Any) -> Bound:
    return bind_raw(raw(**fields), headers)


def sp(**params: Any) -> Bound:
    return bind(sampling_params=params)


def rejected(data: bytes, headers: Any = None) -> RequestRejected:
    with pytest.raises(RequestRejected) as info:
        bind_raw(data, headers)
    exc = info.value
    assert exc.status == 400
    assert set(exc.body) == {"error"}
    err = exc.body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "BadRequestError"
    assert err["code"] == 400
    assert err["message"] == exc.message
    return exc


# --------------------------------------------------------------------------- parse/bind


def test_the_format_is_installed_on_its_native_route() -> None:
    assert installed_formats()["vllm"] is VllmFormat
    served = {f.name: f.routes for f in load_generate_formats(env={})}
    assert [(r.method, r.path) for r in served["vllm"]] == [("POST", "/inference/v1/generate")]
    # As the /generate format it serves both paths, POST only.
    (only,) = load_generate_formats("vllm", env={})
    assert {(r.method, r.path) for r in only.routes} == {
        ("POST", "/generate"),
        ("POST", "/inference/v1/generate"),
    }


def test_a_minimal_request_binds_to_one_envelope_with_vllm_defaults() -> None:
    bound = bind()
    assert bound.stream is False
    assert bound.client_id is None
    assert bound.migration is None
    (env,) = bound.items
    assert env.id == ""
    assert env.format == "vllm"
    assert env.token_ids == [1, 2, 3]
    assert env.model is None
    s = env.sampling
    # An omitted max_tokens is the server's default (the room left), not vLLM-v0.11's 16.
    assert s.max_tokens is None
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == (1.0, 1.0, None, 0.0)
    assert (s.min_tokens, s.seed, s.stop_token_ids, s.ignore_eos) == (0, None, [], False)
    assert env.output.to_wire() == {}
    assert env.routing.to_wire() == {}
    assert env.engine == {"sampling_params": {}}  # the body as sent, minus the prompt
    assert bound.options == VllmOptions(
        prompt_tokens=3,
        logprobs=None,
        prompt_logprobs=None,
        model=None,
        include_usage=False,
        continuous_usage=False,
    )


def test_envelopes_survive_the_wire() -> None:
    bound = bind(
        sampling_params={"max_tokens": 5, "n": 2, "seed": 9, "logprobs": 1, "prompt_logprobs": 2},
        model="m",
        priority=3,
        cache_salt="s",
        kv_transfer_params={"do_remote_decode": True},
        request_id="r",
    )
    for env in bound.items:
        env.id = "p" * 32
        assert Envelope.from_wire(env.to_wire()) == env


def test_sampling_params_are_mapped() -> None:
    env = sp(
        max_tokens=20,
        min_tokens=3,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.1,
        seed=7,
        stop_token_ids=[4, 5],
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
    ).items[0]
    s = env.sampling
    assert (s.max_tokens, s.min_tokens, s.temperature, s.top_p, s.top_k, s.min_p) == (
        20, 3, 0.5, 0.9, 40, 0.1,
    )  # fmt: skip
    assert (s.seed, s.stop_token_ids, s.ignore_eos) == (7, [4, 5], True)
    native = env.engine["sampling_params"]
    assert native["presence_penalty"] == 0.5
    assert native["repetition_penalty"] == 1.1
    assert native["top_k"] == 40


@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_zero_or_minus_one_is_off(top_k: int) -> None:
    env = sp(top_k=top_k).items[0]
    assert env.sampling.top_k is None
    assert env.engine["sampling_params"]["top_k"] == top_k  # the native value is kept


def test_min_tokens_is_checked_against_the_dataclass_default_max_tokens() -> None:
    """vLLM validates SamplingParams before the server defaults max_tokens, so a
    min_tokens above the dataclass default (16) with no max_tokens is refused."""
    assert sp(min_tokens=16).items[0].sampling.min_tokens == 16
    text, _ = invalid(raw(sampling_params={"min_tokens": 17}))
    assert "min_tokens must be less than or equal to max_tokens=16, got 17." in text


@pytest.mark.parametrize("stop", [None, []])
def test_empty_stop_is_accepted(stop: Any) -> None:
    sp(stop=stop)


def test_an_empty_stop_string_is_refused_as_vllm_does() -> None:
    text, _ = invalid(raw(sampling_params={"stop": ""}))
    assert "stop cannot contain an empty string." in text


def test_passthrough_sampling_params_reach_the_engine() -> None:
    env = sp(
        structured_outputs={"regex": "a+"},
        extra_args={"x": 1},
        logit_bias={"5": -1.5},
        allowed_token_ids=[1, 2],
        return_sampling_mask=True,
        skip_special_tokens=False,
        detokenize=True,
        output_kind=2,
    ).items[0]
    assert env.engine["sampling_params"] == {
        "structured_outputs": {"regex": "a+"},
        "extra_args": {"x": 1},
        "logit_bias": {"5": -1.5},
        "allowed_token_ids": [1, 2],
        "return_sampling_mask": True,
        "skip_special_tokens": False,
        "detokenize": True,
        "output_kind": 2,
    }


def test_top_level_fields_reach_the_engine_and_routing() -> None:
    kv = {"do_remote_decode": True, "remote_host": None}
    env = bind(
        {**JSON, "x-request-id": "abc"},
        model="genmesh-mock",
        cache_salt="tenant-1",
        priority=4,
        kv_transfer_params=kv,
        sampling_params={"extra_args": {"keep": 1}},
        request_id="body-id",
        stream=True,
        stream_options={"include_usage": True},
        output_mode="tokens",
    ).items[0]
    assert env.model == "genmesh-mock"
    assert env.routing.cache_salt == "tenant-1"
    assert env.routing.priority == -4
    # The native payload: as sent, minus the prompt, the ID and the transport options.
    assert env.engine == {
        "model": "genmesh-mock",
        "cache_salt": "tenant-1",
        "priority": 4,  # vLLM's own sense
        "kv_transfer_params": kv,
        "sampling_params": {"extra_args": {"keep": 1}},
        "output_mode": "tokens",
    }


@pytest.mark.parametrize(
    ("priority", "routing"),
    [
        (None, None),
        (0, 0),
        (5, -5),
        (-3, 3),
        # vLLM bounds priority to int64; the negation saturates at the bounds.
        (2**63 - 1, -(2**63 - 1)),
        (-(2**63), 2**63 - 1),
    ],
)
def test_priority_is_negated_and_saturates(priority: int | None, routing: int | None) -> None:
    fields = {} if priority is None else {"priority": priority}
    assert bind(**fields).items[0].routing.priority == routing


@pytest.mark.parametrize(
    ("headers", "rank"),
    [
        ({"X-data-parallel-rank": "3"}, 3),
        ({"x-data-parallel-rank": " 4 "}, 4),
        ({"x-data-parallel-rank": "+2"}, 2),
        ({"x-data-parallel-rank": str(2**32 - 1)}, 2**32 - 1),
        ({"x-data-parallel-rank": str(2**32)}, None),
        ({"x-data-parallel-rank": "-1"}, None),
        ({"x-data-parallel-rank": "1.5"}, None),
        ({"x-data-parallel-rank": "two"}, None),
        ({"x-data-parallel-rank": ""}, None),
        ({}, None),
    ],
)
def test_dp_rank_header(headers: dict[str, str], rank: int | None) -> None:
    env = bind({**JSON, **headers}).items[0]
    assert env.routing.dp_rank == rank


@pytest.mark.parametrize(
    ("headers", "fields", "client_id"),
    [
        ({}, {}, None),
        ({}, {"request_id": "body-id"}, "body-id"),
        ({"x-request-id": "hdr"}, {}, "hdr"),
        ({"x-request-id": "hdr"}, {"request_id": "body-id"}, "hdr"),  # the header wins
        ({"X-Request-Id": "  spaced  "}, {"request_id": "body-id"}, "spaced"),  # trimmed
        ({"x-request-id": "   "}, {"request_id": "body-id"}, "body-id"),  # blank: ignored
        ({"x-request-id": ""}, {}, None),
        ({}, {"request_id": ""}, None),
        ({}, {"request_id": None}, None),
    ],
)
def test_client_id_rules(headers: dict[str, str], fields: dict[str, Any], client_id: Any) -> None:
    bound = bind({**JSON, **headers}, **fields)
    assert bound.client_id == client_id
    assert all(env.client_id == client_id for env in bound.items)
    assert all(env.id == "" for env in bound.items)  # the handler mints private IDs
    assert all("request_id" not in env.engine for env in bound.items)


def test_case_insensitive_headers_work() -> None:
    headers = CIMultiDict({"Content-Type": "application/json", "X-REQUEST-ID": "abc"})
    headers["X-Data-Parallel-Rank"] = "1"
    bound = bind(headers)
    assert bound.client_id == "abc"
    assert bound.items[0].routing.dp_rank == 1


def test_stream_flag() -> None:
    assert bind(stream=True).stream is True
    assert bind(stream=False).stream is False
    assert bind(stream=None).stream is False


@pytest.mark.parametrize(
    ("options", "include", "continuous"),
    [
        (None, False, False),
        ({}, True, False),
        ({"include_usage": True}, True, False),
        ({"include_usage": None}, False, False),  # vLLM: bool(include_usage)
        ({"include_usage": False}, False, False),
        ({"continuous_usage_stats": True}, True, True),
        ({"include_usage": False, "continuous_usage_stats": True}, False, False),
    ],
)
def test_stream_options(options: Any, include: bool, continuous: bool) -> None:
    opts = bind(stream=True, stream_options=options).options
    assert (opts.include_usage, opts.continuous_usage) == (include, continuous)


def test_output_options() -> None:
    assert sp(logprobs=None).items[0].output.to_wire() == {}
    assert sp(logprobs=0).items[0].output.to_wire() == {"logprobs": True}
    assert sp(logprobs=3).items[0].output.to_wire() == {"logprobs": True, "top_logprobs": 3}
    # Prompt logprobs from position 0, with the larger top-k of the two.
    out = sp(logprobs=1, prompt_logprobs=4).items[0].output
    assert out.to_wire() == {"logprobs": True, "top_logprobs": 4, "prompt_logprobs_start": 0}
    out = sp(prompt_logprobs=0).items[0].output
    assert out.to_wire() == {"prompt_logprobs_start": 0}
    opts = sp(logprobs=1, prompt_logprobs=4).options
    assert (opts.logprobs, opts.prompt_logprobs) == (1, 4)


def test_one_token_prompt_can_ask_for_prompt_logprobs() -> None:
    bound = bind_raw(
        json.dumps({"token_ids": [9], "sampling_params": {"prompt_logprobs": 1}}).encode()
    )
    assert bound.items[0].output.prompt_logprobs_start == 0


def test_n_fans_out_into_one_envelope_per_sample() -> None:
    bound = sp(n=3, seed=10, logprobs=1, prompt_logprobs=2, max_tokens=4)
    assert len(bound.items) == 3
    assert [env.sampling.seed for env in bound.items] == [10, 11, 12]  # vLLM V1's children
    assert [env.engine["sampling_params"]["seed"] for env in bound.items] == [10, 11, 12]
    assert all(env.engine["sampling_params"]["n"] == 1 for env in bound.items)
    assert all(env.engine["sampling_params"]["max_tokens"] == 4 for env in bound.items)
    assert all(env.sampling.max_tokens == 4 for env in bound.items)
    # Prompt logprobs once, from sample 0; the others ask only for their own top-k.
    assert [env.output.prompt_logprobs_start for env in bound.items] == [0, None, None]
    assert [env.output.top_logprobs for env in bound.items] == [2, 1, 1]
    # Independent copies.
    bound.items[0].sampling.stop_token_ids.append(99)
    bound.items[0].routing.exclude.append("w")
    bound.items[0].engine["x"] = 1
    assert bound.items[1].sampling.stop_token_ids == []
    assert bound.items[1].routing.exclude == []
    assert "x" not in bound.items[1].engine


def test_n_without_seed_keeps_seeds_unset() -> None:
    bound = sp(n=2)
    assert [env.sampling.seed for env in bound.items] == [None, None]
    assert all(env.engine["sampling_params"] == {"n": 1} for env in bound.items)
    # n = 1 as sent stays as sent.
    assert sp(n=1).items[0].engine["sampling_params"] == {"n": 1}


def test_output_mode_tokens_is_accepted() -> None:
    bind(output_mode="tokens")


# ------------------------------------------------------------------- validation paths
# vLLM validates the body with pydantic and answers a failure from its
# RequestValidationError handler (frontend/entrypoints/serve/exception_handling/handlers/
# validation.py): "N validation error(s):" then each pydantic error as FastAPI reports it,
# type "Bad Request", param = the VLLMValidationError's parameter, else the first error's
# location without pydantic's markers (`clean_loc_for_param`).


def invalid(data: bytes, headers: Any = None) -> tuple[str, Any]:
    """A validation failure: (message, param), with the handler's envelope checked."""
    with pytest.raises(RequestRejected) as info:
        bind_raw(data, headers)
    err = info.value.body["error"]
    assert info.value.status == 400
    assert (err["type"], err["code"]) == ("Bad Request", 400)
    assert err["message"] == info.value.message
    return err["message"], err["param"]


@pytest.mark.parametrize(
    "headers",
    [
        {"content-type": "text/plain"},
        {"content-type": "application/x-www-form-urlencoded"},
        {"content-type": "application/jsonl"},
    ],
)
def test_only_json_content_types_are_accepted(headers: dict[str, str]) -> None:
    message, param = invalid(raw(), headers)
    assert message == (
        "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"
    )
    assert param is None


def test_the_content_type_is_checked_before_the_body() -> None:
    message, _ = invalid(b"{not json", {"content-type": "text/plain"})
    assert "Unsupported Media Type" in message
    # With no content type at all FastAPI parses the body as JSON first.
    message, _ = invalid(b"{not json", {})
    assert "JSON decode error" in message
    message, _ = invalid(raw(), {})
    assert "Unsupported Media Type" in message


def test_json_content_type_with_parameters_is_fine() -> None:
    bind({"Content-Type": "application/json; charset=utf-8"})


def test_non_json_bodies_get_fastapis_json_invalid_error() -> None:
    message, param = invalid(b'{"a": 1')
    assert message == (
        "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.7', "
        "'msg': 'JSON decode error', 'input': '<dict of 0 items>', "
        "'ctx': {'error': \"Expecting ',' delimiter\"}}"
    )
    assert param == "body.7"
    message, param = invalid(b"")
    assert message == (
        "1 validation error:\n  {'type': 'missing', 'loc': 'body', "
        "'msg': 'Field required', 'input': 'None'}"
    )
    assert param == "body"


def test_undecodable_bytes_are_a_parse_error() -> None:
    with pytest.raises(RequestRejected) as info:
        bind_raw(b'{"a": "\xff"}')
    assert info.value.body["error"]["message"] == "There was an error parsing the body"


@pytest.mark.parametrize("value", [[1, 2], "x", 3, None])
def test_body_must_be_an_object(value: Any) -> None:
    message, param = invalid(json.dumps(value).encode())
    assert "'type': 'model_type', 'loc': 'body'" in message
    assert param == "body"


def test_missing_token_ids_names_body_token_ids() -> None:
    message, param = invalid(b'{"sampling_params": {}}')
    assert message == (
        "1 validation error:\n  {'type': 'missing', 'loc': 'body.token_ids', "
        "'msg': 'Field required', 'input': '<dict of 1 items>'}"
    )
    assert param == "body.token_ids"


def test_two_errors_are_both_listed() -> None:
    message, param = invalid(b'{"token_ids": [], "stream": "maybe"}')
    assert message.startswith("3 validation errors:\n  {'type': 'too_short'")
    assert "'loc': 'body.sampling_params', 'msg': 'Field required'" in message
    assert "'loc': 'body.stream', 'msg': 'Input should be a valid boolean" in message
    assert param == "body.token_ids"


@pytest.mark.parametrize(
    ("fields", "fragment", "param"),
    [
        ({"token_ids": None}, "'msg': 'Input should be a valid list'", "body.token_ids"),
        ({"token_ids": "abc"}, "'msg': 'Input should be a valid list'", "body.token_ids"),
        ({"token_ids": []}, "List should have at least 1 item after validation, not 0",
         "body.token_ids"),
        ({"token_ids": [1, "x"]}, "unable to parse string as an integer", "body.token_ids.1"),
        ({"token_ids": [1, 2.5]}, "Input should be a valid integer, got a number with a "
         "fractional part", "body.token_ids.1"),
        ({"token_ids": [0, -1]}, "'msg': 'Value error, token_ids must not contain negative "
         "values'", "body.token_ids"),
        ({"sampling_params": None}, "Input should be an instance of SamplingParams",
         "body.sampling_params"),
        ({"model": 5}, "'msg': 'Input should be a valid string'", "body.model"),
        ({"request_id": 5}, "'msg': 'Input should be a valid string'", "body.request_id"),
        ({"stream": "maybe"}, "'msg': 'Input should be a valid boolean", "body.stream"),
        ({"stream_options": []}, "Input should be a valid dictionary or instance of "
         "StreamOptions", "body.stream_options"),
        ({"stream_options": {"include_usage": 3}}, "Input should be a valid boolean",
         "body.stream_options.include_usage"),
        ({"priority": "high"}, "unable to parse string as an integer", "body.priority"),
        ({"priority": 1.5}, "fractional part", "body.priority"),
        ({"priority": 2**63}, "Input should be less than or equal to 9223372036854775807",
         "body.priority"),
        ({"cache_salt": ""}, "String should have at least 1 character", "body.cache_salt"),
        ({"cache_salt": "x" * 1025}, "String should have at most 1024 characters",
         "body.cache_salt"),
        ({"kv_transfer_params": [1]}, "Input should be a valid dictionary",
         "body.kv_transfer_params"),
        ({"output_mode": "bytes"}, "Input should be 'tokens' or 'text'", "body.output_mode"),
        ({"features": "x"}, "Input should be a valid dictionary or instance of "
         "MultiModalFeatures", "body.features"),
        ({"output_mode": "text", "sampling_params": {"detokenize": False}},
         "output_mode='text' requires sampling_params.detokenize to be true", "body"),
    ],
)  # fmt: skip
def test_bad_top_level_fields(fields: dict[str, Any], fragment: str, param: str) -> None:
    message, got = invalid(raw(**fields))
    assert fragment in message
    assert got == param


@pytest.mark.parametrize(
    ("params", "message", "param"),
    [
        # vLLM SamplingParams' own wording (_verify_args), and its `parameter` when it has one.
        ({"n": 0}, "n must be at least 1, got 0.", None),
        ({"n": 16385}, "n must be at most 16384, got 16385. To increase this limit, set the "
         "VLLM_MAX_N_SEQUENCES environment variable.", None),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5.", None),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2], got -3.0.", None),
        ({"repetition_penalty": 0}, "repetition_penalty must be greater than zero, got 0.0.",
         None),
        ({"temperature": -0.1}, "temperature must be non-negative, got -0.1.", "temperature"),
        ({"temperature": 2.5}, "temperature must be in [0, 2], got 2.5.", "temperature"),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0.0.", "top_p"),
        ({"top_k": -2}, "top_k must be 0 (disable), or at least 1, got -2.", None),
        ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5.", None),
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0.", "max_tokens"),
        ({"min_tokens": -1}, "min_tokens must be greater than or equal to 0, got -1.", None),
        ({"max_tokens": 2, "min_tokens": 3},
         "min_tokens must be less than or equal to max_tokens=2, got 3.", None),
        ({"logprobs": -2}, "logprobs must be non-negative or -1, got -2.", "logprobs"),
        ({"prompt_logprobs": -5}, "prompt_logprobs must be non-negative or -1, got -5.",
         "prompt_logprobs"),
        ({"stream_interval": 0}, "stream_interval must be at least 1, got 0.", "stream_interval"),
        ({"stop": [""]}, "stop cannot contain an empty string.", None),
        ({"stop": ["x"], "detokenize": False}, "stop strings are only supported when "
         "detokenize is True. Set detokenize=True to use stop.", None),
        ({"temperature": 0, "n": 2}, "n must be 1 when using greedy sampling, got 2.", None),
    ],
)  # fmt: skip
def test_bad_sampling_values_get_vllms_words(
    params: dict[str, Any], message: str, param: str | None
) -> None:
    text, got = invalid(raw(sampling_params=params))
    # The newest vLLM's handler prints each `loc` cleaned, as it cleans `param`.
    assert text.startswith(
        "2 validation errors:\n  {'type': 'is_instance_of', 'loc': 'body.sampling_params'"
    )
    where = "'loc': 'body.sampling_params'"
    assert f"{where}, 'msg': 'Value error, {message}" in text or (
        f"{where}, 'msg': \"Value error, {message}" in text
    )
    # The VLLMValidationError's parameter, else the cleaned location of the first error.
    assert got == (param or "body.sampling_params")


def test_structured_outputs_take_one_constraint() -> None:
    text, _ = invalid(raw(sampling_params={"structured_outputs": {"regex": "a", "choice": ["b"]}}))
    assert (
        "'loc': 'body.sampling_params.structured_outputs', 'msg': \"Value error, You can only "
        "use one kind of structured outputs constraint but multiple are specified: {'json': None, "
        "'regex': 'a', 'choice': ['b'],"
    ) in text
    assert sp(structured_outputs={"regex": "a+"}).items[0].engine["sampling_params"] == {
        "structured_outputs": {"regex": "a+"}
    }


@pytest.mark.parametrize(
    ("params", "fragment", "where"),
    [
        ({"temperature": "hot"}, "unable to parse string as a number", "temperature"),
        ({"max_tokens": 1.5}, "fractional part", "max_tokens"),
        ({"ignore_eos": "maybe"}, "Input should be a valid boolean", "ignore_eos"),
        ({"stop": 5}, "Input should be a valid string", "stop"),
        ({"logit_bias": {"x": 1}}, "unable to parse string as an integer", "logit_bias.x"),
        ({"stop_token_ids": 5}, "Input should be a valid list", "stop_token_ids"),
        ({"output_kind": 7}, "Input should be 0, 1 or 2", "output_kind"),
    ],
)  # fmt: skip
def test_badly_typed_sampling_params(params: dict[str, Any], fragment: str, where: str) -> None:
    text, param = invalid(raw(sampling_params=params))
    assert fragment in text
    # Printed cleaned (newest vLLM's `_format_error`): pydantic's union-branch and
    # schema-kind markers (`function-after[...]`, `str`, `[key]`) are dropped.
    assert f"'loc': 'body.sampling_params.{where}'" in text
    # The first error is the union's is-instance branch: vLLM names its location.
    assert param == "body.sampling_params"


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        # pydantic's lax mode, which vLLM's validation is: these are accepted, not refused.
        ({"max_tokens": "5"}, 5),
        ({"max_tokens": 5.0}, 5),
        ({"max_tokens": None}, None),
    ],
)
def test_lax_values_are_coerced_as_vllm_coerces_them(
    params: dict[str, Any], expected: int | None
) -> None:
    assert sp(**params).items[0].sampling.max_tokens == expected


def test_vllm_post_init_normalisation() -> None:
    s = sp(temperature=0.001, seed=-1, stop_token_ids=[5, 4, 5], stop=[]).items[0].sampling
    assert s.temperature == 0.01  # vLLM raises tiny temperatures to 1e-2
    assert s.seed is None  # seed -1 means unseeded
    assert s.stop_token_ids == [5, 4]  # deduplicated, order kept
    greedy = sp(temperature=0, top_p=0.5, top_k=3, min_p=0.2).items[0].sampling
    assert (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, None, 0.0)


def test_unknown_fields_are_ignored_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """sglang-router's `return_bytes`, a typo in sampling_params, a future stream option:
    vLLM drops what it does not know (GenerateRequest and SamplingParams silently,
    StreamOptions with a log line); so does this format, logging each name once."""
    data = raw(
        return_bytes=True,
        zz_top_level_probe=1,
        sampling_params={"zz_sampling_probe": 1, "max_tokens": 3},
        stream_options={"zz_stream_probe": True},
    )
    with caplog.at_level("WARNING", logger="genmesh.formats.vllm.request"):
        env = bind_raw(data).items[0]
        bind_raw(data)
    assert env.sampling.max_tokens == 3
    assert env.engine["zz_top_level_probe"] == 1  # still forwarded to vLLM-speaking engines
    logged = " ".join(r.getMessage() for r in caplog.records)
    for name in ("zz_top_level_probe", "sampling_params.zz_sampling_probe",
                 "stream_options.zz_stream_probe"):  # fmt: skip
        assert logged.count(name) == 1


@pytest.mark.parametrize(
    "fields",
    [
        {"features": None, "content_parts": [], "ec_transfer_params": {}},
        {"output_mode": "tokens", "return_token_ids": False, "reasoning_ended": True},
        {"token_offsets": [[0, 1], [1, 2], [2, 3]], "assistant_tokens_mask": [0, 1, 1]},
        {"reasoning_parser_kwargs": {"chat_template_kwargs": {"enable_thinking": False}}},
        {"sampling_params": {"stop": None, "bad_words": [], "logprob_token_ids": None,
                             "thinking_token_budget": -1, "stream_interval": 4,
                             "repetition_detection": {"max_pattern_size": 0},
                             "flat_logprobs": True, "skip_reading_prefix_cache": True,
                             "routed_experts_prompt_start": 2}},
    ],
)  # fmt: skip
def test_fields_vllm_accepts_are_accepted_at_their_defaults(fields: dict[str, Any]) -> None:
    bind(**fields)


@pytest.mark.parametrize(
    ("fields", "fragment", "param"),
    [
        ({"content_parts": [{"type": "image_url"}]}, "multimodal inputs as content_parts",
         "content_parts"),
        ({"ec_transfer_params": {"a": 1}}, "encoder-cache", "ec_transfer_params"),
        ({"output_mode": "text"}, "output_mode 'text' is not supported", "output_mode"),
        ({"sampling_params": {"stop": "x"}}, "stop strings need a tokenizer", SP + "stop"),
        ({"sampling_params": {"bad_words": ["x"]}}, "bad_words need a tokenizer",
         SP + "bad_words"),
        ({"sampling_params": {"logprobs": -1}}, "logprobs=-1 (the whole vocabulary)",
         SP + "logprobs"),
        ({"sampling_params": {"logprob_token_ids": [1]}}, "logprob_token_ids is not supported",
         SP + "logprob_token_ids"),
        ({"sampling_params": {"thinking_token_budget": 10}},
         "thinking_token_budget is set but reasoning_config is not configured",
         "thinking_token_budget"),
        ({"sampling_params": {"n": MAX_N + 1}},
         f"sampling_params.n must be at most the server's max_num_seqs ({MAX_N}), got "
         f"{MAX_N + 1}.", None),
        ({"token_ids": [2**31]}, "Token id 2147483648 is out of vocabulary", "token_ids.0"),
        ({"sampling_params": {"stop_token_ids": [-1]}},
         "token_id(s) [-1] in stop_token_ids contain out-of-vocab token ids.",
         SP + "stop_token_ids"),
        ({"sampling_params": {"allowed_token_ids": []}},
         "allowed_token_ids is not None and empty!", "allowed_token_ids"),
    ],
)  # fmt: skip
def test_what_this_server_cannot_do_is_refused_by_value(
    fields: dict[str, Any], fragment: str, param: str | None
) -> None:
    exc = rejected(raw(**fields))
    assert fragment in exc.message
    assert exc.body["error"]["param"] == param


def test_fanned_out_seeds_must_fit_the_bus() -> None:
    assert [e.sampling.seed for e in sp(n=2, seed=2**64 - 2).items] == [2**64 - 2, 2**64 - 1]
    exc = rejected(raw(sampling_params={"n": 3, "seed": 2**64 - 2}))
    assert exc.message == f"seed must be in [-2**63, 2**64 - n], got {2**64 - 2}."
    assert exc.body["error"]["param"] == "sampling_params.seed"
    assert "does not fit in 64 bits" in rejected(raw(sampling_params={"seed": 2**64})).message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"sampling_params": {"extra_args": {"a": [1, -(2**63) - 1]}}},
            "sampling_params.extra_args.a[1]",
        ),
        ({"kv_transfer_params": {"remote_port": 10**30}}, "kv_transfer_params.remote_port"),
    ],
)
def test_integers_the_bus_cannot_carry_are_refused(fields: dict[str, Any], param: str) -> None:
    exc = rejected(raw(**fields))
    assert "does not fit in 64 bits" in exc.message
    assert exc.body["error"]["param"] == param


# ------------------------------------------------------------------ engine limits
# newest vLLM's tokens serving: an omitted max_tokens is `get_max_tokens` (the room left,
# capped by the generation config's max_new_tokens); a sent one beyond the room is a 400.

CTX = 10


def catalog(**defaults: float) -> EngineCatalog:
    return EngineCatalog([EngineInfo(model="m", context_length=CTX, sampling_defaults=defaults)])


def bind_with(engines: EngineCatalog, prompt: int, **params: Any) -> Bound:
    body = {"token_ids": list(range(1, prompt + 1)), "sampling_params": params}
    return FORMAT.bind(body, JSON, engines)


def refused_with(engines: EngineCatalog, prompt: int, **params: Any) -> RequestRejected:
    with pytest.raises(RequestRejected) as info:
        bind_with(engines, prompt, **params)
    assert info.value.body["error"]["type"] == "BadRequestError"
    return info.value


def test_omitted_max_tokens_is_the_room_left() -> None:
    assert bind_with(catalog(), 3).items[0].sampling.max_tokens == 7
    assert bind_with(catalog(), 3, max_tokens=None).items[0].sampling.max_tokens == 7


def test_omitted_max_tokens_is_capped_by_the_generation_config() -> None:
    assert bind_with(catalog(max_new_tokens=4), 3).items[0].sampling.max_tokens == 4
    assert bind_with(catalog(max_new_tokens=40), 3).items[0].sampling.max_tokens == 7
    # A sent value is the client's, the generation config notwithstanding.
    assert bind_with(catalog(max_new_tokens=4), 3, max_tokens=6).items[0].sampling.max_tokens == 6
    # Other generation-config defaults are not applied by the tokens route (it builds
    # SamplingParams from the body alone).
    s = bind_with(catalog(temperature=0.3, top_p=0.5), 3).items[0].sampling
    assert (s.temperature, s.top_p) == (1.0, 1.0)


def test_max_tokens_that_fit_are_kept() -> None:
    assert bind_with(catalog(), 3, max_tokens=7).items[0].sampling.max_tokens == 7


def test_max_tokens_beyond_the_room_are_refused_not_capped() -> None:
    exc = refused_with(catalog(), 3, max_tokens=8)
    assert exc.message == (
        "'max_tokens' or 'max_completion_tokens' is too large: 8. This model's maximum "
        "context length is 10 tokens and your request has 3 input tokens (8 > 10 - 3)."
    )
    assert exc.body["error"]["param"] == "max_tokens"
    # The overflow that once killed vLLM's engine (prompt + max_tokens past int32).
    assert "is too large: 2147483647" in refused_with(catalog(), 3, max_tokens=2**31 - 1).message


def test_prompts_longer_than_the_context() -> None:
    assert refused_with(catalog(), 11).message == (
        "Input length (11) exceeds model's maximum context length (10)."
    )
    assert refused_with(catalog(), 11, max_tokens=1).message == (
        "The decoder prompt (length 11) is longer than the maximum model length of 10. "
        "Make sure that `max_model_len` is no smaller than the number of text tokens."
    )
    assert refused_with(catalog(), 10).message == (
        "The decoder prompt (length 10) plus the number of requested output tokens (at "
        "least 1) is longer than the maximum model length of 10. Make sure that "
        "`max_model_len` is no smaller than the number of text tokens (prompt + requested "
        "output tokens)."
    )


def test_nothing_is_checked_when_the_catalog_knows_nothing_of_the_model() -> None:
    assert bind_with(NO_ENGINES, 50, max_tokens=10**6).items[0].sampling.max_tokens == 10**6
    assert bind_with(NO_ENGINES, 50).items[0].sampling.max_tokens is None
    body = {"token_ids": [1] * 50, "sampling_params": {"max_tokens": 10**6}, "model": "other"}
    assert FORMAT.bind(body, JSON, catalog()).items[0].sampling.max_tokens == 10**6


class _IdentityCodec:
    name = "identity"
    joiners: dict[str, Any] = {}

    def decode_request(self, request: Any) -> Any:
        return request

    def encode_record(self, record: Any) -> Any:
        return record


@pytest.mark.parametrize(
    "fmt", [FORMAT, CodecFormat(VllmFormat(), _IdentityCodec())], ids=["vllm", "vllm+codec"]
)
def test_a_generated_public_id_is_a_uuid4_hex(fmt: Any) -> None:
    ids = {fmt.new_public_id() for _ in range(50)}
    assert len(ids) == 50
    for public_id in ids:
        assert re.fullmatch(r"[0-9a-f]{32}", public_id)
        assert uuid.UUID(hex=public_id).version == 4


# ------------------------------------------------------------------------ rendering

VOCAB, EOS = 1000, 7


async def _frames(env: Envelope, speedup: float) -> list[frames.Frame]:
    engine = MockEngine(MockConfig(vocab_size=VOCAB, eos_token_id=EOS, speedup=speedup))
    return [output_frame("p", out) async for out in engine.generate(env)]


# A timed mock (one frame per token, as a real engine's decode steps give them) unless a
# test asks for the instant one, whose frames carry up to MOCK_CHUNK_TOKENS tokens.
TIMED = 1e6


def run(
    bound: Bound, public_id: str = "pub", speedup: float = TIMED
) -> tuple[VllmExchange, list[list[frames.Frame]]]:
    for env in bound.items:
        env.id = "p" * 32
    exchange = FORMAT.exchange(bound, public_id, 0.0)
    assert isinstance(exchange, VllmExchange)

    async def collect() -> list[list[frames.Frame]]:
        return [await _frames(env, speedup) for env in bound.items]

    return exchange, asyncio.run(collect())


def unary(bound: Bound, public_id: str = "pub", speedup: float = TIMED) -> dict[str, Any]:
    exchange, per_item = run(bound, public_id, speedup)
    mergers = [Merger(FORMAT.merge_rules, FORMAT.joiners) for _ in per_item]
    for index, item_frames in enumerate(per_item):
        for frame in item_frames:
            mergers[index].add(exchange.render(index, frame))
    body = exchange.body([m.result() for m in mergers])
    json.dumps(body, allow_nan=False)  # valid JSON
    return dict(body)


def sse(bound: Bound, public_id: str = "pub", speedup: float = TIMED) -> list[dict[str, Any]]:
    exchange, per_item = run(bound, public_id, speedup)
    chunks: list[dict[str, Any]] = []
    for index, item_frames in enumerate(per_item):
        for frame in item_frames:
            chunks += exchange.sse(index, exchange.render(index, frame))
    chunks += exchange.sse_end()
    json.dumps(chunks, allow_nan=False)
    return chunks


def test_unary_body_shape() -> None:
    body = unary(sp(max_tokens=4, ignore_eos=True), "abc")
    assert list(body) == ["request_id", "choices", "usage", "prompt_logprobs", "kv_transfer_params"]
    assert body["request_id"] == "generate-tokens-abc"
    (choice,) = body["choices"]
    assert list(choice) == ["index", "token_ids", "logprobs", "finish_reason", "stop_reason"]
    assert choice["index"] == 0
    assert len(choice["token_ids"]) == 4
    assert all(isinstance(t, int) for t in choice["token_ids"])
    assert choice["logprobs"] is None
    assert choice["finish_reason"] == "length"
    assert choice["stop_reason"] is None
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert body["prompt_logprobs"] is None
    assert body["kv_transfer_params"] is None


def test_output_logprobs_have_integer_ids_and_ranks() -> None:
    body = unary(sp(max_tokens=5, ignore_eos=True, logprobs=3))
    choice = body["choices"][0]
    content = choice["logprobs"]["content"]
    assert [e["token_id"] for e in content] == choice["token_ids"]
    for entry in content:
        assert list(entry) == ["token_id", "logprob", "rank", "top_logprobs"]
        assert entry["rank"] == 1  # the mock decodes greedily
        tops = entry["top_logprobs"]
        assert len(tops) == 3
        assert tops[0] == {k: entry[k] for k in ("token_id", "logprob", "rank")}
        assert [t["rank"] for t in tops] == [1, 2, 3]
        assert tops[0]["logprob"] >= tops[1]["logprob"] >= tops[2]["logprob"]
        assert all(isinstance(t["token_id"], int) for t in tops)


def test_logprobs_zero_is_the_sampled_token_only() -> None:
    content = unary(sp(max_tokens=3, ignore_eos=True, logprobs=0))["choices"][0]["logprobs"]
    # vLLM lists max(k, 1) entries: with k = 0, just the sampled token.
    for entry in content["content"]:
        assert entry["top_logprobs"] == [
            {"token_id": entry["token_id"], "logprob": entry["logprob"], "rank": entry["rank"]}
        ]
    assert all(isinstance(e["logprob"], float) for e in content["content"])


def test_sampled_token_comes_first_in_top_logprobs() -> None:
    top = [(10, -0.1), (11, -0.5), (12, -0.9)]
    # A token sampled below the top: it leads, then the best alternatives, k in all.
    assert top_entries(12, -0.9, 3, top, 2) == [
        {"token_id": 12, "logprob": -0.9, "rank": 3},
        {"token_id": 10, "logprob": -0.1, "rank": 1},
    ]
    assert top_entries(20, -4.0, 30, top, 3) == [
        {"token_id": 20, "logprob": -4.0, "rank": 30},
        {"token_id": 10, "logprob": -0.1, "rank": 1},
        {"token_id": 11, "logprob": -0.5, "rank": 2},
    ]
    # The greedy token: exactly the top k.
    assert [e["token_id"] for e in top_entries(10, -0.1, 1, top, 3)] == [10, 11, 12]
    # logprobs=0: vLLM still lists the sampled token (max(k, 1) entries).
    assert top_entries(10, -0.1, 1, top, 0) == [{"token_id": 10, "logprob": -0.1, "rank": 1}]


def test_logprobs_are_clamped_like_vllm() -> None:
    assert clamp(-math.inf) == -9999.0
    assert clamp(-12345.0) == -9999.0
    assert clamp(-1.5) == -1.5
    assert clamp(math.nan) == -9999.0


@pytest.mark.parametrize(
    ("finish", "expected"),
    [
        (None, (None, None)),
        ({"reason": "eos", "matched": 7}, ("stop", None)),
        ({"reason": "stop", "matched": 42}, ("stop", 42)),
        ({"reason": "stop"}, ("stop", None)),
        ({"reason": "length"}, ("length", None)),
        ({"reason": "abort", "message": "x"}, ("abort", None)),
        ({"reason": "weird"}, ("abort", None)),
    ],
)
def test_finish_reasons(finish: Any, expected: tuple[Any, Any]) -> None:
    assert finish_reason(finish) == expected


def test_prompt_logprobs_shape() -> None:
    prompt = [5, 6, 7, 8]
    body = unary(
        bind_raw(
            json.dumps(
                {"token_ids": prompt, "sampling_params": {"max_tokens": 2, "prompt_logprobs": 2}}
            ).encode()
        )
    )
    plp = body["prompt_logprobs"]
    assert len(plp) == len(prompt)
    assert plp[0] is None
    for pos, entry in enumerate(plp[1:], start=1):
        keys = list(entry)
        assert keys[0] == str(prompt[pos])  # the actual prompt token first
        assert 2 <= len(keys) <= 3  # plus the top 2 (one may be the token itself)
        for value in entry.values():
            assert list(value) == ["logprob", "rank", "decoded_token"]
            assert value["decoded_token"] is None
            assert isinstance(value["rank"], int)
        alt_ranks = [v["rank"] for k, v in entry.items() if k != str(prompt[pos])]
        assert alt_ranks == sorted(alt_ranks)
        assert set(alt_ranks) <= {1, 2}
    assert body["choices"][0]["logprobs"] is None  # no sample logprobs asked


def test_one_token_prompt_gives_one_null_entry() -> None:
    data = {"token_ids": [9], "sampling_params": {"max_tokens": 2, "prompt_logprobs": 1}}
    body = unary(bind_raw(json.dumps(data).encode()))
    assert body["prompt_logprobs"] == [None]
    assert len(body["choices"][0]["token_ids"]) >= 1


@pytest.mark.parametrize(("k_out", "k_prompt"), [(1, 4), (4, 1), (0, 3), (3, 0)])
def test_each_list_is_trimmed_to_its_own_k(k_out: int, k_prompt: int) -> None:
    body = unary(sp(max_tokens=3, ignore_eos=True, logprobs=k_out, prompt_logprobs=k_prompt))
    for entry in body["choices"][0]["logprobs"]["content"]:
        assert len(entry["top_logprobs"]) == max(k_out, 1)  # the sampled token at least
    for entry in body["prompt_logprobs"][1:]:
        alternatives = [v for v in entry.values() if v["rank"] <= k_prompt]
        assert len(entry) in (k_prompt, k_prompt + 1)
        assert len(alternatives) == k_prompt or len(entry) == k_prompt + 1


def test_prompt_logprobs_shorter_than_the_prompt_are_aligned_to_its_end() -> None:
    frame = {
        "t": "out",
        "tokens": [],
        "prompt_logprobs": [None, -1.0],
        "prompt_ranks": [None, 2],
        "prompt_top_logprobs": [None, [(4, -0.5), (3, -1.0)]],
    }
    assert prompt_logprobs(frame, [1, 2, 3], 1) == [
        None,
        None,
        {
            "3": {"logprob": -1.0, "rank": 2, "decoded_token": None},
            "4": {"logprob": -0.5, "rank": 1, "decoded_token": None},
        },
    ]
    # The token itself in the top list keeps its place first, once.
    assert list(prompt_logprobs(frame, [1, 2, 3], 2)[2]) == ["3", "4"]


def test_stop_token_sets_stop_reason() -> None:
    free = unary(sp(max_tokens=6, ignore_eos=True))["choices"][0]["token_ids"]
    stop = free[2]
    choice = unary(sp(max_tokens=6, stop_token_ids=[stop]))["choices"][0]
    assert choice["token_ids"] == free[: free.index(stop) + 1]
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == stop


def test_n_samples_are_choices_in_order() -> None:
    body = unary(sp(max_tokens=3, ignore_eos=True, n=2, seed=1))
    assert [c["index"] for c in body["choices"]] == [0, 1]
    one = unary(sp(max_tokens=3, ignore_eos=True, seed=1))["choices"][0]["token_ids"]
    two = unary(sp(max_tokens=3, ignore_eos=True, seed=2))["choices"][0]["token_ids"]
    assert [c["token_ids"] for c in body["choices"]] == [one, two]
    assert body["usage"]["prompt_tokens"] == 3  # the prompt counts once
    assert body["usage"]["completion_tokens"] == 6
    assert body["usage"]["total_tokens"] == 9


def test_sse_chunks() -> None:
    chunks = sse(sp(max_tokens=3, ignore_eos=True, logprobs=1), "abc")
    assert len(chunks) == 3  # no usage chunk without stream_options
    for chunk in chunks:
        assert list(chunk)[:3] == ["request_id", "choices", "usage"]
        assert chunk["request_id"] == "generate-tokens-abc"
        assert chunk["usage"] is None
        (choice,) = chunk["choices"]
        assert choice["index"] == 0
        assert len(choice["token_ids"]) == 1  # deltas
        assert len(choice["logprobs"]["content"]) == 1
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    body = unary(sp(max_tokens=3, ignore_eos=True, logprobs=1), "abc")
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == body["choices"][0][
        "token_ids"
    ]
    assert [e for c in chunks for e in c["choices"][0]["logprobs"]["content"]] == body["choices"][
        0
    ]["logprobs"]["content"]


def test_sse_of_multi_token_frames_says_what_one_token_frames_say() -> None:
    """The instant mock's frames carry many tokens (so do coalesced ones): the chunks are
    fewer, their concatenation and the unary body the same."""
    params = sp(max_tokens=70, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    coalesced, timed = sse(params, "abc", speedup=0.0), sse(params, "abc")
    assert len(coalesced) < len(timed)

    def joined(chunks: list[dict[str, Any]], key: str) -> list[Any]:
        out: list[Any] = []
        for chunk in chunks:
            value = chunk["choices"][0][key]
            out += value["content"] if key == "logprobs" else value
        return out

    for key in ("token_ids", "logprobs"):
        assert joined(coalesced, key) == joined(timed, key)
    assert coalesced[0]["prompt_logprobs"] == timed[0]["prompt_logprobs"]
    assert coalesced[-1]["choices"][0]["finish_reason"] == "length"
    assert unary(params, "abc", speedup=0.0) == unary(params, "abc")


def test_sse_carries_prompt_logprobs_once() -> None:
    chunks = sse(sp(max_tokens=3, ignore_eos=True, prompt_logprobs=1))
    assert "prompt_logprobs" in chunks[0]
    assert all("prompt_logprobs" not in c for c in chunks[1:])
    body = unary(sp(max_tokens=3, ignore_eos=True, prompt_logprobs=1))
    assert chunks[0]["prompt_logprobs"] == body["prompt_logprobs"]


def test_sse_usage_chunk_and_continuous_usage() -> None:
    chunks = sse(bind(stream=True, stream_options={}, sampling_params={"max_tokens": 2, "n": 2}))
    *data, last = chunks
    assert all(c["usage"] is None for c in data)
    assert last == {
        "request_id": last["request_id"],
        "choices": [],
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": 4,
            "total_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }
    chunks = sse(
        bind(
            stream=True,
            stream_options={"continuous_usage_stats": True},
            sampling_params={"max_tokens": 3, "ignore_eos": True},
        )
    )
    assert [c["usage"]["completion_tokens"] for c in chunks[:-1]] == [1, 2, 3]
    assert [c["usage"]["total_tokens"] for c in chunks[:-1]] == [4, 5, 6]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 3


def _exchange(**options: Any) -> VllmExchange:
    opts = {
        "prompt_tokens": 2,
        "logprobs": None,
        "prompt_logprobs": None,
        "model": None,
        "include_usage": False,
        "continuous_usage": False,
        **options,
    }
    return VllmExchange(VllmOptions(**opts), "id", [1, 2], 1)


def test_sse_skips_empty_frames_but_never_the_terminal_one() -> None:
    ex = _exchange()
    assert ex.sse(0, ex.render(0, {"t": "out", "tokens": []})) == []
    assert ex.sse(0, ex.render(0, {"t": "out", "tokens": [5]})) != []
    (end,) = ex.sse(0, ex.render(0, {"t": "end", "tokens": [], "finish": {"reason": "abort"}}))
    assert end["choices"][0]["token_ids"] == []
    assert end["choices"][0]["finish_reason"] == "abort"


def test_engine_metadata_is_kept_alongside_prompt_logprobs() -> None:
    ex = _exchange(prompt_logprobs=0)
    first = {
        "t": "out",
        "tokens": [3],
        "prompt_logprobs": [None, -0.5],
        "prompt_ranks": [None, 1],
        "engine": {"weight_version": "v1"},
    }
    last = {
        "t": "end",
        "tokens": [4],
        "finish": {"reason": "length"},
        "usage": {"prompt_tokens": 2, "completion_tokens": 2, "cached_tokens": 1},
        "engine": {
            "sampling_mask": [[0, 1, 1]],
            "kv_transfer_params": {"remote_block_ids": [[1]]},
            "token_ids": "not-allowed-to-override",
        },
    }
    records = [ex.render(0, first), ex.render(0, last)]
    chunks = [c for i, r in enumerate(records) for c in ex.sse(0, r)]
    body = ex.body([fold(records, MERGE_RULES)])
    assert body["prompt_logprobs"] == [
        None,
        {"2": {"logprob": -0.5, "rank": 1, "decoded_token": None}},
    ]
    choice = body["choices"][0]
    assert choice["token_ids"] == [3, 4]
    assert choice["sampling_mask"] == [[0, 1, 1]]
    assert choice["weight_version"] == "v1"  # metadata of different frames merges
    assert body["kv_transfer_params"] == {"remote_block_ids": [[1]]}
    assert "kv_transfer_params" not in choice
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}
    # The stream carries the same.
    assert chunks[0]["choices"][0]["weight_version"] == "v1"
    assert chunks[0]["prompt_logprobs"] == body["prompt_logprobs"]
    assert chunks[1]["choices"][0]["sampling_mask"] == [[0, 1, 1]]
    assert chunks[1]["choices"][0]["token_ids"] == [4]
    assert chunks[1]["kv_transfer_params"] == {"remote_block_ids": [[1]]}


def test_a_frame_with_only_metadata_is_streamed() -> None:
    ex = _exchange()
    (chunk,) = ex.sse(0, ex.render(0, {"t": "out", "tokens": [], "engine": {"x": 1}}))
    assert chunk["choices"][0] == {
        "index": 0,
        "token_ids": [],
        "logprobs": None,
        "finish_reason": None,
        "stop_reason": None,
        "x": 1,
    }


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "BadRequestError"),
        (404, "NotFoundError"),
        (413, None),
        (499, "RequestCancelledError"),
        (500, "InternalServerError"),
        (501, "NotImplementedError"),
        (503, "ServiceUnavailableError"),
        (504, "GatewayTimeoutError"),
        (599, "InternalServerError"),
    ],
)
def test_error_types(status: int, kind: str | None) -> None:
    name = error_type(status)
    if kind is not None:
        assert name == kind
    assert name.endswith("Error")
    assert not name.endswith("ErrorError")
    assert FORMAT.error_body(status, "m") == {
        "error": {"message": "m", "type": name, "param": None, "code": status}
    }


def test_exchange_errors() -> None:
    ex = _exchange(model="other-model")
    err = MeshError(ErrorCode.NOT_FOUND, "model 'other-model' is not served here; served: x")
    assert ex.error(err, 404) == {
        "error": {
            "message": "The model `other-model` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    err = MeshError(ErrorCode.UNAVAILABLE, "worker went away")
    assert ex.error(err, 503) == {
        "error": {
            "message": "worker went away",
            "type": "ServiceUnavailableError",
            "param": None,
            "code": 503,
        }
    }
    err = MeshError(ErrorCode.INVALID_ARGUMENT, "token id 5000 is outside the vocabulary")
    assert ex.error(err, 400)["error"]["type"] == "BadRequestError"


# ------------------------------------------------------------------ merge property

logprob = st.floats(min_value=-20, max_value=0, allow_nan=False)


@st.composite
def generations(draw: st.DrawFn) -> tuple[list[frames.Frame], list[int]]:
    """A generation as one frame per token, plus the sizes to regroup it into."""
    count = draw(st.integers(min_value=0, max_value=12))
    per_token = []
    for _ in range(count):
        token = draw(st.integers(min_value=0, max_value=50))
        per_token.append(
            (
                token,
                draw(logprob),
                draw(st.integers(min_value=1, max_value=40)),
                [(draw(st.integers(0, 50)), draw(logprob)) for _ in range(3)],
            )
        )
    cuts = draw(st.lists(st.integers(min_value=0, max_value=count), max_size=6))
    return per_token, sorted(set(cuts))


def _frames_of(
    per_token: list[Any], cuts: list[int], finish: dict[str, Any], engine: dict[str, Any]
) -> list[frames.Frame]:
    bounds = [0, *cuts, len(per_token)]
    out: list[frames.Frame] = []
    for n, (a, b) in enumerate(itertools.pairwise(bounds)):
        group = per_token[a:b]
        frame: frames.Frame = {
            "t": "out",
            "tokens": [t for t, _, _, _ in group],
            "logprobs": [lp for _, lp, _, _ in group],
            "ranks": [r for _, _, r, _ in group],
            "top_logprobs": [top for _, _, _, top in group],
        }
        if n == 0:
            frame["prompt_logprobs"] = [None, -0.25]
            frame["prompt_ranks"] = [None, 2]
            frame["prompt_top_logprobs"] = [None, [(9, -0.1), (8, -0.2)]]
            frame["cached_tokens"] = 1
        out.append(frame)
    out[-1]["t"] = "end"
    out[-1]["finish"] = finish
    out[-1]["usage"] = {"completion_tokens": len(per_token)}
    out[-1]["engine"] = engine
    return out


@settings(max_examples=200, deadline=None)
@given(
    generation=generations(),
    finish=st.sampled_from(
        [{"reason": "length"}, {"reason": "eos"}, {"reason": "stop", "matched": 3}]
    ),
    k=st.integers(min_value=0, max_value=3),
)
def test_folding_is_independent_of_how_tokens_are_split_into_frames(
    generation: tuple[list[Any], list[int]], finish: dict[str, Any], k: int
) -> None:
    per_token, cuts = generation
    engine = {"sampling_mask": [[1, 0]]}

    def render_all(frame_list: list[frames.Frame]) -> tuple[Any, list[Any]]:
        ex = _exchange(logprobs=k, prompt_logprobs=k, include_usage=True)
        records = [ex.render(0, f) for f in frame_list]
        chunks = [c for r in records for c in ex.sse(0, r)] + ex.sse_end()
        return ex.body([fold(records, MERGE_RULES)]), chunks

    whole, whole_chunks = render_all(_frames_of(per_token, [], finish, engine))
    split, split_chunks = render_all(_frames_of(per_token, cuts, finish, engine))
    assert split == whole
    # Streams differ in chunking only: the same tokens, logprobs and final usage.
    for chunks in (whole_chunks, split_chunks):
        data = [c for c in chunks if c["choices"]]
        assert [t for c in data for t in c["choices"][0]["token_ids"]] == [
            t for t, _, _, _ in per_token
        ]
        assert [e for c in data for e in c["choices"][0]["logprobs"]["content"]] == whole[
            "choices"
        ][0]["logprobs"]["content"]
        assert chunks[-1]["usage"] == whole["usage"]
        assert data[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert whole["usage"]["completion_tokens"] == len(per_token)


def test_the_ignored_names_remembered_are_bounded(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Clients choose the field names: the set of names logged once cannot grow forever."""
    from genmesh.formats.vllm import request as vllm_request

    monkeypatch.setattr(vllm_request.IGNORED, "seen", set())
    monkeypatch.setattr(vllm_request.IGNORED, "limit", 3)
    with caplog.at_level("WARNING", logger="genmesh.formats.vllm.request"):
        for i in range(10):
            bind_raw(raw(**{f"zz_bounded_{i}": 1}))
        bind_raw(raw(zz_bounded_9=1))
    assert len(vllm_request.IGNORED.seen) <= 3 + 1  # one request's names past the bound
    # Every name was logged at least once; a name past the bound is logged again.
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert all(f"zz_bounded_{i}" in logged for i in range(10))
    assert logged.count("zz_bounded_9") == 2


def test_error_messages_are_sanitised_as_vllm_does() -> None:
    """vLLM's `sanitize_message` runs on every error message: file paths (even in the
    client's own values, shown in a validation error's `input`) become `<path>`."""
    # (A string input is echoed; a whole body no longer is: the newest vLLM describes
    # containers as "<dict of N items>".)
    text, _ = invalid(b'{"sampling_params": {}, "token_ids": "/home/me/models/llama"}')
    assert "'msg': 'Input should be a valid list'" in text
    assert "/home/me" not in text
    assert "'input': '<path>'" in text
    assert error("bad <object at 0x7f3a2b>")["error"]["message"] == "bad <object>"


# ------------------------------------------------ logprob counts against max_logprobs


def limits(vocab: int | None, max_logprobs: int | None) -> EngineCatalog:
    info = EngineInfo(model="m", context_length=CTX, vocab_size=vocab, max_logprobs=max_logprobs)
    return EngineCatalog([info])


@pytest.mark.parametrize(
    ("params", "message", "param"),
    [
        ({"logprobs": 21}, "Requested sample logprobs of 21, which is greater than max "
         "allowed: 20 (parameter=logprobs, value=21)", "logprobs"),
        ({"logprobs": -1}, "Requested sample logprobs of 1000, which is greater than max "
         "allowed: 20 (parameter=logprobs, value=1000)", "logprobs"),
        ({"prompt_logprobs": 30}, "Requested prompt logprobs of 30, which is greater than max "
         "allowed: 20 (parameter=prompt_logprobs, value=30)", "prompt_logprobs"),
        # vLLM checks sample logprobs before prompt logprobs.
        ({"logprobs": 25, "prompt_logprobs": 30}, "Requested sample logprobs of 25", "logprobs"),
    ],
)  # fmt: skip
def test_logprob_counts_are_checked_against_max_logprobs(
    params: dict[str, Any], message: str, param: str
) -> None:
    rejected = refused_with(limits(1000, 20), 3, max_tokens=1, **params)
    assert rejected.body["error"]["message"].startswith(message)
    assert rejected.body["error"]["param"] == param


def test_logprobs_within_the_limit_pass_and_minus_one_is_the_vocabulary() -> None:
    item = bind_with(limits(1000, 20), 3, max_tokens=1, logprobs=20, prompt_logprobs=0).items[0]
    assert (item.output.logprobs, item.output.top_logprobs) == (True, 20)
    # 0 asks for the sampled token only: vLLM's walrus skips the check.
    assert bind_with(limits(1000, 5), 3, max_tokens=1, logprobs=0).items[0].output.top_logprobs == 0
    # An engine whose limit is its vocabulary (vLLM --max-logprobs -1) serves -1 in full.
    whole = bind_with(limits(50, 50), 3, max_tokens=1, logprobs=-1).items[0]
    assert whole.output.top_logprobs == 50
    assert whole.engine["sampling_params"]["logprobs"] == -1  # the engine gets the body


def test_without_a_stated_limit_the_engine_decides() -> None:
    # No max_logprobs in the cards: any count is passed on (a real vLLM checks its own).
    item = bind_with(limits(1000, None), 3, max_tokens=1, logprobs=500).items[0]
    assert item.output.top_logprobs == 500
    # No vocabulary size: -1 cannot be resolved.
    rejected = refused_with(limits(None, 20), 3, max_tokens=1, logprobs=-1)
    assert "needs the vocabulary size" in rejected.body["error"]["message"]
