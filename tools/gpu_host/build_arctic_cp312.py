"""Build vLLM's `suffix` method's one dependency, Arctic Inference's suffix tree, as a wheel for the GPU host (cp312).

    python tools/gpu_host/build_arctic_cp312.py [--python PYTHON3.12] [--out DIR]

vLLM 0.26's `suffix` method imports `arctic_inference.suffix_decoding.SuffixDecodingCache` (vllm/v1/spec_decode/
suffix_decoding.py) and nothing else of Arctic Inference. Arctic Inference 0.3.0 publishes no binary wheel for
CPython 3.12, and its sdist's setup.py imports torch to build its CUDA ops, so it cannot be built where no torch for
3.12 is at hand. The suffix tree alone (csrc/suffix_decoding: C++ and nanobind, no torch) can. This script:

  1. downloads the sdist (pip, --no-binary; pip prepares its metadata by running its setup.py, so run this script
     with a Python that imports torch and setuptools) and checks it against SDIST_SHA256;
  2. builds csrc/suffix_decoding with CMake, ninja and nanobind NANOBIND under the given CPython 3.12 (a fresh venv
     under DIR), against the system's C++ runtime, and prints the newest glibc and libstdc++ symbol versions the
     module needs (the host must have them). Not linked statically: a static libstdc++ brings the build system's
     newest glibc symbols with it (arc4random, glibc 2.36), which asks more of the host than the shared one
     (glibc 2.32, GCC 11's libstdc++, built here with GCC 12 on glibc 2.36);
  3. assembles arctic_inference-0.3.0-cp312-cp312-linux_x86_64.whl from the package's `__init__.py`, the
     `suffix_decoding` package (`__init__.py`, `cache.py`) and the built `_C` module, with no entry points: the full
     package registers a `vllm.general_plugins` entry point that patches vLLM when it loads, which the host must not
     get. Requires-Dist is numpy alone (cache.py imports it; the host has it);
  4. installs the wheel and numpy alone into a second fresh 3.12 venv (no torch, no vLLM), imports what vLLM imports
     and runs the cache on a small example, checking the draft it proposes and that no vLLM plugin is registered.

Prints the wheel's path, size and sha256; `vllm_host.py prepare --arctic-wheel PATH` carries it.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VERSION = "0.3.0"
SDIST = f"arctic_inference-{VERSION}.tar.gz"
SDIST_SHA256 = "7f22e3e1b1071c6061c0d6951be17c0fb50b08d06d6e543144c8f52faba60a36"
NANOBIND = "nanobind==2.9.2"
WHEEL = f"arctic_inference-{VERSION}-cp312-cp312-linux_x86_64.whl"
# The sdist's files the wheel keeps (relative to its top folder): what `from arctic_inference.suffix_decoding import
# SuffixDecodingCache` loads. simulator.py is left out (it imports pandas, tqdm and transformers, and vLLM never does).
PACKAGE_FILES = ["arctic_inference/__init__.py", "arctic_inference/suffix_decoding/__init__.py",
                 "arctic_inference/suffix_decoding/cache.py"]
EXTENSION = "arctic_inference/suffix_decoding/_C.cpython-312-x86_64-linux-gnu.so"
ZIP_TIME = (2025, 1, 1, 0, 0, 0)  # fixed, so one .so gives one wheel checksum

SMOKE = """
import importlib.metadata as md, sys
from arctic_inference.suffix_decoding import SuffixDecodingCache
assert 'torch' not in sys.modules and 'vllm' not in sys.modules
assert not list(md.entry_points(group='vllm.general_plugins')), 'a vLLM plugin is registered'
cache = SuffixDecodingCache(max_tree_depth=24, max_cached_requests=4)
cache.start_request('a', [1, 2, 3])
cache.add_active_response('a', [4, 5, 6, 7, 8])
cache.stop_request('a')
cache.start_request('b', [9, 1, 2, 3])
cache.add_active_response('b', [4])
draft = cache.speculate('b', [1, 2, 3, 4], max_spec_tokens=8, max_spec_factor=4.0, min_token_prob=0.1)
assert list(draft.token_ids) == [5, 6, 7, 8], draft.token_ids
assert 'a' in cache.cached_requests and 'b' in cache.active_requests
cache.stop_request('b')
cache.evict_cached_response('a')
assert 'a' not in cache.cached_requests
# as vLLM calls it: int32 rows of its token array (the zero-copy ndarray overloads), a slice as the pattern
import numpy as np
rows = np.zeros((2, 16), dtype=np.int32)
rows[0, :8] = [1, 2, 3, 4, 5, 6, 7, 8]
rows[1, :5] = [9, 1, 2, 3, 4]
cache.start_request('c', rows[0, :3])
cache.add_active_response('c', rows[0, 3:8])
cache.stop_request('c')
cache.start_request('d', rows[1, :4])
cache.add_active_response('d', rows[1, 4:5])
assert list(cache.speculate('d', rows[1, 1:5], max_spec_tokens=8, max_spec_factor=4.0,
                            min_token_prob=0.1).token_ids) == [5, 6, 7, 8]
print('smoke ok: draft', list(draft.token_ids), 'cached', sorted(cache.cached_requests))
"""


def log(msg: str) -> None:
    print(f"[arctic] {msg}", flush=True)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run(cmd: list[str], **kw) -> None:
    log(" ".join(str(c) for c in cmd))
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def python312(given: str | None) -> Path:
    """The CPython 3.12 to build with: --python, else python3.12 on PATH, else pyenv's newest 3.12."""
    candidates = [given] if given else [shutil.which("python3.12")]
    if not given:
        candidates += sorted(str(p / "bin/python3.12") for p in (Path.home() / ".pyenv/versions").glob("3.12.*"))
    for c in candidates:
        if c and Path(c).exists():
            version = subprocess.run([c, "-c", "import sys; print(sys.version_info[:2] == (3, 12))"],
                                     capture_output=True, text=True).stdout.strip()
            if version == "True":
                return Path(c)
            if given:
                raise SystemExit(f"--python {given} is not CPython 3.12 (the GPU host's)")
    raise SystemExit("no CPython 3.12 found: pass --python PATH")


def fetch_sdist(out: Path) -> Path:
    sdist = out / SDIST
    if not sdist.exists():
        # --no-build-isolation: pip prepares the sdist's metadata by running its setup.py, which imports torch
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "arctic-inference",
             "--no-build-isolation", f"arctic-inference=={VERSION}", "-d", out])
    if (got := sha256(sdist)) != SDIST_SHA256:
        raise SystemExit(f"{sdist}: sha256 {got}, expected {SDIST_SHA256}")
    return sdist


def venv(py: Path, where: Path, packages: list[str], *pip_args: str) -> Path:
    shutil.rmtree(where, ignore_errors=True)
    run([py, "-m", "venv", where])
    if packages:
        run([where / "bin/python", "-m", "pip", "install", "-q", *pip_args, *packages])
    return where / "bin/python"


def build_extension(py: Path, src: Path, out: Path) -> Path:
    builder = venv(py, out / "venv-build", [NANOBIND])
    build = out / "cmake-build"
    shutil.rmtree(build, ignore_errors=True)
    run(["cmake", "-S", src / "csrc/suffix_decoding", "-B", build, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
         f"-DPython_EXECUTABLE={builder}"])
    run(["cmake", "--build", build])
    built = list(build.glob("_C.cpython-312-x86_64-linux-gnu.so"))
    if len(built) != 1:
        raise SystemExit(f"expected one _C.cpython-312 module in {build}, found {built}")
    return built[0]


def symbol_floor(module: Path) -> str:
    """The newest glibc, libstdc++ and C++ ABI symbol versions the module asks for (what the host must provide)."""
    if not shutil.which("objdump"):
        return "unknown (no objdump)"
    dynamic = subprocess.run(["objdump", "-T", str(module)], check=True, capture_output=True, text=True).stdout
    newest = {}
    for lib, version in re.findall(r"\b(GLIBC|GLIBCXX|CXXABI)_([0-9.]+)", dynamic):
        key = tuple(int(x) for x in version.split("."))
        newest[lib] = max(newest.get(lib, key), key)
    return ", ".join(f"{lib}_{'.'.join(map(str, v))}" for lib, v in sorted(newest.items()))


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def assemble(src: Path, extension: Path, wheel: Path) -> None:
    files = {name: (src / name).read_bytes() for name in PACKAGE_FILES}
    files[EXTENSION] = extension.read_bytes()
    info = f"arctic_inference-{VERSION}.dist-info"
    files[f"{info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: arctic_inference\nVersion: {VERSION}\nLicense: Apache-2.0\n"
        "Requires-Dist: numpy\n"
        "Summary: Arctic Inference's suffix decoding cache alone (csrc/suffix_decoding), for vLLM's suffix method\n"
    ).encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: hqlab build_arctic_cp312\nRoot-Is-Purelib: false\n" \
                             b"Tag: cp312-cp312-linux_x86_64\n"
    files[f"{info}/LICENSE"] = (src / "LICENSE").read_bytes()
    record = [record_line(n, d) for n, d in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            entry = zipfile.ZipInfo(name, ZIP_TIME)
            entry.external_attr = 0o644 << 16
            z.writestr(entry, data, compress_type=zipfile.ZIP_DEFLATED)


def check(py: Path, wheel: Path, out: Path) -> None:
    tester = venv(py, out / "venv-check", ["numpy"])
    run([tester, "-m", "pip", "install", "-q", "--no-index", "--no-deps", wheel])
    listed = subprocess.run([tester, "-m", "pip", "list", "--format=freeze"], check=True, capture_output=True,
                            text=True).stdout.split()
    log(f"check venv holds: {' '.join(listed)}")
    if any(p.lower().startswith(("torch==", "vllm==")) for p in listed):
        raise SystemExit("the check venv must hold no torch and no vLLM")
    run([tester, "-c", SMOKE], cwd=out)  # outside the sdist's folder, so the installed package is the one imported


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python", default=None, help="a CPython 3.12 (default: python3.12 on PATH, else pyenv's)")
    p.add_argument("--out", default=str(ROOT / ".vllm-dist/arctic"), help="work folder (default: %(default)s)")
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    py = python312(args.python)
    log(f"building with {py}")
    sdist = fetch_sdist(out)
    src_root = out / "src"
    shutil.rmtree(src_root, ignore_errors=True)
    with tarfile.open(sdist) as t:
        t.extractall(src_root, filter="data")
    src = src_root / f"arctic_inference-{VERSION}"
    extension = build_extension(py, src, out)
    log(f"{extension.name} needs at most {symbol_floor(extension)}")
    wheel = out / WHEEL
    assemble(src, extension, wheel)
    check(py, wheel, out)
    size = wheel.stat().st_size
    log(f"{wheel}  {size:,} bytes  sha256 {sha256(wheel)}")
    shown = wheel.relative_to(ROOT) if wheel.is_relative_to(ROOT) else wheel
    log(f"carry it: python tools/gpu_host/vllm_host.py prepare --arctic-wheel {shown} ...")


if __name__ == "__main__":
    main()
