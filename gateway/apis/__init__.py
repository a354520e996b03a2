"""The APIs the gateway serves, one adapter each (:mod:`gateway.apis.base` says what
an adapter is; :mod:`gateway.apis.registry` lists them)."""
