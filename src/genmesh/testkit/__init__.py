"""Faithful mock engine servers (SGLang, vLLM) for tests and demos without a GPU.

    genmesh testkit sglang --port 30000 [--incremental] [--token-delay-ms 5]
    genmesh testkit vllm --port 8100 [--no-tokens-only]

Both generate with genmesh's deterministic token model (the same tokens the mock worker
engine produces) and take injected faults through `/testkit/...` admin routes
(`genmesh.testkit.common`).
"""
