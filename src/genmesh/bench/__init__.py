"""`genmesh bench`: a load generator for native generate endpoints (genmesh, SGLang
`/generate`, vLLM `/inference/v1/generate`, Dynamo), docs/bench.md.

- `config`: the command's options and the rules between them;
- `workload`: prompt and output lengths, shared-prefix groups, the request bodies;
- `apis`: each format's route, body and how its answers count output tokens;
- `runner`: one request timed over HTTP, closed and open loops, warm-up;
- `stats`: percentiles and the summary; `report`: the table and the JSON file;
- `plot`: latency CDFs and throughput over time as PNG or a self-contained HTML page;
- `main`: the command, from its config to those outputs.
"""
