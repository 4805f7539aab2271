"""A checkpoint store is written by the task it belongs to, and the restore that reads it runs
as root outside the task's container: nothing a manifest says, and nothing a task leaves in
its checkpoint folder, makes a restore write outside that folder, make a setuid file, or make
a save read a file outside it (issue 22, item 1). Each fault is injected by writing what a
task could write; a property-based fuzz of the manifest reader and restore closes the file."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sysconfig
import tempfile
from pathlib import Path

import pytest
from conftest import ROOT
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as hs

from hypercli.errors import HyperError
from hypercli.mount import checkpoint as C
from hypercli.mount.checkpoint_manifest import BadManifest, parse

PIECES = [b"alpha", b"bravo!", b"charlie"]
PACK = b"".join(PIECES)
PACK_NAME = "packs/" + hashlib.sha256(PACK).hexdigest()
GEN = "gen/00000009.00000001.json"


def block(i: int) -> list:
    """The manifest entry of piece ``i`` of PACK."""
    off = sum(len(p) for p in PIECES[:i])
    return [hashlib.sha256(PIECES[i]).hexdigest(), PACK_NAME, off, len(PIECES[i])]


def entry(*pieces: int, mode: int = 0o644) -> dict:
    return {"size": sum(len(PIECES[i]) for i in pieces), "mode": mode, "n": len(pieces),
            "blocks": {str(k): block(i) for k, i in enumerate(pieces)}}


def craft(store: Path, files: dict | bytes, name: str = GEN) -> str:
    """Write a pack and a generation into a file:// store as a task would; returns the URL."""
    (store / "packs").mkdir(parents=True, exist_ok=True)
    (store / "gen").mkdir(exist_ok=True)
    (store / PACK_NAME).write_bytes(PACK)
    data = files if isinstance(files, bytes) else json.dumps(
        {"attempt": 9, "seq": 1, "time": 0, "base": None, "files": files}).encode()
    (store / name).write_bytes(data)
    return f"file://{store}"


def tree(top: Path) -> dict:
    """path → (kind, mode, bytes) of everything under ``top``, symlinks not followed."""
    out = {}
    for dirpath, dirs, names in os.walk(top):
        for n in dirs + names:
            p = Path(dirpath) / n
            s = p.lstat()
            data = p.read_bytes() if stat.S_ISREG(s.st_mode) else (
                os.readlink(p).encode() if stat.S_ISLNK(s.st_mode) else b"")
            out[str(p.relative_to(top))] = (stat.S_IFMT(s.st_mode), stat.S_IMODE(s.st_mode),
                                            data)
    return out


@pytest.fixture
def box(tmp_path):
    """(sandbox, checkpoint folder, store folder, outside folder) with a file in each of
    the folder and the outside one."""
    ck, store, outside = tmp_path / "ck", tmp_path / "store", tmp_path / "outside"
    ck.mkdir()
    outside.mkdir()
    (ck / "kept.txt").write_text("the folder's own file")
    (outside / "victim").write_text("not the task's")
    return tmp_path, ck, store, outside


@pytest.mark.parametrize("path", [
    "../outside/x", "../../../../../../tmp/hyper-escaped", "a/../../outside/x", "/tmp/abs-x",
    "a//b", "a/./b", "./a", "a/", "", "a\x00b", ".."])
def test_a_path_that_is_not_plain_and_relative_is_refused_and_nothing_is_written(box, path):
    sandbox, ck, store, outside = box
    before = tree(sandbox)
    url = craft(store, {"fine": entry(0), path: entry(1)})
    with pytest.raises(BadManifest) as e:
        C.restore(url, ck, sandbox / "ck.state.json")
    assert GEN in str(e.value) and repr(path) in str(e.value)
    assert e.value.hint and e.value.exit_code == 3
    after = tree(sandbox)
    assert {k: v for k, v in after.items() if not k.startswith(("ck.", "store"))} == {
        k: v for k, v in before.items() if not k.startswith("store")}  # the folder as it was
    assert not Path("/tmp/hyper-escaped").exists() and not Path("/tmp/abs-x").exists()


def test_a_path_through_a_symlink_in_the_folder_is_refused(box):
    sandbox, ck, store, outside = box
    (ck / "sub").symlink_to(outside)
    url = craft(store, {"sub/x": entry(0)})
    with pytest.raises(BadManifest, match="'sub', a symlink"):
        C.restore(url, ck, sandbox / "ck.state.json")
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]


def test_a_symlink_where_a_file_goes_is_replaced_not_written_through(box):
    sandbox, ck, store, outside = box
    (ck / "model.pt").symlink_to(outside / "victim")
    url = craft(store, {"model.pt": entry(0, 1)})
    C.restore(url, ck, sandbox / "ck.state.json")
    assert (outside / "victim").read_text() == "not the task's"
    assert not (ck / "model.pt").is_symlink()
    assert (ck / "model.pt").read_bytes() == b"alphabravo!"


def test_modes_keep_permission_bits_only(box):
    sandbox, ck, store, outside = box
    url = craft(store, {"tool": entry(0, mode=0o4755), "dir/g": entry(1, mode=0o2775),
                        "t": entry(2, mode=0o1777), "odd": entry(2, mode=-1)})
    C.restore(url, ck, sandbox / "ck.state.json")
    modes = {p: stat.S_IMODE((ck / p).stat().st_mode) for p in ("tool", "dir/g", "t", "odd")}
    assert modes == {"tool": 0o755, "dir/g": 0o775, "t": 0o777, "odd": 0o777}


@pytest.mark.parametrize("bad", [
    {"x": {"size": 5, "mode": 0o644, "n": 1, "blocks": {"0": ["ab", PACK_NAME, 0, 5]}}},
    {"x": {"size": 5, "mode": 0o644, "n": 1, "blocks": {"0": [block(0)[0], "packs/../../etc",
                                                              0, 5]}}},
    {"x": {"size": 99, "mode": 0o644, "n": 1, "blocks": {"0": block(0)}}},
    {"x": {"size": 5, "mode": 0o644, "n": 2, "blocks": {"0": block(0)}}},
    {"x": {"size": 5, "mode": 0o644, "n": 10 ** 12, "blocks": {}}},
    {"x": {"size": 5, "mode": "0644", "n": 1, "blocks": {"0": block(0)}}},
    {"x": entry(0), "x/y": entry(1)},
    b"{\"files\": {\"a\": " * 3000,
    b"\xff\xfe not json",
])
def test_a_malformed_manifest_is_a_clear_error(box, bad):
    sandbox, ck, store, _ = box
    url = craft(store, bad)
    with pytest.raises(BadManifest, match=GEN):
        C.restore(url, ck, sandbox / "ck.state.json")
    assert (ck / "kept.txt").read_text() == "the folder's own file"


def test_stale_things_in_the_way_of_the_generation_are_replaced(box):
    sandbox, ck, store, outside = box
    (ck / "a").write_text("a file where the generation has a folder")
    (ck / "b" / "deep").mkdir(parents=True)
    (ck / "b" / "deep" / "f").write_text("a folder where the generation has a file")
    (ck / "b" / "link").symlink_to(outside)
    url = craft(store, {"a/x": entry(0), "b": entry(1)})
    C.restore(url, ck, sandbox / "ck.state.json")
    assert (ck / "a" / "x").read_bytes() == b"alpha" and (ck / "b").read_bytes() == b"bravo!"
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]


def test_the_folder_itself_as_a_symlink_is_refused(box):
    sandbox, ck, store, outside = box
    link = sandbox / "ck2"
    link.symlink_to(outside)
    url = craft(store, {"x": entry(0)})
    with pytest.raises(C.FolderError, match="symlink"):
        C.restore(url, link, sandbox / "ck2.state.json")
    with pytest.raises(C.FolderError):
        C.save(link, f"file://{sandbox}/other", 1, sandbox / "ck2.state.json")
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]


def test_a_save_never_reads_through_a_symlink(box):
    """A task that puts symlinks to host files and folders in its checkpoint folder must not
    get them copied into its store (from where the next restore would hand them over)."""
    sandbox, ck, store, outside = box
    (ck / "leak").symlink_to(outside / "victim")
    (ck / "dirleak").symlink_to(outside)
    (ck / "fifo.pt").unlink(missing_ok=True)
    os.mkfifo(ck / "fifo.pt")  # a save that opened it would block forever
    url = f"file://{store}"
    r = C.save(ck, url, 1, sandbox / "ck.state.json")
    gen = json.loads((store / r.generation).read_bytes())
    assert sorted(gen["files"]) == ["kept.txt"]
    out = sandbox / "restored"
    C.restore(url, out, sandbox / "restored.state.json")
    assert sorted(p.name for p in out.iterdir()) == ["kept.txt"]


# ------------------------------------------------------------------------------------ fuzz

_PARTS = hs.sampled_from(["a", "b", "c.pt", "..", ".", "", "/", "\x00", "ä", "x" * 300])
_PATHS = hs.lists(_PARTS, min_size=1, max_size=4).map("/".join) | hs.text(max_size=12)
_INTS = hs.integers(-3, 40) | hs.sampled_from([0o4755, 0o2777, 0o7777, 2 ** 70, -2 ** 40])
_BLOCK = hs.sampled_from([0, 1, 2]).map(block) | hs.lists(
    hs.sampled_from(["", PACK_NAME, "packs/x", hashlib.sha256(b"").hexdigest(), 0, 5, -1,
                     None, 2 ** 64]), max_size=5)
_FILE = hs.fixed_dictionaries({
    "size": _INTS, "mode": _INTS, "n": _INTS,
    "blocks": hs.dictionaries(hs.sampled_from(["0", "1", "2", "-1", "x", "00"]), _BLOCK,
                              max_size=3)}) | hs.sampled_from([None, [], "x", 3]) | hs.sampled_from(
    [0, 1, 2]).map(lambda i: entry(i))
_MANIFEST = hs.fixed_dictionaries({
    "attempt": _INTS, "seq": _INTS,
    "base": hs.none() | hs.sampled_from(["gen/00000001.00000001.json", GEN, "../x", 3]),
    "files": hs.dictionaries(_PATHS, _FILE, max_size=4)})
_PLANTED = hs.dictionaries(hs.sampled_from(["a", "b", "c.pt", "a/b"]),
                           hs.sampled_from(["file", "dir", "link-out", "link-file"]),
                           max_size=3)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(manifest=_MANIFEST | hs.binary(max_size=200).map(lambda b: {"raw": b}),
       planted=_PLANTED)
def test_fuzz_any_manifest_gives_a_folder_or_a_clear_error_and_nothing_outside(
        manifest, planted):
    with tempfile.TemporaryDirectory() as d:
        sandbox = Path(d)
        ck, store, outside = sandbox / "ck", sandbox / "store", sandbox / "outside"
        ck.mkdir()
        outside.mkdir()
        (outside / "victim").write_text("not the task's")
        for rel, kind in planted.items():  # what the task left in its folder
            p = ck / rel
            try:
                p.parent.mkdir(parents=True, exist_ok=True)
                if kind == "file":
                    p.write_text("old")
                elif kind == "dir":
                    p.mkdir()
                elif kind == "link-out":
                    p.symlink_to(outside)
                else:
                    p.symlink_to(outside / "victim")
            except OSError:
                pass
        data = manifest["raw"] if "raw" in manifest else json.dumps(manifest).encode()
        url = craft(store, data)
        outside_before = tree(outside)
        try:
            r = C.restore(url, ck, sandbox / "ck.state.json")
        except HyperError as e:
            assert str(e) and e.exit_code == 3
            event(type(e).__name__)
        else:
            event("restored")
            assert r.generation == GEN
            files = parse(GEN, data)["files"]
            for rel, f in files.items():
                p = ck / rel
                assert p.is_file() and not p.is_symlink() and p.stat().st_size == f["size"]
        assert tree(outside) == outside_before
        assert {x.name for x in sandbox.iterdir()} <= {
            "ck", "store", "outside", "ck.state.json", "ck.state.lock"}
        for dirpath, dirs, names in os.walk(ck):
            for n in names + dirs:
                s = (Path(dirpath) / n).lstat()
                assert not s.st_mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX)


# ----------------------------------------------- the attack by a task that writes its store

#: the task's attempt 1 writes a generation of its own into its checkpoint store (under
#: $HYPER_OUTPUTS with file:// storage on the local provider; any object store it can reach
#: otherwise: a task in a container cannot write $HYPER_OUTPUTS, tests/test_task_boundary.py,
#: but with object storage it shares the store's credentials) with one hostile entry, and
#: fails; attempt 2 shows what the restore made
EVIL = r"""
s="$HYPER_OUTPUTS/.checkpoints/$HYPER_TASK_ID"
if [ "$HYPER_ATTEMPT" = 1 ]; then
  mkdir -p "$s/packs" "$s/gen"
  printf 'pwned\n' > /tmp/p
  sha=$(sha256sum /tmp/p | cut -d' ' -f1)
  cp /tmp/p "$s/packs/$sha"
  ln -s /root "$HYPER_CHECKPOINT/link"
  case {{kind}} in
    dotdot) path=../../../../../../../../../tmp/escaped-dotdot; mode=420 ;;
    abs) path=/tmp/escaped-abs; mode=420 ;;
    link) path=link/escaped-link; mode=420 ;;
    setuid) path=tool; mode=2541 ;;
  esac
  f='{"size":6,"mode":%d,"n":1,"blocks":{"0":["%s","packs/%s",0,6]}}'
  printf "{\"attempt\":99,\"seq\":1,\"time\":0,\"base\":null,\"files\":{\"%s\":$f}}" \
    "$path" "$mode" "$sha" "$sha" > "$s/gen/00000099.00000001.json"
  exit 1
fi
ls -ln "$HYPER_CHECKPOINT/"
"""


@pytest.mark.slow
def test_a_task_that_writes_its_store_cannot_make_the_next_restore_write_outside(ssh_hosts,
                                                                                tmp_path):
    """A task (on an SSH test host running the local provider as a node does) crafts its
    checkpoint store; the next attempt's restore, run as root, creates nothing outside the
    checkpoint folder and no setuid file."""
    import yaml
    packages = sysconfig.get_paths()["purelib"]
    [host] = ssh_hosts.start(1, share=(ROOT, packages))  # a clone under /tmp or /root too
    recipe = {"name": "evil", "workdir": "none", "cluster": {"provider": "local", "workers": 2},
              "experiments": {"t": {"retries": 1, "checkpoint_every": 1,
                                    "parameters": {"kind": ["dotdot", "abs", "link", "setuid"]},
                                    "command": EVIL}}}
    host.run("cat > /root/evil.yaml", input=yaml.safe_dump(recipe), check=True)
    home = "/root/hh"
    # this Python's own binary lives under /root, which a host has its own of: the host's
    # /usr/bin/python3 (the same 3.11) runs hypercli from here with this Python's packages
    path = f"{ROOT}:{packages}"
    run = host.run(f"HYPER_HOME={home} PYTHONPATH={path} /usr/bin/python3 -m hypercli run "
                   "/root/evil.yaml", timeout=600)
    out = run.stdout + run.stderr
    left = host.run("ls -d /tmp/escaped-* /root/escaped-* 2>/dev/null; "
                    f"find / -xdev -name 'escaped-*' -newer /root/evil.yaml 2>/dev/null; "
                    f"find {home} -perm /6000 -type f").stdout
    assert left == "", out
    stderr = {}
    for kind in ("dotdot", "abs", "link", "setuid"):
        i = ["dotdot", "abs", "link", "setuid"].index(kind)
        d = f"{home}/local/tasks/evil-1.t-{i:04d}.2-*"  # the attempt's folder
        stderr[kind] = host.run(f"cat {d}/stderr {d}/stdout").stdout
    for kind, entry in (("dotdot", "../../../../../../../../../tmp/escaped-dotdot"),
                        ("abs", "/tmp/escaped-abs"), ("link", "link/escaped-link")):
        assert ("checkpoint generation gen/00000099.00000001.json, entry "
                f"'{entry}'") in stderr[kind], (kind, stderr[kind], out)
        assert "restoring the checkpoint failed" in stderr[kind]
    assert "-rwxr-xr-x" in stderr["setuid"] and " tool" in stderr["setuid"], stderr["setuid"]
