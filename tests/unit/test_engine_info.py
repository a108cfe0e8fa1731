"""Engine info: what workers advertise, read tolerantly, combined per model."""

from __future__ import annotations

import pytest

from genmesh.engines.mock import MockConfig, MockEngine, parse_sampling_defaults
from genmesh.shared.engine_info import NO_ENGINES, EngineCatalog, EngineInfo, sampling_defaults
from genmesh.shared.settings import parse

pytestmark = pytest.mark.unit


def test_round_trip_keeps_every_field() -> None:
    info = EngineInfo(
        model="m",
        context_length=4096,
        max_total_num_tokens=100_000,
        block_size=16,
        sampling_defaults={"temperature": 0.6, "top_p": 0.95, "max_new_tokens": 64},
        engine_version="x-1",
        vocab_size=151_936,
        max_logprobs=20,
    )
    assert EngineInfo.from_wire(info.to_wire()) == info


@pytest.mark.parametrize("card", [None, [], {}, {"model": 3}, {"context_length": 5}])
def test_a_card_without_a_model_name_has_no_info(card: object) -> None:
    assert EngineInfo.from_wire(card) is None


def test_wrong_types_and_unknown_defaults_are_dropped_not_fatal() -> None:
    info = EngineInfo.from_wire(
        {
            "model": "m",
            "context_length": "4096",
            "max_total_num_tokens": -1,
            "block_size": True,
            "sampling_defaults": {"temperature": "hot", "top_k": 20, "typical_p": 0.5},
            "engine_version": 7,
            "vocab_size": 0,
            "max_logprobs": -1,  # vLLM's "the vocabulary": adapters resolve it or omit it
        }
    )
    assert info == EngineInfo(model="m", sampling_defaults={"top_k": 20})


def test_catalog_takes_the_tightest_limits_of_a_models_workers() -> None:
    catalog = EngineCatalog(
        [
            EngineInfo("b", context_length=8192, max_total_num_tokens=50_000, max_logprobs=5),
            EngineInfo("a", context_length=4096),
            EngineInfo(
                "b",
                context_length=2048,
                sampling_defaults={"top_p": 0.9},
                vocab_size=1000,
                max_logprobs=20,
            ),
        ]
    )
    assert catalog.models == ["a", "b"]
    b = catalog.get("b")
    assert b is not None
    assert (b.context_length, b.max_total_num_tokens) == (2048, 50_000)
    assert (b.vocab_size, b.max_logprobs) == (1000, 5)
    assert catalog.get(None) == catalog.get("a")
    assert catalog.get("c") is None
    assert not NO_ENGINES
    assert NO_ENGINES.get() is None


def test_the_mock_advertises_its_limits() -> None:
    config = MockConfig(max_model_len=1000, sampling_defaults=(("temperature", 0.7),))
    info = EngineInfo.from_wire(MockEngine(config).describe()["engine_info"])
    assert info is not None
    assert (info.model, info.context_length) == (config.model, 1000)
    assert info.max_total_num_tokens == 1_048_576  # unset --mock-kv-blocks: as always
    assert info.sampling_defaults == {"temperature": 0.7}
    assert (info.vocab_size, info.max_logprobs) == (config.vocab_size, 20)


def test_a_worker_that_states_nothing_takes_nothing_away() -> None:
    """Limits are the tightest stated; block size, defaults and version the first stated,
    whichever worker the directory happens to list first."""
    silent = EngineInfo("m")
    stated = EngineInfo(
        "m",
        context_length=4096,
        block_size=32,
        sampling_defaults={"top_p": 0.9},
        engine_version="x-1",
    )
    for order in ([silent, stated], [stated, silent]):
        assert EngineCatalog(order).get("m") == stated


def test_sampling_defaults_read_a_map_or_its_json_text() -> None:
    """SGLang reports --preferred-sampling-params as the JSON text it was given."""
    text = '{"temperature": 0.6, "max_new_tokens": 64, "stop": ["x"], "top_k": true}'
    assert sampling_defaults(text) == {"temperature": 0.6, "max_new_tokens": 64}
    assert sampling_defaults({"min_p": 0.1}) == {"min_p": 0.1}
    assert sampling_defaults('{"temperature": NaN, "top_p": Infinity, "top_k": 5}') == {"top_k": 5}
    for unreadable in ("{not json", "[1]", None, 3):
        assert sampling_defaults(unreadable) == {}


def test_the_mock_takes_its_advertised_facts_from_the_command_line() -> None:
    config = parse(
        MockConfig,
        [
            *("--mock-kv-blocks", "80", "--mock-block-size", "64"),
            *("--mock-sampling-defaults", '{"temperature": 0.6, "top_k": 20}'),
        ],
        environ={},
    )
    info = EngineInfo.from_wire(MockEngine(config).describe()["engine_info"])
    assert info is not None
    assert (info.max_total_num_tokens, info.block_size) == (80 * 64, 64)
    assert info.sampling_defaults == {"temperature": 0.6, "top_k": 20}


@pytest.mark.parametrize("text", ['{"temprature": 0.6}', '{"top_p": "high"}', "[0.6]", "{"])
def test_mock_sampling_defaults_refuse_what_would_silently_vanish(text: str) -> None:
    with pytest.raises(ValueError, match=r"(?i)expect"):
        parse_sampling_defaults(text)
