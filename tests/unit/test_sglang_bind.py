"""SGLang /generate: `bind` (request -> envelope) and `SglangExchange.render` (frames -> chunks)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from multidict import CIMultiDict

from genmesh.formats.base import Bound, RequestRejected
from genmesh.formats.sglang import SglangFormat
from genmesh.formats.sglang.request import (
    _INTERNAL,
    _PASSTHROUGH,
    _UNSUPPORTED,
    DEFAULT_MAX_NEW_TOKENS,
    KNOWN_FIELDS,
    SglangOptions,
    bind,
)
from genmesh.formats.sglang.response import MERGE_RULES, SglangExchange, native_finish_reason
from genmesh.shared import frames
from genmesh.shared.envelope import Envelope, OutputOptions, Routing, Sampling
from genmesh.shared.errors import ErrorCode, MeshError


def body(**fields: Any) -> bytes:
    return json.dumps({"input_ids": [1, 2, 3], **fields}).encode()


def sp(**params: Any) -> bytes:
    return body(sampling_params=params)


def ok(raw: bytes, headers: dict[str, str] | None = None) -> Bound:
    return bind(raw, headers or {})


def rejected(raw: bytes, headers: dict[str, str] | None = None) -> RequestRejected:
    with pytest.raises(RequestRejected) as info:
        bind(raw, headers or {})
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


# ---------------------------------------------------------------- legacy-shape rejections


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"", "request body is not valid JSON"),
        (b"{input_ids: [1]}", "request body is not valid JSON"),
        (b"\xff\xfe\x00garbage", "request body is not valid JSON"),
        (b"[1, 2, 3]", "request body must be a JSON object, got list"),
        (b'"hello"', "request body must be a JSON object, got str"),
        (b"null", "request body must be a JSON object, got NoneType"),
        (b"42", "request body must be a JSON object, got int"),
        (json.dumps({"input_ids": "1 2 3"}).encode(), "input_ids: Input should be a valid list"),
        (json.dumps({"input_ids": {"0": 1}}).encode(), "input_ids: Input should be a valid list"),
        (json.dumps({"input_ids": [1, "2"]}).encode(), "input_ids[1]: Input should be a valid int"),
        (json.dumps({"input_ids": [1, True]}).encode(), "input_ids[1]"),
        (json.dumps({"input_ids": [1.5]}).encode(), "input_ids[0]"),
        (body(rid=5), "rid: Input should be a valid string"),
        (body(sampling_params="greedy"), "sampling_params: Input should be a valid dictionary"),
        (body(sampling_params=3), "sampling_params: Input should be a valid dictionary"),
        (sp(max_new_tokens="10"), "sampling_params.max_new_tokens: Input should be a valid int"),
        (sp(max_new_tokens=1.5), "sampling_params.max_new_tokens"),
        (sp(max_new_tokens=True), "sampling_params.max_new_tokens"),
        (sp(min_new_tokens="1"), "sampling_params.min_new_tokens: Input should be a valid int"),
        (sp(n="2"), "sampling_params.n: Input should be a valid integer"),
        (sp(temperature="hot"), "sampling_params.temperature: Input should be a valid number"),
        (sp(temperature=True), "sampling_params.temperature: Input should be a valid number"),
        (sp(top_p=[1]), "sampling_params.top_p: Input should be a valid number"),
        (sp(min_p="0"), "sampling_params.min_p: Input should be a valid number"),
        (sp(top_k=1.5), "sampling_params.top_k: Input should be a valid integer"),
        (sp(frequency_penalty="x"), "sampling_params.frequency_penalty"),
        (sp(presence_penalty=False), "sampling_params.presence_penalty"),
        (sp(repetition_penalty="1"), "sampling_params.repetition_penalty"),
        (sp(stop_token_ids=7), "sampling_params.stop_token_ids: Input should be a list of token"),
        (sp(stop_token_ids=[1, "2"]), "sampling_params.stop_token_ids"),
        (sp(stop_token_ids=[True]), "sampling_params.stop_token_ids"),
        (sp(stop_token_ids=[-1]), "sampling_params.stop_token_ids"),
        (sp(stop_token_ids=[2**31]), "sampling_params.stop_token_ids"),
        (sp(sampling_seed="7"), "sampling_params.sampling_seed: Input should be a valid integer"),
        (sp(ignore_eos="yes"), "sampling_params.ignore_eos: Input should be a valid boolean"),
        (sp(ignore_eos=1), "sampling_params.ignore_eos: Input should be a valid boolean"),
        (body(stream="yes"), "stream: Input should be a valid boolean"),
        (body(return_logprob=1), "return_logprob: Input should be a valid boolean"),
        (body(logprob_start_len="0"), "logprob_start_len: Input should be a valid integer"),
        (body(top_logprobs_num=1.0), "top_logprobs_num: Input should be a valid integer"),
        (body(routed_dp_rank="0"), "routed_dp_rank: Input should be a valid integer"),
        (body(data_parallel_rank=True), "data_parallel_rank: Input should be a valid integer"),
        (body(priority="high"), "priority: Input should be a valid integer"),
        (body(extra_key=5), "extra_key: Input should be a valid string"),
    ],
)
def test_type_errors_use_the_legacy_shape(raw: bytes, fragment: str) -> None:
    assert_legacy(rejected(raw), fragment)


def test_deeply_nested_body_is_rejected() -> None:
    exc = rejected(b"[" * 100_000)
    assert_legacy(exc, "request body is not valid JSON")


# ---------------------------------------------------------------- value rejections


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        # prompts
        (json.dumps({"text": "Hello"}).encode(), "text prompts need a tokenizer"),
        (body(text="Hello"), "send input_ids instead"),
        (json.dumps({}).encode(), "Either text or input_ids should be provided."),
        (json.dumps({"input_ids": None}).encode(), "Either text or input_ids should be provided."),
        (json.dumps({"input_ids": []}).encode(), "input_ids cannot be empty."),
        (json.dumps({"input_ids": [[1, 2], [3]]}).encode(), "batch input"),
        (json.dumps({"input_ids": [1, [2]]}).encode(), "batch input"),
        (json.dumps({"input_ids": [1, -1]}).encode(), "input_ids[1]: token id -1 is out of range"),
        (json.dumps({"input_ids": [2**31]}).encode(), "out of range"),
        # batch-only forms
        (body(rid=["a", "b"]), "rid: a list of rids is for batch input"),
        (body(sampling_params=[{}, {}]), "sampling_params: a list of sampling_params"),
        # parallel sampling
        (sp(n=2), "parallel sampling (n=2) is not supported yet; send n=1"),
        (sp(n=0), "parallel sampling (n=0)"),
        # budgets
        (sp(max_new_tokens=-1), "max_new_tokens must be at least 0, got -1."),
        (
            sp(max_new_tokens=4, min_new_tokens=5),
            "min_new_tokens must be in [0, max_new_tokens(4)], got 5.",
        ),
        (sp(min_new_tokens=129), "min_new_tokens must be in [0, max_new_tokens(128)], got 129."),
        (sp(min_new_tokens=-1), "min_new_tokens must be in [0, max_new_tokens(128)], got -1."),
        # sampling ranges (SGLang's wording)
        (sp(temperature=-0.1), "temperature must be non-negative, got -0.1."),
        (sp(top_p=0), "top_p must be in (0, 1], got 0.0."),
        (sp(top_p=1.5), "top_p must be in (0, 1], got 1.5."),
        (sp(top_k=0), "top_k must be -1 (disable), or at least 1, got 0."),
        (sp(top_k=-2), "top_k must be -1 (disable), or at least 1, got -2."),
        (sp(min_p=-0.01), "min_p must be in [0, 1], got -0.01."),
        (sp(min_p=1.01), "min_p must be in [0, 1], got 1.01."),
        (sp(frequency_penalty=2.5), "frequency_penalty must be in [-2, 2], got 2.5."),
        (sp(frequency_penalty=-2.01), "frequency_penalty must be in [-2, 2], got -2.01."),
        (sp(presence_penalty=-3), "presence_penalty must be in [-2, 2], got -3.0."),
        (sp(repetition_penalty=0), "repetition_penalty must be in (0, 2], got 0.0."),
        (sp(repetition_penalty=2.1), "repetition_penalty must be in (0, 2], got 2.1."),
        (
            b'{"input_ids": [1], "sampling_params": {"temperature": Infinity}}',
            "temperature must be a finite number, got inf.",
        ),
        (
            b'{"input_ids": [1], "sampling_params": {"top_p": NaN}}',
            "top_p must be a finite number, got nan.",
        ),
        # stop strings and guided decoding
        (sp(stop="\n"), "stop strings need a tokenizer"),
        (sp(stop=["</s>"]), "use stop_token_ids"),
        (sp(regex="a+", json_schema="{}"), "Only one of regex, json_schema, or ebnf can be set."),
        (sp(regex="a+", ebnf="root ::= 'a'"), "Only one of regex, json_schema, or ebnf"),
        (sp(json_schema="{}", ebnf="x", regex="y"), "Only one of regex, json_schema, or ebnf"),
        # logprobs
        (
            body(return_logprob=True, logprob_start_len=3),
            "logprob_start_len (3) is higher than the number of input tokens (3). "
            "Request with a lower logprob_start_len.",
        ),
        (body(return_logprob=True, logprob_start_len=10), "logprob_start_len (10)"),
        (body(logprob_start_len=-2), "logprob_start_len must be >= -1, got -2"),
        (body(top_logprobs_num=-1), "top_logprobs_num must be >= 0, got -1"),
        # routing
        (body(routed_dp_rank=-1), "routed_dp_rank must be >= 0, got -1"),
        (body(data_parallel_rank=-3), "routed_dp_rank must be >= 0, got -3"),
    ],
)
def test_value_errors_use_the_error_shape(raw: bytes, fragment: str) -> None:
    assert_value(rejected(raw), fragment)


def test_unknown_top_level_fields_are_listed() -> None:
    exc = rejected(body(zeta=1, alpha=2, sampling_params={}))
    assert_value(exc, "unsupported top-level SGLang generate field(s): alpha, zeta")


def test_unknown_fields_reported_before_anything_else() -> None:
    # even with a missing prompt, the unknown field is what the client hears about
    exc = rejected(json.dumps({"prompt": "hi"}).encode())
    assert_value(exc, "field(s): prompt")


@pytest.mark.parametrize("field", _INTERNAL)
def test_internal_bootstrap_fields_refused(field: str) -> None:
    exc = rejected(body(**{field: 1}))
    assert_value(exc, f"`{field}` is internal routing state and cannot be set by clients")


def test_internal_fields_may_be_null() -> None:
    bound = ok(body(**dict.fromkeys(_INTERNAL)))
    assert bound.envelope.token_ids == [1, 2, 3]


@pytest.mark.parametrize(("field", "reason"), sorted(_UNSUPPORTED.items()))
def test_unsupported_fields_refused(field: str, reason: str) -> None:
    value: Any = {"id": "s"} if field == "session_params" else "x"
    if field in ("return_hidden_states", "return_routed_experts"):
        value = True
    exc = rejected(body(**{field: value}))
    assert_value(exc, reason)
    assert exc.message == reason


@pytest.mark.parametrize("empty", [None, False, [], {}])
@pytest.mark.parametrize("field", sorted(_UNSUPPORTED))
def test_unsupported_fields_with_empty_values_accepted(field: str, empty: Any) -> None:
    assert ok(body(**{field: empty})).envelope.engine[field] == empty


@pytest.mark.parametrize("stop", [None, [], ""])
def test_empty_stop_accepted(stop: Any) -> None:
    assert ok(sp(stop=stop)).envelope.sampling.stop_token_ids == []


def test_one_guided_key_is_accepted_and_passed_through() -> None:
    bound = ok(sp(regex="a+", json_schema=None))
    assert bound.envelope.engine["sampling_params"]["regex"] == "a+"


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
    ok(sp(**params))


def test_logprob_start_len_only_checked_with_return_logprob() -> None:
    bound = ok(body(logprob_start_len=50))
    assert bound.envelope.output == OutputOptions()


@pytest.mark.parametrize("field", sorted(_PASSTHROUGH))
def test_passthrough_fields_accepted_and_kept(field: str) -> None:
    assert field in KNOWN_FIELDS
    bound = ok(body(**{field: "v"}))
    assert bound.envelope.engine == {field: "v"}


# ---------------------------------------------------------------- projection


def test_defaults() -> None:
    bound = ok(json.dumps({"input_ids": [5, 6]}).encode())
    env = bound.envelope
    assert env.id == ""  # minted by the shared handler
    assert env.format == "sglang"
    assert env.token_ids == [5, 6]
    assert env.sampling == Sampling(max_tokens=DEFAULT_MAX_NEW_TOKENS)
    assert DEFAULT_MAX_NEW_TOKENS == 128
    assert env.output == OutputOptions()
    assert env.routing == Routing()
    assert env.client_id is None
    assert env.engine == {}
    assert bound.stream is False
    assert bound.client_id is None
    assert bound.migration is None
    assert bound.options == SglangOptions(
        prompt_tokens=2, return_logprob=False, top_logprobs_num=0, max_new_tokens=128
    )


def test_null_max_new_tokens_means_uncapped() -> None:
    bound = ok(sp(max_new_tokens=None))
    assert bound.envelope.sampling.max_tokens is None
    assert bound.options.max_new_tokens is None


def test_sampling_projection() -> None:
    env = ok(
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
    ).envelope
    assert env.sampling == Sampling(
        max_tokens=64,
        min_tokens=2,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=1234,
        stop_token_ids=[2, 151645],
        ignore_eos=True,
    )
    assert isinstance(env.sampling.temperature, float)


def test_top_k_minus_one_is_none() -> None:
    assert ok(sp(top_k=-1)).envelope.sampling.top_k is None


def test_integer_sampling_numbers_become_floats() -> None:
    s = ok(sp(temperature=1, top_p=1, min_p=0)).envelope.sampling
    assert (s.temperature, s.top_p, s.min_p) == (1.0, 1.0, 0.0)
    assert all(isinstance(v, float) for v in (s.temperature, s.top_p, s.min_p))


def test_return_logprob_default_start_is_last_prompt_position() -> None:
    bound = ok(body(return_logprob=True))
    assert bound.envelope.output == OutputOptions(
        logprobs=True, top_logprobs=0, prompt_logprobs_start=2
    )
    assert bound.options.return_logprob is True


def test_return_logprob_with_start_and_top() -> None:
    bound = ok(body(return_logprob=True, logprob_start_len=0, top_logprobs_num=5))
    assert bound.envelope.output == OutputOptions(
        logprobs=True, top_logprobs=5, prompt_logprobs_start=0
    )
    assert bound.options.top_logprobs_num == 5


def test_explicit_minus_one_start() -> None:
    bound = ok(body(return_logprob=True, logprob_start_len=-1))
    assert bound.envelope.output.prompt_logprobs_start == 2


def test_logprob_options_ignored_without_return_logprob() -> None:
    bound = ok(body(top_logprobs_num=5, logprob_start_len=0))
    assert bound.envelope.output == OutputOptions()
    assert bound.options.top_logprobs_num == 0
    assert bound.options.return_logprob is False


def test_stream_flag() -> None:
    assert ok(body(stream=True)).stream is True
    assert ok(body(stream=False)).stream is False
    assert ok(body(stream=None)).stream is False


def test_rid_is_the_client_id() -> None:
    bound = ok(body(rid="my-req"))
    assert bound.client_id == "my-req"
    assert bound.envelope.client_id == "my-req"


def test_x_request_id_header_is_the_client_id() -> None:
    bound = ok(body(), {"x-request-id": "  hdr-1 "})
    assert bound.client_id == "hdr-1"
    assert bound.envelope.client_id == "hdr-1"


def test_header_lookup_is_case_insensitive_with_aiohttp_headers() -> None:
    headers = CIMultiDict({"X-Request-ID": "hdr-2"})
    assert bind(body(), headers).client_id == "hdr-2"


def test_blank_header_is_no_client_id() -> None:
    assert ok(body(), {"x-request-id": "   "}).client_id is None


def test_rid_wins_over_header() -> None:
    bound = ok(body(rid="from-body"), {"x-request-id": "from-header"})
    assert bound.client_id == "from-body"
    assert bound.envelope.client_id == "from-body"


def test_routing_projection() -> None:
    env = ok(body(routed_dp_rank=2, priority=-5, extra_key="tenant-a")).envelope
    assert env.routing == Routing(dp_rank=2, priority=-5, cache_salt="tenant-a")


def test_legacy_data_parallel_rank() -> None:
    assert ok(body(data_parallel_rank=1)).envelope.routing.dp_rank == 1
    # the newer name wins when both are sent
    assert ok(body(data_parallel_rank=1, routed_dp_rank=3)).envelope.routing.dp_rank == 3


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
    engine = ok(raw).envelope.engine
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
    env = bound.envelope
    env.id = "minted"
    assert Envelope.from_wire(env.to_wire()) == env


def test_format_object_delegates() -> None:
    fmt = SglangFormat(SglangFormat.default_routes())
    assert [(r.method, r.path) for r in fmt.routes] == [("POST", "/generate"), ("PUT", "/generate")]
    assert fmt.merge_rules is MERGE_RULES
    bound = fmt.bind(body(rid="x"), {})
    assert bound.client_id == "x"
    assert fmt.error_body(503, "not ready") == {"error": {"message": "not ready"}}
    exchange = fmt.exchange(bound, "pub", 0.0)
    assert isinstance(exchange, SglangExchange)


# ---------------------------------------------------------------- fixed bugs


def test_min_new_tokens_unbounded_when_max_new_tokens_null() -> None:
    bound = ok(sp(max_new_tokens=None, min_new_tokens=200))
    assert bound.envelope.sampling.min_tokens == 200


def test_huge_integer_sampling_number_is_rejected() -> None:
    raw = b'{"input_ids": [1], "sampling_params": {"temperature": 1' + b"0" * 400 + b"}}"
    exc = rejected(raw)
    assert exc.status == 400


# ---------------------------------------------------------------- rendering


def options(
    *, logprob: bool = False, top: int = 0, max_new: int | None = 16, prompt: int = 3
) -> SglangOptions:
    return SglangOptions(
        prompt_tokens=prompt, return_logprob=logprob, top_logprobs_num=top, max_new_tokens=max_new
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
    exchange = SglangExchange(opts or options(), "pub-1", [1, 2, 3], time.monotonic())
    (chunk,) = exchange.render(frame)
    return chunk


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
    chunk = render_one(end_frame(1, [9], finish), options(max_new=max_new))
    assert chunk["meta_info"]["finish_reason"] == expected


def test_stream_of_chunks() -> None:
    exchange = SglangExchange(options(prompt=3), "pub-1", [1, 2, 3], time.monotonic())
    chunks = [
        *exchange.render(out_frame(1, [], cached_tokens=2)),
        *exchange.render(out_frame(2, [10])),
        *exchange.render(out_frame(3, [11, 12])),
        *exchange.render(end_frame(4, [13], {"reason": "length"})),
    ]
    assert [c["output_ids"] for c in chunks] == [[], [10], [11, 12], [13]]
    metas = [c["meta_info"] for c in chunks]
    assert [m["completion_tokens"] for m in metas] == [0, 1, 3, 4]
    assert all(m["id"] == "pub-1" for m in metas)
    assert all(m["prompt_tokens"] == 3 for m in metas)
    assert [m["cached_tokens"] for m in metas] == [2, 2, 2, 2]
    assert [m["finish_reason"] for m in metas[:-1]] == [None] * 3
    assert metas[-1]["finish_reason"] == {"type": "length", "length": 16}
    # e2e latency only on the final chunk
    assert ["e2e_latency" in m for m in metas] == [False, False, False, True]
    assert 0 <= metas[-1]["e2e_latency"] < 5
    # no logprob keys unless asked
    assert not any(k.endswith("logprobs") for m in metas for k in m)
    assert list(metas[0]) == [
        "id",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
    ]


def test_finish_on_an_out_frame_is_ignored() -> None:
    chunk = render_one(out_frame(1, [4], finish={"reason": "length"}))
    assert chunk["meta_info"]["finish_reason"] is None
    assert "e2e_latency" not in chunk["meta_info"]


def test_e2e_latency_measured_from_receipt() -> None:
    exchange = SglangExchange(options(), "p", [1], time.monotonic() - 2.5)
    (chunk,) = exchange.render(end_frame(1, [], {"reason": "length"}))
    assert 2.5 <= chunk["meta_info"]["e2e_latency"] < 10


def test_logprob_triples_and_input_logprobs_on_every_chunk() -> None:
    prompt = [1, 2, 3]
    exchange = SglangExchange(options(logprob=True, top=2), "pub", prompt, time.monotonic())
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
    chunks = [c for f in (first, second, last) for c in exchange.render(f)]
    metas = [c["meta_info"] for c in chunks]
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
    exchange = SglangExchange(options(logprob=True), "pub", [1, 2, 3], time.monotonic())
    exchange.render(out_frame(1, [], prompt_logprobs=[None]))
    (chunk,) = exchange.render(out_frame(1, [7], logprobs=[-1.0], prompt_logprobs=[None, -9.0]))
    assert chunk["meta_info"]["input_token_logprobs"] == [[None, 3, None]]


def test_input_logprobs_empty_until_they_arrive() -> None:
    exchange = SglangExchange(options(logprob=True), "pub", [1, 2, 3], time.monotonic())
    (chunk,) = exchange.render(out_frame(1, [7], logprobs=[-1.0]))
    assert chunk["meta_info"]["input_token_logprobs"] == []
    assert "input_top_logprobs" not in chunk["meta_info"]  # top_logprobs_num is 0


def test_error_body() -> None:
    exchange = SglangExchange(options(), "pub", [1], time.monotonic())
    err = MeshError(ErrorCode.NO_WORKER, "no worker serves model m")
    assert exchange.error(err, 503) == {"error": {"message": "no worker serves model m"}}


def test_bind_then_render_a_mock_like_stream() -> None:
    """The options bind produces drive the renderer: a logprob request end to end."""
    bound = ok(body(return_logprob=True, top_logprobs_num=1, sampling_params={"max_new_tokens": 2}))
    fmt = SglangFormat(SglangFormat.default_routes())
    exchange = fmt.exchange(bound, "pub-7", time.monotonic())
    c1 = exchange.render(
        out_frame(
            1,
            [5],
            logprobs=[-0.5],
            top_logprobs=[[[5, -0.5]]],
            prompt_logprobs=[None],
            prompt_top_logprobs=[None],
        )
    )[0]
    c2 = exchange.render(
        end_frame(2, [6], {"reason": "length"}, logprobs=[-0.7], top_logprobs=[[[6, -0.7]]])
    )[0]
    assert c1["meta_info"]["input_token_logprobs"] == [[None, 3, None]]
    assert c1["meta_info"]["input_top_logprobs"] == [None]
    assert c2["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    assert c2["meta_info"]["completion_tokens"] == 2
    assert c2["meta_info"]["id"] == "pub-7"
