"""What validating a native request costs: `GenerateFormat.bind` per request, by format.

    .venv/bin/python benchmarks/bench_bind.py [--format sglang|vllm|both|sglang+b64zstd]
        [--repeats R] [--number N]

Each case is a request body as a client sends it, parsed once (`format.parse`); the timed
step is `format.bind(body, headers, engines)` with an engine catalog that knows a context
length and sampling defaults, as a frontend's would, and then `parse` + `bind` from the raw
bytes. Prints, per case, the median over R runs of N requests, in microseconds per request.

To compare two versions of genmesh, run the same script with each one's source first on
the path, e.g. `PYTHONPATH=/tmp/before/src .venv/bin/python benchmarks/bench_bind.py`
(for `sglang+b64zstd`, the codec's too: `PYTHONPATH=/tmp/before/src:/tmp/before/codecs/
b64zstd/src`). The cases are a table by format (`CASES`): add a format's cases there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import timeit
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from genmesh.formats.base import GenerateFormat
from genmesh.shared.engine_info import EngineCatalog, EngineInfo

ENGINES = EngineCatalog(
    [
        EngineInfo(
            model="bench-model",
            context_length=32_768,
            max_total_num_tokens=1_048_576,
            block_size=16,
            sampling_defaults={"temperature": 0.7, "top_p": 0.8, "top_k": 20},
        )
    ]
)


def _prompt(length: int, offset: int = 0) -> list[int]:
    return [(offset + 7919 * i) % 150_000 for i in range(length)]


@dataclass(frozen=True)
class Case:
    name: str
    body: dict[str, Any]
    headers: dict[str, str]


def _sglang() -> GenerateFormat:
    from genmesh.formats.sglang import SglangFormat

    return SglangFormat()


def _vllm() -> GenerateFormat:
    from genmesh.formats.vllm import VllmFormat

    return VllmFormat()


def _sglang_b64zstd() -> GenerateFormat:
    from genmesh.formats.catalog import load_generate_formats

    return load_generate_formats("sglang+b64zstd", env={})[0]


def _b64zstd_cases() -> list[Case]:
    from genmesh_b64zstd import encode_int32  # the codec's package, installed by dev.py

    return [
        Case(
            f"1 x {label} tokens, typical sampling",
            {"input_ids": encode_int32(_prompt(n)), "sampling_params": TYPICAL_SGLANG},
            {},
        )
        for label, n in (("1000", 1000), ("32,000", LONG))
    ]


TYPICAL_SGLANG = {
    "max_new_tokens": 256,
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 40,
    "stop_token_ids": [151645, 151643],
}
TYPICAL_VLLM = {
    "max_tokens": 256,
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 50,
    "seed": 1234,
    "logprobs": 1,
    "stop_token_ids": [2],
}
JSON = {"content-type": "application/json"}
# The longest prompt the mock's context takes with 16 tokens out (performance.md).
LONG = 32_000

# Per format: how to make it, and how to make the requests to time.
CASES: dict[str, tuple[Callable[[], GenerateFormat], Callable[[], list[Case]]]] = {
    "sglang": (
        _sglang,
        lambda: [
            Case(
                "1 x 1000 tokens, typical sampling",
                {"input_ids": _prompt(1000), "sampling_params": TYPICAL_SGLANG, "rid": "r1"},
                {},
            ),
            Case(
                "1 x 32,000 tokens, typical sampling",
                {"input_ids": _prompt(LONG), "sampling_params": TYPICAL_SGLANG, "rid": "r1"},
                {},
            ),
            Case(
                "8 x 256 tokens, n=1",
                {
                    "input_ids": [_prompt(256, b) for b in range(8)],
                    "sampling_params": {**TYPICAL_SGLANG, "n": 1},
                },
                {},
            ),
        ],
    ),
    "vllm": (
        _vllm,
        lambda: [
            Case(
                "1 x 1000 tokens, typical, n=1",
                {
                    "token_ids": _prompt(1000),
                    "sampling_params": TYPICAL_VLLM,
                    "model": "bench-model",
                },
                JSON,
            ),
            Case(
                "1 x 1000 tokens, typical, n=4",
                {
                    "token_ids": _prompt(1000),
                    "sampling_params": {**TYPICAL_VLLM, "n": 4},
                    "model": "bench-model",
                },
                JSON,
            ),
            Case(
                "1 x 32,000 tokens, typical, n=1",
                {
                    "token_ids": _prompt(LONG),
                    "sampling_params": {**TYPICAL_VLLM, "max_tokens": 16},
                    "model": "bench-model",
                },
                JSON,
            ),
        ],
    ),
    "sglang+b64zstd": (_sglang_b64zstd, _b64zstd_cases),
}
# `--format both`: the JSON formats.
BOTH = ("sglang", "vllm")


def bind_us(fmt: GenerateFormat, case: Case, number: int, repeats: int) -> tuple[float, float]:
    """Median µs per request of `bind` alone, and of `parse` + `bind`."""
    raw = json.dumps(case.body).encode()
    body = fmt.parse(raw)

    def bind() -> None:
        fmt.bind(body, case.headers, ENGINES)

    def parse_and_bind() -> None:
        fmt.bind(fmt.parse(raw), case.headers, ENGINES)

    bind()  # warm up (and fail loudly on a body the format refuses)
    medians = []
    for step in (bind, parse_and_bind):
        runs = timeit.repeat(step, number=number, repeat=repeats)
        medians.append(statistics.median(runs) / number * 1e6)
    return medians[0], medians[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--format", default="both", help="sglang, vllm, both (the two) or sglang+b64zstd"
    )
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per case")
    parser.add_argument("--number", type=int, default=200, help="binds per run")
    args = parser.parse_args(argv)
    names = list(BOTH) if args.format == "both" else [args.format]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"no cases for format(s) {', '.join(unknown)}; have {', '.join(CASES)}")
    print(f"{'format':<14} {'case':<36} {'bind µs':>9} {'parse+bind µs':>14}")
    for name in names:
        make, cases = CASES[name]
        fmt = make()
        for case in cases():
            alone, with_parse = bind_us(fmt, case, args.number, args.repeats)
            print(f"{name:<14} {case.name:<36} {alone:>9.1f} {with_parse:>14.1f}", flush=True)


if __name__ == "__main__":
    main()
