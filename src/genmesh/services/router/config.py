"""`genmesh router`: everything a router is configured with, declared once
(`shared/settings.py` derives the flags, variables and --help from it)."""

from __future__ import annotations

from dataclasses import dataclass

from genmesh.routing.busy import AdmissionConfig
from genmesh.routing.pairing import PdConfig
from genmesh.routing.policies import POLICY_OPTION, KvConfig
from genmesh.shared.connection import MeshConnection, MetricsConfig
from genmesh.shared.credentials import NatsAuth, nats_auth_group
from genmesh.shared.ids import new_router_id
from genmesh.shared.settings import group, option, reuse, subject_token


@dataclass(frozen=True, slots=True)
class RouterConfig:
    mesh: MeshConnection = group(MeshConnection())
    auth: NatsAuth = nats_auth_group()
    # Given by whoever starts routers and waits for them (`genmesh up`, the tests): a
    # router's presence in discovery names it.
    router_id: str = option(
        default_factory=new_router_id,
        parse=subject_token,
        help="router id (a subject token); random if unset",
    )
    policy: str = reuse(POLICY_OPTION)
    kv: KvConfig = group(KvConfig(), title="kv policy")
    admission: AdmissionConfig = group(
        AdmissionConfig(), title="admission control (busy workers, the wait queue)"
    )
    pd: PdConfig = group(PdConfig(), title="prefill/decode pairs")
    metrics: MetricsConfig = group(MetricsConfig())
