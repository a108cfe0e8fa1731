from __future__ import annotations

import aiohttp

from tests.mesh import Mesh


async def test_unary_generate(mesh: Mesh) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(
            mesh.http_url + "/generate",
            json={
                "input_ids": [1, 2, 3],
                "sampling_params": {"max_new_tokens": 5, "ignore_eos": True},
            },
        ) as r:
            body = await r.json()
    assert r.status == 200, body
    assert len(body["output_ids"]) == 5
    assert body["meta_info"]["completion_tokens"] == 5
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
