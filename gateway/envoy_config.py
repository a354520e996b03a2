"""``python -m gateway.envoy_config``: the command that renders the Envoy bootstrap;
the renderer is :mod:`gateway.epp.envoy_config`."""

import sys

from gateway.epp.envoy_config import main

if __name__ == "__main__":
    sys.exit(main())
