"""What validating a vLLM `/inference/v1/generate` request costs the frontend: the time of
`VllmFormat.parse` + `VllmFormat.bind` (JSON bytes -> envelopes), per request.

    .venv/bin/python benchmarks/bench_bind_vllm.py [--prompt-tokens 1000] [--requests 2000]
        [--repeats 7] [--json FILE]

Cases: one `--prompt-tokens` prompt with typical sampling params (max_tokens, temperature,
top_p, top_k, seed, logprobs, stop_token_ids), n = 1 and n = 4, and the same without
logprobs. Each repeat binds `--requests` requests in a row and records the mean; the
figures are the median and the minimum over the repeats, in µs per request, for `bind`
alone (the parsed body given) and for `parse + bind`. On a shared machine the minimum is
the steadier of the two (other load only adds time). The engine catalog knows the model
(context 32768), as a frontend's does once workers are up.

To compare with another checkout, run this file with PYTHONPATH at that checkout's `src`
(the script only needs `VllmFormat` and `EngineCatalog`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from genmesh.formats.vllm import VllmFormat
from genmesh.shared.engine_info import EngineCatalog, EngineInfo

HEADERS = {"content-type": "application/json"}
TYPICAL = {
    "max_tokens": 256,
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 50,
    "seed": 1234,
    "logprobs": 1,
    "stop_token_ids": [2],
}


def cases(prompt_tokens: int) -> dict[str, bytes]:
    prompt = [(7 * i + 1) % 50_000 for i in range(prompt_tokens)]
    plain = {k: v for k, v in TYPICAL.items() if k != "logprobs"}
    bodies = {
        "n=1": {"token_ids": prompt, "sampling_params": TYPICAL, "model": "m"},
        "n=4": {"token_ids": prompt, "sampling_params": {**TYPICAL, "n": 4}, "model": "m"},
        "n=1 no logprobs": {"token_ids": prompt, "sampling_params": plain, "model": "m"},
        "n=4 no logprobs": {"token_ids": prompt, "sampling_params": {**plain, "n": 4}},
    }
    return {name: json.dumps(body).encode() for name, body in bodies.items()}


def per_request_us(run: Any, requests: int, repeats: int) -> tuple[float, float]:
    """(median, minimum) over the repeats of the mean time per request, in µs."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(requests):
            run()
        samples.append((time.perf_counter() - start) / requests * 1e6)
    return statistics.median(samples), min(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    fmt = VllmFormat()
    engines = EngineCatalog([EngineInfo(model="m", context_length=32_768)])
    results: dict[str, dict[str, float]] = {}
    for name, data in cases(args.prompt_tokens).items():
        parsed = fmt.parse(data)
        fmt.bind(parsed, HEADERS, engines)  # warm up, and fail early if it is refused
        bind_med, bind_min = per_request_us(
            lambda p=parsed: fmt.bind(p, HEADERS, engines), args.requests, args.repeats
        )
        full_med, full_min = per_request_us(
            lambda d=data: fmt.bind(fmt.parse(d), HEADERS, engines), args.requests, args.repeats
        )
        results[name] = {
            "bind_us_median": round(bind_med, 1),
            "bind_us_min": round(bind_min, 1),
            "parse_bind_us_median": round(full_med, 1),
            "parse_bind_us_min": round(full_min, 1),
        }
        print(
            f"{name:>16}: bind median {bind_med:7.1f} min {bind_min:7.1f} µs"
            f"   parse+bind median {full_med:7.1f} min {full_min:7.1f} µs",
            flush=True,
        )
    if args.json:
        report = {"prompt_tokens": args.prompt_tokens, "python": sys.version, "cases": results}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
