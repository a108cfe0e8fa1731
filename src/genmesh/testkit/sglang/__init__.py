"""A mock SGLang server: the native HTTP API of `sglang.launch_server --skip-tokenizer-init`.

    genmesh testkit sglang --port 30000 [--incremental] [--token-delay-ms 5]

It speaks SGLang's wire format as the engine itself does (reference `engine-apis.md` §A),
written independently of genmesh's own SGLang format code so that it can catch bugs in
genmesh's rendering and parsing:

- `POST`/`PUT /generate`: `input_ids` (one prompt or a batch), `rid`, `sampling_params`,
  `stream`, logprobs (`return_logprob`, `logprob_start_len`, `top_logprobs_num`,
  `token_ids_logprob`) and routed experts (`return_routed_experts`,
  `routed_experts_start_len`). Errors take SGLang's three shapes: 400 `{"error": ...}`
  for a rejected request (or an in-band `data: {"error": ...}` event once a stream has
  started), 400 `{"object": "error", ...}` for a malformed body, and the scheduler's
  abort finish reasons.
- Streaming is cumulative (SGLang's default) or incremental (`--incremental`), reported
  by `/get_server_info` as `incremental_streaming_output` and the legacy `stream_output`.
- `POST /abort_request` aborts by rid *prefix* (after an exact-match check), like SGLang.
- `/health`, `/health_generate`, `/get_model_info` (`/model_info`), `/get_server_info`
  (`/server_info`), `/v1/models`, `/flush_cache`.

Tokens come from genmesh's deterministic token model (`genmesh.engines.mock`): the same
tokens, logprobs and routed experts the mock worker engine produces.
Tests inject faults and read state through the `/testkit/` routes of
`genmesh.testkit.common`.

The parts, in the order a request meets them:

- `request`: the two ways SGLang refuses a request, and the first check (pydantic's JSON
  types of `GenerateReqInput`);
- `normalize`: batch and argument normalization and the per-request checks, into `Item`s;
- `sampling`: `SamplingParams` and its checks;
- `schedule`: the scheduler: the waiting queue, prefill and decode steps, aborts and
  injected faults;
- `response`: what goes on the wire: output objects, SSE events and error bodies;
- `app`: `build_app`, the `/generate` and `/abort_request` handlers;
- `info`: the health, model and server info routes.
"""

from __future__ import annotations

from genmesh.testkit.sglang.app import build_app

__all__ = ["build_app"]
