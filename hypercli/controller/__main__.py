"""``python -m hypercli.controller OP [ARG]``: the requests a controller host answers (run
there by :mod:`hypercli.controller.client` over SSH, with ``HYPER_HOME`` the controller's own
folder). JSON answers go to stdout, one object; ``logs`` writes a tar. A HyperError is
answered as ``{"error", "hint", "exit_code", "kind"}`` with exit status 3.

    submit        stdin: the handover (host.submit)      serve   the service (host.serve)
    export WID [SINCE]  its records (and samples since)  logs WID  tar of its logs and outputs
    follow WID [EVERY]  export's answer as a JSON line every EVERY s (1) until it ends
    cancel REF    cancel a workflow or task              status  the service and its workflows
    stop          stop the service, tasks left running   collected WID  its records were copied
"""

from __future__ import annotations

import json
import sys

from hypercli.errors import HyperError


def main(argv: list[str]) -> int:
    from hypercli.controller import host
    op, args = (argv[0] if argv else ""), argv[1:]
    try:
        if op == "serve":
            return host.serve()
        if op == "follow":
            return host.follow(args[0], float(args[1]) if len(args) > 1 else 1.0)
        if op == "logs":
            sys.stdout.buffer.write(host.logs_tar(args[0]))
            return 0
        if op == "submit":
            out = host.submit(json.loads(sys.stdin.buffer.read()))
        elif op == "export":
            out = host.export(args[0], float(args[1]) if len(args) > 1 else None)
        elif op == "cancel":
            out = host.cancel(args[0])
        elif op == "collected":
            out = host.collected(args[0])
        elif op == "status":
            out = host.status()
        elif op == "stop":
            out = {"pid": host.stop()}
        else:
            print(json.dumps({"error": f"unknown request {op!r}", "exit_code": 2}))
            return 2
    except HyperError as e:
        print(json.dumps({"error": str(e), "hint": e.hint, "exit_code": e.exit_code,
                          "kind": type(e).__name__}))
        return 3
    sys.stdout.write(json.dumps(out, separators=(",", ":"), default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
