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

Generation is genmesh's deterministic token model, so the mock returns exactly the tokens
and logprobs the mock worker engine does (`decode`). Requests are validated where vLLM
validates them: the route answers 400 `BadRequestError`, the engine's own input checks come
in-band once a stream has started (`request`, `sampling`). Injected faults
(`genmesh.testkit.common`) are consulted once per generate request that passed validation
(`schedule`), and `GET /testkit/vllm/requests` lists what the mock accepted (`app`).

The parts, in the order a request meets them:

- `request`: the generate request's checks, the engine's input checks, the token budget;
- `sampling`: `SamplingParams`: the fields' JSON types, then `_verify_args`;
- `errors`: vLLM's error envelope, and pydantic's wording for a field of the wrong type;
- `schedule`: the engine (its running requests and aborts) and one accepted request's
  run: decode steps paced by the token delay, aborts, injected faults, a client leaving;
- `decode`: the deterministic model continued greedily, one step per token;
- `response`: JSON bodies, SSE chunks, logprobs, error replies;
- `app`: `build_app`; the generate, abort, health, models, version and request-log routes.
"""

from __future__ import annotations

from genmesh.testkit.vllm.app import PROFILES, Profile, build_app, state_of

__all__ = ["PROFILES", "Profile", "build_app", "state_of"]
