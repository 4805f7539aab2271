"""Files split across tasks: balanced, chunk-ordered shards of a dataset read from its index
(no mount), glob groups, and what each task is given."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hypercli.errors import RecipeError
from hypercli.mount import pack
from hypercli.shards import balanced_bounds
from hypercli.state import State
from test_run import run_recipe


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 10**7), max_size=300), st.integers(1, 400))
def test_shards_cover_every_file_exactly_once(sizes, n):
    b = balanced_bounds(sizes, n)
    assert b[0] == 0 and b[-1] == len(sizes)
    assert all(x < y for x, y in zip(b, b[1:]))  # contiguous, none empty
    assert len(b) - 1 <= max(1, n) and (len(b) - 1 == min(n, len(sizes)) or sizes)
    covered = [i for k in range(len(b) - 1) for i in range(b[k], b[k + 1])]
    assert covered == list(range(len(sizes)))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 50), st.integers(1, 2000))
def test_equal_files_make_equal_shards(n, files):
    b = balanced_bounds([4096] * files, n)
    counts = [y - x for x, y in zip(b, b[1:])]
    assert len(counts) == min(n, files) and max(counts) - min(counts) <= 1


def test_a_dataset_split_from_its_index(hyper_home, write_recipe, tmp_path):
    src = tmp_path / "corpus"
    (src / "sub").mkdir(parents=True)
    for i in range(12):
        (src / f"f{i:02d}.txt").write_text("x" * (100 * (i + 1)))
    (src / "sub" / "empty.txt").write_text("")
    url = f"file://{tmp_path}/store/corpus"
    pack.push(src, url, chunk_size=1 << 20)
    order = [p for p, _ in pack.dataset_files(url)]
    assert sorted(order) == sorted([f"f{i:02d}.txt" for i in range(12)] + ["sub/empty.txt"])
    path = write_recipe(f"""
        name: split
        cluster: {{workers: 2}}
        experiments:
          part:
            parameters: {{shard: {{shards: 4, of: "chunks+{url}"}}}}
            command: |
              cp "$HYPER_SHARD_FILES" "$HYPER_OUTPUT/files"
              echo "$HYPER_SHARD $HYPER_SHARDS" > "$HYPER_OUTPUT/me"
          group:
            parameters: {{g: {{files: "corpus/*.txt", per_task: 5}}}}
            command: cp "$HYPER_SHARD_FILES" "$HYPER_OUTPUT/files"
    """)
    state, summary = run_recipe(path)
    assert summary.exit_code == 0
    out = hyper_home / "storage" / summary.workflow
    got = [(out / f"part-{k:04d}" / "files").read_text().splitlines() for k in range(4)]
    assert [p for shard in got for p in shard] == order  # pack order, each file once
    assert [(out / f"part-{k:04d}" / "me").read_text().split() for k in range(4)] == [
        [str(k), "4"] for k in range(4)]
    groups = [(out / f"group-{k:04d}" / "files").read_text().splitlines() for k in range(3)]
    assert [len(g) for g in groups] == [5, 5, 2]
    assert sorted(p for g in groups for p in g) == sorted(f"corpus/f{i:02d}.txt"
                                                           for i in range(12))
    # a dataset that changed is another plan (its file list is part of the digest)
    (src / "f99.txt").write_text("new")
    pack.push(src, url, chunk_size=1 << 20)
    state2, summary2 = run_recipe(path)
    assert summary2.workflow != summary.workflow
    assert len(State().tasks(summary2.workflow)) == 4 + 3


def test_shard_sources_must_exist(write_recipe, hyper_home):
    from hypercli.workflows import load
    path = write_recipe("""
        name: bad
        mounts: {/raw: "s3://bucket/raw"}
        experiments:
          a: {parameters: {s: {shards: 2, of: /data}}, command: 'true'}
    """)
    with pytest.raises(RecipeError, match="not a mount of this recipe"):
        load(str(path))
    path = write_recipe("""
        name: bad
        mounts: {/raw: "s3://bucket/raw"}
        experiments:
          a: {parameters: {s: {shards: 2, of: /raw}}, command: 'true'}
    """, name="b.yaml")
    with pytest.raises(RecipeError, match="plain bucket mount"):
        load(str(path))
    path = write_recipe("""
        name: bad
        experiments:
          a: {parameters: {s: {files: "nothing/*.txt"}}, command: 'true'}
    """, name="c.yaml")
    with pytest.raises(RecipeError, match="no file to split"):
        load(str(path))
    path = write_recipe("""
        name: bad
        experiments:
          a: {parameters: {s: {shards: 2, of: /x}, t: {files: "*.txt"}}, command: 'true'}
    """, name="d.yaml")
    with pytest.raises(RecipeError, match="only one parameter can split files"):
        load(str(path))
