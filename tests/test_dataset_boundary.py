"""A crafted dataset or pull cannot break out, crash or lie (issue 22, items 8 and 12).

A dataset comes from object storage, where anyone who can write the bucket can write its
manifest and its index: everything here is done the way such a writer would, by editing a
real index made by ``pack.push`` (SQLite, re-signed in the manifest) or by writing one from
nothing. Pulls and listings run through the real ``hyper data`` command, mounts through the
real daemon over libfuse 3 (``tests/test_mount.py``'s ``Mounted``, which stops it by pid), and
a cached chunk is attacked by another user (``nobody``, through ``setpriv``).

The last test is a property-based fuzz (hypothesis) of the index reader: whatever an index
holds, ``pull`` and ``ls`` give a result or a HyperError, and ``pull`` writes nothing outside
its target folder (not through ``..``, an absolute path, nor a symlink it made or found).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ROOT
from hypercli.errors import HyperError
from hypercli.mount import pack
from hypercli.mount.index import Index
from hypercli.mount.store import open_store

MiB = 1 << 20
FUSE = os.path.exists("/dev/fuse") and shutil.which("fusermount3")


# -- helpers ------------------------------------------------------------------------------
def make_tree(src: Path) -> dict[str, bytes]:
    """A small tree: a/x, a/b/y, a/big (2 chunks of 1 MiB and a bit), d/* for the mount."""
    files = {"a/x": b"payload\n", "a/b/y": b"why\n" * 100,
             "a/big": bytes(range(256)) * (MiB // 256 + 700),
             "d/g1": b"good one\n" * 500, "d/g2": b"good two\n" * 700,
             "d/bad-kind": b"k" * 100, "d/bad-mtime": b"m" * 100, "d/bad-size": b"s" * 100,
             "d/short": b"short\n" * 2000}
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    return files


def rewrite_index(url: str, tmp: Path, sql: str = "", params=(), raw: bytes | None = None
                  ) -> None:
    """Tamper with a dataset's index as its store's writer could: run ``sql`` on a copy (or
    put ``raw`` bytes in its place), store it under its new SHA-256 and name it in the
    manifest."""
    store = open_store(url)
    m = pack.load_manifest(store)
    path = tmp / "evil.sqlite"
    if raw is None:
        shutil.copyfile(pack.fetch_index(store, m, tmp / "orig-index"), path)
        db = sqlite3.connect(path)
        if params:
            db.execute(sql, params)
        else:
            db.executescript(sql)
        db.commit()
        db.close()
    else:
        path.write_bytes(raw)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    store.put_file(f"index/{sha}.sqlite", path)
    store.put("manifest.json", json.dumps(dict(m, index=f"index/{sha}.sqlite",
                                               index_sha256=sha)).encode())
    path.unlink()


def hyper_data(*args):
    """`python -m hypercli data ...` (HYPER_HOME from the environment)."""
    return subprocess.run([sys.executable, "-m", "hypercli", "data", *map(str, args)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, COLUMNS="200"))


def tree_state(root: Path) -> dict:
    """path → (kind, mode, bytes or link target, mtime ns) of everything under root, never
    following a symlink."""
    out = {}
    for dirpath, dirs, names in os.walk(root):
        for n in dirs + names:
            p = os.path.join(dirpath, n)
            st_ = os.lstat(p)
            what = os.readlink(p) if stat.S_ISLNK(st_.st_mode) else \
                Path(p).read_bytes() if stat.S_ISREG(st_.st_mode) else None
            out[os.path.relpath(p, root)] = (stat.S_IFMT(st_.st_mode), st_.st_mode & 0o7777,
                                             what, st_.st_mtime_ns)
    return out


@pytest.fixture
def dataset(tmp_path):
    """(url, files) of a pushed copy of :func:`make_tree` in a ``file://`` store."""
    src = tmp_path / "src"
    files = make_tree(src)
    url = f"file://{tmp_path}/store"
    pack.push(src, url, chunk_size=MiB)
    return url, files


# -- item 8: the destination folder and the modes -----------------------------------------
def test_pull_keeps_an_existing_folders_mode_and_mtime_and_masks_every_mode(tmp_path,
                                                                             hyper_home):
    src = tmp_path / "src"
    make_tree(src)
    os.chmod(src / "a" / "x", 0o4755)      # setuid
    os.chmod(src / "a" / "b", 0o3775)      # setgid, sticky
    os.chmod(src, 0o1777)                  # a dataset root that would open the home to all
    url = f"file://{tmp_path}/store"
    pack.push(src, url, chunk_size=MiB)
    rewrite_index(url, tmp_path, f"UPDATE files SET mode=mode|{0o6000} WHERE path='a/b/y'")
    home = tmp_path / "home"
    home.mkdir()
    os.chmod(home, 0o700)
    os.utime(home, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    p = hyper_data("pull", url, home)
    assert p.returncode == 0, p.stderr
    st_ = os.stat(home)
    assert (st_.st_mode & 0o7777, st_.st_mtime_ns) == (0o700, 1_000_000_000_000_000_000)
    assert os.stat(home / "a" / "x").st_mode & 0o7777 == 0o755
    assert os.stat(home / "a" / "b").st_mode & 0o7777 == 0o775
    assert os.stat(home / "a" / "b" / "y").st_mode & 0o7777 == 0o644
    assert (home / "a" / "x").read_bytes() == b"payload\n"
    assert pack.ls(url, "a/x", cache_dir=tmp_path / "c")[0].mode & 0o7000 == 0

    # a subtree, into a folder that did not exist: made, never given the dataset's root mode
    new = tmp_path / "new"
    pack.pull(url, new, path_prefix="a/b", cache_dir=tmp_path / "c")
    assert os.stat(new).st_mode & 0o7000 == 0
    assert os.stat(new / "a" / "b").st_mode & 0o7777 == 0o775


def test_pull_removes_nothing_it_did_not_make(dataset, tmp_path):
    """Files a pull writes go through temporary files of its own: a user's file that has the
    name such a file once had (``.<name>.hyper-tmp``) is left alone, beside the folder and in
    it; what the dataset names is replaced (not followed when it is a symlink)."""
    url, files = dataset
    dest = tmp_path / "dest"
    (dest / "a").mkdir(parents=True)
    mine = dest / "a" / ".x.hyper-tmp"
    mine.write_text("mine\n")
    (dest / "a" / "x").symlink_to(tmp_path / "outside")  # in the way: replaced
    pack.pull(url, dest, cache_dir=tmp_path / "c")
    assert mine.read_text() == "mine\n"
    assert not (tmp_path / "outside").exists()
    assert (dest / "a" / "x").read_bytes() == files["a/x"]


@pytest.mark.parametrize("attack", ["root-is-a-file", "prefix-dotdot"])
def test_pull_never_writes_outside_its_folder(dataset, tmp_path, attack):
    """A dataset whose root is a file (its temporary file went beside the folder, over a
    user's file of that name), or a ``--path`` with '..' (the folders above it were made
    outside): nothing outside the destination is written or made, and the error is a
    HyperError naming the entry."""
    url, _ = dataset
    outside = tmp_path / "outside"
    outside.mkdir()
    row = ("INSERT INTO files VALUES ('{p}', '{parent}', '{name}', 'd', 0, 16877, 0, NULL, "
           "NULL);")
    sql, prefix = {
        "root-is-a-file": ("UPDATE files SET kind='f', sha256=(SELECT sha256 FROM files "
                           "WHERE path='a/x') WHERE path='';"
                           "INSERT INTO segments SELECT '', seq, chunk, offset, length FROM "
                           "segments WHERE path='a/x';", ""),
        "prefix-dotdot": (row.format(p="../outside/evil", parent="../outside", name="evil") +
                          row.format(p="../outside/evil/more", parent="../outside/evil",
                                     name="more"), "../outside/evil/more"),
    }[attack]
    rewrite_index(url, tmp_path, sql)
    dest = tmp_path / "dest"
    dest.mkdir()
    beside = tmp_path / ".dest.hyper-tmp"
    beside.write_text("mine\n")
    siblings = set(os.listdir(tmp_path))
    with pytest.raises(HyperError) as e:
        pack.pull(url, dest, path_prefix=prefix, cache_dir=tmp_path / "c")
    assert os.listdir(outside) == [] and os.listdir(dest) == []
    assert set(os.listdir(tmp_path)) <= siblings | {"c"}
    assert beside.exists() and beside.read_text() == "mine\n"
    assert ("root is not a folder" if attack == "root-is-a-file" else
            "not a path in a dataset") in str(e.value)


# -- item 12: a corrupt or crafted index is a clear error ---------------------------------
CRAFTS = {
    "unknown-kind": ("UPDATE files SET kind='x' WHERE path='a/x'", "a/x", "unknown kind"),
    "mtime-inf": ("UPDATE files SET mtime=1e309 WHERE path='a/x'", "a/x", "mtime"),
    "mtime-text": ("UPDATE files SET mtime='yesterday' WHERE path='a/x'", "a/x", "mtime"),
    "mtime-megabyte": ("UPDATE files SET mtime=printf('%.1000000c', 'x') WHERE path='a/x'",
                       "a/x", "mtime"),
    "size-negative": ("UPDATE files SET size=-5 WHERE path='a/x'", "a/x", "size"),
    "size-text": ("UPDATE files SET size='big' WHERE path='a/x'", "a/x", "size"),
    "mode-text": ("UPDATE files SET mode='rwx' WHERE path='a/x'", "a/x", "mode"),
    "size-past-segments": ("UPDATE files SET size=size+4096 WHERE path='a/x'", "a/x",
                           "segments hold"),
    "segment-past-chunks": ("UPDATE segments SET chunk=99 WHERE path='a/x'", "a/x",
                            "segment"),
    "no-segments-table": ("DROP TABLE segments", None, "no table 'segments'"),
    "no-files-table": ("DROP TABLE files", None, "no table 'files'"),
    "no-mtime-column": ("CREATE TABLE f2 AS SELECT path, parent, name, kind, size, mode, "
                        "sha256, target FROM files; DROP TABLE files; "
                        "ALTER TABLE f2 RENAME TO files", None, "no column 'mtime'"),
    "format-text": ("UPDATE meta SET value='one' WHERE key='format'", None, "not a format"),
    "not-sqlite": (None, None, "not a database"),
}


@pytest.mark.parametrize("craft", sorted(CRAFTS))
def test_crafted_index_is_a_clear_error_in_pull_and_ls(dataset, tmp_path, hyper_home, craft):
    url, _ = dataset
    sql, entry, why = CRAFTS[craft]
    if sql is None:
        rewrite_index(url, tmp_path, raw=b"SQLite format 3\0" + b"\xff" * 4000)
    else:
        rewrite_index(url, tmp_path, sql)
    dest = tmp_path / "dest"
    for args in (("pull", url, dest), ("ls", url, "a"), ("ls", url, "a/x")):
        if craft in ("size-past-segments", "segment-past-chunks") and args[0] == "ls":
            continue  # a listing reads no segments
        p = hyper_data(*args)
        assert (p.returncode, "Traceback" in p.stderr) == (3, False), (args, p.stderr)
        assert why in p.stderr, (args, p.stderr)
        if entry is not None:
            assert repr(entry) in p.stderr, (args, p.stderr)
        assert "hint:" in p.stderr and len(p.stderr) < 2000  # a crafted value is cut short
    assert not dest.exists()  # the index is read whole before anything is written
    p = hyper_data("verify", url)  # a problem found, not a traceback
    assert (p.returncode, "Traceback" in p.stderr) == (1, False), p.stdout + p.stderr
    assert why in p.stdout and (entry is None or repr(entry) in p.stdout), p.stdout
    assert len(p.stdout) < 2000


def test_manifest_naming_a_chunk_or_index_by_a_path_is_refused(dataset, tmp_path):
    url, _ = dataset
    store = open_store(url)
    m = pack.load_manifest(store)
    for bad in (dict(m, chunks=[[("../" * 22)[:64], 5]]),
                dict(m, index_sha256=("/.." * 22)[:64], index=f"index/{('/..' * 22)[:64]}"
                     ".sqlite")):
        store.put("manifest.json", json.dumps(bad).encode())
        with pytest.raises(pack.DatasetError, match="not a format 1 dataset manifest"):
            pack.ls(url, cache_dir=tmp_path / "c")


# -- item 12 on the mount: one bad entry costs only itself ---------------------------------
@pytest.mark.skipif(not FUSE, reason="needs /dev/fuse and fusermount3")
def test_mount_answers_eio_for_a_bad_entry_alone(dataset, tmp_path):
    from test_mount import Mounted
    url, files = dataset
    rewrite_index(url, tmp_path, (
        "UPDATE files SET kind='x' WHERE path='d/bad-kind';"
        "UPDATE files SET mtime='yesterday' WHERE path='d/bad-mtime';"
        "UPDATE files SET size=-1 WHERE path='d/bad-size';"
        "UPDATE files SET size=size+4096 WHERE path='d/short';"
        # a row whose name cannot be shown: left out of the listing
        "INSERT INTO files SELECT 'elsewhere/zz', 'd', 'zz', kind, size, mode, mtime, sha256,"
        " target FROM files WHERE path='d/g1';"))
    for warm in (0, 100):  # asked by LOOKUP, or known from READDIRPLUS before a read
        m = Mounted(url, tmp_path, f"mnt{warm}", warm_entries=warm)
        try:
            d = m.mp / "d"
            assert sorted(os.listdir(d)) == ["bad-kind", "bad-mtime", "bad-size", "g1", "g2",
                                             "short"]
            with os.scandir(d) as it:
                kinds = {de.name: de.is_file() for de in it if de.name.startswith("g")}
            assert kinds == {"g1": True, "g2": True}
            for name in ("bad-kind", "bad-mtime", "bad-size"):
                with pytest.raises(OSError) as e:
                    os.stat(d / name)
                assert e.value.errno == errno.EIO, name
            with pytest.raises(OSError) as e:  # never a short read and a silent EOF
                (d / "short").read_bytes()
            assert e.value.errno == errno.EIO
            assert (d / "g1").read_bytes() == files["d/g1"]
            assert (d / "g2").read_bytes() == files["d/g2"]
            assert (m.mp / "a" / "x").read_bytes() == files["a/x"]
            assert "bad-kind" in m.log() and "unknown kind" in m.log()
            assert "segments hold" in m.log()
        finally:
            m.close()


# -- a cached chunk changed behind the daemon's back --------------------------------------
@pytest.mark.skipif(not FUSE or not shutil.which("setpriv"),
                    reason="needs FUSE and setpriv")
def test_cached_chunks_cannot_be_changed_by_another_user(dataset):
    """The chunk cache's files (and the cached index) are read-only and their folders the
    daemon's alone, whatever the umask (here 0, which made them writable by all): another
    user cannot change, replace or read a cached chunk or index, and the mount keeps serving
    the right bytes."""
    from test_mount import Mounted, drop_page_cache
    url, files = dataset
    base = Path(tempfile.mkdtemp(prefix="hyper-cache-test-"))  # not under root's 0700 tmp
    os.chmod(base, 0o755)
    old = os.umask(0)
    m = None
    try:
        m = Mounted(url, base, "mnt", cache_dir=base / "cache", warm_entries=0)
        os.umask(old)
        assert (m.mp / "d" / "g1").read_bytes() == files["d/g1"]  # d/* share a chunk
        chunks = base / "cache" / "chunks"
        cached = [p for p in chunks.iterdir() if not p.name.startswith(".")]
        assert cached
        index = list((base / "cache" / "index").glob("*.sqlite"))
        assert len(index) == 1
        attack = ("import os, sys\n"
                  "ok = []\n"
                  "for p in sys.argv[1:]:\n"
                  "    try:\n"
                  "        with open(p, 'r+b') as f:\n"
                  "            f.write(b'X' * os.fstat(f.fileno()).st_size)\n"
                  "        ok.append(p)\n"
                  "    except OSError as e:\n"
                  "        print(p, e.strerror)\n"
                  "    try:\n"
                  "        open(os.path.dirname(p) + '/.x.tmp', 'wb').close()\n"
                  "        os.replace(os.path.dirname(p) + '/.x.tmp', p)\n"
                  "        ok.append('replace ' + p)\n"
                  "    except OSError as e:\n"
                  "        print(p, e.strerror)\n"
                  "print('CHANGED', ok)\n")
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                            "/usr/bin/python3", "-c", attack, *map(str, cached + index)],
                           capture_output=True, text=True, timeout=60)
        assert "CHANGED []" in r.stdout, r.stdout + r.stderr
        assert "Permission denied" in r.stdout
        drop_page_cache(m.mp, ["d/g1"])
        for name in ("g1", "g2", "short"):
            assert (m.mp / "d" / name).read_bytes() == files[f"d/{name}"]
        assert m.stats()["verify_failures"] == 0
        assert all(os.stat(p).st_mode & 0o777 == 0o400 for p in cached + index)
        assert os.stat(chunks).st_mode & 0o777 == 0o700
        assert os.stat(index[0].parent).st_mode & 0o777 == 0o700
    finally:
        os.umask(old)
        if m is not None:
            m.close()
        shutil.rmtree(base, ignore_errors=True)


# -- the fuzz -----------------------------------------------------------------------------
OUT = "@OUT"  # replaced by the example's outside folder
PATHS = st.one_of(
    st.sampled_from(["", "a", "a/x", "a/b", "a/b/y", "a/big", "found", "found/x", "lnk",
                     "lnk/z", "..", "../outside/x", "a/../../outside/y", "/abs", f"{OUT}/p",
                     "a//x", "./a", "a/.", "x\0y", "d", "d/g1", "é/ü"]),
    st.text(alphabet="ab./\0", max_size=8))
ANY = st.one_of(st.none(), st.integers(-(1 << 63), (1 << 63) - 1),
                st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
                st.binary(max_size=6))
ROWS = st.lists(st.tuples(
    PATHS, st.one_of(st.none(), PATHS), st.one_of(st.none(), PATHS),
    st.one_of(st.sampled_from(["f", "d", "l", "x", ""]), ANY),
    st.one_of(st.integers(0, 3 * MiB), ANY),
    st.one_of(st.sampled_from([0o100644, 0o104755, 0o41777, 0o120777, 0o20666]), ANY),
    st.one_of(st.floats(0, 2e9), ANY),
    st.one_of(st.sampled_from(["SHA:a/x", "SHA:a/big", "0" * 64]), ANY),
    st.one_of(st.sampled_from([OUT, "..", "../..", "a", "found", "/etc"]), ANY)),
    max_size=8)
SEGMENTS = st.lists(st.tuples(PATHS, st.integers(-1, 3) | ANY, st.integers(-1, 3) | ANY,
                              st.integers(-1, 2 * MiB) | ANY,
                              st.integers(-1, 2 * MiB) | ANY), max_size=6)
DAMAGE = st.sampled_from([None, None, None, "DROP TABLE segments", "DROP TABLE chunks",
                          "DROP TABLE meta", "DELETE FROM meta", "DELETE FROM chunks",
                          "UPDATE chunks SET size=size+1", "UPDATE chunks SET seq=seq+1",
                          "UPDATE chunks SET sha256='../x'", "DELETE FROM files WHERE path=''",
                          "CREATE TABLE f2 AS SELECT path, kind FROM files; DROP TABLE files;"
                          " ALTER TABLE f2 RENAME TO files"])


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """A pushed dataset (``file://`` store folder) every example starts from."""
    tmp = tmp_path_factory.mktemp("template")
    make_tree(tmp / "src")
    pack.push(tmp / "src", f"file://{tmp}/store", chunk_size=MiB)
    m = json.loads((tmp / "store" / "manifest.json").read_text())
    with sqlite3.connect(tmp / "store" / m["index"]) as db:  # any value fits: no constraints
        for t in ("files", "segments", "chunks"):
            db.executescript(f"CREATE TABLE t2 AS SELECT * FROM {t}; DROP TABLE {t}; "
                             f"ALTER TABLE t2 RENAME TO {t};")
    return tmp / "store"


def _fill(v, out: str, shas: dict):
    if isinstance(v, str):
        if v.startswith("SHA:"):
            return shas[v[4:]]
        return v.replace(OUT, out)
    return v


@settings(max_examples=int(os.environ.get("HYPER_FUZZ_EXAMPLES", "120")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(keep=st.booleans(), rows=ROWS, segments=SEGMENTS, damage=DAMAGE,
       raw=st.one_of(st.none(), st.none(), st.none(), st.binary(max_size=200)),
       prefix=st.sampled_from(["", "", "a", "a/b", "..", "d"]))
def test_fuzz_any_index_gives_a_result_or_a_clear_error_and_nothing_outside(
        template, keep, rows, segments, damage, raw, prefix):
    base = Path(tempfile.mkdtemp(prefix="hyper-fuzz-"))
    try:
        store = base / "store"
        shutil.copytree(template, store)
        outside = base / "outside"
        outside.mkdir()
        (outside / "keep").write_text("mine\n")
        dest = base / "dest"
        dest.mkdir()
        (dest / "found").symlink_to(outside)  # a symlink the pull finds in its way
        url = f"file://{store}"
        m = json.loads((store / "manifest.json").read_text())
        index = store / m["index"]
        shas = {}
        with sqlite3.connect(index) as db:
            shas = dict(db.execute("SELECT path, sha256 FROM files WHERE kind='f'"))
            if not keep:
                db.execute("DELETE FROM files WHERE path!=''")
                db.execute("DELETE FROM segments")
            for r in rows:
                r = [_fill(v, str(outside), shas) for v in r]
                path, parent, name = r[0], r[1], r[2]
                parent = path.rsplit("/", 1)[0] if "/" in path else "" if parent is None \
                    else parent
                name = path.rsplit("/", 1)[-1] if name is None else name
                db.execute("INSERT INTO files VALUES (?,?,?,?,?,?,?,?,?)",
                           (path, parent, name, *r[3:]))
            for s in segments:
                db.execute("INSERT INTO segments VALUES (?,?,?,?,?)",
                           [_fill(v, str(outside), shas) for v in s])
            if damage:
                db.executescript(damage)
        if raw is not None:
            index.write_bytes(raw)
        sha = hashlib.sha256(index.read_bytes()).hexdigest()
        index.rename(store / "index" / f"{sha}.sqlite")
        (store / "manifest.json").write_text(json.dumps(dict(
            m, index=f"index/{sha}.sqlite", index_sha256=sha)))
        before = tree_state(outside)
        siblings = sorted(os.listdir(base))

        for call in (lambda: pack.ls(url, cache_dir=base / "cache"),
                     lambda: pack.ls(url, "a", cache_dir=base / "cache"),
                     lambda: pack.pull(url, dest, path_prefix=prefix, jobs=2,
                                       cache_dir=base / "cache")):
            try:
                call()
            except HyperError:
                pass  # a clear error; anything else fails the example
        assert tree_state(outside) == before
        assert set(os.listdir(base)) <= set(siblings) | {"cache"}
        for dirpath, dirs, names in os.walk(dest):
            for n in dirs + names:
                p = Path(dirpath) / n
                assert os.lstat(p).st_mode & 0o7000 == 0, p  # no setuid, setgid, sticky
                if not p.is_symlink():
                    assert p.resolve().is_relative_to(dest.resolve()), p
        try:
            Index(store / "index" / f"{sha}.sqlite")
        except (ValueError, sqlite3.DatabaseError):
            pass
    finally:
        shutil.rmtree(base, ignore_errors=True)
