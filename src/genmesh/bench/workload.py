"""The requests a run sends: lengths, prompts, shared prefixes and bodies, all from
`--seed`, so two runs with the same options send the same bodies in the same order.

A length with a spread R is uniform over `round(L * (1 - R)) .. round(L * (1 + R))` (at
least 1), as vLLM's random dataset draws its `--random-range-ratio`. Token ids are uniform
below `--vocab-size`. With G prefix groups, request i belongs to group `i mod G` and its
prompt is that group's P-token prefix followed by its own random tokens; a prompt's length
counts the prefix (so P must fit the shortest prompt: `BenchConfig.check`).

Bodies are made as they are sent (one `orjson.dumps` each), not all ahead: a `--duration`
run does not know how many it needs, and a body costs microseconds.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from genmesh.bench.apis import APIS
from genmesh.bench.config import BenchConfig


@dataclass(frozen=True, slots=True)
class Request:
    index: int
    body: bytes
    prompt_tokens: int
    output_tokens: int  # asked for


def length_range(length: int, spread: float) -> tuple[int, int]:
    return max(1, round(length * (1 - spread))), max(1, round(length * (1 + spread)))


class Workload:
    """The request sequence of one phase ("measured" or "warmup": each its own stream of
    random numbers, so a warm-up does not change the measured requests)."""

    def __init__(self, config: BenchConfig, phase: str = "measured") -> None:
        self.config = config
        self.api = APIS[config.format]
        self.rng = random.Random(f"{config.seed}:{phase}")
        self.inputs = length_range(config.input_len, config.input_len_range)
        self.outputs = length_range(config.output_len, config.output_len_range)
        # The groups' prefixes come from the seed alone: warm-up and measured requests share
        # them, as a server's cache would see one workload.
        prefix_rng = random.Random(f"{config.seed}:prefixes")
        self.prefixes = [
            self._tokens(prefix_rng, config.prefix_len) for _ in range(config.prefix_groups)
        ]

    def _tokens(self, rng: random.Random, count: int) -> list[int]:
        return rng.choices(range(self.config.vocab_size), k=count)

    def prompt(self, index: int) -> list[int]:
        length = self.rng.randint(*self.inputs)
        if not self.prefixes:
            return self._tokens(self.rng, length)
        prefix = self.prefixes[index % len(self.prefixes)]
        return prefix + self._tokens(self.rng, length - len(prefix))

    def request(self, index: int) -> Request:
        prompt = self.prompt(index)
        output = self.rng.randint(*self.outputs)
        body = self.api.body(prompt, output, self.config.stream, self.config.model)
        return Request(index, body, len(prompt), output)

    def __iter__(self) -> Iterator[Request]:
        index = 0
        while True:
            yield self.request(index)
            index += 1
