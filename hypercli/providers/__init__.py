"""Where nodes come from. One module per provider behind the contract in ``base.py``.

``get_provider(name)`` imports a provider's module only when it is asked for, so
``hyper --help`` and the local provider never import a cloud SDK.
"""

from __future__ import annotations

import importlib

from hypercli.errors import UsageError

#: provider name → module path; each module defines ``make_provider(**options)``.
REGISTRY = {
    "local": "hypercli.providers.local",
    "ssh": "hypercli.providers.ssh",
    "aws": "hypercli.providers.cloud_provider",
    "gcp": "hypercli.providers.cloud_provider",
    "azure": "hypercli.providers.cloud_provider",
}
#: the providers whose nodes a cloud creates (their SDK is imported on first API call)
CLOUDS = ("aws", "gcp", "azure")


def get_provider(name: str, **options):
    """The provider called ``name`` (a fresh instance).

    Args:
        options: provider settings (``trust_new_hosts`` from the command line; ``options``:
            a cluster's recorded ``cluster:`` options, which cloud providers need to find
            its region).

    Raises:
        UsageError: unknown provider.
    """
    if name not in REGISTRY:
        raise UsageError(f"unknown provider {name!r}", f"one of: {', '.join(REGISTRY)}")
    module = importlib.import_module(REGISTRY[name])
    if name in CLOUDS:
        return module.make_provider(name, **options)
    return module.make_provider(**options)
