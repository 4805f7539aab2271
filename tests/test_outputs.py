"""`hyper outputs`: every successful task's output gathered into DIR/TASK/, checked, resumable,
with --merge concatenating same-named files in task order, byte for byte; from file:// storage
and from S3 (a real S3 API server on loopback)."""

from __future__ import annotations

import json
import shutil

import pytest

from hypercli.state import State

RECIPE = """
    name: gath
    cluster: {{workers: 2}}
    {storage}
    experiments:
      shard:
        parameters: {{i: [0, 1, 2, 3]}}
        command: |
          python3 - <<'PY'
          import json, os
          i = {{{{i}}}}
          with open(os.path.join(os.environ["HYPER_OUTPUT"], "predictions.jsonl"), "w") as f:
              for j in range(3):
                  f.write(json.dumps({{"shard": i, "row": j, "text": "é" * j}}) + "\\n")
          with open(os.path.join(os.environ["HYPER_OUTPUT"], "bin"), "wb") as f:
              f.write(bytes(range(256)) * (i + 1))
          if i == 3:
              raise SystemExit(1)
          PY
      other: {{command: 'echo other > "$HYPER_OUTPUT/note.txt"'}}
"""


def expected_merge() -> bytes:
    lines = [json.dumps({"shard": i, "row": j, "text": "é" * j}) + "\n"
             for i in range(3) for j in range(3)]
    return "".join(lines).encode()


def check(hyper, tmp_path, wid):
    dest = tmp_path / "gathered"
    r = hyper("outputs", wid, "shard", dest, "--merge")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 task outputs pulled" in r.stdout and "merged predictions.jsonl" in r.stdout
    assert sorted(p.name for p in dest.iterdir() if p.is_dir()) == [
        "shard-0000", "shard-0001", "shard-0002"]  # the failed task has no output here
    assert (dest / "predictions.jsonl").read_bytes() == expected_merge()
    assert (dest / "bin").read_bytes() == b"".join(bytes(range(256)) * (i + 1)
                                                   for i in range(3))
    assert (dest / "shard-0001" / "bin").read_bytes() == bytes(range(256)) * 2
    r = hyper("outputs", wid, "shard", dest)  # again: nothing to pull
    assert r.returncode == 0 and "0 task outputs pulled" in r.stdout and "3 already" in r.stdout
    shutil.rmtree(dest / "shard-0002")
    r = hyper("outputs", wid, dest)  # resumes: the missing task, and the other experiment
    assert r.returncode == 0 and "2 task outputs pulled" in r.stdout, r.stdout
    assert (dest / "other-0000" / "note.txt").read_text() == "other\n"
    assert (dest / "shard-0002" / "bin").read_bytes() == bytes(range(256)) * 3


def test_outputs_from_file_storage(hyper_home, write_recipe, hyper, tmp_path):
    path = write_recipe(RECIPE.format(storage=""))
    r = hyper("run", path)
    assert r.returncode == 1
    check(hyper, tmp_path, "gath-1")
    r = hyper("outputs", "gath-1", "nope", tmp_path / "x")
    assert r.returncode == 2 and "no experiment 'nope'" in r.stderr


@pytest.mark.slow
def test_outputs_from_s3(s3, hyper_home, write_recipe, hyper, tmp_path):
    s3.make_bucket("bkt")
    path = write_recipe(RECIPE.format(storage="storage: s3://bkt/out"))
    r = hyper("run", path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert State().workflow("gath-1")["storage"] == "s3://bkt/out"
    check(hyper, tmp_path, "gath-1")


def test_outputs_never_copy_a_host_folder_through_a_symlinked_outputs_root(
        hyper_home, write_recipe, hyper, tmp_path):
    """A task on the node itself (no container) moves its workflow's outputs root away and
    puts a symlink to a host folder in its place: ``hyper outputs`` refuses it, naming the
    folder, and copies nothing of the host's."""
    path = write_recipe("""
        name: moved
        cluster: {workers: 1}
        experiments:
          one: {command: 'echo mine > "$HYPER_OUTPUT/x"'}
        """)
    assert hyper("run", path).returncode == 0
    root = hyper_home / "storage" / "moved-1"
    host = tmp_path / "host"
    (host / "one-0000").mkdir(parents=True)
    (host / "one-0000" / "secret").write_text("the host's\n")
    root.rename(tmp_path / "moved-away")
    root.symlink_to(host)
    r = hyper("outputs", "moved-1", tmp_path / "got")
    assert r.returncode != 0 and "is a symlink or not a folder: not followed" in r.stderr, \
        r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert not any(p.name == "secret" for p in (tmp_path / "got").rglob("*"))
