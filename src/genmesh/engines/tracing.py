"""An HTTP engine call as a CLIENT span `POST <path>`: a child of the worker's span, whose
context travels to the engine as `traceparent` (`tracing.inject_current`)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from urllib.parse import urlsplit

from opentelemetry.trace import Span, SpanKind

from genmesh.engines.base import EngineOutput
from genmesh.shared import tracing
from genmesh.shared.errors import ErrorCode, MeshError
from genmesh.shared.tracing import (
    ENGINE,
    FINISH,
    FINISH_REASON,
    FIRST_TOKEN,
    GENMESH_ERROR_TYPE,
    TOKENS_OUTPUT,
    fail,
)


def engine_call(
    outputs: AsyncGenerator[EngineOutput, None], engine: str, url: str, path: str
) -> AsyncGenerator[EngineOutput, None]:
    """An HTTP engine's outputs under a CLIENT span `POST <path>`, a child of the current
    span (the worker's); `outputs` itself when tracing is off. The span is current while
    the adapter runs, so `inject_current` gives the engine its `traceparent`."""
    tr = tracing.tracer()
    if tr is None:
        return outputs
    span = tr.start_span(f"POST {path}", kind=SpanKind.CLIENT)
    if span.is_recording():
        parts = urlsplit(url.rstrip("/") + path)
        span.set_attributes(
            {
                "http.request.method": "POST",
                "url.full": parts.geturl(),
                "url.template": path,
                "server.address": parts.hostname or "",
                "server.port": parts.port or (443 if parts.scheme == "https" else 80),
                ENGINE: engine,
            }
        )
    return _engine_call(outputs, span)


async def _engine_call(
    outputs: AsyncGenerator[EngineOutput, None], span: Span
) -> AsyncGenerator[EngineOutput, None]:
    ctx = tracing.with_span(span)
    recording = span.is_recording()
    tokens = 0
    answered = finished = False
    try:
        while True:
            # Current only while the adapter runs: each step attaches and detaches in
            # this task, so the worker's own code between steps never sees it.
            token = tracing.attach(ctx)
            try:
                out = await outputs.__anext__()
            except StopAsyncIteration:
                return
            finally:
                tracing.detach(token)
            if not answered:
                answered = True
                if recording:
                    span.set_attribute("http.response.status_code", 200)
            if out.tokens and not tokens:
                span.add_event(FIRST_TOKEN)
            tokens += len(out.tokens)
            if out.finish is not None:
                finished = True
                if recording:
                    reason = out.finish.get("reason")
                    if isinstance(reason, str):
                        span.set_attribute(FINISH_REASON, reason)
                    span.add_event(FINISH, {TOKENS_OUTPUT: tokens})
            yield out
    except MeshError as exc:
        if recording:
            status = (exc.detail or {}).get("status_code")
            if isinstance(status, int):
                span.set_attribute("http.response.status_code", status)
            fail(span, exc.code.value, exc.message)
        raise
    except Exception as exc:
        if recording:
            span.record_exception(exc)
            fail(span, ErrorCode.INTERNAL.value, repr(exc))
        raise
    except BaseException:  # cancelled, or closed by the worker
        if recording and not finished:
            span.set_attribute(GENMESH_ERROR_TYPE, ErrorCode.CANCELLED.value)
        raise
    finally:
        token = tracing.attach(ctx)
        try:
            await outputs.aclose()  # the adapter's abort, if any, under this span too
        finally:
            tracing.detach(token)
            if recording:
                span.set_attribute(TOKENS_OUTPUT, tokens)
            span.end()
