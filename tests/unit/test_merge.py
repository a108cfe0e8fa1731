"""The generic chunk merger, and the SGLang rules folded over real-shaped chunks."""

from __future__ import annotations

import copy
import itertools
import random
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from genmesh.formats.merge import Merger, Rule, concat, fold
from genmesh.formats.sglang.request import ItemOptions, SglangOptions
from genmesh.formats.sglang.response import MERGE_RULES, SglangExchange
from genmesh.shared import frames

pytestmark = pytest.mark.unit


def keys_deep(obj: Any) -> Any:
    """The key order of every map, recursively (dict equality ignores order)."""
    if isinstance(obj, dict):
        return [(k, keys_deep(v)) for k, v in obj.items()]
    if isinstance(obj, list):
        return [keys_deep(v) for v in obj]
    return None


# ---------------------------------------------------------------- delta


def test_delta_concatenates_lists() -> None:
    out = fold([{"ids": [1]}, {"ids": [2, 3]}, {"ids": []}, {"ids": [4]}], {"ids": Rule.DELTA})
    assert out == {"ids": [1, 2, 3, 4]}


def test_delta_concatenates_strings() -> None:
    out = fold([{"text": "Hel"}, {"text": "lo"}, {"text": ""}], {"text": Rule.DELTA})
    assert out == {"text": "Hello"}


def test_delta_null_neither_clears_nor_breaks() -> None:
    rules = {"ids": Rule.DELTA}
    assert fold([{"ids": None}, {"ids": [1]}, {"ids": None}, {"ids": [2]}], rules) == {
        "ids": [1, 2]
    }
    assert fold([{"ids": None}], rules) == {"ids": None}


def test_delta_does_not_alias_or_mutate_chunks() -> None:
    first = {"ids": [1, 2]}
    second = {"ids": [3]}
    merger = Merger({"ids": Rule.DELTA})
    merger.add(first)
    merger.add(second)
    result = merger.result()
    assert result == {"ids": [1, 2, 3]}
    assert first == {"ids": [1, 2]}
    assert second == {"ids": [3]}
    result["ids"].append(99)
    assert first == {"ids": [1, 2]}


def test_single_delta_chunk_is_copied() -> None:
    chunk = {"ids": [1]}
    result = fold([chunk], {"ids": Rule.DELTA})
    result["ids"].append(2)
    assert chunk == {"ids": [1]}


# ---------------------------------------------------------------- joiners


def test_concat_joins_lists_and_strings() -> None:
    assert concat([[1], [], [2, 3], [4]]) == [1, 2, 3, 4]
    assert concat([[1]]) == [1]
    assert concat(["Hel", "", "lo"]) == "Hello"
    assert concat(["x"]) == "x"
    assert concat([[[1, 2]], [[3]]]) == [[1, 2], [3]]  # one level only


def test_concat_returns_a_new_list() -> None:
    pieces = [[1, 2], [3]]
    out = concat(pieces)
    assert out is not pieces[0]
    out.append(9)
    assert pieces == [[1, 2], [3]]


def test_custom_joiner_is_called_once_with_all_pieces_in_order() -> None:
    calls: list[list[Any]] = []

    def join(pieces: list[Any]) -> Any:
        calls.append(list(pieces))
        return "|".join(pieces)

    rules = {"m.b64": Rule.DELTA, "ids": Rule.DELTA}
    merger = Merger(rules, {"m.b64": join})
    chunks = [
        {"ids": [1], "m": {"b64": "AA"}},
        {"ids": [2], "m": {"b64": None}},  # nulls are not pieces
        {"ids": [], "m": {"b64": ""}},
        {"m": {"b64": "BB"}},
        {"ids": [3], "m": {"b64": "CC"}},
    ]
    for chunk in chunks:
        merger.add(chunk)
    assert calls == []  # pieces are kept aside until the end
    result = merger.result()
    assert calls == [["AA", "", "BB", "CC"]]
    # the custom joiner's output stands; other delta fields still use `concat`
    assert result == {"ids": [1, 2, 3], "m": {"b64": "AA||BB|CC"}}


def test_joiner_is_keyed_by_the_full_dotted_path() -> None:
    rules = {"a.x": Rule.DELTA, "b.x": Rule.DELTA}
    joined = fold(
        [{"a": {"x": [1]}, "b": {"x": [1]}}, {"a": {"x": [2]}, "b": {"x": [2]}}],
        rules,
        {"b.x": lambda pieces: sum(sum(p) for p in pieces)},
    )
    assert joined == {"a": {"x": [1, 2]}, "b": {"x": 3}}


def test_joiner_is_not_called_without_pieces() -> None:
    def boom(pieces: list[Any]) -> Any:
        raise AssertionError(f"called with {pieces}")

    assert fold([{"d": None}, {"d": None}], {"d": Rule.DELTA}, {"d": boom}) == {"d": None}


def test_joiner_for_a_path_without_a_delta_rule_is_unused() -> None:
    def boom(pieces: list[Any]) -> Any:
        raise AssertionError(f"called with {pieces}")

    out = fold([{"v": [1]}, {"v": [2]}], {}, {"v": boom})
    assert out == {"v": [2]}  # `last`, the default rule


def test_fold_with_joiners_equals_merger_with_joiners() -> None:
    def join(pieces: list[Any]) -> Any:
        return tuple(x for p in pieces for x in p)

    chunks = [{"d": [1]}, {"d": [2, 3]}]
    merger = Merger({"d": Rule.DELTA}, {"d": join})
    for chunk in chunks:
        merger.add(chunk)
    assert merger.result() == fold(chunks, {"d": Rule.DELTA}, {"d": join}) == {"d": (1, 2, 3)}
    assert fold(chunks, {"d": Rule.DELTA}, None) == {"d": [1, 2, 3]}


def test_delta_result_is_repeatable_and_sees_later_pieces() -> None:
    merger = Merger({"d": Rule.DELTA})
    merger.add({"d": [1]})
    assert merger.result() == {"d": [1]}
    assert merger.result() == {"d": [1]}
    merger.add({"d": [2]})
    assert merger.result() == {"d": [1, 2]}


# ---------------------------------------------------------------- last / prompt


def test_last_is_the_default_rule() -> None:
    out = fold([{"a": 1, "b": "x"}, {"a": 2}, {"a": None}], {})
    assert out == {"a": None, "b": "x"}


def test_last_replaces_maps_without_rules_below_them_wholesale() -> None:
    chunks = [
        {"finish": {"type": "stop", "matched": 7}},
        {"finish": {"type": "length"}},
    ]
    assert fold(chunks, {"ids": Rule.DELTA}) == {"finish": {"type": "length"}}


def test_prompt_keeps_the_first_attempts_last_known_value() -> None:
    # An engine may report a prompt property late (cached tokens); "not in this chunk"
    # (null) never erases what is known.
    chunks = [{"p": 10}, {"p": 12}, {"p": None}]
    assert fold(chunks, {"p": Rule.PROMPT}) == {"p": 12}


def test_prompt_null_until_known() -> None:
    assert fold([{"p": None}, {"p": 3}], {"p": Rule.PROMPT}) == {"p": 3}
    assert fold([{"p": None}], {"p": Rule.PROMPT}) == {"p": None}


def test_prompt_ignores_later_attempts() -> None:
    merger = Merger({"p": Rule.PROMPT})
    merger.add({"p": 7}, 0)
    merger.add({"p": 99}, 1)  # the replayed prompt of a migration
    assert merger.result() == {"p": 7}


# ---------------------------------------------------------------- attempt


def test_attempt_last_value_within_one_attempt() -> None:
    chunks = [{"n": 1}, {"n": 2}, {"n": 3}]
    assert fold(chunks, {"n": Rule.ATTEMPT}) == {"n": 3}


def test_attempts_sum_their_final_values() -> None:
    merger = Merger({"n": Rule.ATTEMPT})
    for attempt, values in ((0, [1, 2, 3]), (1, [1, 2]), (2, [1, 2, 3, 4])):
        for v in values:
            merger.add({"n": v}, attempt)
    assert merger.result() == {"n": 3 + 2 + 4}


def test_attempts_are_summed_whatever_the_arrival_order() -> None:
    merger = Merger({"n": Rule.ATTEMPT})
    merger.add({"n": 5}, 2)
    merger.add({"n": 7}, 0)
    merger.add({"n": 1}, 1)
    assert merger.result() == {"n": 13}


def test_attempt_nulls_are_skipped() -> None:
    merger = Merger({"n": Rule.ATTEMPT})
    merger.add({"n": 4}, 0)
    merger.add({"n": None}, 1)
    assert merger.result() == {"n": 4}
    only_null = Merger({"n": Rule.ATTEMPT})
    only_null.add({"n": None})
    assert only_null.result() == {"n": None}


def test_attempt_nested_and_result_is_repeatable() -> None:
    merger = Merger({"m.n": Rule.ATTEMPT})
    merger.add({"m": {"n": 2}}, 0)
    merger.add({"m": {"n": 3}}, 1)
    assert merger.result() == {"m": {"n": 5}}
    assert merger.result() == {"m": {"n": 5}}
    merger.add({"m": {"n": 4}}, 1)
    assert merger.result() == {"m": {"n": 6}}


# ---------------------------------------------------------------- nesting and order


def test_maps_with_rules_below_are_merged_key_by_key() -> None:
    rules = {"meta.ids": Rule.DELTA}
    chunks = [
        {"meta": {"a": 1, "ids": [1]}},
        {"meta": {"b": 2, "ids": [2]}},
        {"meta": {"a": 3}},
    ]
    assert fold(chunks, rules) == {"meta": {"a": 3, "ids": [1, 2], "b": 2}}


def test_deeply_nested_rules() -> None:
    rules = {"a.b.c": Rule.DELTA, "a.b.p": Rule.PROMPT}
    chunks = [
        {"a": {"b": {"c": [1], "p": "first", "x": 1}, "y": 1}},
        {"a": {"b": {"c": [2], "p": "second"}, "z": 2}},
    ]
    assert fold(chunks, rules) == {"a": {"b": {"c": [1, 2], "p": "second", "x": 1}, "y": 1, "z": 2}}


def test_non_map_value_at_a_parent_path_is_replaced_by_a_map() -> None:
    rules = {"meta.ids": Rule.DELTA}
    assert fold([{"meta": None}, {"meta": {"ids": [1]}}], rules) == {"meta": {"ids": [1]}}


def test_key_order_is_first_appearance() -> None:
    rules = {"m.d": Rule.DELTA, "m.n": Rule.ATTEMPT, "m.p": Rule.PROMPT}
    chunks = [
        {"z": 1, "m": {"n": 1, "d": [1]}},
        {"a": 1, "m": {"p": 0, "n": 2, "x": 0}, "z": 2},
        {"m": {"d": [2], "e": 1}, "b": 1},
    ]
    out = fold(chunks, rules)
    assert list(out) == ["z", "m", "a", "b"]
    assert list(out["m"]) == ["n", "d", "p", "x", "e"]
    assert out["m"] == {"n": 2, "d": [1, 2], "p": 0, "x": 0, "e": 1}


def test_fold_of_nothing_is_empty() -> None:
    assert fold([], MERGE_RULES) == {}


def test_non_map_value_replacing_a_parent_map_is_the_last_value() -> None:
    rules = {"meta.ids": Rule.DELTA}
    assert fold([{"meta": {"ids": [1]}}, {"meta": 5}], rules) == {"meta": 5}


# ---------------------------------------------------------------- SGLang chunk folding


@st.composite
def splits(draw: st.DrawFn, n: int) -> list[int]:
    """Sorted cut points in [0, n], possibly repeated (empty chunks)."""
    cuts = draw(st.lists(st.integers(min_value=0, max_value=n), max_size=8))
    return sorted(cuts)


def pieces(seq: list[Any], cuts: list[int]) -> list[list[Any]]:
    bounds = [0, *cuts, len(seq)]
    return [seq[a:b] for a, b in itertools.pairwise(bounds)]


def sglang_chunks(
    tokens: list[int],
    lps: list[float],
    cuts: list[int],
    prompt_lps: list[Any],
    *,
    prompt_tokens: int,
    completed_before: int = 0,
    final: bool,
) -> list[dict[str, Any]]:
    """Chunks shaped like `--incremental-streaming-output` SGLang for one attempt."""
    chunks: list[dict[str, Any]] = []
    parts = pieces(list(range(len(tokens))), cuts)
    running = 0
    for i, part in enumerate(parts):
        running += len(part)
        last = final and i == len(parts) - 1
        meta: dict[str, Any] = {
            "id": "pub-1",
            "finish_reason": {"type": "length", "length": 64} if last else None,
            "prompt_tokens": prompt_tokens + completed_before,
            "completion_tokens": running,
            "cached_tokens": 0,
            "input_token_logprobs": prompt_lps,
            "output_token_logprobs": [[lps[j], tokens[j], None] for j in part],
        }
        if last:
            meta["e2e_latency"] = 0.25
        chunks.append({"output_ids": [tokens[j] for j in part], "meta_info": meta})
    return chunks


token_lists = st.lists(st.integers(min_value=0, max_value=151_935), max_size=40)


@settings(max_examples=150, deadline=None)
@given(token_lists.flatmap(lambda t: st.tuples(st.just(t), splits(len(t)))))
def test_sglang_fold_of_any_chunking_equals_one_chunk(case: tuple[list[int], list[int]]) -> None:
    tokens, cuts = case
    lps = [-(i % 7) / 8 for i in range(len(tokens))]
    prompt_lps = [[None, 11, None], [-1.5, 12, None]]
    one = fold(sglang_chunks(tokens, lps, [], prompt_lps, prompt_tokens=2, final=True), MERGE_RULES)
    many_chunks = sglang_chunks(tokens, lps, cuts, prompt_lps, prompt_tokens=2, final=True)
    snapshot = copy.deepcopy(many_chunks)
    many = fold(many_chunks, MERGE_RULES)
    assert many == one
    assert keys_deep(many) == keys_deep(one)
    assert many_chunks == snapshot  # folding never mutates its input
    assert many["output_ids"] == tokens
    assert many["meta_info"]["completion_tokens"] == len(tokens)
    assert many["meta_info"]["finish_reason"] == {"type": "length", "length": 64}


@settings(max_examples=150, deadline=None)
@given(
    token_lists.flatmap(
        lambda t: st.tuples(
            st.just(t),
            splits(len(t)),  # where workers failed (migrations)
            st.lists(st.integers(min_value=0, max_value=len(t)), max_size=10),  # chunk cuts
        )
    )
)
def test_sglang_fold_across_migrations_equals_one_chunk(
    case: tuple[list[int], list[int], list[int]],
) -> None:
    tokens, migrations, cuts = case
    lps = [-(i % 5) / 4 for i in range(len(tokens))]
    prompt_lps = [[None, 3, None]]
    one = fold(sglang_chunks(tokens, lps, [], prompt_lps, prompt_tokens=1, final=True), MERGE_RULES)

    merger = Merger(MERGE_RULES)
    bounds = [0, *migrations, len(tokens)]
    for attempt, (a, b) in enumerate(itertools.pairwise(bounds)):
        local_cuts = sorted(c - a for c in cuts if a <= c <= b)
        # A later attempt's prompt includes the replayed output: different prompt facts.
        attempt_prompt_lps = prompt_lps if attempt == 0 else [[None, 99, None]] * (a + 1)
        for chunk in sglang_chunks(
            tokens[a:b],
            lps[a:b],
            local_cuts,
            attempt_prompt_lps,
            prompt_tokens=1,
            completed_before=a,
            final=b == len(tokens),
        ):
            merger.add(chunk, attempt)
    many = merger.result()
    assert many == one
    assert keys_deep(many) == keys_deep(one)
    assert many["meta_info"]["prompt_tokens"] == 1
    assert many["meta_info"]["input_token_logprobs"] == prompt_lps


def frames_for(
    tokens: list[int], cuts: list[int], prompt: list[int], top_k: int
) -> list[dict[str, Any]]:
    """Worker frames for `tokens` cut into pieces; the first carries prompt logprobs."""
    out: list[dict[str, Any]] = []
    parts = pieces(tokens, cuts)
    for i, part in enumerate(parts):
        offset = sum(len(p) for p in parts[:i])
        frame: dict[str, Any] = {
            "t": frames.END if i == len(parts) - 1 else frames.OUT,
            "id": "r",
            "seq": i + 1,
            "tokens": part,
            "logprobs": [-0.5 - (offset + j) / 100 for j in range(len(part))],
            "top_logprobs": [[(tid, -0.5), ((tid + 1) % 1000, -1.0)][:top_k] for tid in part],
        }
        if i == 0:
            frame["prompt_logprobs"] = [None, *[-2.0 - j for j in range(len(prompt) - 1)]]
            frame["prompt_top_logprobs"] = [None] + [[(t, -2.0)] for t in prompt[1:]]
            frame["cached_tokens"] = 0
        if frame["t"] == frames.END:
            frame["finish"] = {"reason": "eos", "matched": 7}
            frame["usage"] = {"prompt_tokens": len(prompt), "completion_tokens": len(tokens)}
        out.append(frame)
    return out


def item_options(prompt: list[int], top_k: int, public_id: str | None = None) -> ItemOptions:
    return ItemOptions(
        public_id=public_id,
        prompt_tokens=len(prompt),
        return_logprob=True,
        top_logprobs_num=top_k,
        max_new_tokens=50,
    )


def render_fold(frames_: list[dict[str, Any]], prompt: list[int], top_k: int) -> dict[str, Any]:
    options = SglangOptions(items=[item_options(prompt, top_k)], multi=False)
    exchange = SglangExchange(options, "pub-9", [prompt], time.monotonic())
    merger = Merger(MERGE_RULES)
    for frame in frames_:
        merger.add(exchange.render(0, frame))
    result = merger.result()
    assert result["meta_info"].pop("e2e_latency") >= 0
    return result


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=999), min_size=1, max_size=30).flatmap(
        lambda t: st.tuples(st.just(t), splits(len(t)))
    ),
    st.sampled_from([0, 1, 2]),
)
def test_rendered_frames_fold_like_one_frame(case: tuple[list[int], list[int]], top_k: int) -> None:
    tokens, cuts = case
    prompt = [5, 6, 7]
    one = render_fold(frames_for(tokens, [], prompt, top_k), prompt, top_k)
    many = render_fold(frames_for(tokens, cuts, prompt, top_k), prompt, top_k)
    assert many == one
    assert keys_deep(many) == keys_deep(one)
    meta = many["meta_info"]
    assert many["output_ids"] == tokens
    assert meta["completion_tokens"] == len(tokens)
    assert [t for _, t, _ in meta["output_token_logprobs"]] == tokens
    assert meta["input_token_logprobs"][0] == [None, 5, None]
    if top_k:
        assert len(meta["output_top_logprobs"]) == len(tokens)
    else:
        assert "output_top_logprobs" not in meta


@st.composite
def batches(draw: st.DrawFn) -> list[tuple[list[int], list[int], list[int]]]:
    """Items of a batch: (prompt, tokens, cut points for the frames)."""
    out = []
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        prompt = draw(st.lists(st.integers(min_value=0, max_value=999), min_size=1, max_size=5))
        tokens = draw(st.lists(st.integers(min_value=0, max_value=999), max_size=20))
        out.append((prompt, tokens, draw(splits(len(tokens)))))
    return out


def render_batch(
    case: list[tuple[list[int], list[int], list[int]]],
    top_k: int,
    order: list[int] | None,
    *,
    split: bool,
) -> list[dict[str, Any]]:
    """Render every item's frames through one exchange, interleaved in `order` (item
    indices), and fold each item's records on their own."""
    options = SglangOptions(
        items=[item_options(prompt, top_k, f"item-{i}") for i, (prompt, _, _) in enumerate(case)],
        multi=True,
    )
    exchange = SglangExchange(options, "pub", [p for p, _, _ in case], time.monotonic())
    queues = [
        iter(frames_for(tokens, cuts if split else [], prompt, top_k))
        for prompt, tokens, cuts in case
    ]
    if order is None:
        order = list(range(len(case)))  # one frame per item
    mergers = [Merger(MERGE_RULES) for _ in case]
    for index in order:
        record = exchange.render(index, next(queues[index]))
        (payload,) = exchange.sse(index, record)
        assert payload["index"] == index
        mergers[index].add(record)
    assert all(next(q, None) is None for q in queues)  # every frame was rendered
    folded = [m.result() for m in mergers]
    for record in folded:
        assert record["meta_info"].pop("e2e_latency") >= 0
    assert exchange.body(folded) == folded
    return folded


@settings(max_examples=100, deadline=None)
@given(batches(), st.sampled_from([0, 2]), st.randoms(use_true_random=False))
def test_batch_items_fold_alike_however_frames_split_and_interleave(
    case: list[tuple[list[int], list[int], list[int]]], top_k: int, rnd: random.Random
) -> None:
    # one frame per item, items in order
    one = render_batch(case, top_k, None, split=False)
    # each item's tokens cut into frames, items interleaved at random
    order = [i for i, (_, tokens, cuts) in enumerate(case) for _ in pieces(tokens, cuts)]
    rnd.shuffle(order)
    many = render_batch(case, top_k, order, split=True)
    assert many == one
    assert keys_deep(many) == keys_deep(one)
    for i, ((prompt, tokens, _), record) in enumerate(zip(case, many, strict=True)):
        meta = record["meta_info"]
        assert record["output_ids"] == tokens
        assert meta["id"] == f"item-{i}"
        assert meta["completion_tokens"] == len(tokens)
        assert meta["prompt_tokens"] == len(prompt)
        assert meta["finish_reason"] == {"type": "stop", "matched": 7}
        assert [t for _, t, _ in meta["output_token_logprobs"]] == tokens
        assert [t for _, t, _ in meta["input_token_logprobs"]] == prompt
        if top_k:
            assert len(meta["output_top_logprobs"]) == len(tokens)
