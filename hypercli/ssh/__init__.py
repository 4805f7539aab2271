"""SSH to nodes: persistent verified connections (``conn``), pinned host keys (``hostkeys``),
parallel fan-out with per-host results (``fanout``), and image transfer (``images``)."""
