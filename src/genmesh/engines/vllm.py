"""The `vllm` engine adapter: a client of a real vLLM server's token-in/token-out API.

Every dispatch goes to `POST /inference/v1/generate` under its own private `request_id`
(32 hex digits, never the client's id), asking for a stream. Servers that stream (vLLM's
scale-out builds and later) answer with SSE deltas; older ones (v0.11-v0.18) ignore
`stream` and answer one JSON body: the response's content type tells which, and both
become the same `EngineOutput`s (reference `engine-apis.md` §B.4-§B.5). vLLM's stream
chunks carry neither prompt logprobs nor a P/D prefill's reply `kv_transfer_params`, so
requests that need those are sent unary (`stream: false`).

Cancelling the generator aborts the engine's request: through `POST /abort_requests`
when the server offers it (`--tokens-only`; learnt once by `healthy()`), and always by
closing the HTTP connection, which is how vLLM aborts a request without that endpoint.
vLLM knows a request as `"generate-tokens-" + request_id` (§B.2, inferred there), so an
abort names that id and, to be safe, the bare one too.

Errors, as the seed PR describes them: an HTTP 4xx is the request's fault
(`invalid_argument`, with the engine's message, `status_code` and `err_type`); 5xx,
connection failures and timeouts are `unavailable` (retryable); an in-band error event is
`invalid_argument` before any token (`unavailable` when it carries a 5xx code or comes
after tokens); a stream that ends before its terminal chunk, or with `[DONE]` first, is
`unavailable` with reason `stream_incomplete`; a dropped connection is `unavailable` with
reason `connection_lost`.

Translation. genmesh priorities are "higher = more urgent", vLLM's the opposite, so the
adapter negates them. vLLM returns prompt logprobs from position 0 (entry 0 null); the
adapter keeps those from `output.prompt_logprobs_start` on, the first of them None as in
every engine's output. vLLM refuses `max_tokens: 0`, which genmesh allows (a prompt-only
scoring request): the adapter asks for one token and drops it.

Prefill/decode disaggregation (docs/disaggregation.md, "vLLM"; reference `engine-apis.md`
§C.3) is vLLM's connector protocol, run in sequence: `prefill` sends the request as a
scoring request (one token, dropped) with `kv_transfer_params {"do_remote_decode": true}`,
unary, and hands the reply's `kv_transfer_params` over, untouched, to `decode`, which sends
the request again with them; the decode server pulls the prompt's KV and samples every
output token itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import secrets
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import aiohttp
import orjson

from genmesh.engines.base import EngineOutput
from genmesh.engines.http import (
    HttpEngineBase,
    HttpEngineConfig,
    http_error,
    incomplete,
    sse_events,
    unavailable,
)
from genmesh.engines.tracing import engine_call
from genmesh.shared import tracing
from genmesh.shared.engine_info import EngineInfo
from genmesh.shared.envelope import Envelope
from genmesh.shared.errors import ErrorCode, MeshError
from genmesh.shared.frames import Finish, TopLogprobs

if TYPE_CHECKING:
    from nats.aio.client import Client

    from genmesh.shared.micro import MicroService
    from genmesh.shared.subjects import Subjects

log = logging.getLogger(__name__)

GENERATE_PATH = "/inference/v1/generate"
ABORT_PATH = "/abort_requests"
# What the health check aborts to learn whether the server has ABORT_PATH: no request.
ABORT_PROBE_ID = "genmesh-abort-route-probe"
# vLLM's own name for a request submitted with `request_id: X` (reference §B.2).
ENGINE_ID_PREFIX = "generate-tokens-"
# Fields of a vLLM-format request the adapter sets itself (the format strips them too).
_OWNED = frozenset(("request_id", "token_ids", "stream", "stream_options"))
# Choice fields the adapter maps; the rest (`sampling_mask`, `routed_experts`, ...) travel
# as engine extras for genmesh's vLLM format to pass on.
_MAPPED_CHOICE = frozenset(
    ("index", "token_ids", "logprobs", "finish_reason", "stop_reason", "text")
)
# Top-level response fields that travel as engine extras.
_TOP_LEVEL_EXTRAS = ("kv_transfer_params", "ec_transfer_params")
_ACCEPT = "text/event-stream, application/json"
# The `detail.reason` of a P/D decode whose server could not read the prefill's KV.
KV_TRANSFER_FAILED = "kv_transfer"
# Seconds to wait, after the terminal chunk, for the usage chunk and `[DONE]`.
_TAIL_TIMEOUT_S = 5.0


def new_dispatch_id() -> str:
    return secrets.token_hex(16)


def engine_request_ids(dispatch_id: str) -> list[str]:
    """The ids to abort: what vLLM calls the request, then the bare id in case it differs."""
    return [ENGINE_ID_PREFIX + dispatch_id, dispatch_id]


# What a P/D proxy sends its prefill server (vLLM's toy proxy,
# tests/v1/kv_connector/nixl_integration/toy_proxy_server.py): the NIXL connector then keeps
# the prompt's KV blocks for a decode server and answers where they are.
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def client_kv_transfer_params(env: Envelope) -> dict[str, Any] | None:
    """The `kv_transfer_params` of a client that spoke vLLM (its own P/D proxy), if any."""
    kv = env.engine.get("kv_transfer_params") if env.format == "vllm" else None
    return kv if isinstance(kv, dict) else None


def vllm_request(
    env: Envelope,
    dispatch_id: str,
    model: str | None = None,
    kv_transfer_params: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """The body and headers of one dispatch: the client's own fields if it spoke vLLM,
    then everything the envelope decides (budget, logprobs, routing, ...), which wins;
    `kv_transfer_params` (none unless given) replace the client's."""
    native = env.format == "vllm"
    body = {k: v for k, v in env.engine.items() if k not in _OWNED} if native else {}
    body.pop("kv_transfer_params", None)
    sp = dict(body.get("sampling_params") or {})
    s = env.sampling
    if s.max_tokens is None:
        sp.pop("max_tokens", None)  # the server's default
    else:
        sp["max_tokens"] = max(s.max_tokens, 1)  # 0: one token, dropped by the reader
    sp["min_tokens"] = s.min_tokens
    sp["stop_token_ids"] = list(s.stop_token_ids)
    sp["ignore_eos"] = s.ignore_eos
    if s.seed is None:
        sp.pop("seed", None)
    else:
        sp["seed"] = s.seed
    for key, value in (
        ("temperature", s.temperature),
        ("top_p", s.top_p),
        ("top_k", s.top_k),
        ("min_p", s.min_p),
    ):
        if value is not None:
            sp[key] = value
    sp["n"] = 1
    # The server picks the output kind itself (DELTA when it streams).
    sp.pop("output_kind", None)
    out = env.output
    if out.logprobs:
        sp["logprobs"] = out.top_logprobs
    else:
        sp.pop("logprobs", None)
    if out.prompt_logprobs_start is not None:
        sp["prompt_logprobs"] = out.top_logprobs
    else:
        sp.pop("prompt_logprobs", None)
    if not native:
        # Token ids are all genmesh reads: spare the server the detokenizing.
        sp.setdefault("detokenize", False)
    kv = kv_transfer_params
    if kv is not None:
        # Both places: /inference/v1/generate hands the engine `sampling_params` as sent
        # (vllm/entrypoints/serve/disagg/serving.py, `ServingTokens.serve_tokens`), so
        # v0.11-v0.18 see the params only in extra_args, where the KV connector reads them;
        # the top-level field (GenerateRequest.kv_transfer_params, protocol.py) reaches the
        # engine once the server copies it there itself (vllm-project/vllm#42644).
        body["kv_transfer_params"] = kv
        extra = sp.get("extra_args")
        sp["extra_args"] = {**(extra if isinstance(extra, dict) else {}), "kv_transfer_params": kv}
    body["sampling_params"] = sp

    routing = env.routing
    if routing.cache_salt is None:
        body.pop("cache_salt", None)
    else:
        body["cache_salt"] = routing.cache_salt
    if routing.priority is None:
        body.pop("priority", None)
    else:
        body["priority"] = -routing.priority  # vLLM: lower = more urgent
    if model:
        body["model"] = model
    else:
        body.pop("model", None)
    body["token_ids"] = list(env.token_ids)  # the engine reads JSON: one list, here
    body["request_id"] = dispatch_id
    # vLLM's stream chunks carry no prompt logprobs and no reply kv_transfer_params
    # (§B.5, §C.3): a request that wants them (or is a P/D prefill leg) is unary.
    prefill_leg = isinstance(kv, dict) and bool(kv.get("do_remote_decode"))
    body["stream"] = out.prompt_logprobs_start is None and not prefill_leg
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}

    headers = {"Accept": _ACCEPT}
    if routing.dp_rank is not None:
        headers["X-data-parallel-rank"] = str(routing.dp_rank)
    return body, headers


# ------------------------------------------------------------------------------ parsing


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return None if math.isnan(number) else number


def _entry_token(entry: dict[str, Any]) -> int | None:
    """An entry's token id: integer `token_id` (newer builds) or `"token_id:N"` (older)."""
    tid = _int(entry.get("token_id"))
    if tid is not None:
        return tid
    token = entry.get("token")
    if isinstance(token, str) and token.startswith("token_id:"):
        try:
            return int(token[len("token_id:") :])
        except ValueError:
            return None
    return None


def _top_k(candidates: list[tuple[int, float, int | None]], k: int) -> TopLogprobs:
    """The k best of (token_id, logprob, rank) candidates, best first. Ranks decide when
    every candidate has one (and a rank beyond k is no top-k entry); logprobs otherwise."""
    if all(rank is not None for _, _, rank in candidates):
        ordered = sorted(candidates, key=lambda c: c[2] or 0)
        ordered = [c for c in ordered if (c[2] or 0) <= k]
    else:
        ordered = sorted(candidates, key=lambda c: -c[1])
    out: TopLogprobs = []
    seen: set[int] = set()
    for tid, lp, _ in ordered:
        if tid not in seen:
            seen.add(tid)
            out.append((tid, lp))
        if len(out) == k:
            break
    return out


def _finish(reason: Any, stop_reason: Any) -> Finish:
    """vLLM's finish reason as genmesh's."""
    if reason == "stop":
        # EOS and stop tokens both read "stop"; a stop token names itself in stop_reason.
        return {"reason": "stop", "matched": _int(stop_reason)}
    if reason == "length":
        return {"reason": "length"}
    if reason == "abort":
        return {"reason": "abort"}
    if reason == "error":
        # The status the streaming route answers the same FinishReason.ERROR with
        # (GenerationError, 500), so both routes' engine failures read alike.
        raise unavailable(
            "vLLM ended the request with an engine error (finish_reason error)", status_code=500
        )
    return {"reason": "abort", "message": f"vLLM finish reason {str(reason)[:100]!r}"}


class _Parser:
    """Turns vLLM response objects (SSE chunks or a unary body) into `EngineOutput`s."""

    def __init__(self, env: Envelope) -> None:
        self.env = env
        self.delivered = 0
        self.prompt_seen = False
        # True once the engine reported the request finished (no abort needed any more).
        self.finished = False
        self.usage: dict[str, Any] | None = None
        # max_tokens 0 was sent as 1: the token is not the client's.
        self.drop_tokens = env.sampling.max_tokens == 0

    def error(self, error: Any) -> MeshError:
        """An in-band `{"error": ...}`: the request's fault before any token, unless the
        engine says it failed itself (a 5xx code); after tokens, the engine broke."""
        if isinstance(error, dict):
            message = str(error.get("message") or error.get("type") or "vLLM error")
            status, err_type = _int(error.get("code")), error.get("type")
        else:
            message, status, err_type = str(error), None, None
        err_type = err_type if isinstance(err_type, str) else None
        if self.delivered or (status is not None and status >= 500):
            return unavailable(f"vLLM failed mid-stream: {message}", status_code=status)
        return MeshError(
            ErrorCode.INVALID_ARGUMENT,
            message,
            detail={"status_code": status if status is not None else 400, "err_type": err_type},
        )

    def parse(self, obj: dict[str, Any]) -> EngineOutput | None:
        """One response object as an output; None when it carries nothing new."""
        if "error" in obj and not obj.get("choices"):
            raise self.error(obj["error"])
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        out = EngineOutput(tokens=[])
        extras: dict[str, Any] = {}
        choices = obj.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices else None
        if isinstance(choice, dict):
            tokens = choice.get("token_ids") or []
            if not isinstance(tokens, list) or any(_int(t) is None for t in tokens):
                raise unavailable(f"vLLM sent malformed token_ids: {str(tokens)[:200]}")
            if not self.drop_tokens:
                out.tokens = list(tokens)
                self._logprobs(out, choice.get("logprobs"))
            reason = choice.get("finish_reason")
            if reason is not None:
                out.finish = _finish(reason, choice.get("stop_reason"))
                if self.drop_tokens and out.finish["reason"] != "abort":
                    out.finish = {"reason": "length"}
            extras = {k: v for k, v in choice.items() if k not in _MAPPED_CHOICE and v is not None}
        for key in _TOP_LEVEL_EXTRAS:
            if obj.get(key) is not None:
                extras[key] = obj[key]
        if extras:
            out.engine = extras
        rows = obj.get("prompt_logprobs")
        start = self.env.output.prompt_logprobs_start
        if start is not None and not self.prompt_seen and isinstance(rows, list):
            self.prompt_seen = True
            self._prompt_logprobs(out, rows, start)
        self.delivered += len(out.tokens)
        if out.finish is not None:
            self.finished = True
            return out
        if out.tokens or out.prompt_logprobs is not None or out.engine:
            return out
        return None

    def _logprobs(self, out: EngineOutput, logprobs: Any) -> None:
        wants = self.env.output
        if not wants.logprobs or not isinstance(logprobs, dict):
            return
        content = logprobs.get("content")
        if not isinstance(content, list) or len(content) != len(out.tokens):
            log.debug("vLLM logprobs do not line up with the tokens; dropped")
            return
        lps: list[float] = []
        ranks: list[int] = []
        tops: list[TopLogprobs] = []
        for token, entry in zip(out.tokens, content, strict=True):
            if not isinstance(entry, dict):
                return
            lp = _float(entry.get("logprob"))
            if lp is None:
                return  # a position without data: no logprobs for this output
            lps.append(lp)
            candidates = _candidates(entry.get("top_logprobs"))
            rank = _int(entry.get("rank"))
            ranks.append(_implied_rank(token, candidates) if rank is None else rank)
            if wants.top_logprobs:
                tops.append(_top_k(candidates, wants.top_logprobs))
        out.logprobs = lps
        out.ranks = ranks if all(ranks) else None
        if wants.top_logprobs:
            out.top_logprobs = tops

    def _prompt_logprobs(self, out: EngineOutput, rows: list[Any], start: int) -> None:
        """vLLM's per-position maps, from `start` on (the first entry None)."""
        prompt = self.env.token_ids
        k = self.env.output.top_logprobs
        lps: list[float | None] = [None]
        ranks: list[int | None] = [None]
        tops: list[TopLogprobs | None] = [None]
        for pos in range(start + 1, len(prompt)):
            row = rows[pos] if pos < len(rows) else None
            if not isinstance(row, dict):
                lps.append(None)
                ranks.append(None)
                tops.append(None)
                continue
            candidates: list[tuple[int, float, int | None]] = []
            for key, value in row.items():
                if not isinstance(value, dict):
                    continue
                try:
                    tid = int(key)
                except ValueError:
                    continue
                lp = _float(value.get("logprob"))
                if lp is not None:
                    candidates.append((tid, lp, _int(value.get("rank"))))
            own = row.get(str(prompt[pos]))
            own = own if isinstance(own, dict) else {}
            lps.append(_float(own.get("logprob")))
            ranks.append(_int(own.get("rank")))
            tops.append(_top_k(candidates, k) if k else None)
        out.prompt_logprobs = lps
        out.prompt_ranks = ranks
        out.prompt_top_logprobs = tops if k else None

    def finalize(self, out: EngineOutput) -> EngineOutput:
        """The terminal output with the usage the server reported (or what is known)."""
        usage = self.usage or {}
        details = usage.get("prompt_tokens_details")
        cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
        if cached is not None:
            out.cached_tokens = cached
        prompt_tokens = _int(usage.get("prompt_tokens"))
        out.usage = {
            "prompt_tokens": len(self.env.token_ids) if prompt_tokens is None else prompt_tokens,
            "completion_tokens": self.delivered,
            "cached_tokens": cached or 0,
        }
        return out


def _candidates(tops: Any) -> list[tuple[int, float, int | None]]:
    out: list[tuple[int, float, int | None]] = []
    for entry in tops if isinstance(tops, list) else []:
        if not isinstance(entry, dict):
            continue
        tid, lp = _entry_token(entry), _float(entry.get("logprob"))
        if tid is not None and lp is not None:
            out.append((tid, lp, _int(entry.get("rank"))))
    return out


def _implied_rank(token: int, candidates: list[tuple[int, float, int | None]]) -> int:
    """A token's rank when the server gives none (older builds): its place among the
    listed candidates, best first, if some candidate ranks below it (then it is inside
    the top-k the list holds); else unknown (0). A sampled token outside the top-k comes
    last in vLLM's list, so a last place says nothing."""
    ordered = [tid for tid, _, _ in sorted(candidates, key=lambda c: -c[1])]
    if token in ordered[:-1]:
        return ordered.index(token) + 1
    return 0


_CACHE_CONFIG_INFO = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^}]*)\}", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def cache_config_labels(metrics: Any) -> dict[str, str]:
    """The labels of the first `vllm:cache_config_info` series of a Prometheus text page
    (vLLM's CacheConfig, one series per engine); empty when there is none."""
    found = _CACHE_CONFIG_INFO.search(metrics) if isinstance(metrics, str) else None
    return dict(_LABEL.findall(found["labels"])) if found else {}


def _label_int(text: str | None) -> int | None:
    """A label's positive integer ("None" and the like: not known)."""
    if text is None or not text.isdigit():
        return None
    return int(text) or None


def _streams(response: aiohttp.ClientResponse) -> bool:
    return response.content_type == "text/event-stream"


# ------------------------------------------------------------------------------ engine


def dev_max_logprobs(server_info: Any) -> int | None:
    """`--max-logprobs` as the dev-mode `GET /server_info?config_format=json` states it
    (`vllm_config.model_config.max_logprobs`; the route exists with VLLM_SERVER_DEV_MODE=1
    only). Its -1 means "the vocabulary size", which no route states: None then, as
    for a server without the route."""
    config = server_info.get("vllm_config") if isinstance(server_info, dict) else None
    model = config.get("model_config") if isinstance(config, dict) else None
    value = _int(model.get("max_logprobs")) if isinstance(model, dict) else None
    return value if value is not None and value > 0 else None


class VllmEngine(HttpEngineBase):
    name = "vllm"

    def __init__(self, config: HttpEngineConfig) -> None:
        super().__init__(config)
        # Facts learnt from the server by healthy(); forgotten while it is down.
        self._model: str | None = None
        self._max_model_len: int | None = None
        self._version: str | None = None
        self._cache: dict[str, str] = {}
        self._max_logprobs: int | None = None
        # Whether POST /abort_requests exists (None = not known yet).
        self._abort_offered: bool | None = None
        # The engine request id of every generation in progress, by envelope id.
        self._dispatches: dict[str, str] = {}

    def describe(self) -> dict[str, Any]:
        return {
            "model": self._model or "unknown",
            "formats": ["*"],
            "engine_url": self.config.url,
            "abort_requests": self._abort_offered,
            "max_model_len": self._max_model_len,
            "engine_info": self._engine_info(),
        }

    def _engine_info(self) -> dict[str, Any] | None:
        """The card's `engine_info`: what vLLM's HTTP server states. The generation-config
        defaults vLLM applies to unset sampling parameters are stated by no route (only
        the dev-mode `/server_info` dumps the config, and it names the file, not the
        values), so sampling_defaults stays empty. `max_logprobs` is read from that same
        dev-mode route when the server has it; no route states the vocabulary size (the
        tokens-only server may have no tokenizer, and `/tokenizer_info` is the tokenizer's,
        not the model's), so vocab_size stays unknown."""
        if self._model is None:
            return None
        block = _label_int(self._cache.get("block_size"))
        blocks = _label_int(self._cache.get("num_gpu_blocks"))
        # Newer builds label the pool in tokens; older ones only in blocks.
        tokens = _label_int(self._cache.get("kv_cache_size_tokens"))
        if tokens is None and block is not None and blocks is not None:
            tokens = block * blocks
        return EngineInfo(
            model=self._model,
            context_length=self._max_model_len,
            max_total_num_tokens=tokens,
            block_size=block,
            engine_version=f"vllm-{self._version}" if self._version else None,
            max_logprobs=self._max_logprobs,
        ).to_wire()

    def _forget(self) -> None:
        self._model = None
        self._max_model_len = None
        self._version = None
        self._cache = {}
        self._max_logprobs = None
        self._abort_offered = None

    async def healthy(self) -> bool:
        """The server answers `/health`; its model, limits and abort endpoint are (re)learnt
        then, once per time it comes up."""
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        base = self.config.base
        try:
            async with self.session.get(f"{base}/health", timeout=timeout) as r:
                await r.read()
                if r.status != 200:
                    self._forget()
                    return False
            if self._model is None:
                self._learn_model(await self._get(f"{base}/v1/models", timeout, json=True))
                version = await self._get(f"{base}/version", timeout, json=True)
                if isinstance(version, dict) and isinstance(version.get("version"), str):
                    self._version = version["version"]
                self._cache = cache_config_labels(await self._get(f"{base}/metrics", timeout))
                self._max_logprobs = dev_max_logprobs(
                    await self._get(f"{base}/server_info?config_format=json", timeout, json=True)
                )
            if self._abort_offered is None:
                # An ID nothing runs under: a current vLLM answers /abort_requests with its
                # cancel router, which aborts *every* request when the list is empty.
                async with self.session.post(
                    f"{base}{ABORT_PATH}", json={"request_ids": [ABORT_PROBE_ID]}, timeout=timeout
                ) as r:
                    await r.read()
                    self._learn_abort(r.status)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("vLLM at %s is not healthy: %s", self.config.url, exc)
            self._forget()
            return False
        return True

    async def _get(self, url: str, timeout: aiohttp.ClientTimeout, *, json: bool = False) -> Any:
        """The body of a GET (decoded JSON, or text), None unless it answers 200: an older
        server without the route (or with `--disable-log-stats`, no metrics) is no failure."""
        async with self.session.get(url, timeout=timeout) as r:
            if r.status != 200:
                await r.read()
                return None
            return await r.json(content_type=None) if json else await r.text()

    def _learn_model(self, models: Any) -> None:
        data = models.get("data") if isinstance(models, dict) else None
        first = data[0] if isinstance(data, list) and data else None
        if isinstance(first, dict) and isinstance(first.get("id"), str):
            self._model = first["id"]
            self._max_model_len = _int(first.get("max_model_len"))

    def _learn_abort(self, status: int) -> None:
        if 200 <= status < 300:
            self._abort_offered = True
        elif status in (404, 405):
            self._abort_offered = False

    async def _cancel(self, dispatch_id: str, response: aiohttp.ClientResponse | None) -> None:
        """Stop a request the engine may still run: abort it by id when the server can,
        then close its connection (which is vLLM's abort when it cannot)."""
        try:
            if self._abort_offered is not False:
                await self._abort_by_id(dispatch_id)
        finally:
            if response is not None:
                response.close()

    async def abort(self, request_id: str) -> bool:
        """vLLM's own abort of the engine request (`POST /abort_requests`): its stream
        then ends with finish reason `abort`. False without that endpoint: closing the
        connection is vLLM's abort then, and it answers nothing more on it."""
        dispatch_id = self._dispatches.get(request_id)
        if dispatch_id is None or not self._abort_offered:
            return False
        return await self._abort_by_id(dispatch_id)

    async def _abort_by_id(self, dispatch_id: str) -> bool:
        """`POST /abort_requests` with the ids vLLM knows the request by (and learn from
        the answer whether the server has that route); best effort."""
        try:
            status, _ = await self.post_admin(
                ABORT_PATH, {"request_ids": engine_request_ids(dispatch_id)}
            )
        except MeshError as exc:
            log.warning("could not abort %s: %s", dispatch_id, exc.message)
            return False
        self._learn_abort(status)
        return status == 200

    async def flush_cache(self) -> None:
        """`POST /reset_prefix_cache` (vLLM's flush; served in its dev mode)."""
        status, text = await self.post_admin("/reset_prefix_cache")
        if status != 200:
            raise unavailable(f"vLLM did not reset its prefix cache (HTTP {status}): {text[:200]}")

    def generate(self, env: Envelope) -> AsyncGenerator[EngineOutput, None]:
        # With tracing on: under an HTTP client span, which the server hears of (traceparent).
        return self._call(self._generate(env, client_kv_transfer_params(env)))

    def _call(
        self, outputs: AsyncGenerator[EngineOutput, None]
    ) -> AsyncGenerator[EngineOutput, None]:
        return engine_call(outputs, self.name, self.config.url, GENERATE_PATH)

    # ------------------------------------------------------------------ P/D (§C.3)

    pd_kind = "vllm"
    # The decode needs the prefill's reply (its kv_transfer_params): one after the other.
    pd_concurrent = False

    async def pd_attach(
        self, nc: Client, subjects: Subjects, worker_id: str, micro: MicroService | None = None
    ) -> None:
        """Nothing to attach: the servers move the KV between themselves (NIXL)."""

    def pd_card(self) -> dict[str, Any]:
        # A decode server (kv_consumer) runs a request without kv_transfer_params as any
        # server does: the decode worker can serve a request alone.
        return {"local_prefill": True}

    def pd_ticket(self, envelope: Envelope, prefill: dict[str, Any]) -> dict[str, Any]:
        # The halves pair through the prefill's reply, not through anything agreed before.
        return {}

    def prefill(
        self, envelope: Envelope, ticket: dict[str, Any]
    ) -> AsyncGenerator[EngineOutput, None]:
        return self._call(self._prefill(envelope))

    def decode(
        self, envelope: Envelope, ticket: dict[str, Any], handoff: dict[str, Any] | None
    ) -> AsyncGenerator[EngineOutput, None]:
        return self._call(self._decode(envelope, handoff or None))

    async def _prefill(self, env: Envelope) -> AsyncGenerator[EngineOutput, None]:
        """Stage 1: the prompt only (a scoring request: one token, dropped, for the decode
        server samples every token), unary, with do_remote_decode; min_tokens cannot
        exceed that one token. Its prompt logprobs are the request's; its reply's
        kv_transfer_params are the handoff, as opaque as vLLM's own proxies hold them.
        A reply without them (the prefill ended other than length-capped: its one token
        was a stop token) hands over nothing, and the decode computes the prompt itself.
        With max_tokens 0 the prefill is the whole request: no do_remote_decode then, so
        that the server keeps no KV for a decode that never comes."""
        stage = replace(
            env,
            sampling=replace(env.sampling, max_tokens=0, min_tokens=0),
            output=replace(env.output, logprobs=False),
        )
        remote = None if env.sampling.max_tokens == 0 else PREFILL_KV_TRANSFER_PARAMS
        async for out in self._generate(stage, remote):
            if out.finish is not None:
                if out.finish["reason"] == "abort":
                    raise unavailable(
                        f"vLLM aborted the prefill: {out.finish.get('message', 'abort')}"
                    )
                extras = out.engine or {}
                handoff = extras.pop("kv_transfer_params", None)
                out.engine = extras or None
                out.handoff = handoff if isinstance(handoff, dict) else {}
            yield out

    async def _decode(
        self, env: Envelope, handoff: dict[str, Any] | None
    ) -> AsyncGenerator[EngineOutput, None]:
        """Stage 2: the request as `generate` sends it, with the prefill's handoff as its
        kv_transfer_params (none without one: the decode server then computes the prompt
        itself), and without prompt logprobs, which the prefill gave. A decode server that
        cannot read the prefill's KV ends the request with FinishReason.ERROR, which it
        answers as a 500 (`_raise_if_error`, vllm/entrypoints/openai/engine/serving.py;
        `kv_load_failure_policy` "fail", vllm/config/kv_transfer.py): a retryable failure
        of the pair, named for what it is."""
        stage = replace(env, output=replace(env.output, prompt_logprobs_start=None))
        started = False
        try:
            async for out in self._generate(stage, handoff):
                started = started or bool(out.tokens)
                yield out
        except MeshError as exc:
            if handoff is None or started or exc.detail.get("status_code") != 500:
                raise
            raise unavailable(
                f"KV transfer failed: the vLLM decode server could not load the prefill's "
                f"KV ({exc.message})",
                reason=KV_TRANSFER_FAILED,
            ) from None

    # ------------------------------------------------------------------ one dispatch

    async def _generate(
        self, env: Envelope, kv_transfer_params: dict[str, Any] | None
    ) -> AsyncGenerator[EngineOutput, None]:
        if env.output.routed_experts_start is not None:
            # Say so rather than answer without them.
            raise MeshError(
                ErrorCode.INVALID_ARGUMENT, "this vLLM engine does not report routed experts"
            )
        dispatch_id = new_dispatch_id()
        body, headers = vllm_request(env, dispatch_id, self._model, kv_transfer_params)
        self._dispatches[env.id] = dispatch_id
        parser = _Parser(env)
        url = f"{self.config.base}{GENERATE_PATH}"
        response: aiohttp.ClientResponse | None = None
        # Once the POST starts the engine may know the request: from then on, leaving
        # early (a cancel) must abort it. Every way of ending that the engine knows of
        # (its finish, an error answer, a connection it saw close) sets done.
        submitted = done = False
        try:
            submitted = True
            try:
                response = await self.session.post(
                    url, json=body, headers=tracing.inject_current(headers)
                )
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                done = True  # never reached the server
                raise unavailable(f"cannot reach vLLM at {self.config.url}: {exc}") from None
            except TimeoutError:
                raise unavailable(
                    f"vLLM at {self.config.url} did not answer in time", reason="timeout"
                ) from None
            except aiohttp.ClientConnectionError as exc:
                done = True  # the connection is gone: vLLM aborts on a disconnect
                raise unavailable(
                    f"vLLM at {self.config.url} dropped the request: {exc!r}",
                    reason="connection_lost",
                ) from None
            if response.status != 200:
                done = True
                raise await http_error(response, "vLLM")
            read = self._read_sse if _streams(response) else self._read_unary
            try:
                async with contextlib.aclosing(read(response, parser)) as outputs:
                    async for out in outputs:
                        done = out.finish is not None
                        yield out
            except MeshError:
                done = True  # the engine ended this request itself
                raise
            except aiohttp.ClientPayloadError as exc:
                done = True
                raise unavailable(f"vLLM stream broke: {exc}", reason="connection_lost") from None
            except TimeoutError:
                # Silence, not an end: the engine may still be working on it.
                raise unavailable(
                    f"vLLM sent nothing for {self.config.read_timeout_s:g}s",
                    reason="connection_lost",
                ) from None
            except aiohttp.ClientConnectionError as exc:
                done = True
                raise unavailable(
                    f"vLLM stream failed: {exc!r}", reason="connection_lost"
                ) from None
        finally:
            if self._dispatches.get(env.id) == dispatch_id:
                del self._dispatches[env.id]
            if submitted and not done and not parser.finished:
                # Cancelled or abandoned: stop the engine's work, under our own id only.
                await asyncio.shield(self._cancel(dispatch_id, response))
            elif response is not None:
                response.release()

    async def _read_sse(
        self, response: aiohttp.ClientResponse, parser: _Parser
    ) -> AsyncGenerator[EngineOutput, None]:
        events = cast(AsyncGenerator[Any, None], sse_events(response))
        terminal: EngineOutput | None = None
        try:
            async for event in events:
                if event == "[DONE]":
                    raise incomplete(f"vLLM {GENERATE_PATH} sent [DONE] before a terminal chunk")
                if not isinstance(event, dict):
                    raise unavailable(f"vLLM sent an unexpected event: {str(event)[:200]}")
                out = parser.parse(event)
                if out is None:
                    continue
                if out.finish is not None:
                    terminal = out  # held until its usage arrives
                    break
                yield out
            if terminal is None:
                raise incomplete(f"vLLM {GENERATE_PATH} stream ended before a terminal chunk")
            # The tail: the usage chunk, then [DONE]. The request is over, so a tail that
            # is slow or broken costs only the usage numbers, never the result.
            try:
                async with asyncio.timeout(_TAIL_TIMEOUT_S):
                    async for event in events:
                        if event == "[DONE]":
                            break
                        if isinstance(event, dict) and isinstance(event.get("usage"), dict):
                            parser.usage = event["usage"]
            except (aiohttp.ClientError, TimeoutError, MeshError) as exc:
                log.debug("vLLM stream tail after the terminal chunk failed: %r", exc)
        finally:
            await events.aclose()
        yield parser.finalize(terminal)

    async def _read_unary(
        self, response: aiohttp.ClientResponse, parser: _Parser
    ) -> AsyncGenerator[EngineOutput, None]:
        raw = await response.read()
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            # Most likely cut short: the engine's answer is incomplete.
            raise incomplete(f"vLLM answered with a body that is not JSON: {raw[:200]!r}") from None
        if not isinstance(obj, dict):
            raise unavailable(f"vLLM answered with an unexpected body: {str(obj)[:200]}")
        out = parser.parse(obj)
        if out is None or out.finish is None:
            raise incomplete(f"vLLM {GENERATE_PATH} answered without a finish reason")
        yield parser.finalize(out)
