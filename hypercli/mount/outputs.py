"""Task outputs in object storage: each task's ``HYPER_OUTPUT`` folder becomes a chunked
dataset at ``<storage>/<workflow>/<task>`` when its attempt succeeds (pushed from the node), and
the outputs of the experiments a task comes ``after`` are pulled into its ``HYPER_OUTPUTS``
before it starts. The user reads them with ``hyper data pull <storage>/<workflow>/<task> DIR``.

``file://`` storage needs none of this: the folder is used directly (local provider) or filled
by hypercli over SSH (ssh provider).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hypercli.mount import pack
from hypercli.mount.store import open_store

OUTPUT_CHUNK = 16 << 20  # bytes: outputs are small next to datasets; smaller chunks suit them


def output_url(storage: str, workflow: str, task: str) -> str:
    """``<storage>/<workflow>/<task>``."""
    return f"{storage.rstrip('/')}/{workflow}/{task}"


def checkpoint_url(storage: str, workflow: str, task: str) -> str:
    """``<storage>/<workflow>/.checkpoints/<task>``: where a task's checkpoint generations are
    kept (beside the outputs, not in the task's output folder, which ``file://`` storage
    fills from the task's own ``HYPER_OUTPUT``)."""
    return f"{storage.rstrip('/')}/{workflow}/.checkpoints/{task}"


def push_output(src: str | os.PathLike, url: str) -> pack.PushReport:
    """Push a task's output folder (created empty when the task wrote nothing).
    Raises StoreError/UsageError."""
    Path(src).mkdir(parents=True, exist_ok=True)
    return pack.push(src, url, chunk_size=OUTPUT_CHUNK, jobs=8)


def pull_outputs(storage: str, workflow: str, experiments: list[str],
                 dest: str | os.PathLike, jobs: int = 8) -> list[str]:
    """Pull the outputs of every task of ``experiments`` into ``dest/<task>/``.

    Returns:
        the task ids pulled.
    Raises:
        StoreError: the store failed.
    """
    store = open_store(f"{storage.rstrip('/')}/{workflow}")
    tasks = sorted({key.split("/", 1)[0] for exp in experiments
                    for key, _ in store.list(f"{exp}-") if key.endswith("/manifest.json")
                    and key.split("/", 1)[0][len(exp) + 1:].isdigit()})

    def one(task: str) -> None:
        pack.pull(output_url(storage, workflow, task), Path(dest) / task, jobs=4)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(one, tasks))
    return tasks
