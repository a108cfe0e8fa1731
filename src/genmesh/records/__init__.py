"""Request trace records: one JSON record per HTTP generate request (`docs/observability.md`,
"Request records").

- `observer`: the frontend observer that builds the records (`RequestRecords`);
- `sinks`: where records go (a JSONL file, gzip segments that roll, a NATS subject);
- `hashing`: prompt block hashes and output hashes, stable across runs and machines;
- `check` and `replay`: `genmesh trace check|replay`.
"""

from __future__ import annotations

SCHEMA = "genmesh.request.trace.v1"
