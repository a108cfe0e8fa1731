"""A mock vLLM server: token-in/token-out `POST /inference/v1/generate` without a GPU.

    genmesh testkit vllm --port 8100 [--no-tokens-only]

It speaks vLLM's wire format as the reference describes it (`engine-apis.md` §B, §E "vLLM
mock"), written from that reference and vLLM's sources, not from genmesh's vLLM format, so
that tests of genmesh's vLLM engine adapter catch rendering and parsing bugs on either side.

Profiles (`build_app(config, profile=...)`):

- `"new"` (default, the CLI's): vLLM's scale-out token-in/token-out route. SSE deltas with
  one choice per event, the terminal chunk always sent (also an abort without new tokens),
  a usage chunk `{"request_id", "choices": [], "usage"}` when `stream_options` asks for it
  (`include_usage` defaults to true once `stream_options` is sent), `usage` on every chunk
  with `continuous_usage_stats`, then `data: [DONE]`. Engine id and response `request_id`
  are `"generate-tokens-" + id`. Omitted `max_tokens` = `max_model_len - len(token_ids)`.
  Tokens-mode logprobs with integer ids and ranks. `n > 1` is refused (400), as the newest
  route does.
- `"old"` (vLLM ≈ v0.11-v0.18): `stream` is ignored (one JSON body), logprobs use the
  placeholder strings `"token_id:N"` (with each alternative's own id), omitted `max_tokens`
  is 16, `n > 1` gives `n` choices, top-level `kv_transfer_params` is not forwarded to the
  engine (only `sampling_params.extra_args.kv_transfer_params` is).

Generation is genmesh's deterministic token model (`genmesh.engines.mock`):
greedy over a rolling hash of (seed or 0, every token so far), min-tokens masking of EOS and
stop ids, so the mock returns exactly the tokens and logprobs the mock worker engine does.

Where validation happens, as in vLLM:

- request validation (pydantic, `SamplingParams._verify_args`, the route itself) answers
  HTTP 400 `BadRequestError` (404 `NotFoundError` for an unknown `model`), also for a
  streaming request;
- engine-side input checks (token id outside the vocabulary, prompt not shorter than
  `max_model_len`, more than 20 sample or prompt logprobs) surface when the engine takes
  the request: HTTP 400 for a unary request, but `200` + an in-band
  `data: {"error": {...}}` event + `data: [DONE]` for a streaming one (vLLM has already sent
  its stream headers by then).

Faults (`genmesh.testkit.common`), consulted once per generate request that passed
validation, fire after `after_tokens` decode steps (if the generation lasts that long):
`http_error` answers `status` with vLLM's error envelope (with `after_tokens > 0`: a stream
gets an in-band error event + `[DONE]`, a unary request the error status after generating);
`abort` finishes with `finish_reason: "abort"` (vLLM's abort carries no status or message,
so `status`/`message` are unused); `drop` aborts the TCP connection; `no_terminal` ends a
stream without terminal chunk and `[DONE]`; `done_early` sends `[DONE]` without terminal
chunk; `hang` stops sending until the client goes away or the request is aborted (then it
finishes with "abort"). For a unary request `no_terminal` and `done_early` both answer 200
with a JSON body cut short.

Extra admin route (besides `/testkit/...` from `common`): `GET /testkit/vllm/requests`
lists the generate requests the mock accepted (`{"request_id", "headers", "body"}`, the
last 1000), `DELETE` clears it; adapter tests assert on what was sent.

The parts, in the order a request meets them:

- `request`: the route's validation of a generate request (and `SamplingParams`'), the
  engine's input checks, and the token budget;
- `schedule`: one accepted request's run: decode steps paced by the token delay, aborts,
  injected faults, the client going away;
- `decode`: the deterministic model continued greedily, one step per token;
- `response`: vLLM's error envelope, JSON and SSE rendering, logprobs;
- `app`: `build_app`, the generate, abort, health, models and version routes.
"""

from __future__ import annotations

from genmesh.testkit.vllm.app import PROFILES, Profile, build_app, state_of

__all__ = ["PROFILES", "Profile", "build_app", "state_of"]
