"""``hyper ui``: a read-only dashboard over the state file (``pip install 'hypercli[ui]'``).

:mod:`.app` is the ASGI application (Starlette): HTML pages that fetch JSON from ``/api/...``
every 1.5 s and draw with plotly.js, served from the plotly package itself (no CDN).
:func:`.app.serve` runs it with uvicorn on 127.0.0.1 unless told otherwise.

Rules:
* read-only: no endpoint changes the state file, a node or a task;
* every request needs the token printed at start (``?token=...`` once, then a cookie, as
  Jupyter does); anything else is 403;
* text from recipes, tasks and logs reaches the page only as JSON drawn with ``textContent``
  or as HTML-escaped text, never as markup.
"""
