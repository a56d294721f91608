"""Crash test of the atomic publish (SPEC §2.7): a process killed right after EACH write point (os._exit through
the HQLAB_PUBLISH_KILL_AFTER hook) leaves the previously published set intact and loadable, nothing published is
half-written, and the next run completes the publish. Run on the publish helper alone (every point, first
publish and republish) and on the real `hqlab vocab build` (every point of a republish over an existing list)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hqlab.vocab.publish import INDEX, KILL_ENV, KILL_EXIT_CODE, PRISTINE, PublishError, publish, read_index

REPO = Path(__file__).resolve().parents[2]
DRIVER = "import json, sys; from hqlab.vocab.publish import publish; s = json.load(open(sys.argv[1])); " \
         "publish(s['folder'], {k: v.encode() for k, v in s['files'].items()}, s['meta'])"

A = {"ids.json": '{"ids": [1, 2, 3]}\n', "lm_head.safetensors": "rows of A " * 50, "mapping.safetensors": "map A"}
B = {"ids.json": '{"ids": [1, 2, 3, 4]}\n', "lm_head.safetensors": "rows of B " * 60, "mapping.safetensors": "map B"}
C = {"ids.json": '{"ids": [7]}\n', "lm_head.safetensors": "rows of C", "mapping.safetensors": "map A"}


def run_publish(folder: Path, files: dict[str, str], meta: dict, kill_after: int = 0) -> int:
    spec = folder.parent / f"{folder.name}.spec.json"
    spec.write_text(json.dumps({"folder": str(folder), "files": files, "meta": meta}))
    env = {**os.environ, KILL_ENV: str(kill_after)} if kill_after else \
        {k: v for k, v in os.environ.items() if k != KILL_ENV}
    return subprocess.run([sys.executable, "-c", DRIVER, str(spec)], env=env, cwd=REPO).returncode


def published(folder: Path) -> dict[str, str] | None:
    """The committed set (every file verified against the index), or None if nothing is published."""
    try:
        index = read_index(folder)
    except PublishError as e:
        assert "nothing published" in str(e), str(e)
        return None
    return {name: (folder / e["file"]).read_text() for name, e in index["files"].items()}


def assert_clean(folder: Path) -> None:
    """No .tmp leftovers and no data file that the committed index does not name."""
    index = read_index(folder)
    names = {e["file"] for e in index["files"].values()} | {INDEX}
    assert sorted(p.name for p in folder.iterdir() if p.is_file()) == sorted(names)
    if (folder / PRISTINE).exists():
        assert not list((folder / PRISTINE).glob("*.tmp"))


def points_of(folder: Path, files: dict[str, str], meta: dict, start: Path | None) -> list[str]:
    """Write points of a publish from the state `start` (a folder copy, or empty), counted in-process."""
    scratch = folder.parent / f"{folder.name}-count"
    if start is not None:
        shutil.copytree(start, scratch)
    result = publish(scratch, {k: v.encode() for k, v in files.items()}, meta)
    shutil.rmtree(scratch)
    return result.write_points


def test_write_points_are_what_the_spec_lists(tmp_path):
    def shape(points):  # file names without their content hash
        return [p.split("-")[0] if "-" in p else p for p in points]

    data = [f"{kind}:{name}" for name in ("ids", "lm_head", "mapping") for kind in ("tmp", "replace")]
    index = ["tmp:index.json", "replace:index.json"]
    assert shape(points_of(tmp_path / "v", A, {"v": "A"}, None)) == data + index  # the index last
    publish(tmp_path / "a", {k: v.encode() for k, v in A.items()}, {"v": "A"})
    again = shape(points_of(tmp_path / "a2", B, {"v": "B"}, tmp_path / "a"))
    # republish: a pristine copy of A (its files, then its index), then B's files, then the index
    pristine = [p.replace(":", ":pristine/") for p in data + index]
    assert again == pristine + data + index
    assert publish(tmp_path / "a", {k: v.encode() for k, v in A.items()}, {"v": "A"}).write_points == []


@pytest.mark.parametrize("scenario", ["first publish", "republish"])
def test_killed_after_each_write_point(tmp_path, scenario):
    base = tmp_path / "base"
    if scenario == "republish":
        assert run_publish(base, A, {"v": "A"}) == 0
    points = points_of(tmp_path / "n", B, {"v": "B"}, base if scenario == "republish" else None)
    assert points
    for n, point in enumerate(points, 1):
        folder = tmp_path / f"k{n}"
        if scenario == "republish":
            shutil.copytree(base, folder)
        assert run_publish(folder, B, {"v": "B"}, kill_after=n) == KILL_EXIT_CODE, point
        state = published(folder)
        committed = point == "replace:index.json"  # killed after the commit point: the new set is published
        expected_old = None if scenario == "first publish" else A
        assert state == (B if committed else expected_old), (point, state)
        assert run_publish(folder, B, {"v": "B"}) == 0, point  # the next run completes it
        assert published(folder) == B
        assert_clean(folder)
        if scenario == "republish":
            assert published(folder / PRISTINE) == A, point


def test_pristine_is_copied_once_and_never_overwritten(tmp_path):
    folder = tmp_path / "v"
    for files, tag in ((A, "A"), (B, "B"), (C, "C"), (B, "B")):
        assert run_publish(folder, files, {"v": tag}) == 0
        assert published(folder) == files
        assert_clean(folder)
    assert published(folder / PRISTINE) == A
    assert read_index(folder / PRISTINE)["meta"] == {"v": "A"}


def test_tampered_or_missing_files_are_detected(tmp_path):
    folder = tmp_path / "v"
    publish(folder, {k: v.encode() for k, v in A.items()}, {})
    index = read_index(folder)
    target = folder / index["files"]["lm_head.safetensors"]["file"]
    target.write_bytes(target.read_bytes()[:-1] + b"X")
    with pytest.raises(PublishError, match="does not match index.json"):
        read_index(folder)
    target.unlink()
    with pytest.raises(PublishError, match="lm_head.safetensors .* is missing"):
        read_index(folder)
    (folder / INDEX).write_text("{not json")
    with pytest.raises(PublishError, match="unreadable index"):
        read_index(folder)


def test_refuses_a_folder_with_other_files(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(PublishError, match="not empty and not a published folder .*notes.txt"):
        publish(tmp_path, {"ids.json": b"[1]"}, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


# ----------------------------------------------------------------------------------------------------------------
# The real build, killed at every write point of a republish

SELFGEN = REPO / "data" / "selfgen" / "qwen2.5-coder-0.5b.jsonl"


def vocab_build_cli(corpus: Path, size: int, out: Path, kill_after: int = 0) -> subprocess.CompletedProcess:
    """`hqlab vocab build` as a fresh interpreter."""
    env = {k: v for k, v in os.environ.items() if k != KILL_ENV}
    env["OMP_NUM_THREADS"] = "1"
    if kill_after:
        env[KILL_ENV] = str(kill_after)
    return subprocess.run([sys.executable, "-m", "hqlab.cli", "vocab", "build", "--corpus", str(corpus),
                           "--size", str(size), "--out", str(out)], env=env, cwd=REPO, capture_output=True, text=True)


def vocab_build_forked(corpus: Path, size: int, out: Path, kill_after: int) -> int:
    """The same build in a child process, killed by the hook. Children come from a forkserver that imported
    hqlab.vocab once (no interpreter start-up per kill point). Not a plain fork of this process: after torch has
    used its OpenMP thread pool here (any earlier model test), a forked child that runs torch hangs for ever."""
    import multiprocessing

    from hqlab.vocab.publish import call_killed_after
    from hqlab.vocab import build

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["hqlab.vocab", "hqlab.vocab.publish"])  # read once, when the server starts
    child = context.Process(target=call_killed_after, args=(kill_after, build, "qwen2.5-coder-0.5b", [corpus], size,
                                                            str(out)), kwargs={"progress": False})
    child.start()
    child.join(timeout=600)
    if child.exitcode is None:
        child.kill()
        pytest.fail(f"the build child killed after write point {kill_after} did not finish in 10 minutes")
    return child.exitcode


@pytest.mark.slow
def test_vocab_build_killed_after_each_write_point(tmp_path):
    from hqlab.vocab import build, load_draft_head, load_draft_vocab

    corpus = tmp_path / "corpus.jsonl"  # the committed self-generated corpus of the 0.5B
    corpus.write_bytes(SELFGEN.read_bytes())

    base, clean = tmp_path / "base", tmp_path / "clean"
    assert vocab_build_cli(corpus, 1024, base).returncode == 0
    shutil.copytree(base, clean)
    points = build("qwen2.5-coder-0.5b", [corpus], 2048, clean, progress=False).write_points  # uninterrupted
    old_index, new_index = read_index(base), read_index(clean)
    new_ids = load_draft_vocab(clean)
    assert load_draft_vocab(base).numel() == 1024 and new_ids.numel() == 2048
    assert len(points) == 16  # republish: pristine copy (3 files + index), 3 files, index; tmp and replace each

    def check_killed_then_completed(folder: Path, n: int) -> None:
        ids = load_draft_vocab(folder)  # the committed list: the old one, or the new one once the index is in
        committed = n == len(points)
        assert ids.numel() == (2048 if committed else 1024), points[n - 1]
        assert read_index(folder) == (new_index if committed else old_index)
        build("qwen2.5-coder-0.5b", [corpus], 2048, folder, progress=False)  # the next run completes it
        assert read_index(folder) == new_index
        ids, rows = load_draft_head(folder)
        assert ids.equal(new_ids) and rows.shape == (2048, 896)
        assert_clean(folder)
        assert read_index(folder / PRISTINE) == old_index

    for n in range(1, len(points) + 1):
        folder = tmp_path / f"k{n}"
        shutil.copytree(base, folder)
        assert vocab_build_forked(corpus, 2048, folder, n) == KILL_EXIT_CODE, points[n - 1]
        check_killed_then_completed(folder, n)

    # and once through the real command line, killed between writing the new index and committing it
    folder = tmp_path / "cli"
    shutil.copytree(base, folder)
    proc = vocab_build_cli(corpus, 2048, folder, kill_after=len(points) - 1)
    assert proc.returncode == KILL_EXIT_CODE, proc.stderr[-2000:]
    assert (folder / "index.json.tmp").exists()  # the half-done index never became the index
    check_killed_then_completed(folder, len(points) - 1)
