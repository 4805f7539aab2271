"""hypercli: run recipes of container tasks on spot VMs, SSH hosts or this machine.

The package is a pipeline (see README.md, "Concepts"): ``recipe`` (YAML → Recipe) →
``plan`` (Recipe → Workflow of tasks) → ``state`` (SQLite) → ``scheduler`` (run loop) →
``providers`` (where nodes come from) and ``node`` (the node-side task protocol) → ``cli``.
"""

__version__ = "0.1.0"
