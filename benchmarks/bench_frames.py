"""What one reply frame costs in Python: build and encode on the worker, decode and read on
the requester. The per-token path of the mesh, without the network.

    .venv/bin/python benchmarks/bench_frames.py [--frames N] [--repeats R]

Rows: genmesh's own path (a dict built by `output_frame`, msgpack, `frames.parse`, one
`frames.Summary`), and, when msgspec is installed (`pip install msgspec`; genmesh does not
depend on it), the same frame as a msgspec Struct encoded and decoded by msgspec: the
alternative weighed for typed frames (docs/architecture.md, "Typed frames are
TypedDicts"). Prints the median of the repeats in microseconds per frame.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from genmesh.codecs import get_codec
from genmesh.engines.base import EngineOutput
from genmesh.engines.execute import output_frame
from genmesh.shared import frames

RID = "a3f9c1d2e4b5a6c7d8e9f0a1b2c3d4e5"


def per_frame_us(step: Callable[[int], Any], count: int, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(count):
            step(i)
        runs.append((time.perf_counter() - start) / count * 1e6)
    return statistics.median(runs)


def outputs(logprobs: bool) -> EngineOutput:
    out = EngineOutput(tokens=[84490])
    if logprobs:
        out.logprobs, out.ranks = [-0.25], [1]
    return out


def genmesh_rows(count: int, repeats: int) -> list[tuple[str, str, float]]:
    codec = get_codec("msgpack")
    rows = []
    for label, logprobs in (("1 token", False), ("1 token + logprobs", True)):
        out = outputs(logprobs)

        def send(i: int, out: EngineOutput = out) -> bytes:
            frame = output_frame(RID, out)
            frame["seq"] = i
            return codec.encode(frame)

        data = send(1)
        summary = frames.Summary()

        def receive(i: int, data: bytes = data, summary: frames.Summary = summary) -> None:
            _, frame = frames.parse(codec.decode(data))
            assert frame is not None
            summary.add(frame)

        rows.append((label, "dict + msgpack (genmesh)", per_frame_us(send, count, repeats)))
        rows.append((label, "decode + parse + Summary", per_frame_us(receive, count, repeats)))
    return rows


def msgspec_rows(count: int, repeats: int) -> list[tuple[str, str, float]]:
    try:
        import msgspec
    except ImportError:
        return []

    class Out(msgspec.Struct, tag_field="t", tag="out", omit_defaults=True):
        id: str
        seq: int
        tokens: list[int]
        logprobs: list[float] | None = None
        ranks: list[int] | None = None

    class Ack(msgspec.Struct, tag_field="t", tag="ack"):
        id: str
        seq: int
        worker: str
        dispatch: str

    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(Out | Ack)
    rows = []
    for label, logprobs in (("1 token", False), ("1 token + logprobs", True)):
        extra: dict[str, Any] = {"logprobs": [-0.25], "ranks": [1]} if logprobs else {}

        def send(i: int, extra: dict[str, Any] = extra) -> bytes:
            return encoder.encode(Out(id=RID, seq=i, tokens=[84490], **extra))

        data = send(1)

        def receive(i: int, data: bytes = data) -> None:
            frame = decoder.decode(data)
            assert isinstance(frame, Out)

        rows.append((label, "msgspec Struct (encode)", per_frame_us(send, count, repeats)))
        rows.append((label, "msgspec Struct (decode)", per_frame_us(receive, count, repeats)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=200_000, help="frames per run")
    parser.add_argument("--repeats", type=int, default=5, help="runs; the median is shown")
    args = parser.parse_args()
    rows = genmesh_rows(args.frames, args.repeats) + msgspec_rows(args.frames, args.repeats)
    print(f"{'frame':<20} {'path':<28} {'us/frame':>9}")
    for label, path, us in rows:
        print(f"{label:<20} {path:<28} {us:>9.2f}")
    if not any(path.startswith("msgspec") for _, path, _ in rows):
        print("(msgspec is not installed: `pip install msgspec` adds its rows)")


if __name__ == "__main__":
    main()
