"""vLLM's P/D at the API level with the NIXL connector (reference `engine-apis.md` §C.3).

Source: vllm-project/vllm vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py.
A prefill (`do_remote_decode`) that finishes length-capped keeps its full KV blocks for the
decode side (`request_finished` returns `delay_free_blocks` and the `kv_transfer_params` the
prefill's reply carries); with no full block there is nothing to send and nothing is kept.
A decode given `do_remote_prefill` with remote blocks reads them from the prefill engine
(`remote_host`/`remote_port`: here the prefill mock's HTTP port, `genmesh.testkit.pd`), then
samples every output token itself. A read that fails ends the request with
`FinishReason.ERROR` (`kv_load_failure_policy`, default "fail", vllm/config/kv_transfer.py),
which the serving layer answers as `GenerationError("Internal server error")`, 500
(vllm/entrypoints/openai/serving_engine.py `_raise_if_error`).
"""

from __future__ import annotations

from typing import Any

from genmesh.testkit.pd import Handles, TransferFailed, fetch
from genmesh.testkit.vllm.errors import ApiError

LOAD_FAILED = "Internal server error"


def offer(handles: Handles, params: dict[str, Any]) -> None:
    """The prefill's side of `request_finished`: keep the blocks it just named, if any."""
    if any(params["remote_block_ids"]):
        handles.offer(
            params["remote_request_id"],
            {"engine_id": params["remote_engine_id"], "block_ids": params["remote_block_ids"]},
        )


async def receive(params: dict[str, Any] | None, wait_s: float) -> None:
    """The decode's side: read the remote blocks `params` name (nothing to read without
    `do_remote_prefill` or without blocks: the decode computes the prompt itself);
    `ApiError` 500 when the read fails."""
    if (
        not params
        or not params.get("do_remote_prefill")
        or not any(params.get("remote_block_ids") or [])
    ):
        return
    try:
        await fetch(
            str(params.get("remote_host")),
            int(params.get("remote_port") or 0),
            str(params.get("remote_request_id")),
            wait_s,
            match={"engine_id": str(params.get("remote_engine_id"))},
        )
    except (TransferFailed, ValueError):
        raise ApiError(LOAD_FAILED, 500) from None
