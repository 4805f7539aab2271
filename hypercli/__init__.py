"""hypercli: run recipes of container tasks on spot VMs, SSH hosts or this machine.

The package is a pipeline (see docs/concepts.md): ``recipe`` (YAML → Recipe) →
``plan`` (Recipe → Workflow of tasks) → ``state`` (SQLite) → ``scheduler`` (run loop) →
``providers`` (where nodes come from) and ``node`` (the node-side task protocol) → ``cli``.

The Python API (:mod:`hypercli.api`) is reachable from here: ``hypercli.run(recipe)``,
``hypercli.up``, ``hypercli.down``, ``hypercli.status``, ``hypercli.workflow``, and the errors
they raise (``hypercli.HyperError`` and its subclasses). They are imported on first use, so
``import hypercli`` (and ``hyper --help``) stays light and the node runtime, which ships this
package, needs nothing beyond the standard library to import it.
"""

__version__ = "0.1.0"

_API = ("run", "up", "down", "status", "workflow", "Workflow", "Logs")
_ERRORS = ("HyperError", "UsageError", "RecipeError", "InfraError", "NodeError", "StateError")
__all__ = [*_API, *_ERRORS, "__version__"]


def __getattr__(name: str):
    if name in _API:
        from hypercli import api
        return getattr(api, name)
    if name in _ERRORS:
        from hypercli import errors
        return getattr(errors, name)
    raise AttributeError(f"module 'hypercli' has no attribute {name!r}")
