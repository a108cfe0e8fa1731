"""SGLang /generate as a drop-in (issue 11): the engine's facts at bind time (sampling
defaults, context checks), `token_ids_logprob` from bind to rendered meta_info, and the
mock engine computing it."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from genmesh.engines.base import EngineOutput
from genmesh.engines.mock import MockConfig, MockEngine, TokenModel, advance, initial_state
from genmesh.engines.sglang import sglang_body
from genmesh.formats.base import Bound, RequestRejected
from genmesh.formats.merge import fold
from genmesh.formats.sglang import SglangFormat, request
from genmesh.formats.sglang.response import JOINERS, MERGE_RULES
from genmesh.shared import frames
from genmesh.shared.engine_info import EngineCatalog, EngineInfo
from genmesh.shared.envelope import Envelope, EnvelopeError, OutputOptions, Sampling
from genmesh.shared.errors import ErrorCode, MeshError

pytestmark = pytest.mark.unit

CONTEXT = 100


def catalog(**info: Any) -> EngineCatalog:
    return EngineCatalog([EngineInfo(model="m", **info)])


def bind(body: dict[str, Any], engines: EngineCatalog | None = None) -> Bound:
    return request.bind(json.loads(json.dumps(body)), {}, engines or EngineCatalog())


def refused(body: dict[str, Any], engines: EngineCatalog | None = None) -> str:
    with pytest.raises(RequestRejected) as info:
        bind(body, engines)
    assert info.value.status == 400
    assert info.value.body == {"error": {"message": info.value.message}}
    return info.value.message


# ---------------------------------------------------------------- sampling defaults

DEFAULTS = {
    "temperature": 0.6,
    "top_p": 0.95,
    "top_k": 20,
    "min_p": 0.05,
    "repetition_penalty": 1.0,
    "max_new_tokens": 64,
}


def test_the_engines_defaults_fill_unset_sampling_params() -> None:
    """SGLang: `{**preferred_sampling_params, **sampling_params}`."""
    env = bind({"input_ids": [1, 2]}, catalog(sampling_defaults=DEFAULTS)).items[0]
    assert env.sampling == Sampling(
        max_tokens=64, temperature=0.6, top_p=0.95, top_k=20, min_p=0.05
    )


def test_what_the_request_sets_wins_over_the_defaults() -> None:
    body = {
        "input_ids": [1, 2],
        "sampling_params": {"temperature": 0.2, "top_k": 5, "max_new_tokens": 3},
    }
    bound = bind(body, catalog(sampling_defaults=DEFAULTS))
    env = bound.items[0]
    assert env.sampling == Sampling(max_tokens=3, temperature=0.2, top_p=0.95, top_k=5, min_p=0.05)
    assert bound.options.items[0].max_new_tokens == 3
    # The native payload is what the client sent; an engine applies its own defaults.
    assert env.engine["sampling_params"] == body["sampling_params"]


def test_null_over_a_default_is_sglangs_own_default() -> None:
    body = {"input_ids": [1], "sampling_params": {"temperature": None, "max_new_tokens": None}}
    env = bind(body, catalog(sampling_defaults=DEFAULTS)).items[0]
    assert env.sampling.temperature == 1.0  # SamplingParams' default, not the preferred 0.6
    assert env.sampling.max_tokens is None  # uncapped, as asked
    assert env.sampling.top_p == 0.95


def test_defaults_are_verified_like_the_request_would_be() -> None:
    message = refused({"input_ids": [1]}, catalog(sampling_defaults={"top_p": 1.5}))
    assert message == "top_p must be in (0, 1], got 1.5."


def test_a_default_repetition_penalty_pins_the_request_to_its_worker() -> None:
    bound = bind({"input_ids": [1]}, catalog(sampling_defaults={"repetition_penalty": 1.1}))
    assert bound.migration is not None
    assert "repetition_penalty" in bound.migration
    assert bind({"input_ids": [1]}, catalog(sampling_defaults=DEFAULTS)).migration is None


def test_without_engine_info_sglangs_own_defaults_apply() -> None:
    env = bind({"input_ids": [1]}).items[0]
    assert env.sampling == Sampling(max_tokens=128)


# ---------------------------------------------------------------- context checks


def test_a_prompt_as_long_as_the_context_is_refused() -> None:
    message = refused({"input_ids": [1] * CONTEXT}, catalog(context_length=CONTEXT))
    assert message == (
        f"The input ({CONTEXT} tokens) is longer than the model's context length "
        f"({CONTEXT} tokens)."
    )
    assert bind({"input_ids": [1] * (CONTEXT - 1)}, catalog(context_length=CONTEXT)).items


def test_prompt_plus_max_new_tokens_beyond_the_context_is_refused_not_capped() -> None:
    body = {"input_ids": [1] * 60, "sampling_params": {"max_new_tokens": 41}}
    message = refused(body, catalog(context_length=CONTEXT))
    assert message == (
        "Requested token count exceeds the model's maximum context length of 100 tokens. "
        "You requested a total of 101 tokens: 60 tokens from the input messages and 41 "
        "tokens for the completion. Please reduce the number of tokens in the input "
        "messages or the completion to fit within the limit."
    )
    # exactly the context is allowed (SGLang refuses only beyond it)
    body["sampling_params"] = {"max_new_tokens": 40}
    assert bind(body, catalog(context_length=CONTEXT)).items[0].sampling.max_tokens == 40


def test_only_an_explicit_max_new_tokens_is_checked() -> None:
    """SGLang checks `obj.sampling_params.get("max_new_tokens")`: the default 128 and a
    preferred default are left to the scheduler, which caps them."""
    assert bind({"input_ids": [1] * 90}, catalog(context_length=CONTEXT)).items
    engines = catalog(context_length=CONTEXT, sampling_defaults={"max_new_tokens": 500})
    assert bind({"input_ids": [1] * 90}, engines).items[0].sampling.max_tokens == 500


def test_every_prompt_of_a_batch_is_checked() -> None:
    body = {"input_ids": [[1], [1] * CONTEXT]}
    assert "The input (100 tokens)" in refused(body, catalog(context_length=CONTEXT))


def test_nothing_is_checked_when_the_catalog_knows_nothing() -> None:
    body = {"input_ids": [1] * 5000, "sampling_params": {"max_new_tokens": 10**6}}
    assert bind(body).items[0].sampling.max_tokens == 10**6
    assert bind(body, catalog()).items  # an engine that did not say its context length


def test_the_format_object_passes_the_catalog_through() -> None:
    fmt = SglangFormat()
    with pytest.raises(RequestRejected):
        fmt.bind({"input_ids": [1] * CONTEXT}, {}, catalog(context_length=CONTEXT))


# ---------------------------------------------------------------- token_ids_logprob: bind


def test_token_ids_logprob_is_carried_with_return_logprob() -> None:
    bound = bind({"input_ids": [1, 2, 3], "return_logprob": True, "token_ids_logprob": [5, 9]})
    env = bound.items[0]
    assert env.output == OutputOptions(
        logprobs=True, prompt_logprobs_start=2, logprob_token_ids=[5, 9]
    )
    assert bound.options.items[0].token_ids_logprob is True
    assert env.engine["token_ids_logprob"] == [5, 9]
    env.id = "x"
    assert Envelope.from_wire(env.to_wire()) == env
    assert env.to_wire()["output"]["logprob_token_ids"] == [5, 9]


def test_token_ids_logprob_without_return_logprob_asks_for_nothing() -> None:
    bound = bind({"input_ids": [1, 2, 3], "token_ids_logprob": [5]})
    assert bound.items[0].output == OutputOptions()
    assert bound.options.items[0].token_ids_logprob is False


@pytest.mark.parametrize("empty", [None, []])
def test_empty_token_ids_logprob_is_none(empty: Any) -> None:
    bound = bind({"input_ids": [1], "return_logprob": True, "token_ids_logprob": empty})
    assert bound.items[0].output.logprob_token_ids is None
    assert bound.options.items[0].token_ids_logprob is False


def test_a_flat_list_applies_to_every_prompt_and_sample() -> None:
    body = {
        "input_ids": [[1, 2], [3]],
        "return_logprob": True,
        "token_ids_logprob": [4, 4, 0],
        "sampling_params": {"n": 2},
    }
    bound = bind(body)
    assert [env.output.logprob_token_ids for env in bound.items] == [[4, 4, 0]] * 4
    # every envelope owns its list
    assert len({id(env.output.logprob_token_ids) for env in bound.items}) == 4


def test_a_list_of_lists_is_one_list_per_prompt() -> None:
    body = {"input_ids": [[1, 2], [3]], "return_logprob": True, "token_ids_logprob": [[4], [5, 6]]}
    bound = bind(body)
    assert [env.output.logprob_token_ids for env in bound.items] == [[4], [5, 6]]
    assert [env.engine["token_ids_logprob"] for env in bound.items] == [[4], [5, 6]]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"input_ids": [[1], [2]], "token_ids_logprob": [[4], [5]], "sampling_params": {"n": 2}},
            "Cannot use list token_ids_logprob with parallel_sample_num > 1",
        ),
        (
            {"input_ids": [[1], [2]], "token_ids_logprob": [[4]]},
            "The length of token_ids_logprob should be equal to the batch size.",
        ),
        (
            {"input_ids": [1], "token_ids_logprob": [[4]]},
            "token_ids_logprob must be a flat list of integers.",
        ),
        (
            {"input_ids": [1], "return_logprob": True, "token_ids_logprob": [2**31]},
            "token_ids_logprob contains out-of-vocabulary token id 2147483648",
        ),
    ],
)
def test_token_ids_logprob_refusals(body: dict[str, Any], message: str) -> None:
    assert message in refused(body)


# ---------------------------------------------------------------- token_ids_logprob: render


def _render(frame_list: list[dict[str, Any]], prompt: list[int]) -> list[dict[str, Any]]:
    bound = bind(
        {
            "input_ids": prompt,
            "return_logprob": True,
            "logprob_start_len": 0,
            "token_ids_logprob": [5, 9],
        }
    )
    exchange = SglangFormat().exchange(bound, "pub", time.monotonic())
    return [exchange.render(0, f) for f in frame_list]  # type: ignore[arg-type]


def test_meta_info_carries_sglangs_token_ids_logprob_lists() -> None:
    prompt = [1, 2, 3]
    first = {
        "t": frames.OUT,
        "id": "r",
        "seq": 1,
        "tokens": [7],
        "logprobs": [-0.5],
        "prompt_logprobs": [None, -1.0, -2.0],
        "token_ids_logprobs": [[(5, -3.0), (9, -4.0)]],
        "prompt_token_ids_logprobs": [None, [(5, -1.5), (9, -2.5)], [(5, -1.25), (9, -2.25)]],
    }
    last = {
        "t": frames.END,
        "id": "r",
        "seq": 2,
        "tokens": [8],
        "logprobs": [-0.25],
        "token_ids_logprobs": [[(5, -3.5), (9, -4.5)]],
        "finish": {"reason": "length"},
        "usage": {},
    }
    records = _render([first, last], prompt)
    input_lists = [
        None,
        [[-1.5, 5, None], [-2.5, 9, None]],
        [[-1.25, 5, None], [-2.25, 9, None]],
    ]
    for record in records:
        meta = record["meta_info"]
        # SGLang's key order: token logprobs, then the token-ids ones.
        keys = [k for k in meta if "logprobs" in k]
        assert keys == [
            "input_token_logprobs",
            "output_token_logprobs",
            "output_token_logprobs_length",
            "input_token_ids_logprobs",
            "output_token_ids_logprobs",
        ]
        assert meta["input_token_ids_logprobs"] == input_lists  # in full on every chunk
    assert [r["meta_info"]["output_token_ids_logprobs"] for r in records] == [
        [[[-3.0, 5, None], [-4.0, 9, None]]],
        [[[-3.5, 5, None], [-4.5, 9, None]]],
    ]
    assert [r["meta_info"]["output_token_logprobs_length"] for r in records] == [1, 2]
    folded = fold(records, MERGE_RULES, JOINERS)["meta_info"]
    assert folded["output_token_logprobs_length"] == 2
    assert folded["input_token_ids_logprobs"] == input_lists
    assert folded["output_token_ids_logprobs"] == [
        [[-3.0, 5, None], [-4.0, 9, None]],
        [[-3.5, 5, None], [-4.5, 9, None]],
    ]


def test_a_migrated_attempt_keeps_the_first_prompts_lists() -> None:
    """Merge rules: input lists describe the original prompt (`prompt`), output ones add
    up (`delta`)."""
    assert MERGE_RULES["meta_info.input_token_ids_logprobs"] == "prompt"
    assert MERGE_RULES["meta_info.output_token_ids_logprobs"] == "delta"
    prompt = [1, 2]
    records = _render(
        [
            {"t": frames.OUT, "id": "r", "seq": 1, "tokens": [], "prompt_logprobs": [None, -1.0],
             "prompt_token_ids_logprobs": [None, [(5, -1.0), (9, -2.0)]]},
            {"t": frames.OUT, "id": "r", "seq": 2, "tokens": [3], "logprobs": [-0.1],
             "token_ids_logprobs": [[(5, -3.0), (9, -4.0)]],
             "prompt_token_ids_logprobs": [None, [(5, -7.0), (9, -7.0)], [(5, -7.0), (9, -7.0)]]},
        ],
        prompt,
    )  # fmt: skip
    assert records[1]["meta_info"]["input_token_ids_logprobs"] == [
        None,
        [[-1.0, 5, None], [-2.0, 9, None]],
    ]


# ---------------------------------------------------------------- the mock engine


async def _outputs(env: Envelope, vocab: int = 1000) -> list[EngineOutput]:
    engine = MockEngine(MockConfig(vocab_size=vocab, eos_token_id=7))
    return [out async for out in engine.generate(env)]


def _env(prompt: list[int], ids: list[int], start: int | None, max_tokens: int = 3) -> Envelope:
    return Envelope(
        id="r",
        token_ids=prompt,
        sampling=Sampling(max_tokens=max_tokens, ignore_eos=True),
        output=OutputOptions(
            logprobs=True, prompt_logprobs_start=start, logprob_token_ids=ids or None
        ),
    )


async def test_the_mock_reports_each_listed_id_at_every_position() -> None:
    prompt, ids = [11, 12, 13, 14], [5, 900, 5]
    outs = await _outputs(_env(prompt, ids, start=1))
    model = TokenModel(1000)
    state = initial_state(0)
    expected_prompt: list[Any] = []
    for i, tid in enumerate(prompt):
        if i >= 1:
            expected_prompt.append(None if i == 1 else [(t, model.logprob(state, t)) for t in ids])
        state = advance(state, tid)
    assert outs[0].prompt_token_ids_logprobs == expected_prompt
    expected_out = []
    for out in outs:
        for token in out.tokens:
            expected_out.append([(t, model.logprob(state, t)) for t in ids])
            state = advance(state, token)
    assert [row for out in outs for row in out.token_ids_logprobs or []] == expected_out
    assert len(expected_out) == 3


async def test_a_listed_chosen_token_has_its_token_logprob() -> None:
    chosen = [t for out in await _outputs(_env([3, 4], [], start=None)) for t in out.tokens]
    outs = await _outputs(_env([3, 4], chosen, start=None))
    assert [t for out in outs for t in out.tokens] == chosen
    rows = [dict(row) for out in outs for row in out.token_ids_logprobs or []]
    logprobs = [lp for out in outs for lp in out.logprobs or []]
    assert [row[token] for row, token in zip(rows, chosen, strict=True)] == logprobs


async def test_the_mock_refuses_ids_outside_its_vocabulary() -> None:
    with pytest.raises(MeshError) as info:
        await _outputs(_env([1, 2], [3, 1000], start=None))
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
    assert info.value.message == (
        "token_ids_logprob contains out-of-vocabulary token id 1000; valid range is [0, 1000)."
    )


# ---------------------------------------------------------------- the SGLang adapter


def test_the_sglang_adapter_sends_token_ids_logprob() -> None:
    env = _env([1, 2, 3], [5, 9], start=2)
    body = sglang_body(env, "rid-1")
    assert body["return_logprob"] is True
    assert body["token_ids_logprob"] == [5, 9]
    assert body["logprob_start_len"] == 2
    env.output.logprob_token_ids = None
    env.engine = {"token_ids_logprob": [4]}
    env.format = "sglang"
    assert "token_ids_logprob" not in sglang_body(env, "rid-2")


# ---------------------------------------------------------------- return_prompt_token_ids


def test_return_prompt_token_ids_puts_the_prompt_on_every_record() -> None:
    bound = bind({"input_ids": [[4, 5], [6]], "return_prompt_token_ids": True})
    exchange = SglangFormat().exchange(bound, "pub", time.monotonic())
    out = {"t": frames.OUT, "id": "r", "seq": 1, "tokens": [9]}
    end = {"t": frames.END, "id": "r", "seq": 2, "tokens": [], "finish": {"reason": "length"},
           "usage": {}}  # fmt: skip
    records = [exchange.render(i, f) for i in (0, 1) for f in (out, end)]  # type: ignore[arg-type]
    assert [r["prompt_token_ids"] for r in records] == [[4, 5], [4, 5], [6], [6]]
    assert fold(records[:2], MERGE_RULES, JOINERS)["prompt_token_ids"] == [4, 5]
    plain = bind({"input_ids": [4, 5]})
    record = SglangFormat().exchange(plain, "p", time.monotonic()).render(0, out)  # type: ignore[arg-type]
    assert "prompt_token_ids" not in record


def test_the_envelope_checks_logprob_token_ids() -> None:
    wire = {"v": 1, "id": "x", "token_ids": [1], "output": {"logprob_token_ids": [3, -1]}}
    with pytest.raises(EnvelopeError, match=r"output\.logprob_token_ids\[1\]: expected a token"):
        Envelope.from_wire(wire)
    wire["output"] = {"logprob_token_ids": []}
    assert Envelope.from_wire(wire).output.logprob_token_ids is None


@pytest.mark.parametrize("key", ["extra_key", "cache_salt"])
def test_a_list_salt_on_a_single_request_is_sglangs_refusal(key: str) -> None:
    assert (
        refused({"input_ids": [1], key: ["a"]}) == f"{key} should be a string for a single request."
    )


def test_cache_salt_wins_over_extra_key_and_empty_is_none() -> None:
    env = bind({"input_ids": [1], "extra_key": "e", "cache_salt": "c"}).items[0]
    assert env.routing.cache_salt == "c"
    assert bind({"input_ids": [1], "extra_key": ""}).items[0].routing.cache_salt is None
    salts = bind({"input_ids": [[1], [2]], "extra_key": ["a", "b"]}).items
    assert [env.routing.cache_salt for env in salts] == ["a", "b"]


def test_session_id_is_a_routing_hint() -> None:
    assert bind({"input_ids": [1], "session_id": "s-1"}).items[0].routing.session == "s-1"


def test_a_lora_path_list_of_the_wrong_length_is_sglangs_refusal() -> None:
    message = refused({"input_ids": [[1], [2]], "lora_path": ["a"]})
    assert message == "lora_path list length (1) must match batch size (2)"
