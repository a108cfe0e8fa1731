"""The routing core: which worker serves a request envelope.

One choice for every place that routes: router processes (`services/router`) and a
`MeshClient` that routes its own requests (the frontend's default). Both keep a
`WorkerDirectory` from discovery and give it to a `Chooser` with a policy; the choice, its
refusals (`MeshError`: the same code, message and retryable flag wherever it is made) and
the load accounting are here (`choice.py`), so a request is routed the same way whoever
routes it; the policies and their option are in `policies.py`, which imports nothing heavy
(configs read it for `--help`).
"""
