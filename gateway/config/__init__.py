"""``backends.yaml``: the gateway's whole configuration, validated by pydantic, one
module per concern:

- :mod:`~gateway.config.base`: :class:`ConfigError`, the strict base of every section;
- :mod:`~gateway.config.upstream`: ``backends``, ``timeouts``, ``retries``, ``health``,
  ``breaker``;
- :mod:`~gateway.config.serving`: ``listen`` (and the endpoint picker), ``pools``,
  ``limits``, ``lifecycle``, ``streaming``;
- :mod:`~gateway.config.routing_rules`: ``routing``, ``models``;
- :mod:`~gateway.config.sessions`: ``sessions``;
- :mod:`~gateway.config.stores`: ``state``, ``batch``, ``usage``;
- :mod:`~gateway.config.tenancy`: ``auth``, ``admin``, ``admission``;
- :mod:`~gateway.config.tracing`: ``tracing``;
- :mod:`~gateway.config.migration`: ``migration``;
- :mod:`~gateway.config.root`: :class:`GatewayConfig` and the checks across sections;
- :mod:`~gateway.config.loader`: :func:`load_config`, :func:`parse_config`;
- :mod:`~gateway.config.errors`: validation errors in plain words;
- :mod:`~gateway.config.reference`: ``docs/configuration.md``, generated from the models.

:func:`load_config` is the only entry point; it raises :class:`ConfigError` with one
human-readable message naming the file and the offending field. Every name below is
importable from ``gateway.config``.
"""

from gateway.config.base import AUTO_MODELS, ConfigError, PositiveSeconds, Strict
from gateway.config.loader import load_config, parse_config
from gateway.config.migration import Migration
from gateway.config.root import GatewayConfig
from gateway.config.routing_rules import CanarySplit, Fallback, FallbackTrigger, LoraAdapter, ModelSettings, Routing
from gateway.config.serving import ENGINE_FIELDS, EndpointPicker, Lifecycle, Limits, Listen, Pool, Streaming
from gateway.config.sessions import Sessions
from gateway.config.stores import Batch, Price, StateStore, Usage
from gateway.config.tenancy import Admin, Admission, Auth, ClientKey
from gateway.config.tracing import Tracing
from gateway.config.upstream import (
    Backend,
    BackendLora,
    Breaker,
    HealthChecks,
    KVEvents,
    Retries,
    SpeedHints,
    TimeoutOverrides,
    Timeouts,
)

__all__ = [
    "AUTO_MODELS",
    "Admin",
    "Admission",
    "Auth",
    "Backend",
    "BackendLora",
    "Batch",
    "Breaker",
    "CanarySplit",
    "ClientKey",
    "ConfigError",
    "ENGINE_FIELDS",
    "EndpointPicker",
    "Fallback",
    "FallbackTrigger",
    "GatewayConfig",
    "HealthChecks",
    "KVEvents",
    "Lifecycle",
    "Limits",
    "Listen",
    "LoraAdapter",
    "Migration",
    "ModelSettings",
    "Pool",
    "PositiveSeconds",
    "Price",
    "Retries",
    "Routing",
    "Sessions",
    "SpeedHints",
    "StateStore",
    "Streaming",
    "Strict",
    "TimeoutOverrides",
    "Timeouts",
    "Tracing",
    "Usage",
    "load_config",
    "parse_config",
]
