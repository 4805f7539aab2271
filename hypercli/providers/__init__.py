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
}

PLANNED = ("aws", "gcp", "azure")


def get_provider(name: str, **options):
    """The provider called ``name`` (a fresh instance).

    Args:
        options: provider settings from the command line (``trust_new_hosts``).

    Raises:
        UsageError: unknown provider, or one this version does not ship yet.
    """
    if name not in REGISTRY:
        if name in PLANNED:
            raise UsageError(f"provider {name!r} is not available in this version of hypercli",
                             "use provider: local")
        raise UsageError(f"unknown provider {name!r}", f"one of: {', '.join(REGISTRY)}")
    return importlib.import_module(REGISTRY[name]).make_provider(**options)
