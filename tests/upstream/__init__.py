"""The upstream projects' own HTTP tests, ported to genmesh (docs/testing.md lists them).

One module per upstream file; each names its origin (repository, path, commit, test).
They run against the shared in-process mesh (`mesh` fixture): real nats-server, real HTTP,
the deterministic mock engine in place of a model.
"""
