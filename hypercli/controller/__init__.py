"""Controllers: a host that drives workflows while the machine that ran ``hyper run`` is away.

``hyper run RECIPE --controller`` (or ``controller: user@host`` in an ssh cluster) plans the
workflow and brings the cluster up here as any run does, then hands the workflow over: the
controller runs the same scheduler with a state file of its own and the cluster's key
(:mod:`~hypercli.controller.host`), backs the workflow up after every change to a majority of
the cluster's nodes under a lease (:mod:`~hypercli.controller.backup`), and this machine's
commands look at it there, copy its records back when it ends, and take it over when the
controller is gone (:mod:`~hypercli.controller.client`). On a cloud the controller is a small
on-demand instance of the user's, found or launched for the handover
(:mod:`~hypercli.controller.cloud`).
"""
