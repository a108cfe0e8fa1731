"""SGLang /generate: `parse` + `bind` (request -> one envelope per generation) and
`SglangExchange` (frames -> records, SSE payloads, unary bodies)."""

from __future__ import annotations

import base64
import itertools
import json
import re
import struct
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict

from genmesh.formats.base import Bound, RequestRejected
from genmesh.formats.merge import Merger, fold
from genmesh.formats.sglang import SglangFormat, request
from genmesh.formats.sglang.request import (
    INTERNAL,
    UNSUPPORTED,
    ItemOptions,
    SglangOptions,
)
from genmesh.formats.sglang.response import (
    JOINERS,
    MERGE_RULES,
    SglangExchange,
    native_finish_reason,
)
from genmesh.formats.sglang.sampling import DEFAULT_MAX_NEW_TOKENS
from genmesh.shared import frames
from genmesh.shared.envelope import Envelope, OutputOptions, Routing, Sampling
from genmesh.shared.errors import ErrorCode, MeshError

pytestmark = pytest.mark.unit

RANDOM_ID = re.compile(r"^[0-9a-f]{32}$")


def body(**fields: Any) -> bytes:
    return json.dumps({"input_ids": [1, 2, 3], **fields}).encode()


def sp(**params: Any) -> bytes:
    return body(sampling_params=params)


def batch(*prompts: list[int], **fields: Any) -> bytes:
    return json.dumps({"input_ids": list(prompts), **fields}).encode()


def bind_raw(raw: bytes, headers: Any = None) -> Bound:
    """What the handler does: parse the bytes, then bind the JSON value."""
    return request.bind(request.parse(raw), headers if headers is not None else {})


def ok(raw: bytes, headers: dict[str, str] | None = None) -> Bound:
    return bind_raw(raw, headers)


def single(bound: Bound) -> Envelope:
    """The one envelope of a single (non-batch, n = 1) request."""
    assert len(bound.items) == 1
    assert isinstance(bound.options, SglangOptions)
    assert len(bound.options.items) == 1
    assert bound.options.multi is False
    return bound.items[0]


def item_options(bound: Bound) -> list[ItemOptions]:
    assert isinstance(bound.options, SglangOptions)
    assert len(bound.options.items) == len(bound.items)
    return bound.options.items


def rejected(raw: bytes, headers: dict[str, str] | None = None) -> RequestRejected:
    with pytest.raises(RequestRejected) as info:
        bind_raw(raw, headers)
    return info.value


def assert_legacy(exc: RequestRejected, fragment: str) -> None:
    """The pydantic-validation shape SGLang uses for wrong JSON types."""
    assert exc.status == 400
    assert exc.body == {
        "object": "error",
        "message": exc.message,
        "type": "Bad Request",
        "param": None,
        "code": 400,
    }
    assert fragment in exc.message


def assert_value(exc: RequestRejected, fragment: str) -> None:
    """The `{"error": {"message"}}` shape SGLang uses for ValueErrors."""
    assert exc.status == 400
    assert exc.body == {"error": {"message": exc.message}}
    assert fragment in exc.message


# ---------------------------------------------------------------- parse


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        (b'{"input_ids": [1]}', {"input_ids": [1]}),
        (b"[1, 2]", [1, 2]),
        (b"null", None),
        (b'"x"', "x"),
    ],
)
def test_parse_returns_the_json_value(raw: bytes, value: Any) -> None:
    assert request.parse(raw) == value


def test_bind_takes_parsed_json_not_bytes() -> None:
    env = single(request.bind({"input_ids": [4, 5]}, {}))
    assert env.token_ids == [4, 5]
    with pytest.raises(RequestRejected) as info:
        request.bind(b'{"input_ids": [4, 5]}', {})
    assert_legacy(info.value, "Input should be a dictionary or an instance of GenerateReqInput")


# ---------------------------------------------------------------- legacy-shape rejections
# What FastAPI refuses before SGLang's code runs (pydantic's lax mode on GenerateReqInput),
# worded as SGLang's RequestValidationError handler words it.

NON_INT64 = "contains non-int64 element"


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"", "{'type': 'missing', 'loc': ('body',), 'msg': 'Field required'"),
        (b"{input_ids: [1]}", "'type': 'json_invalid', 'loc': ('body', 1)"),
        (b"{input_ids: [1]}", "'ctx': {'error': 'Expecting property name enclosed in double"),
        (b"\xff\xfe\x00garbage", "'msg': 'JSON decode error'"),
        (b"[1, 2, 3]", "Input should be a dictionary or an instance of GenerateReqInput"),
        (b'"hello"', "'type': 'dataclass_type', 'loc': ('body',)"),
        (b"null", "'type': 'dataclass_type', 'loc': ('body',)"),
        (b"42", "'type': 'dataclass_type', 'loc': ('body',)"),
        (json.dumps({"input_ids": "1 2 3"}).encode(), "must be list or null; got str"),
        (json.dumps({"input_ids": {"0": 1}}).encode(), "must be list or null; got dict"),
        (json.dumps({"input_ids": [1, "2"]}).encode(), NON_INT64),
        (json.dumps({"input_ids": [1.5]}).encode(), "elements must be int or list; got float"),
        (batch([1], [1.5]), "row 1: elements must be int; got float"),
        (json.dumps({"input_ids": [2**63]}).encode(), NON_INT64),
        # not a batch (the first entry is a token), so a nested list is a bad token
        (json.dumps({"input_ids": [1, [2]]}).encode(), NON_INT64),
        # a batch (the first entry is a list): every entry must be a list of tokens
        (batch([1, 2], 3), "row 1: must be list; got int"),
        (batch([1], [2, "x"]), f"row 1: {NON_INT64}"),
        (batch([1], [[2]]), "row 1: elements must be int; got list"),
        (json.dumps({"input_ids": ["a"]}).encode(), "elements must be int or list; got str"),
        (body(rid=5), "'loc': ('body', 'rid', 'str'), 'msg': 'Input should be a valid string'"),
        (batch([1], [2], rid=5), "'loc': ('body', 'rid', 'list[str]')"),
        (body(sampling_params="greedy"), "Input should be a valid dictionary"),
        (body(sampling_params=3), "'loc': ('body', 'sampling_params', 'dict[str,any]')"),
        (batch([1], [2], sampling_params=[{}, "greedy"]), "Input should be a valid dictionary"),
        (batch([1], [2], sampling_params=[{}, None]), "Input should be a valid dictionary"),
        (body(stream=None), "'loc': ('body', 'stream'), 'msg': 'Input should be a valid boolean"),
        (batch([1], [2], stream=[True, False]), "'loc': ('body', 'stream')"),
        (body(priority="high"), "'loc': ('body', 'priority'), 'msg': 'Input should be a valid"),
        (body(extra_key=5), "'loc': ('body', 'extra_key', 'str')"),
        (body(return_logprob="maybe"), "'loc': ('body', 'return_logprob', 'bool')"),
        (body(token_ids_logprob=5), "'loc': ('body', 'token_ids_logprob'"),
        (body(token_ids_logprob=["a"]), "'loc': ('body', 'token_ids_logprob'"),
        (body(bootstrap_host=1), "'loc': ('body', 'bootstrap_host'"),
        # sampling_params: SGLang checks no types there (a wrong one fails later with a
        # 500); genmesh checks them strictly, and says where.
        (sp(max_new_tokens="10"), "'loc': ('body', 'sampling_params', 'max_new_tokens')"),
        (sp(max_new_tokens=1.5), "'loc': ('body', 'sampling_params', 'max_new_tokens')"),
        (sp(max_new_tokens=True), "'loc': ('body', 'sampling_params', 'max_new_tokens')"),
        (sp(min_new_tokens="1"), "'loc': ('body', 'sampling_params', 'min_new_tokens')"),
        (sp(n="2"), "'loc': ('body', 'sampling_params', 'n')"),
        (sp(n=True), "'loc': ('body', 'sampling_params', 'n')"),
        (sp(n=2.0), "'loc': ('body', 'sampling_params', 'n')"),
        (sp(temperature="hot"), "'sampling_params', 'temperature'), 'msg': 'Input should be"),
        (sp(temperature=True), "'sampling_params', 'temperature')"),
        (sp(top_p=[1]), "'sampling_params', 'top_p')"),
        (sp(min_p="0"), "'sampling_params', 'min_p')"),
        (sp(top_k=1.5), "'sampling_params', 'top_k'), 'msg': 'Input should be a valid integer"),
        (sp(frequency_penalty="x"), "'sampling_params', 'frequency_penalty')"),
        (sp(presence_penalty=False), "'sampling_params', 'presence_penalty')"),
        (sp(repetition_penalty="1"), "'sampling_params', 'repetition_penalty')"),
        (sp(stop_token_ids=7), "'sampling_params', 'stop_token_ids')"),
        (sp(stop_token_ids=[1, "2"]), "'sampling_params', 'stop_token_ids', 1)"),
        (sp(stop_token_ids=[True]), "'sampling_params', 'stop_token_ids', 0)"),
        (sp(sampling_seed="7"), "'sampling_params', 'sampling_seed')"),
        (sp(ignore_eos="yes"), "'sampling_params', 'ignore_eos'), 'msg': 'Input should be a"),
        (sp(ignore_eos=1), "'sampling_params', 'ignore_eos')"),
        (sp(json_schema={"type": "object"}), "'sampling_params', 'json_schema')"),
        (
            batch([1], [2], sampling_params=[{}, {"top_k": "5"}]),
            "'loc': ('body', 'sampling_params', 1, 'top_k')",
        ),
        (sp(temperature=10**400), "'sampling_params', 'temperature')"),
    ],
)
def test_type_errors_use_the_legacy_shape(raw: bytes, fragment: str) -> None:
    assert_legacy(rejected(raw), fragment)


def test_legacy_message_is_fastapis_summary_then_the_error_list() -> None:
    exc = rejected(body(rid=5, priority="x"))
    errors = [
        {"type": "string_type", "loc": ("body", "rid", "str"), "msg": "Input should be a valid "
         "string", "input": 5},
        {"type": "list_type", "loc": ("body", "rid", "list[str]"), "msg": "Input should be a "
         "valid list", "input": 5},
        {"type": "int_parsing", "loc": ("body", "priority"), "msg": "Input should be a valid "
         "integer, unable to parse string as an integer", "input": "x"},
    ]  # fmt: skip
    lines = "".join(f"\n  {err}" for err in errors)
    assert exc.message == f"3 validation errors:{lines} {errors}"


def test_a_body_that_cannot_be_read_is_fastapis_http_exception() -> None:
    exc = rejected(b"[" * 100_000)
    assert exc.status == 400
    assert exc.body == {
        "object": "error",
        "message": "There was an error parsing the body",
        "type": "400",
        "param": None,
        "code": 400,
    }


@pytest.mark.parametrize(
    ("fields", "check"),
    [
        # pydantic's lax mode, as FastAPI validates SGLang's body
        ({"stream": "yes"}, lambda b: b.stream is True),
        ({"stream": 0}, lambda b: b.stream is False),
        ({"return_logprob": 1}, lambda b: b.items[0].output.logprobs is True),
        (
            {"logprob_start_len": "0", "return_logprob": "true"},
            lambda b: b.items[0].output.prompt_logprobs_start == 0,
        ),
        (
            {"top_logprobs_num": 2.0, "return_logprob": True},
            lambda b: b.items[0].output.top_logprobs == 2,
        ),
        ({"routed_dp_rank": "1"}, lambda b: b.items[0].routing.dp_rank == 1),
        ({"data_parallel_rank": True}, lambda b: b.items[0].routing.dp_rank == 1),
        (
            {"return_routed_experts": "yes", "routed_experts_start_len": "1"},
            lambda b: b.items[0].output.routed_experts_start == 1,
        ),
        # booleans are ints to SGLang's input_ids check
        ({"input_ids": [1, True]}, lambda b: b.items[0].token_ids == [1, 1]),
        # text beside input_ids: the ids are the prompt (SGLang's precedence)
        ({"text": "Hello"}, lambda b: b.items[0].token_ids == [1, 2, 3]),
    ],
)  # fmt: skip
def test_lax_values_sglang_accepts_are_accepted(fields: dict[str, Any], check: Any) -> None:
    assert check(ok(body(**fields)))


# ---------------------------------------------------------------- value rejections


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        # prompts
        (json.dumps({"text": "Hello"}).encode(), request.SKIP_TOKENIZER_TEXT),
        (json.dumps({"text": ["a", "b"]}).encode(), "cannot accept text prompts"),
        (json.dumps({}).encode(), "Either text, input_ids or input_embeds should be provided."),
        (json.dumps({"input_ids": None}).encode(), "Either text, input_ids or input_embeds"),
        (json.dumps({"input_ids": []}).encode(), "input_ids cannot be empty."),
        (json.dumps({"input_ids": [[]]}).encode(), "input_ids cannot be empty."),
        (batch([1, 2], []), "input_ids cannot be empty."),
        (json.dumps({"input_ids": [1, -1]}).encode(), "input_ids[1]: token id -1 is out of range"),
        (json.dumps({"input_ids": [2**31]}).encode(), "out of range"),
        (batch([1], [2, -1]), "input_ids[1][1]: token id -1 is out of range"),
        (batch([2**31]), "input_ids[0][0]: token id 2147483648 is out of range"),
        # batch-only forms on a single request
        (body(rid=["a", "b"]), "The rid should be a string for a single request."),
        (body(rid=["a"]), "The rid should be a string for a single request."),
        (
            body(sampling_params=[{}, {}]),
            "sampling_params should be a scalar for a single request.",
        ),
        (body(sampling_params=[{}]), "sampling_params should be a scalar for a single request."),
        (body(return_logprob=[True]), "return_logprob should be a scalar for a single request."),
        (body(logprob_start_len=[0]), "logprob_start_len should be a scalar for a single"),
        (body(top_logprobs_num=[1]), "top_logprobs_num should be a scalar for a single request."),
        (body(token_ids_logprob=[[1], [2]]), "token_ids_logprob must be a flat list of integers."),
        # parallel sampling
        (sp(n=0), "sampling_params.n must be at least 1, got 0"),
        (sp(n=-3), "sampling_params.n must be at least 1, got -3"),
        # budgets
        (sp(max_new_tokens=-1), "max_new_tokens must be at least 0, got -1."),
        (
            sp(max_new_tokens=4, min_new_tokens=5),
            "min_new_tokens must be in [0, max_new_tokens(4)], got 5.",
        ),
        (sp(min_new_tokens=129), "min_new_tokens must be in [0, max_new_tokens(128)], got 129."),
        (sp(min_new_tokens=-1), "min_new_tokens must be in [0, max_new_tokens], got -1."),
        # sampling ranges (SGLang's SamplingParams.verify wording)
        (sp(temperature=-0.1), "temperature must be a non-negative finite number, got -0.1."),
        (sp(top_p=0), "top_p must be in (0, 1], got 0.0."),
        (sp(top_p=1.5), "top_p must be in (0, 1], got 1.5."),
        (sp(top_k=0), "top_k must be -1 (disable) or at least 1, got 0."),
        (sp(top_k=-2), "top_k must be -1 (disable) or at least 1, got -2."),
        (sp(min_p=-0.01), "min_p must be in [0, 1], got -0.01."),
        (sp(min_p=1.01), "min_p must be in [0, 1], got 1.01."),
        (sp(frequency_penalty=2.5), "frequency_penalty must be in [-2, 2], got 2.5."),
        (sp(frequency_penalty=-2.01), "frequency_penalty must be in [-2, 2], got -2.01."),
        (sp(presence_penalty=-3), "presence_penalty must be in [-2, 2], got -3.0."),
        (
            sp(repetition_penalty=0),
            "repetition_penalty must be in (0, 2] (1.0 = no penalty), got 0.0.",
        ),
        (
            sp(repetition_penalty=2.1),
            "repetition_penalty must be in (0, 2] (1.0 = no penalty), got 2.1.",
        ),
        (
            b'{"input_ids": [1], "sampling_params": {"temperature": Infinity}}',
            "temperature must be a non-negative finite number, got inf.",
        ),
        (
            b'{"input_ids": [1], "sampling_params": {"top_p": NaN}}',
            "top_p must be in (0, 1], got nan.",
        ),
        (sp(logit_bias={"x": 1.0}), "invalid literal for int() with base 10: 'x'"),
        (sp(logit_bias={"-1": 1.0}), "logit_bias must has keys in [0, vocab_size - 1], got -1."),
        (sp(stop_token_ids=[-1]), "stop_token_ids: token id -1 is out of range"),
        (sp(stop_token_ids=[2**31]), "stop_token_ids: token id 2147483648 is out of range"),
        # a key SamplingParams does not take: SGLang's SamplingParams(**params) refuses it
        (sp(foo=1), "Unexpected keyword argument 'foo'"),
        (sp(max_tokens=5), "Unexpected keyword argument 'max_tokens'"),
        # what needs a tokenizer, in SGLang's words
        (
            sp(stop="\n"),
            "stop=['\\n'] is unavailable when skip_tokenizer_init=True (requires tokenizer "
            "to decode tokens to text for matching).",
        ),
        (sp(stop=["</s>"]), "stop=['</s>'] is unavailable when skip_tokenizer_init=True"),
        (sp(stop=""), "stop=[''] is unavailable"),
        (sp(stop_regex="a+"), "stop_regex=['a+'] is unavailable when skip_tokenizer_init=True"),
        # guided decoding
        (sp(regex="a+", json_schema="{}"), "Only one of regex, json_schema, or ebnf can be set."),
        (sp(regex="a+", ebnf="root ::= 'a'"), "Only one of regex, json_schema, or ebnf"),
        (sp(json_schema="{}", ebnf="x", regex="y"), "Only one of regex, json_schema, or ebnf"),
        (sp(beam_width=2), "beam search (sampling_params.beam_width) is not supported"),
        # logprobs (the scheduler's 400 abort, in its words)
        (
            body(return_logprob=True, logprob_start_len=3),
            "req.logprob_start_len=3 is higher than the number of input tokens "
            "len(req.origin_input_ids)=3. Please use a smaller logprob_start_len.",
        ),
        (body(return_logprob=True, logprob_start_len=10), "req.logprob_start_len=10 is higher"),
        (body(logprob_start_len=-2), "logprob_start_len must be >= -1, got -2"),
        (body(top_logprobs_num=-1), "top_logprobs_num must be >= 0, got -1"),
        (body(token_ids_logprob=[-1]), "token_ids_logprob contains out-of-vocabulary token id -1"),
        # routing and sessions
        (body(routed_dp_rank=-1), "the data-parallel rank must be >= 0, got -1"),
        (body(data_parallel_rank=-3), "the data-parallel rank must be >= 0, got -3"),
        (body(session_id="s", session_params={}), "session_id and session_params cannot both"),
        (
            body(return_flat_raw_top_logprobs_b64=True),
            "return_flat_raw_top_logprobs_b64 requires return_flat_raw_top_logprobs.",
        ),
    ],
)
def test_value_errors_use_the_error_shape(raw: bytes, fragment: str) -> None:
    assert_value(rejected(raw), fragment)


def test_unknown_top_level_fields_are_ignored_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SGLang (FastAPI over a dataclass) ignores fields it does not know; sglang-router
    0.3.x adds `model` and `return_bytes` to every body."""
    name = "zeta_field_for_this_test"
    with caplog.at_level("INFO", logger="genmesh.formats"):
        for _ in range(3):
            env = single(ok(body(**{name: 1, "model": "m", "return_bytes": False})))
            assert env.token_ids == [1, 2, 3]
            # Unknown fields stay out of the engine's native payload.
            assert env.engine == {"return_bytes": False}
    mentions = [r for r in caplog.records if name in r.getMessage()]
    assert len(mentions) == 1
    assert "SGLang" in mentions[0].getMessage()


def test_unknown_fields_do_not_hide_a_missing_prompt() -> None:
    exc = rejected(json.dumps({"prompt": "hi"}).encode())
    assert_value(exc, "Either text, input_ids or input_embeds should be provided.")


INTERNAL_VALUES = {
    "bootstrap_host": ("h", ["h", "i"]),
    "bootstrap_port": (8998, [1, 2]),
    "bootstrap_room": (7, [1, 2]),
    "bootstrap_pair_key": ("k", ["k", "l"]),
    "decode_tp_size": (2, [2, 2]),
    "disagg_prefill_dp_rank": (1, 1),
}


@pytest.mark.parametrize("field", INTERNAL)
def test_internal_bootstrap_fields_refused(field: str) -> None:
    scalar, listed = INTERNAL_VALUES[field]
    exc = rejected(body(**{field: scalar}))
    assert_value(exc, f"`{field}` is internal routing state and cannot be set by clients")
    exc = rejected(batch([1], [2], **{field: listed}))
    assert_value(exc, f"`{field}` is internal routing state")


def test_internal_fields_may_be_null() -> None:
    bound = ok(body(**dict.fromkeys(INTERNAL)))
    assert single(bound).token_ids == [1, 2, 3]


# Per field of UNSUPPORTED: a value that asks for it, and values that ask for nothing.
UNSUPPORTED_VALUES: dict[str, tuple[Any, list[Any]]] = {
    "input_embeds": ([[0.5, 0.25]], [None, []]),
    "image_data": ("http://x/cat.png", [None, [], "", [None], {}]),
    "video_data": ("v.mp4", [None, [], ""]),
    "audio_data": ("a.wav", [None, [], ""]),
    "return_hidden_states": (True, [None, False, [False]]),
    "custom_logit_processor": ("{}", [None, "", [None]]),
    "session_params": ({"id": "s"}, [None, {}]),
    "return_sampling_mask": (True, [None, False]),
    "return_flat_raw_top_logprobs": (True, [False]),
    "return_indexer_topk": (True, [False]),
    "positional_embed_overrides": ({"embeds": []}, [None]),
    "multi_item_delimiter_indices": ([3], [None, []]),
    "max_thinking_tokens": (64, [None]),
}


def test_every_unsupported_field_has_values_to_test() -> None:
    assert set(UNSUPPORTED_VALUES) == set(UNSUPPORTED)


@pytest.mark.parametrize(("field", "reason"), sorted(UNSUPPORTED.items()))
def test_unsupported_fields_refused(field: str, reason: str) -> None:
    exc = rejected(body(**{field: UNSUPPORTED_VALUES[field][0]}))
    assert_value(exc, reason)
    assert exc.message == reason


@pytest.mark.parametrize(
    ("field", "empty"),
    [
        (field, empty)
        for field, (_, empties) in sorted(UNSUPPORTED_VALUES.items())
        for empty in empties
    ],
)
def test_unsupported_fields_with_empty_values_accepted(field: str, empty: Any) -> None:
    assert single(ok(body(**{field: empty}))).engine[field] == empty


@pytest.mark.parametrize("stop", [None, []])
def test_empty_stop_accepted(stop: Any) -> None:
    assert single(ok(sp(stop=stop))).sampling.stop_token_ids == []


def test_one_guided_key_is_accepted_and_passed_through() -> None:
    bound = ok(sp(regex="a+", json_schema=None))
    assert single(bound).engine["sampling_params"]["regex"] == "a+"


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0},
        {"top_p": 1},
        {"top_p": 1e-9},
        {"top_k": -1},
        {"top_k": 1},
        {"min_p": 0},
        {"min_p": 1},
        {"frequency_penalty": -2, "presence_penalty": 2},
        {"repetition_penalty": 2},
        {"max_new_tokens": 0},
        {"max_new_tokens": 5, "min_new_tokens": 5},
        {"n": 1},
        {"n": None},
    ],
)
def test_boundary_values_accepted(params: dict[str, Any]) -> None:
    single(ok(sp(**params)))


def test_logprob_start_len_only_checked_with_return_logprob() -> None:
    bound = ok(body(logprob_start_len=50))
    assert single(bound).output == OutputOptions()


# Fields SGLang accepts that change nothing genmesh does (or that a real SGLang engine
# behind an adapter reads from the native payload), each with a value that is not its default.
ACCEPTED = {
    "lora_path": "adapter",
    "return_text_in_logprobs": True,
    "modalities": ["image"],
    "background": True,
    "conversation_id": "c-1",
    "custom_labels": {"team": "x"},
    "no_logs": True,
    "return_entropy": True,
    "return_prompt_token_ids": True,
    "log_metrics": False,
    "require_reasoning": True,
    "routing_key": "k",
    "return_bytes": True,
    "kv_router_hint": {"source_control_endpoint": "e", "block_hashes": []},
    "use_audio_in_video": True,
    "video_config": {"fps": 2},
    "mm_hashes": ["ab"],
    "lora_id": "l",
    "http_worker_ipc": "ipc://x",
    "external_trace_header": {"traceparent": "00-x"},
    "received_time": 1.5,
    "need_wait_for_mm_inputs": False,
    "encoder_urls": ["http://e"],
    "max_dynamic_patch": 4,
    "images_config": {"k": 1},
}


@pytest.mark.parametrize(("field", "value"), sorted(ACCEPTED.items()))
def test_accepted_fields_are_kept_in_the_native_payload(field: str, value: Any) -> None:
    engine = single(ok(body(**{field: value}))).engine
    # Nothing else of the body leaks into the engine payload.
    assert engine == {field: value}


# ---------------------------------------------------------------- projection


def test_defaults() -> None:
    bound = ok(json.dumps({"input_ids": [5, 6]}).encode())
    env = single(bound)
    assert env.id == ""  # minted by the shared handler
    assert env.format == "sglang"
    assert env.token_ids == [5, 6]
    assert env.sampling == Sampling(max_tokens=DEFAULT_MAX_NEW_TOKENS)
    assert DEFAULT_MAX_NEW_TOKENS == 128
    assert env.output == OutputOptions()
    assert env.routing == Routing()
    assert env.client_id is None
    assert env.engine == {}  # the native payload is the body as sent
    assert bound.stream is False
    assert bound.client_id is None
    assert bound.migration is None
    assert bound.options == SglangOptions(
        items=[
            ItemOptions(
                public_id=None,
                prompt_tokens=2,
                return_logprob=False,
                top_logprobs_num=0,
                max_new_tokens=128,
                return_routed_experts=False,
            )
        ],
        multi=False,
    )


def test_null_max_new_tokens_means_uncapped() -> None:
    bound = ok(sp(max_new_tokens=None))
    assert single(bound).sampling.max_tokens is None
    assert item_options(bound)[0].max_new_tokens is None


def test_sampling_projection() -> None:
    env = single(
        ok(
            sp(
                max_new_tokens=64,
                min_new_tokens=2,
                temperature=0.7,
                top_p=0.9,
                top_k=40,
                min_p=0.05,
                sampling_seed=1234,
                stop_token_ids=[2, 151645],
                ignore_eos=True,
                frequency_penalty=0.5,
            )
        )
    )
    assert env.sampling == Sampling(
        max_tokens=64,
        min_tokens=2,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=1234,
        stop_token_ids=[],  # SGLang's ignore_eos silences stop token ids too
        ignore_eos=True,
    )
    assert isinstance(env.sampling.temperature, float)
    without = single(ok(sp(stop_token_ids=[2, 151645])))
    assert without.sampling.stop_token_ids == [2, 151645]


def test_top_k_minus_one_is_none() -> None:
    assert single(ok(sp(top_k=-1))).sampling.top_k is None


def test_integer_sampling_numbers_become_floats() -> None:
    s = single(ok(sp(temperature=1, top_p=1, min_p=0))).sampling
    assert (s.temperature, s.top_p, s.min_p) == (1.0, 1.0, 0.0)
    assert all(isinstance(v, float) for v in (s.temperature, s.top_p, s.min_p))


def test_return_logprob_default_start_is_last_prompt_position() -> None:
    bound = ok(body(return_logprob=True))
    assert single(bound).output == OutputOptions(
        logprobs=True, top_logprobs=0, prompt_logprobs_start=2
    )
    assert item_options(bound)[0].return_logprob is True


def test_return_logprob_with_start_and_top() -> None:
    bound = ok(body(return_logprob=True, logprob_start_len=0, top_logprobs_num=5))
    assert single(bound).output == OutputOptions(
        logprobs=True, top_logprobs=5, prompt_logprobs_start=0
    )
    assert item_options(bound)[0].top_logprobs_num == 5


def test_explicit_minus_one_start() -> None:
    bound = ok(body(return_logprob=True, logprob_start_len=-1))
    assert single(bound).output.prompt_logprobs_start == 2


def test_logprob_options_ignored_without_return_logprob() -> None:
    bound = ok(body(top_logprobs_num=5, logprob_start_len=0))
    assert single(bound).output == OutputOptions()
    assert item_options(bound)[0].top_logprobs_num == 0
    assert item_options(bound)[0].return_logprob is False


def test_stream_flag() -> None:
    assert ok(body(stream=True)).stream is True
    assert ok(body(stream=False)).stream is False
    assert ok(batch([1], [2], stream=True)).stream is True
    assert ok(body(stream=True, sampling_params={"n": 2})).stream is True


def test_rid_is_the_client_id() -> None:
    bound = ok(body(rid="my-req"))
    assert bound.client_id == "my-req"
    assert single(bound).client_id == "my-req"
    assert item_options(bound)[0].public_id == "my-req"


def test_x_request_id_header_is_the_client_id() -> None:
    bound = ok(body(), {"x-request-id": "  hdr-1 "})
    assert bound.client_id == "hdr-1"
    assert single(bound).client_id == "hdr-1"
    assert item_options(bound)[0].public_id == "hdr-1"


def test_header_lookup_is_case_insensitive_with_aiohttp_headers() -> None:
    headers = CIMultiDict({"X-Request-ID": "hdr-2"})
    assert bind_raw(body(), headers).client_id == "hdr-2"


def test_blank_header_is_no_client_id() -> None:
    bound = ok(body(), {"x-request-id": "   "})
    assert bound.client_id is None
    assert single(bound).client_id is None
    assert item_options(bound)[0].public_id is None


def test_rid_wins_over_header() -> None:
    bound = ok(body(rid="from-body"), {"x-request-id": "from-header"})
    assert bound.client_id == "from-body"
    assert single(bound).client_id == "from-body"


def test_routing_projection() -> None:
    env = single(ok(body(routed_dp_rank=2, priority=-5, extra_key="tenant-a")))
    assert env.routing == Routing(dp_rank=2, priority=-5, cache_salt="tenant-a")


def test_legacy_data_parallel_rank() -> None:
    assert single(ok(body(data_parallel_rank=1))).routing.dp_rank == 1
    # the newer name wins when both are sent
    assert single(ok(body(data_parallel_rank=1, routed_dp_rank=3))).routing.dp_rank == 3


def test_native_fields_kept_for_the_engine() -> None:
    raw = body(
        rid="r",
        stream=True,
        sampling_params={"max_new_tokens": 4, "skip_special_tokens": False},
        return_logprob=True,
        lora_path="adapter",
        routed_dp_rank=0,
        custom_labels={"team": "x"},
        text=None,
    )
    engine = single(ok(raw)).engine
    assert engine == {
        "sampling_params": {"max_new_tokens": 4, "skip_special_tokens": False},
        "return_logprob": True,
        "lora_path": "adapter",
        "routed_dp_rank": 0,
        "custom_labels": {"team": "x"},
    }


def test_bound_envelope_is_valid_on_the_wire() -> None:
    bound = ok(
        body(
            rid="r",
            return_logprob=True,
            top_logprobs_num=2,
            routed_dp_rank=1,
            sampling_params={"max_new_tokens": None, "stop_token_ids": [9], "top_k": -1},
        )
    )
    env = single(bound)
    env.id = "minted"
    assert Envelope.from_wire(env.to_wire()) == env


def test_batch_envelopes_are_valid_on_the_wire() -> None:
    bound = ok(
        batch(
            [1, 2, 3],
            [4],
            rid="r",
            return_logprob=True,
            top_logprobs_num=2,
            routed_dp_rank=1,
            token_ids_logprob=[5, 9],
            sampling_params=[{"max_new_tokens": None, "n": 2}, {"stop_token_ids": [9], "n": 2}],
        )
    )
    assert len(bound.items) == 4
    for i, env in enumerate(bound.items):
        env.id = f"minted-{i}"
        assert Envelope.from_wire(env.to_wire()) == env


def test_format_object_delegates() -> None:
    fmt = SglangFormat(SglangFormat.default_routes())
    assert [(r.method, r.path) for r in fmt.routes] == [("POST", "/generate"), ("PUT", "/generate")]
    assert [(r.method, r.path) for r in SglangFormat().routes] == [
        ("POST", "/generate"),
        ("PUT", "/generate"),
    ]
    assert fmt.merge_rules is MERGE_RULES
    assert fmt.joiners is JOINERS
    assert fmt.parse(body(rid="x")) == {"input_ids": [1, 2, 3], "rid": "x"}
    with pytest.raises(RequestRejected) as info:
        fmt.parse(b"{nope")
    assert_legacy(info.value, "'msg': 'JSON decode error'")
    bound = fmt.bind(fmt.parse(body(rid="x")), {})
    assert bound.client_id == "x"
    # 5xx answers take SGLang's HTTPException shape; the rest {"error": {"message"}}.
    assert fmt.error_body(400, "bad") == {"error": {"message": "bad"}}
    assert fmt.error_body(503, "not ready") == {
        "object": "error",
        "message": "not ready",
        "type": "503",
        "param": None,
        "code": 503,
    }
    exchange = fmt.exchange(bound, "pub", 0.0)
    assert isinstance(exchange, SglangExchange)


# ---------------------------------------------------------------- fixed bugs


def test_min_new_tokens_unbounded_when_max_new_tokens_null() -> None:
    bound = ok(sp(max_new_tokens=None, min_new_tokens=200))
    assert single(bound).sampling.min_tokens == 200


def test_huge_integer_sampling_number_is_rejected() -> None:
    raw = b'{"input_ids": [1], "sampling_params": {"temperature": 1' + b"0" * 400 + b"}}"
    exc = rejected(raw)
    assert exc.status == 400


# ---------------------------------------------------------------- batch and n > 1: fan-out


def test_batch_input_fans_out_one_item_per_prompt() -> None:
    bound = ok(batch([1, 2], [3], [4, 5, 6]))
    assert [env.token_ids for env in bound.items] == [[1, 2], [3], [4, 5, 6]]
    opts = item_options(bound)
    assert isinstance(bound.options, SglangOptions)
    assert bound.options.multi is True
    assert [o.prompt_tokens for o in opts] == [2, 1, 3]
    assert all(env.id == "" and env.format == "sglang" for env in bound.items)
    assert all(env.sampling == Sampling(max_tokens=128) for env in bound.items)
    assert bound.client_id is None
    assert bound.stream is False


def test_a_batch_of_one_is_still_multi() -> None:
    bound = ok(batch([7, 8]))
    assert [env.token_ids for env in bound.items] == [[7, 8]]
    assert isinstance(bound.options, SglangOptions)
    assert bound.options.multi is True
    # an array answer needs an id per item: none sent, so a fresh one is minted
    assert RANDOM_ID.match(item_options(bound)[0].public_id or "")


def test_n_fans_out_samples_of_one_prompt() -> None:
    bound = ok(sp(n=3, max_new_tokens=7, temperature=0.5))
    assert len(bound.items) == 3
    assert isinstance(bound.options, SglangOptions)
    assert bound.options.multi is True
    for env, opts in zip(bound.items, item_options(bound), strict=True):
        assert env.token_ids == [1, 2, 3]
        assert env.sampling == Sampling(max_tokens=7, temperature=0.5)
        assert opts.prompt_tokens == 3
        assert opts.max_new_tokens == 7


@pytest.mark.parametrize(("prompts", "n"), [(1, 1), (1, 4), (3, 1), (3, 2), (2, 5)])
def test_fan_out_is_prompts_times_n_with_samples_contiguous(prompts: int, n: int) -> None:
    inputs = [[10 + p] * (p + 1) for p in range(prompts)]
    max_new = [5 + p for p in range(prompts)]
    raw = batch(*inputs, sampling_params=[{"n": n, "max_new_tokens": m} for m in max_new])
    bound = ok(raw)
    assert len(bound.items) == prompts * n
    assert [env.token_ids for env in bound.items] == [p for p in inputs for _ in range(n)]
    assert [env.sampling.max_tokens for env in bound.items] == [
        m for m in max_new for _ in range(n)
    ]
    assert [o.prompt_tokens for o in item_options(bound)] == [
        len(p) for p in inputs for _ in range(n)
    ]


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.lists(st.integers(min_value=0, max_value=1000), min_size=1, max_size=5),
        min_size=1,
        max_size=5,
    ),
    st.integers(min_value=1, max_value=4),
    st.booleans(),
)
def test_fan_out_order_property(prompts: list[list[int]], n: int, as_batch: bool) -> None:
    if not as_batch:
        prompts = prompts[:1]
    ids: Any = prompts if as_batch else prompts[0]
    bound = ok(json.dumps({"input_ids": ids, "sampling_params": {"n": n}}).encode())
    assert len(bound.items) == len(prompts) * n
    for i, env in enumerate(bound.items):
        assert env.token_ids == prompts[i // n]
    assert isinstance(bound.options, SglangOptions)
    assert bound.options.multi is (as_batch or n > 1)
    public_ids = [o.public_id for o in item_options(bound)]
    assert [env.client_id for env in bound.items] == public_ids
    if bound.options.multi:
        assert all(RANDOM_ID.match(p or "") for p in public_ids)
        assert len(set(public_ids)) == len(public_ids)
    else:
        assert public_ids == [None]


def test_explicit_n_one_on_a_batch_is_one_item_per_prompt() -> None:
    bound = ok(batch([1], [2], sampling_params={"n": 1}))
    assert [env.token_ids for env in bound.items] == [[1], [2]]


def test_every_batch_entry_must_share_n() -> None:
    assert_value(
        rejected(batch([1], [2], sampling_params=[{"n": 1}, {"n": 2}])),
        "The parallel_sample_num should be the same for all samples in sample params.",
    )
    # a missing n is n = 1
    assert_value(
        rejected(batch([1], [2], sampling_params=[{}, {"n": 2}])),
        "The parallel_sample_num should be the same for all samples in sample params.",
    )
    assert len(ok(batch([1], [2], sampling_params=[{}, {"n": 1}])).items) == 2
    assert len(ok(batch([1], [2], sampling_params=[{"n": 2}, {"n": 2}])).items) == 4
    assert len(ok(batch([1], [2], sampling_params=[{}, {"n": None}])).items) == 2


# ---------------------------------------------------------------- per-prompt fields


def test_per_prompt_sampling_params() -> None:
    bound = ok(
        batch(
            [1],
            [2, 3],
            sampling_params=[{"max_new_tokens": 4, "temperature": 0}, {}],
        )
    )
    first, second = bound.items
    # SGLang's SamplingParams: a zero temperature is greedy, top_k = 1.
    assert first.sampling == Sampling(max_tokens=4, temperature=0.0, top_k=1)
    assert second.sampling == Sampling(max_tokens=DEFAULT_MAX_NEW_TOKENS)
    assert [o.max_new_tokens for o in item_options(bound)] == [4, DEFAULT_MAX_NEW_TOKENS]


def test_scalar_sampling_params_apply_to_every_prompt() -> None:
    bound = ok(batch([1], [2], [3], sampling_params={"max_new_tokens": 9, "top_k": 5}))
    assert all(env.sampling == Sampling(max_tokens=9, top_k=5) for env in bound.items)
    assert [o.max_new_tokens for o in item_options(bound)] == [9, 9, 9]


def test_each_prompts_sampling_params_are_validated() -> None:
    exc = rejected(batch([1], [2], sampling_params=[{"top_p": 0.5}, {"top_p": 2}]))
    assert_value(exc, "top_p must be in (0, 1], got 2.0.")


@pytest.mark.parametrize(
    ("field", "values"),
    [
        ("sampling_params", [{}]),
        ("sampling_params", [{}, {}, {}]),
        ("return_logprob", [True]),
        ("logprob_start_len", [0, 0, 0]),
        ("top_logprobs_num", []),
    ],
)
def test_per_prompt_list_length_must_match_the_batch(field: str, values: list[Any]) -> None:
    exc = rejected(batch([1], [2], **{field: values}))
    assert_value(exc, f"The length of {field} should be equal to the batch size.")


def test_per_prompt_logprob_fields() -> None:
    bound = ok(
        batch(
            [1, 2, 3],
            [4, 5],
            [6],
            return_logprob=[True, False, True],
            logprob_start_len=[0, 99, -1],
            top_logprobs_num=[3, 4, 0],
        )
    )
    assert [env.output for env in bound.items] == [
        OutputOptions(logprobs=True, top_logprobs=3, prompt_logprobs_start=0),
        OutputOptions(),  # not asked: its (too large) start is not checked
        OutputOptions(logprobs=True, top_logprobs=0, prompt_logprobs_start=0),
    ]
    opts = item_options(bound)
    assert [o.return_logprob for o in opts] == [True, False, True]
    assert [o.top_logprobs_num for o in opts] == [3, 0, 0]


def test_scalar_logprob_fields_apply_to_every_prompt() -> None:
    bound = ok(batch([1, 2, 3], [4, 5], return_logprob=True, top_logprobs_num=2))
    assert [env.output for env in bound.items] == [
        OutputOptions(logprobs=True, top_logprobs=2, prompt_logprobs_start=2),
        OutputOptions(logprobs=True, top_logprobs=2, prompt_logprobs_start=1),
    ]


def test_logprob_start_len_is_checked_against_each_prompt() -> None:
    # a scalar start that fits the first prompt but not the second
    exc = rejected(batch([1, 2, 3], [4], return_logprob=True, logprob_start_len=1))
    assert_value(
        exc,
        "req.logprob_start_len=1 is higher than the number of input tokens "
        "len(req.origin_input_ids)=1.",
    )
    # per-prompt starts
    exc = rejected(batch([1, 2], [4, 5], return_logprob=[False, True], logprob_start_len=[5, 2]))
    assert_value(exc, "req.logprob_start_len=2 is higher than the number of input tokens")
    exc = rejected(batch([1], [2], logprob_start_len=[0, -2]))
    assert_value(exc, "logprob_start_len must be >= -1, got -2")
    exc = rejected(batch([1], [2], top_logprobs_num=[0, -1]))
    assert_value(exc, "top_logprobs_num must be >= 0, got -1")


# ---------------------------------------------------------------- rids


def test_scalar_rid_on_a_batch_numbers_the_items() -> None:
    bound = ok(batch([1], [2], [3], rid="req"))
    assert bound.client_id == "req"
    assert [env.client_id for env in bound.items] == ["req_0", "req_1", "req_2"]
    assert [o.public_id for o in item_options(bound)] == ["req_0", "req_1", "req_2"]


def test_x_request_id_header_on_a_batch_is_used_like_a_scalar_rid() -> None:
    bound = ok(batch([1], [2]), {"x-request-id": " hdr "})
    assert bound.client_id == "hdr"
    assert [env.client_id for env in bound.items] == ["hdr_0", "hdr_1"]
    assert [o.public_id for o in item_options(bound)] == ["hdr_0", "hdr_1"]
    # the body's rid wins over the header
    bound = ok(batch([1], [2], rid="body"), {"x-request-id": "hdr"})
    assert [env.client_id for env in bound.items] == ["body_0", "body_1"]


def test_a_list_of_rids_names_each_prompt() -> None:
    bound = ok(batch([1], [2], [3], rid=["a", "b", "c"]), {"x-request-id": "hdr"})
    assert [env.client_id for env in bound.items] == ["a", "b", "c"]
    assert [o.public_id for o in item_options(bound)] == ["a", "b", "c"]
    # no single client id for the whole request (the handler mints the header's)
    assert bound.client_id is None


def test_rid_list_must_be_unique() -> None:
    exc = rejected(batch([1], [2], [3], rid=["a", "b", "a"]))
    assert_value(exc, "Duplicate request IDs detected within the request: ['a']")


@pytest.mark.parametrize("rids", [["a"], ["a", "b", "c"], []])
def test_rid_list_must_match_the_batch(rids: list[str]) -> None:
    assert_value(
        rejected(batch([1], [2], rid=rids)),
        "The specified rids length mismatch with the batch_size for batch processing.",
    )


@pytest.mark.parametrize("rids", [["a", 5], ["a", None], [["a"], "b"]])
def test_rid_list_must_hold_strings(rids: list[Any]) -> None:
    assert_legacy(rejected(batch([1], [2], rid=rids)), "rid")


def test_batch_without_rid_gets_fresh_distinct_ids() -> None:
    bound = ok(batch([1], [2], [3]))
    ids = [env.client_id for env in bound.items]
    assert all(RANDOM_ID.match(i or "") for i in ids)
    assert len(set(ids)) == 3
    assert [o.public_id for o in item_options(bound)] == ids
    assert bound.client_id is None


@pytest.mark.parametrize(
    ("raw", "headers"),
    [
        (sp(n=3), {}),
        (body(rid="mine", sampling_params={"n": 3}), {}),
        (body(sampling_params={"n": 3}), {"x-request-id": "hdr"}),
        (batch([1], [2], rid="mine", sampling_params={"n": 2}), {}),
        (batch([1], [2], rid=["a", "b"], sampling_params={"n": 2}), {}),
    ],
)
def test_n_above_one_gives_every_sample_a_fresh_random_id(
    raw: bytes, headers: dict[str, str]
) -> None:
    first = ok(raw, headers)
    again = ok(raw, headers)
    ids = [env.client_id for env in first.items]
    assert all(RANDOM_ID.match(i or "") for i in ids)
    assert len(set(ids)) == len(ids)
    assert [o.public_id for o in item_options(first)] == ids
    # fresh on every request, unrelated to what was sent
    assert not set(ids) & {env.client_id for env in again.items}
    assert not set(ids) & {"mine", "hdr", "a", "b", "mine_0", "mine_1", "hdr_0"}


def test_n_above_one_keeps_the_client_id_of_the_request() -> None:
    assert ok(body(rid="mine", sampling_params={"n": 2})).client_id == "mine"
    assert ok(sp(n=2), {"x-request-id": "hdr"}).client_id == "hdr"
    assert ok(sp(n=2)).client_id is None


# ---------------------------------------------------------------- native payload per item


def test_each_item_carries_its_own_native_fields() -> None:
    sps = [{"max_new_tokens": 1, "no_stop_trim": True, "n": 2}, {"max_new_tokens": 2, "n": 2}]
    bound = ok(
        batch(
            [1, 2],
            [3],
            rid=["x", "y"],
            stream=True,
            sampling_params=sps,
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=1,
            lora_path=["adapter-a", "adapter-b"],
            custom_labels={"team": "t"},
            routed_dp_rank=0,
        )
    )
    shared = {
        "custom_labels": {"team": "t"},
        "routed_dp_rank": 0,
        "top_logprobs_num": 1,
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    expected = [
        {
            **shared,
            "sampling_params": {**sps[b], "n": 1},  # each sample is one generation
            "lora_path": ["adapter-a", "adapter-b"][b],
        }
        for b in (0, 0, 1, 1)
    ]
    assert [env.engine for env in bound.items] == expected
    for env in bound.items:
        assert not {"input_ids", "rid", "stream", "text"} & set(env.engine)


def test_scalar_native_fields_are_repeated_per_item() -> None:
    bound = ok(batch([1], [2], sampling_params={"top_k": 3}, return_logprob=True))
    assert [env.engine for env in bound.items] == [
        {"sampling_params": {"top_k": 3}, "return_logprob": True}
    ] * 2


def test_absent_logprob_fields_stay_absent_in_the_native_payload() -> None:
    bound = ok(batch([1], [2], sampling_params=[{"top_k": 3}, {"top_k": 4}]))
    assert [env.engine for env in bound.items] == [
        {"sampling_params": {"top_k": 3}},
        {"sampling_params": {"top_k": 4}},
    ]


@pytest.mark.parametrize(
    "raw",
    [
        batch([1, 2], [3, 4], sampling_params={"stop_token_ids": [7]}, routed_dp_rank=1),
        body(sampling_params={"n": 3, "stop_token_ids": [7]}, routed_dp_rank=1),
        batch([1], [2], sampling_params={"n": 2, "stop_token_ids": [7]}, routed_dp_rank=1),
    ],
)
def test_items_do_not_share_sampling_or_routing(raw: bytes) -> None:
    bound = ok(raw)
    first, *others = bound.items
    assert others
    before = [(env.sampling.stop_token_ids[:], env.routing.exclude[:]) for env in others]
    for env in others:
        assert env.sampling is not first.sampling
        assert env.routing is not first.routing
        assert env.sampling.stop_token_ids is not first.sampling.stop_token_ids
        assert env.routing.exclude is not first.routing.exclude
    first.sampling.stop_token_ids.append(99)
    first.sampling.max_tokens = 1
    first.sampling.temperature = 0.0
    first.routing.exclude.append("w-bad")
    first.routing.dp_rank = 5
    for env, (stops, exclude) in zip(others, before, strict=True):
        assert env.sampling.stop_token_ids == stops == [7]
        assert env.sampling.max_tokens == DEFAULT_MAX_NEW_TOKENS
        assert env.sampling.temperature is None
        assert env.routing.exclude == exclude == []
        assert env.routing.dp_rank == 1


def test_routing_applies_to_every_item() -> None:
    bound = ok(batch([1], [2], routed_dp_rank=2, priority=3, extra_key="salt"))
    assert all(
        env.routing == Routing(dp_rank=2, priority=3, cache_salt="salt") for env in bound.items
    )


# ---------------------------------------------------------------- routed experts (bind)


def test_routed_experts_projection() -> None:
    bound = ok(batch([1, 2, 3], [4, 5], return_routed_experts=True, routed_experts_start_len=1))
    assert [env.output.routed_experts_start for env in bound.items] == [1, 1]
    assert [o.return_routed_experts for o in item_options(bound)] == [True, True]
    off = ok(body(routed_experts_start_len=99))  # only checked when asked for
    assert single(off).output.routed_experts_start is None
    assert item_options(off)[0].return_routed_experts is False


def test_routed_experts_start_is_checked_against_each_prompt() -> None:
    exc = rejected(batch([1, 2, 3], [4], return_routed_experts=True, routed_experts_start_len=2))
    assert_value(exc, "routed_experts_start_len must be in [0, 1] (the prompt length), got 2")
    exc = rejected(body(return_routed_experts=True, routed_experts_start_len=-1))
    assert_value(exc, "routed_experts_start_len must be in [0, 3]")


# ---------------------------------------------------------------- bugs found and fixed


def test_engine_payload_is_the_body_as_sent() -> None:
    assert single(ok(json.dumps({"input_ids": [5, 6]}).encode())).engine == {}
    assert single(ok(body(lora_path="v"))).engine == {"lora_path": "v"}
    assert single(ok(body(sampling_params=None))).engine == {"sampling_params": None}


def test_native_payload_of_a_sample_asks_for_one_generation() -> None:
    bound = ok(batch([1], [2], sampling_params={"n": 3}))
    assert len(bound.items) == 6
    for env in bound.items:
        assert env.engine["sampling_params"].get("n", 1) == 1


def test_top_logprobs_num_list_with_n_above_one_is_rejected() -> None:
    exc = rejected(
        batch([1], [2], return_logprob=True, top_logprobs_num=[1, 2], sampling_params={"n": 2})
    )
    assert exc.status == 400


def test_rid_list_entry_of_wrong_type_is_a_type_error() -> None:
    assert_legacy(rejected(batch([1], [2], rid=["a", 5])), "rid")


def test_lora_path_list_is_per_prompt() -> None:
    bound = ok(batch([1], [2], lora_path=["a", "b"]))
    assert [env.engine["lora_path"] for env in bound.items] == ["a", "b"]


class FanOutRunawayError(Exception):
    """Raised by the guard below when bind mints far more item ids than any sane request."""


def test_huge_n_is_rejected_before_fanning_out(monkeypatch: pytest.MonkeyPatch) -> None:
    minted = itertools.count()

    def guarded_id() -> str:
        if next(minted) > 100_000:
            raise FanOutRunawayError
        return "x" * 32

    monkeypatch.setattr(request, "new_public_id", guarded_id)
    exc = rejected(sp(n=10**9))
    assert exc.status == 400


# ---------------------------------------------------------------- rendering


def item(
    *,
    logprob: bool = False,
    top: int = 0,
    max_new: int | None = 16,
    prompt: int = 3,
    public_id: str | None = None,
    experts: bool = False,
) -> ItemOptions:
    return ItemOptions(
        public_id=public_id,
        prompt_tokens=prompt,
        return_logprob=logprob,
        top_logprobs_num=top,
        max_new_tokens=max_new,
        return_routed_experts=experts,
    )


def options(
    *, logprob: bool = False, top: int = 0, max_new: int | None = 16, prompt: int = 3
) -> SglangOptions:
    return SglangOptions(
        items=[item(logprob=logprob, top=top, max_new=max_new, prompt=prompt)], multi=False
    )


def out_frame(seq: int, tokens: list[int], **extra: Any) -> dict[str, Any]:
    return {"t": frames.OUT, "id": "r", "seq": seq, "tokens": tokens, **extra}


def end_frame(seq: int, tokens: list[int], finish: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "t": frames.END,
        "id": "r",
        "seq": seq,
        "tokens": tokens,
        "finish": finish,
        "usage": {},
        **extra,
    }


def render_one(frame: dict[str, Any], opts: SglangOptions | None = None) -> dict[str, Any]:
    exchange = SglangExchange(opts or options(), "pub-1", [[1, 2, 3]], time.monotonic())
    return exchange.render(0, frame)


@pytest.mark.parametrize(
    ("finish", "max_new", "expected"),
    [
        ({"reason": "eos", "matched": 151645}, 16, {"type": "stop", "matched": 151645}),
        ({"reason": "stop", "matched": 2}, 16, {"type": "stop", "matched": 2}),
        ({"reason": "length"}, 16, {"type": "length", "length": 16}),
        ({"reason": "length"}, None, {"type": "length", "length": None}),
        (
            {"reason": "abort", "message": "queue full", "status_code": 503, "err_type": "x"},
            16,
            {"type": "abort", "message": "queue full", "status_code": 503, "err_type": "x"},
        ),
        (
            {"reason": "abort"},
            16,
            {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None},
        ),
    ],
)
def test_finish_reason_shapes(
    finish: dict[str, Any], max_new: int | None, expected: dict[str, Any]
) -> None:
    assert native_finish_reason(finish, max_new) == expected
    record = render_one(end_frame(1, [9], finish), options(max_new=max_new))
    if max_new is None and finish["reason"] == "length":
        # Uncapped: the exchange reports the length the engine stopped at.
        expected = {"type": "length", "length": 1}
    assert record["meta_info"]["finish_reason"] == expected


def test_stream_of_records() -> None:
    exchange = SglangExchange(options(prompt=3), "pub-1", [[1, 2, 3]], time.monotonic())
    records = [
        exchange.render(0, out_frame(1, [], cached_tokens=2)),
        exchange.render(0, out_frame(2, [10])),
        exchange.render(0, out_frame(3, [11, 12])),
        exchange.render(0, end_frame(4, [13], {"reason": "length"})),
    ]
    assert all(list(r) == ["output_ids", "meta_info"] for r in records)
    assert [c["output_ids"] for c in records] == [[], [10], [11, 12], [13]]
    metas = [c["meta_info"] for c in records]
    assert [m["completion_tokens"] for m in metas] == [0, 1, 3, 4]
    assert all(m["id"] == "pub-1" for m in metas)
    assert all(m["prompt_tokens"] == 3 for m in metas)
    assert [m["cached_tokens"] for m in metas] == [2, 2, 2, 2]
    assert [m["finish_reason"] for m in metas[:-1]] == [None] * 3
    assert metas[-1]["finish_reason"] == {"type": "length", "length": 16}
    # e2e latency only on the final record
    assert ["e2e_latency" in m for m in metas] == [False, False, False, True]
    assert 0 <= metas[-1]["e2e_latency"] < 5
    # no logprob keys unless asked
    assert not any(k.endswith("logprobs") for m in metas for k in m)
    assert "routed_experts" not in metas[-1]
    assert list(metas[0]) == [
        "id",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
    ]


def test_finish_on_an_out_frame_is_ignored() -> None:
    record = render_one(out_frame(1, [4], finish={"reason": "length"}))
    assert record["meta_info"]["finish_reason"] is None
    assert "e2e_latency" not in record["meta_info"]


def test_e2e_latency_measured_from_receipt() -> None:
    exchange = SglangExchange(options(), "p", [[1]], time.monotonic() - 2.5)
    record = exchange.render(0, end_frame(1, [], {"reason": "length"}))
    assert 2.5 <= record["meta_info"]["e2e_latency"] < 10


def test_logprob_triples_and_input_logprobs_on_every_record() -> None:
    prompt = [1, 2, 3]
    exchange = SglangExchange(options(logprob=True, top=2), "pub", [prompt], time.monotonic())
    first = out_frame(
        1,
        [10],
        logprobs=[-0.1],
        top_logprobs=[[[10, -0.1], [11, -0.5]]],
        prompt_logprobs=[None, -1.5],
        prompt_top_logprobs=[None, [[3, -1.5], [4, -2.0]]],
    )
    second = out_frame(2, [11, 12], logprobs=[-0.2, -0.3], top_logprobs=[[[11, -0.2]], None])
    last = end_frame(3, [13], {"reason": "eos", "matched": 13}, logprobs=[-0.4], top_logprobs=[[]])
    records = [exchange.render(0, f) for f in (first, second, last)]
    metas = [c["meta_info"] for c in records]
    expected_input = [[None, 2, None], [-1.5, 3, None]]
    expected_input_top = [None, [[-1.5, 3, None], [-2.0, 4, None]]]
    for meta in metas:
        assert meta["input_token_logprobs"] == expected_input
        assert meta["input_top_logprobs"] == expected_input_top
    assert [m["output_token_logprobs"] for m in metas] == [
        [[-0.1, 10, None]],
        [[-0.2, 11, None], [-0.3, 12, None]],
        [[-0.4, 13, None]],
    ]
    assert [m["output_top_logprobs"] for m in metas] == [
        [[[-0.1, 10, None], [-0.5, 11, None]]],
        [[[-0.2, 11, None]], None],
        [[]],
    ]


def test_later_prompt_logprobs_do_not_replace_the_first() -> None:
    # A migrated attempt reports prompt logprobs for prompt + replayed output; ignore them.
    exchange = SglangExchange(options(logprob=True), "pub", [[1, 2, 3]], time.monotonic())
    exchange.render(0, out_frame(1, [], prompt_logprobs=[None]))
    record = exchange.render(0, out_frame(1, [7], logprobs=[-1.0], prompt_logprobs=[None, -9.0]))
    assert record["meta_info"]["input_token_logprobs"] == [[None, 3, None]]


def test_input_logprobs_empty_until_they_arrive() -> None:
    exchange = SglangExchange(options(logprob=True), "pub", [[1, 2, 3]], time.monotonic())
    record = exchange.render(0, out_frame(1, [7], logprobs=[-1.0]))
    assert record["meta_info"]["input_token_logprobs"] == []
    assert "input_top_logprobs" not in record["meta_info"]  # top_logprobs_num is 0


def test_error_body() -> None:
    exchange = SglangExchange(options(), "pub", [[1]], time.monotonic())
    err = MeshError(ErrorCode.NO_WORKER, "no worker serves model m")
    assert exchange.error(err, 503) == {
        "object": "error",
        "message": "no worker serves model m",
        "type": "503",
        "param": None,
        "code": 503,
    }
    invalid = MeshError(ErrorCode.INVALID_ARGUMENT, "no such token")
    assert exchange.error(invalid, 400) == {"error": {"message": "no such token"}}


def test_bind_then_render_a_mock_like_stream() -> None:
    """The options bind produces drive the renderer: a logprob request end to end."""
    bound = ok(body(return_logprob=True, top_logprobs_num=1, sampling_params={"max_new_tokens": 2}))
    fmt = SglangFormat(SglangFormat.default_routes())
    exchange = fmt.exchange(bound, "pub-7", time.monotonic())
    c1 = exchange.render(
        0,
        out_frame(
            1,
            [5],
            logprobs=[-0.5],
            top_logprobs=[[[5, -0.5]]],
            prompt_logprobs=[None],
            prompt_top_logprobs=[None],
        ),
    )
    c2 = exchange.render(
        0, end_frame(2, [6], {"reason": "length"}, logprobs=[-0.7], top_logprobs=[[[6, -0.7]]])
    )
    assert c1["meta_info"]["input_token_logprobs"] == [[None, 3, None]]
    assert c1["meta_info"]["input_top_logprobs"] == [None]
    assert c2["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    assert c2["meta_info"]["completion_tokens"] == 2
    assert c2["meta_info"]["id"] == "pub-7"


# ---------------------------------------------------------------- rendering several items


def two_items() -> SglangExchange:
    opts = SglangOptions(
        items=[
            item(public_id="a", prompt=2, max_new=4, logprob=True),
            item(public_id=None, prompt=1, max_new=None),
        ],
        multi=True,
    )
    return SglangExchange(opts, "pub-handler", [[1, 2], [3]], time.monotonic())


def test_items_keep_their_own_state() -> None:
    exchange = two_items()
    r = [
        exchange.render(0, out_frame(1, [10], logprobs=[-0.1], prompt_logprobs=[None])),
        exchange.render(1, out_frame(1, [20, 21], cached_tokens=1)),
        exchange.render(0, out_frame(2, [11, 12], logprobs=[-0.2, -0.3])),
        exchange.render(1, end_frame(2, [22], {"reason": "length"})),
        exchange.render(0, end_frame(3, [], {"reason": "length"}, logprobs=[])),
    ]
    metas = [x["meta_info"] for x in r]
    assert [m["id"] for m in metas] == ["a", "pub-handler", "a", "pub-handler", "a"]
    assert [m["completion_tokens"] for m in metas] == [1, 2, 3, 3, 3]
    assert [m["prompt_tokens"] for m in metas] == [2, 1, 2, 1, 2]
    assert [m["cached_tokens"] for m in metas] == [0, 1, 0, 1, 0]
    assert metas[3]["finish_reason"] == {"type": "length", "length": 3}  # uncapped: generated
    assert metas[4]["finish_reason"] == {"type": "length", "length": 4}
    # logprobs only for the item that asked, from its own prompt
    assert metas[0]["input_token_logprobs"] == [[None, 2, None]]
    assert metas[4]["input_token_logprobs"] == [[None, 2, None]]
    assert not any("input_token_logprobs" in metas[i] for i in (1, 3))


def test_sse_carries_index_only_when_multi() -> None:
    exchange = two_items()
    record = exchange.render(1, out_frame(1, [5]))
    snapshot = json.loads(json.dumps(record))
    assert exchange.sse(1, record) == [{**snapshot, "index": 1}]
    assert exchange.sse(0, record) == [{**snapshot, "index": 0}]
    assert record == snapshot  # the record itself is not changed
    assert exchange.sse_end() == []

    alone = SglangExchange(options(), "pub", [[1, 2, 3]], time.monotonic())
    record = alone.render(0, out_frame(1, [5]))
    (payload,) = alone.sse(0, record)
    assert payload == record
    assert "index" not in payload
    assert alone.sse_end() == []


def test_body_is_the_object_for_a_single_request_and_the_list_otherwise() -> None:
    records = [{"output_ids": [1], "meta_info": {"id": "a"}}, {"output_ids": [], "meta_info": {}}]
    assert two_items().body(records) == records
    alone = SglangExchange(options(), "pub", [[1]], time.monotonic())
    assert alone.body(records[:1]) == records[0]


def test_exchange_needs_a_prompt_per_item() -> None:
    opts = SglangOptions(items=[item(), item()], multi=True)
    with pytest.raises(ValueError, match="zip"):
        SglangExchange(opts, "pub", [[1]], time.monotonic())


def test_bind_then_render_a_batch_with_samples() -> None:
    fmt = SglangFormat()
    bound = fmt.bind(fmt.parse(batch([1, 2], [3], rid=["p", "q"], sampling_params={"n": 2})), {})
    exchange = fmt.exchange(bound, "pub-handler", time.monotonic())
    metas = [
        exchange.render(i, end_frame(1, [i], {"reason": "length"}))["meta_info"]
        for i in range(len(bound.items))
    ]
    assert [m["id"] for m in metas] == [env.client_id for env in bound.items]
    assert [m["prompt_tokens"] for m in metas] == [2, 2, 1, 1]
    assert all(m["finish_reason"] == {"type": "length", "length": 128} for m in metas)
    payloads = [exchange.sse(i, {"output_ids": []})[0] for i in range(4)]
    assert [p["index"] for p in payloads] == [0, 1, 2, 3]


# ---------------------------------------------------------------- routed experts (render)


def unpack(b64: str) -> list[int]:
    raw = base64.b64decode(b64)
    return list(struct.unpack(f"<{len(raw) // 4}i", raw))


def test_routed_experts_render_as_base64_int32_and_join_by_decoding() -> None:
    opts = SglangOptions(items=[item(experts=True)], multi=False)
    rows = [[1, 2], [3, 4], [5, 6], [7, 8]]
    exchange = SglangExchange(opts, "pub", [[1, 2, 3]], time.monotonic())
    records = [
        exchange.render(0, out_frame(1, [9], routed_experts=rows[:3])),
        exchange.render(0, out_frame(2, [], routed_experts=[])),
        exchange.render(0, end_frame(3, [9], {"reason": "length"}, routed_experts=rows[3:])),
    ]
    assert [unpack(r["meta_info"]["routed_experts"]) for r in records] == [
        [1, 2, 3, 4, 5, 6],
        [],
        [7, 8],
    ]
    folded = fold(records, MERGE_RULES, JOINERS)
    assert unpack(folded["meta_info"]["routed_experts"]) == list(range(1, 9))
    merger = Merger(SglangFormat.merge_rules, SglangFormat.joiners)
    for r in records:
        merger.add(r)
    assert merger.result()["meta_info"]["routed_experts"] == folded["meta_info"]["routed_experts"]
