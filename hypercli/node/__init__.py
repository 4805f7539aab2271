"""The node side of hypercli: ``agent.py`` (copied to and run on every node) and the client
that talks to it (``client.py``)."""
