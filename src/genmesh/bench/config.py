"""`genmesh bench`'s options, declared once (`shared/settings.py`), and the rules between
them. A module that imports nothing heavy, so `genmesh bench --help` stays quick.

No variables: a benchmark is a one-off, typed out (as `genmesh trace replay`)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from genmesh.shared.settings import (
    InvalidText,
    non_negative_int,
    option,
    positive_float,
    positive_int,
)

FORMATS = ("sglang", "vllm")
# Without -n and --duration a run sends this many requests.
DEFAULT_REQUESTS = 1000


def spread(text: str) -> float:
    """A length's relative spread: 0 (fixed) up to, not including, 1."""
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise InvalidText("must be at least 0 and below 1")
    return value


def http_url(text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidText("must be an http:// or https:// URL with a host")
    return text


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """`genmesh bench`."""

    url: str = option(
        env=None,
        parse=http_url,
        help="the server: http://HOST:PORT (the route follows --format) or a full URL with "
        "its path",
    )
    format: str = option(
        "sglang",
        env=None,
        choices=FORMATS,
        help="body shape and route: sglang (POST /generate, input_ids) or vllm "
        "(POST /inference/v1/generate, token_ids)",
    )
    model: str | None = option(
        None, env=None, help="a `model` field in every body (Dynamo routes by it)"
    )
    stream: bool = option(
        False, env=None, help="ask for SSE (TTFT and inter-token latency per event)"
    )
    requests: int | None = option(
        None,
        short="-n",
        env=None,
        parse=positive_int,
        help=f"measured requests ({DEFAULT_REQUESTS} unless --duration is given; with "
        "both, whichever ends first)",
    )
    duration_s: float | None = option(
        None,
        flag="--duration",
        env=None,
        parse=positive_float,
        help="seconds to send requests for (those in flight then are awaited and counted)",
    )
    concurrency: int = option(
        8,
        short="-c",
        env=None,
        parse=positive_int,
        help="closed loop: requests in flight at once, each sent when one ends "
        "(also the warm-up's concurrency)",
    )
    request_rate: float | None = option(
        None,
        env=None,
        parse=positive_float,
        help="open loop instead: requests per second, Poisson arrivals (exponential gaps)",
    )
    max_concurrency: int | None = option(
        None,
        env=None,
        parse=positive_int,
        help="open loop: at most this many in flight; an arrival beyond waits for a slot "
        "(its clock starts when it is sent)",
    )
    warmup: int = option(
        0,
        env=None,
        parse=non_negative_int,
        help="requests sent first, closed loop, and left out of every figure",
    )
    input_len: int = option(128, env=None, parse=positive_int, help="prompt tokens")
    input_len_range: float = option(
        0.0,
        env=None,
        parse=spread,
        help="prompt lengths uniform in input-len x [1-R, 1+R] (0: all the same)",
    )
    output_len: int = option(
        32,
        env=None,
        parse=positive_int,
        help="output tokens asked for (ignore_eos, so exactly that many)",
    )
    output_len_range: float = option(
        0.0,
        env=None,
        parse=spread,
        help="output lengths uniform in output-len x [1-R, 1+R] (0: all the same)",
    )
    vocab_size: int = option(
        32_000, env=None, parse=positive_int, help="prompt token ids are random below this"
    )
    seed: int = option(0, env=None, help="seeds lengths, token ids and arrival times")
    prefix_groups: int = option(
        0,
        env=None,
        parse=non_negative_int,
        help="shared prefixes: request i belongs to group i mod G, and the requests of a "
        "group share their first --prefix-len tokens",
    )
    prefix_len: int = option(
        0, env=None, parse=non_negative_int, help="tokens of each group's shared prefix"
    )
    timeout_s: float = option(
        300.0,
        flag="--timeout",
        env=None,
        parse=positive_float,
        help="seconds one request may take (then it counts as a timeout error)",
    )
    json_out: str | None = option(
        None,
        env=None,
        metavar="FILE",
        help="write the config, the figures and every request's record as JSON",
    )
    plot: str | None = option(
        None,
        env=None,
        metavar="FILE",
        help="draw latency CDFs and throughput over time: FILE.png, or FILE.html (one "
        "self-contained page); needs the `bench` extra (matplotlib)",
    )
    progress: bool = option(True, flag="--no-progress", env=None, help="no live progress bar")

    @property
    def open_loop(self) -> bool:
        return self.request_rate is not None

    @property
    def shortest_input(self) -> int:
        return max(1, round(self.input_len * (1 - self.input_len_range)))

    def check(self) -> None:
        """Refuse what the options cannot mean together (ValueError, one line)."""
        if self.max_concurrency is not None and not self.open_loop:
            raise ValueError(
                "--max-concurrency caps an open loop: give --request-rate too "
                "(a closed loop's cap is --concurrency)"
            )
        if (self.prefix_groups > 0) != (self.prefix_len > 0):
            raise ValueError("shared prefixes need both --prefix-groups and --prefix-len")
        if self.prefix_len > self.shortest_input:
            raise ValueError(
                f"--prefix-len {self.prefix_len} is longer than the shortest prompt "
                f"({self.shortest_input} tokens from --input-len and --input-len-range)"
            )
        if self.plot is not None and not self.plot.endswith((".png", ".html")):
            raise ValueError(f"--plot {self.plot}: the file must end in .png or .html")
