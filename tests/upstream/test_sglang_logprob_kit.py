"""Port of SGLang's cross-mode logprob tests (the logprob test kit's mixin).

Origin: sgl-project/sglang `python/sglang/test/kits/logprob_kit.py`
@ 967d614c3f6fc3578a406dcfec736157cb1678bf, class `LogprobCrossModeMixin` (mixed into
server tests such as the EAGLE ones): decode logprobs must equal what a prefill of the
same tokens scores. The kit's helpers are ported in tests/upstream/kit.py.

Adapted: prompts and probe IDs are token IDs in the shared mock's vocabulary (see
kit.CROSS_MODE_PROMPTS). `test_cross_mode_logprob_mixed` is the same grid as
test_sglang_srt_endpoint.py's `test_logprob_mixed` (not run twice);
`test_cross_mode_return_text_in_logprobs` needs a tokenizer.
"""

from __future__ import annotations

import pytest

from tests.inproc import InProcessMesh
from tests.upstream.kit import run_logprob_cross_mode_check, run_logprob_start_len_check

pytestmark = pytest.mark.inproc


async def test_cross_mode_logprobs(mesh: InProcessMesh) -> None:
    """Decode vs prefill, every artifact: token, top-k and token-ID logprobs, in and out."""
    await run_logprob_cross_mode_check(mesh.http_url)


async def test_cross_mode_logprob_start_len(mesh: InProcessMesh) -> None:
    await run_logprob_start_len_check(mesh.http_url)


@pytest.mark.skip(reason="needs a tokenizer: return_text_in_logprobs checks each entry's text")
async def test_cross_mode_return_text_in_logprobs() -> None:
    """Upstream: with return_text_in_logprobs every output entry carries text."""
