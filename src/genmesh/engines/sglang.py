"""The `sglang` engine adapter: a client of a real SGLang server's native HTTP API.

Every dispatch goes to `POST /generate` as a stream, under its own private rid: 32 hex
digits, so no rid is a prefix of another (SGLang's `/abort_request` aborts every request
whose rid *starts with* the one given). Cancelling the generator aborts that rid.

SGLang streams either cumulative chunks (its default) or deltas
(`--incremental-streaming-output`); a cursor of delivered tokens reads both, and the mode
the server reports in `/get_server_info` decides how list fields are sliced.

Errors, as the seed PR describes them: an HTTP 4xx is the request's fault
(`invalid_argument`, with the engine's message, `status_code` and `err_type`); 5xx,
connection failures and timeouts are `unavailable` (retryable); a terminal abort before
any token (prefill) is an error (`invalid_argument` with a 4xx `status_code`, else
`internal`), while on decode a plain abort with no `status_code` and no `err_type` is a
cancellation (finish reason `abort`); a stream that ends before its terminal chunk is
`unavailable` with reason `stream_incomplete`. A response that cannot be read (an event
that is not JSON, fields of the wrong shape, an invalid routed-experts blob) is
`unavailable` with reason `malformed_response`, and the request is aborted on the server
(the seed's "malformed decode responses trigger cancellation").

Prefill/decode disaggregation (docs/disaggregation.md, "SGLang"): both halves send the body
`generate` sends plus the bootstrap triple of the request's ticket (`sglang_pd`), each to
its own server, at once. The prefill half answers the prompt's side (prompt logprobs, the
prompt's expert rows, cached tokens); the decode half answers the generation, its first
token (sampled by prefill) included.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import re
import secrets
import struct
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp

from genmesh.engines.base import EngineOutput, usage
from genmesh.engines.http import (
    HttpEngineBase,
    HttpEngineConfig,
    http_error,
    incomplete,
    is_malformed,
    malformed,
    sse_events,
    unavailable,
)
from genmesh.engines.sglang_pd import BootstrapConfig, bootstrap_fields, expert_rows, new_ticket
from genmesh.engines.tracing import engine_call
from genmesh.shared import tracing
from genmesh.shared.engine_info import EngineInfo, sampling_defaults
from genmesh.shared.envelope import Envelope
from genmesh.shared.errors import ErrorCode, MeshError
from genmesh.shared.frames import Finish, TopLogprobs
from genmesh.shared.multimodal import FeaturesError, envelope_items

if TYPE_CHECKING:
    from nats.aio.client import Client

    from genmesh.shared.micro import MicroService
    from genmesh.shared.subjects import Subjects

log = logging.getLogger(__name__)

# meta_info keys the adapter turns into frame fields; the rest travel as engine extras.
_MAPPED_META = frozenset(
    (
        "id",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "e2e_latency",
        "input_token_logprobs",
        "input_top_logprobs",
        "output_token_logprobs",
        "output_top_logprobs",
        "input_token_ids_logprobs",
        "output_token_ids_logprobs",
        "output_token_logprobs_length",
        "routed_experts",
    )
)
# Fields of an SGLang-format request the adapter sets itself.
_OWNED = ("input_ids", "rid", "stream", "text")
# The server info route, newest name first.
INFO_PATHS = ("/server_info", "/get_server_info")


def new_dispatch_rid() -> str:
    return secrets.token_hex(16)


def sglang_body(env: Envelope, rid: str) -> dict[str, Any]:
    """The native request for one dispatch: the client's own fields if it spoke SGLang,
    then everything the envelope decides (budget, logprobs, ...), which wins."""
    _refuse_vllm_multimodal(env)
    body = (
        {k: v for k, v in env.engine.items() if k not in _OWNED} if env.format == "sglang" else {}
    )
    sp = dict(body.get("sampling_params") or {})
    s = env.sampling
    sp["max_new_tokens"] = s.max_tokens
    sp["min_new_tokens"] = s.min_tokens
    sp["ignore_eos"] = s.ignore_eos
    sp["stop_token_ids"] = list(s.stop_token_ids)
    sp.pop("n", None)
    for key, value in (
        ("temperature", s.temperature),
        ("top_p", s.top_p),
        ("top_k", s.top_k),
        ("min_p", s.min_p),
        ("sampling_seed", s.seed),
    ):
        if value is not None:
            sp[key] = value
    body["sampling_params"] = sp
    out = env.output
    body["return_logprob"] = out.logprobs or out.prompt_logprobs_start is not None
    if body["return_logprob"]:
        body["logprob_start_len"] = (
            len(env.token_ids) - 1
            if out.prompt_logprobs_start is None
            else out.prompt_logprobs_start
        )
        body["top_logprobs_num"] = out.top_logprobs
        if out.logprob_token_ids:
            body["token_ids_logprob"] = list(out.logprob_token_ids)
        else:
            body.pop("token_ids_logprob", None)
    if out.routed_experts_start is not None:
        body["return_routed_experts"] = True
        body["routed_experts_start_len"] = out.routed_experts_start
    else:
        body.pop("return_routed_experts", None)
    if env.routing.dp_rank is not None:
        body["routed_dp_rank"] = env.routing.dp_rank
    body["input_ids"] = list(env.token_ids)  # the engine reads JSON: one list, here
    body["rid"] = rid
    body["stream"] = True
    return body


def _refuse_vllm_multimodal(env: Envelope) -> None:
    """vLLM's rendered multimodal items mean nothing to SGLang, which would read each image
    as its placeholder tokens: refused rather than answered without the image."""
    try:
        multimodal = bool(envelope_items(env))
    except FeaturesError:
        multimodal = True
    if multimodal:
        raise MeshError(
            ErrorCode.INVALID_ARGUMENT,
            "multimodal features (vLLM's rendered items) cannot be served by an SGLang engine",
        )


def _positive(value: Any) -> int | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return value if ok else None


def _int32(text: Any) -> list[int]:
    """SGLang's routed-experts blob: base64 of little-endian int32s. ValueError (or
    TypeError, struct.error) when it is not one."""
    raw = base64.b64decode(text, validate=True)
    return list(struct.unpack(f"<{len(raw) // 4}i", raw))


# What reading an event's fields raises when they do not have SGLang's shapes.
_SHAPE_ERRORS = (TypeError, ValueError, KeyError, IndexError, AttributeError, struct.error)


def _tops(rows: Any) -> list[TopLogprobs | None]:
    return [None if row is None else [(t[1], t[0]) for t in row] for row in rows]


class _Cursor:
    """Turns SGLang chunks, cumulative or incremental, into deltas.

    A cumulative list holds the whole sequence (its length is the running total), an
    incremental one only what is new; the two agree on the first chunk, and after that
    the lengths tell them apart, so the cursor works even when the server's mode is
    unknown. The mode, once known, also decides routed experts (counted in ints, not
    tokens, so they cannot tell by themselves).
    """

    def __init__(self, incremental: bool | None) -> None:
        self.incremental = incremental
        self.delivered = 0
        self.experts = 0

    def delta(self, values: list[Any], total: int) -> list[Any]:
        if self.incremental is None and self.delivered:
            if len(values) == total - self.delivered:
                self.incremental = True
            elif len(values) == total:
                self.incremental = False
        if self.incremental or not self.delivered:
            return values
        return values[self.delivered :]

    def expert_delta(self, values: list[int]) -> list[int]:
        new = values if self.incremental else values[self.experts :]
        self.experts += len(new)
        return new


@dataclass(slots=True)
class _Half:
    """One half of a disaggregated request, as its stream is read: SGLang's routed-experts
    blob is collected (and judged once complete) rather than handed on as it comes."""

    prefill: bool
    experts: list[int] = field(default_factory=list)
    experts_valid: bool = True


class SglangEngine(HttpEngineBase):
    name = "sglang"
    # Prefill/decode disaggregation (engines/base.py `Disaggregating`): the two servers pair
    # by the bootstrap room, so both halves run at once.
    pd_kind = "sglang"
    pd_concurrent = True

    def __init__(self, config: HttpEngineConfig, bootstrap: BootstrapConfig | None = None) -> None:
        super().__init__(config)
        self.bootstrap = bootstrap or BootstrapConfig()
        # P/D halves whose routed-experts blob was invalid or incomplete, so left out (the
        # decode worker's join then leaves out the request's rows, and counts the request
        # in genmesh_pd_experts_omitted_total; this says which half was at fault).
        self.pd_experts_omitted = 0
        # Learnt from the server by healthy(); forgotten while it is down.
        self._server_info: dict[str, Any] = {}
        self._model_len: Any = None
        # The engine rid of every generation in progress, by envelope id.
        self._rids: dict[str, str] = {}
        # Engine rids this adapter aborted on purpose (`abort`): their abort finish is
        # the requested end, even before the first token ("Abort in waiting queue").
        self._aborted: set[str] = set()

    def describe(self) -> dict[str, Any]:
        info = self._server_info
        model = info.get("served_model_name") or info.get("model_path")
        engine_info = self._engine_info()
        return {
            "model": str(model) if model else "unknown",
            "formats": ["*"],
            "engine_url": self.config.url,
            "incremental_streaming_output": self._incremental(),
            "max_model_len": engine_info.context_length if engine_info else None,
            "engine_info": engine_info.to_wire() if engine_info else None,
        }

    def _engine_info(self) -> EngineInfo | None:
        """What the server told of itself, as the card's `engine_info`; None until then."""
        info = self._server_info
        model = info.get("served_model_name") or info.get("model_path")
        if not model:
            return None
        version = info.get("version")
        return EngineInfo(
            model=str(model),
            # The model's effective context length is /v1/models' max_model_len; ServerArgs'
            # context_length is only the --context-length override (None without it).
            context_length=_positive(self._model_len) or _positive(info.get("context_length")),
            max_total_num_tokens=_positive(info.get("max_total_num_tokens")),
            block_size=_positive(info.get("page_size")),
            # What /generate merges under each request's sampling_params. The model's
            # generation config (`--sampling-defaults model`) applies only to SGLang's
            # OpenAI routes, and no route reports it.
            sampling_defaults=sampling_defaults(info.get("preferred_sampling_params")),
            engine_version=f"sglang-{version}" if isinstance(version, str) else None,
            # vocab_size and max_logprobs stay unknown: neither /server_info nor
            # /get_model_info states the vocabulary, and SGLang has no logprob limit.
        )

    def _incremental(self) -> bool | None:
        for key in ("incremental_streaming_output", "stream_output"):
            value = self._server_info.get(key)
            if isinstance(value, bool):
                return value
        return None

    async def healthy(self) -> bool:
        """The engine answers `/health`; its model, limits and streaming mode are (re)read
        then, once per time it comes up."""
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        try:
            async with self.session.get(f"{self.config.base}/health", timeout=timeout) as r:
                if r.status != 200:
                    self._server_info = {}
                    return False
            if not self._server_info:
                await self._learn(timeout)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("SGLang at %s is not healthy: %s", self.config.url, exc)
            self._server_info = {}
            return False
        return True

    async def _learn(self, timeout: aiohttp.ClientTimeout) -> None:
        """Read `/server_info` (older servers: `/get_server_info` only; newer ones log
        that name as deprecated) and the model's context length from `/v1/models`."""
        info = await self._get_json(INFO_PATHS, timeout)
        models = await self._get_json(("/v1/models",), timeout)
        data = models.get("data") if isinstance(models, dict) else None
        first = data[0] if isinstance(data, list) and data else None
        self._model_len = first.get("max_model_len") if isinstance(first, dict) else None
        self._server_info = info if isinstance(info, dict) else {}

    async def _get_json(self, paths: tuple[str, ...], timeout: aiohttp.ClientTimeout) -> Any:
        """The JSON of the first of `paths` the server has (404 = try the next); None if
        none answers 200."""
        for path in paths:
            async with self.session.get(f"{self.config.base}{path}", timeout=timeout) as r:
                if r.status == 404:
                    continue
                return await r.json(content_type=None) if r.status == 200 else None
        return None

    async def _abort(self, rid: str) -> None:
        try:
            await self.post_admin("/abort_request", {"rid": rid})
        except MeshError as exc:
            log.warning("could not abort %s: %s", rid, exc.message)

    async def abort(self, request_id: str) -> bool:
        """SGLang's own abort of the engine request: its stream then ends with SGLang's
        abort finish (`Aborted`, or `Abort in waiting queue`)."""
        rid = self._rids.get(request_id)
        if rid is None:
            return False
        self._aborted.add(rid)
        await self._abort(rid)
        return True

    async def flush_cache(self) -> None:
        """`POST /flush_cache`; SGLang answers 400 while it has requests."""
        status, text = await self.post_admin("/flush_cache")
        if status != 200:
            raise unavailable(f"SGLang did not flush its cache (HTTP {status}): {text.strip()}")

    def generate(self, env: Envelope) -> AsyncGenerator[EngineOutput, None]:
        # With tracing on: under an HTTP client span, which the server hears of (traceparent).
        return engine_call(self._generate(env), self.name, self.config.url, "/generate")

    async def _generate(
        self, env: Envelope, half: _Half | None = None, bootstrap: dict[str, Any] | None = None
    ) -> AsyncGenerator[EngineOutput, None]:
        """`env` on the server; as one half of a disaggregated request when `half` is given,
        with `bootstrap`'s fields in the body."""
        rid = new_dispatch_rid()
        body = sglang_body(env, rid)
        if bootstrap is not None:
            body |= bootstrap
        self._rids[env.id] = rid
        # Once the POST starts the engine may know the rid: from then on, leaving early
        # (a cancel) must abort it. Every way of ending that the engine knows sets done.
        submitted = done = False
        try:
            submitted = True
            try:
                response = await self.session.post(
                    f"{self.config.base}/generate", json=body, headers=tracing.inject_current(_SSE)
                )
            except aiohttp.ClientConnectionError as exc:
                done = True
                raise unavailable(f"cannot reach SGLang at {self.config.url}: {exc}") from None
            except TimeoutError:
                # The request may have reached the engine: leave done unset, so it is aborted.
                raise unavailable(f"SGLang at {self.config.url} did not answer in time") from None
            async with response:
                if response.status != 200:
                    done = True
                    raise await http_error(response, "SGLang")
                # A prefill's token is not the answer's: decode delivers (and stops) it.
                stops = set() if half is not None and half.prefill else _emulated_stops(env)
                delivered = 0
                try:
                    async for out in self._read(response, env, rid, half):
                        if stops and out.finish is None and _stop_here(out, stops, env, delivered):
                            yield out  # ends at a stop token SGLang would not see:
                            return  # done stays unset, so the engine's run is aborted
                        delivered += len(out.tokens)
                        done = out.finish is not None
                        yield out
                except MeshError as exc:
                    # The engine ended this request itself, unless its answer was
                    # unreadable: then it still runs it, and must be aborted.
                    done = not is_malformed(exc)
                    raise
                except aiohttp.ClientPayloadError as exc:
                    done = True
                    raise unavailable(
                        f"SGLang stream broke: {exc}", reason="connection_lost"
                    ) from None
                except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                    done = True
                    raise unavailable(
                        f"SGLang stream failed: {exc!r}", reason="connection_lost"
                    ) from None
        finally:
            if self._rids.get(env.id) == rid:
                del self._rids[env.id]
            self._aborted.discard(rid)
            if submitted and not done:
                # Cancelled or abandoned: stop the engine's work, under our own rid only.
                await asyncio.shield(self._abort(rid))

    async def _read(
        self, response: aiohttp.ClientResponse, env: Envelope, rid: str, half: _Half | None
    ) -> AsyncGenerator[EngineOutput, None]:
        cursor = _Cursor(self._incremental())
        async for event in sse_events(response):
            if event == "[DONE]":
                raise incomplete("SGLang /generate finished without a terminal response")
            try:
                out = self._output(event, cursor, env, rid, half)
            except _SHAPE_ERRORS as exc:
                raise malformed(f"SGLang sent a malformed response: {exc!r}") from None
            if out is not None:
                yield out
                if out.finish is not None:
                    return
        raise incomplete("SGLang /generate closed before a terminal response")

    def _output(
        self, event: Any, cursor: _Cursor, env: Envelope, rid: str, half: _Half | None
    ) -> EngineOutput | None:
        """One event as an output (None if it brings nothing new); raises the error it
        reports, or a shape error when it is not SGLang's."""
        if not isinstance(event, dict):
            raise TypeError(f"an event that is not an object: {str(event)[:200]}")
        wants = env.output
        if "error" in event:
            error = event["error"]
            message = str(error.get("message") if isinstance(error, dict) else error)
            code = ErrorCode.UNAVAILABLE if cursor.delivered else ErrorCode.INVALID_ARGUMENT
            raise MeshError(code, message)
        meta = event.get("meta_info") or {}
        delivered = cursor.delivered
        ids = event.get("output_ids") or []
        total = meta.get("completion_tokens")
        if not isinstance(total, int):
            total = delivered + len(ids)
        out = EngineOutput(tokens=list(cursor.delta(ids, total)))
        if wants.logprobs and "output_token_logprobs" in meta:
            triples = cursor.delta(meta["output_token_logprobs"] or [], total)
            out.logprobs = [t[0] for t in triples]
            if wants.top_logprobs:
                rows = cursor.delta(meta.get("output_top_logprobs") or [], total)
                out.top_logprobs = [[(t[1], t[0]) for t in row or []] for row in rows]
            if wants.logprob_token_ids:
                rows = cursor.delta(meta.get("output_token_ids_logprobs") or [], total)
                out.token_ids_logprobs = [[(t[1], t[0]) for t in row or []] for row in rows]
        if not delivered:
            out.cached_tokens = int(meta.get("cached_tokens") or 0)
            if wants.prompt_logprobs_start is not None:
                out.prompt_logprobs = [t[0] for t in meta.get("input_token_logprobs") or []]
                if wants.top_logprobs:
                    out.prompt_top_logprobs = _tops(meta.get("input_top_logprobs") or [])
                if wants.logprob_token_ids:
                    out.prompt_token_ids_logprobs = _tops(
                        meta.get("input_token_ids_logprobs") or []
                    )
        if wants.routed_experts_start is not None and meta.get("routed_experts"):
            _experts(out, meta["routed_experts"], cursor, half)
        extras = {k: v for k, v in meta.items() if k not in _MAPPED_META}
        if extras:
            out.engine = {"meta_info": extras}
        cursor.delivered += len(out.tokens)
        finish = meta.get("finish_reason")
        if finish is not None:
            # A prefill's token is no output: an abort ends it as one before any token.
            before = 0 if half is not None and half.prefill else cursor.delivered
            out.finish = _finish(finish, before, rid in self._aborted)
            out.usage = {
                "prompt_tokens": int(meta.get("prompt_tokens") or len(env.token_ids)),
                "completion_tokens": cursor.delivered,
                "cached_tokens": int(meta.get("cached_tokens") or 0),
            }
            return out
        return out if out.tokens or out.prompt_logprobs is not None else None

    # ------------------------------------------------ prefill/decode disaggregation

    async def pd_attach(
        self, nc: Client, subjects: Subjects, worker_id: str, micro: MicroService | None = None
    ) -> None:
        """Nothing to attach: SGLang's servers move the KV between themselves."""

    def pd_card(self) -> dict[str, Any]:
        """A prefill server's bootstrap address; a decode-mode server refuses a request
        without a room, so a decode worker cannot run one alone."""
        host, port = self.bootstrap.address(self.config.url, self._server_info)
        return {"local_prefill": False, "bootstrap_host": host, "bootstrap_port": port}

    def pd_ticket(self, envelope: Envelope, prefill: dict[str, Any]) -> dict[str, Any]:
        return new_ticket(prefill)

    def prefill(
        self, envelope: Envelope, ticket: dict[str, Any]
    ) -> AsyncGenerator[EngineOutput, None]:
        return engine_call(self._prefill(envelope, ticket), self.name, self.config.url, "/generate")

    async def _prefill(
        self, env: Envelope, ticket: dict[str, Any]
    ) -> AsyncGenerator[EngineOutput, None]:
        """The prompt's side, as one output: prompt logprobs, the prompt's expert rows,
        cached tokens, finish `length` and usage with no completion token. SGLang's prefill
        also samples the first token, but the decode server delivers it (§C.1)."""
        half = _Half(prefill=True)
        fields = bootstrap_fields(ticket, nothing_to_decode=env.sampling.max_tokens == 0)
        outputs = [out async for out in self._generate(env, half, fields)]
        first, last = outputs[0], outputs[-1]  # _read ends with a finish, or raises
        cached = first.cached_tokens or 0
        result = EngineOutput(
            tokens=[],
            cached_tokens=cached,
            prompt_logprobs=first.prompt_logprobs,
            prompt_top_logprobs=first.prompt_top_logprobs,
            prompt_token_ids_logprobs=first.prompt_token_ids_logprobs,
            usage=usage(len(env.token_ids), 0, cached),
        )
        assert last.finish is not None
        # A normal end (SGLang's `length 0` once the KV is taken) is the prompt's length
        # finish; an abort here is one this adapter asked for (any other raised).
        result.finish = last.finish if last.finish["reason"] == "abort" else {"reason": "length"}
        start = env.output.routed_experts_start
        if start is not None:
            rows = len(env.token_ids) - start
            result.routed_experts = self._pd_rows(half, rows, rows, "prefill")
            if env.sampling.max_tokens == 0 and result.routed_experts:
                # The answer itself: SGLang's blob covers [start, seqlen - 1), and with no
                # output token that leaves out the prompt's last position.
                result.routed_experts.pop()
        yield result

    def decode(
        self, envelope: Envelope, ticket: dict[str, Any], handoff: dict[str, Any] | None
    ) -> AsyncGenerator[EngineOutput, None]:
        return engine_call(self._decode(envelope, ticket), self.name, self.config.url, "/generate")

    async def _decode(
        self, env: Envelope, ticket: dict[str, Any]
    ) -> AsyncGenerator[EngineOutput, None]:
        """The generation, as `generate` reads it, every token included (the first comes
        from the prefill through the server), without what prefill computed: prompt
        logprobs, and the prompt's expert rows (decode's blob covers the prompt too, but
        only its own forward passes, one per token but the last, are decode's)."""
        half = _Half(prefill=False)
        fields = bootstrap_fields(ticket, nothing_to_decode=False)
        start = env.output.routed_experts_start
        delivered = 0
        async with contextlib.aclosing(self._generate(env, half, fields)) as outputs:
            async for out in outputs:
                out.prompt_logprobs = out.prompt_top_logprobs = None
                out.prompt_token_ids_logprobs = None
                if not out.tokens and out.finish is None:
                    continue
                delivered += len(out.tokens)
                if start is not None and out.finish is not None:
                    own = max(delivered - 1, 0)
                    total = len(env.token_ids) - start + own
                    out.routed_experts = self._pd_rows(half, total, own, "decode")
                yield out

    def _pd_rows(self, half: _Half, total: int, keep: int, which: str) -> list[list[int]] | None:
        """The last `keep` of the `total` expert rows of a half's blob; None (counted) when
        the blob is invalid or incomplete: omitted whole, never passed on half."""
        rows = expert_rows(half.experts if half.experts_valid else None, total, keep)
        if rows is None:
            self.pd_experts_omitted += 1
            # Routine with engines that leave P/D expert data incomplete: counted, not warned.
            log.debug(
                "SGLang's %s routed experts left out: %s blob, %d rows expected",
                which,
                "an invalid" if not half.experts_valid else f"a {len(half.experts)}-value",
                total,
            )
        return rows


def _experts(out: EngineOutput, blob: Any, cursor: _Cursor, half: _Half | None) -> None:
    """An event's routed-experts blob: on `out` for a whole request (an invalid one is a
    malformed response); collected by a P/D half, which omits an invalid one."""
    if half is None:
        out.routed_experts = [cursor.expert_delta(_int32(blob))]
        return
    try:
        values = _int32(blob)
    except _SHAPE_ERRORS:
        half.experts_valid = False
        return
    half.experts.extend(cursor.expert_delta(values))


_SSE = {"Accept": "text/event-stream"}


def _emulated_stops(env: Envelope) -> set[int]:
    """Stop token ids the adapter must watch itself. SGLang skips stop token ids as well
    as EOS under ignore_eos; genmesh's canonical stop ids apply regardless (the SGLang
    format already drops them where its clients expect SGLang's rule)."""
    return set(env.sampling.stop_token_ids) if env.sampling.ignore_eos else set()


def _stop_here(out: EngineOutput, stops: set[int], env: Envelope, delivered: int) -> bool:
    """Cut `out` after its first stop token (past min tokens) and finish it there."""
    for i, token in enumerate(out.tokens):
        if token in stops and delivered + i >= env.sampling.min_tokens:
            keep = i + 1
            out.tokens = out.tokens[:keep]
            if out.logprobs is not None:
                out.logprobs = out.logprobs[:keep]
            if out.top_logprobs is not None:
                out.top_logprobs = out.top_logprobs[:keep]
            out.finish = {"reason": "stop", "matched": token}
            out.usage = {
                "prompt_tokens": len(env.token_ids),
                "completion_tokens": delivered + keep,
                "cached_tokens": out.cached_tokens or 0,
            }
            return True
    return False


# SGLang's P/D failures: disaggregation/prefill.py ("Prefill bootstrap failed", "Prefill
# transfer failed"), decode.py ("Decode transfer failed"), each "with exception
# KVTransferError(...)" of its transfer backend (mooncake/conn.py).
_TRANSFER_FAILED = re.compile(r"(?:bootstrap|transfer) failed|KVTransferError")


def _finish(finish: Any, delivered: int, aborted: bool = False) -> Finish:
    """SGLang's finish reason as genmesh's, or the error it stands for. `aborted`: the
    adapter asked SGLang to abort this request, so a plain abort is the end it asked
    for even before the first token."""
    if not isinstance(finish, dict):
        finish = {"type": str(finish)}
    kind = finish.get("type")
    if kind == "stop":
        return {"reason": "stop", "matched": finish.get("matched")}
    if kind == "length":
        return {"reason": "length"}
    status, err_type = finish.get("status_code"), finish.get("err_type")
    message = str(finish.get("message") or kind)
    if kind == "abort" and (delivered or aborted) and status is None and err_type is None:
        # On decode, a plain abort is a cancellation: the engine stopped the request.
        return {"reason": "abort", "message": message}
    detail = {"status_code": status, "err_type": err_type}
    if isinstance(status, int) and 400 <= status < 500:
        raise MeshError(ErrorCode.INVALID_ARGUMENT, message, detail=detail)
    if isinstance(status, int) and status >= 500 and _TRANSFER_FAILED.search(message):
        # P/D: the KV never moved between prefill and decode (a timeout, a dead peer):
        # another pair may well succeed.
        raise MeshError(
            ErrorCode.UNAVAILABLE,
            f"SGLang's KV transfer between prefill and decode failed: {message}",
            detail={**detail, "reason": "kv_transfer_failed"},
        )
    if isinstance(status, int) and status >= 500:
        # The engine failed (queue full): as with an HTTP 5xx, retry.
        raise MeshError(
            ErrorCode.UNAVAILABLE, f"SGLang ended the request: {message}", detail=detail
        )
    raise MeshError(
        ErrorCode.INTERNAL, f"SGLang ended the request ({kind}): {message}", detail=detail
    )
