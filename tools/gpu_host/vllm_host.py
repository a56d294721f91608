"""Carry vLLM 0.26 and a model to an offline GPU host (torch 2.11, python 3.12, no network, small transfers).

  1. here (CPU):  python tools/gpu_host/vllm_host.py prepare [--part-mib N] [--reuse] [--model NAME ...]
                                                               [--arctic-wheel WHEEL]
       downloads the wheels vLLM needs there and the host lacks (tools/gpu_host/README.md lists them and why), trims vLLM's
       wheel to what an H200 running a dense model loads, takes each model's GGUF from the hqlab cache and packs all
       of it into checksummed parts under .parts/ (tools/gpu_host/pack_parts.py); prints the host commands.
       --arctic-wheel adds the cp312 suffix-tree wheel of build_arctic_cp312.py (vLLM's `suffix` method).
  2. host, one call per part:  python3 tools/gpu_host/vllm_host.py stash .parts/part-NNN.bin
       checks the carried part against the manifest and keeps it in the host's work folder (GPU_WORK). A call that
       needs one model stages only the wheels' and that model's parts: `vllm_host.py parts --model NAME` (here)
       lists them (the 1.5B alone: 21 of 28 parts).
  3. host:  python3 tools/gpu_host/vllm_host.py run -- python3 benchmarks/vllm_gpu.py bench ...
       reassembles and checks every file, installs the wheels into GPU_WORK/site (with hqlab's vLLM plugin entry
       point and the hqlab_kernels name, as `pip install -e .` would), converts the GGUFs (hqlab.models) once per
       warm machine, then runs the command with that environment, its output teed to $OUT/<log>.

A part is at most what one transfer may carry beside the working tree; the work folder must outlive one call (the
parts arrive over several), so it lives in the system temp folder.

  here, around the GPU calls:  python tools/gpu_host/vllm_host.py park   /   ... unpark
       The committed results and figures (PARKABLE: more than half of the tree) are read by no GPU command. `park`
       moves them to .parked/ (ignored, so it does not travel), which leaves room for parts twice as large: half the
       stash calls. It refuses while they hold uncommitted changes, and `unpark` moves them back (also after an
       interrupted session: `git status` then shows them deleted, and .parked/ still holds them). Commit nothing
       while parked.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout that is not installed (the GPU host)

PARTS = ROOT / ".parts"
PARKED = ROOT / ".parked"
PARKABLE = ("data/results", "figures")  # tracked, large, and read by no command on the GPU host
DIST = ROOT / ".vllm-dist"
# Work folder on the GPU host: it must outlive one call (the parts arrive over several), so the system temp folder.
GPU_WORK = Path(os.environ.get("HQLAB_GPU_WORK") or Path(tempfile.gettempdir()) / "hqlab-gpu")
GPU_PARTS = GPU_WORK / "parts"
GPU_FILES = GPU_WORK / "files"
GPU_SITE = GPU_WORK / "site"
GPU_CACHE = GPU_WORK / "cache"
MODELS = ["qwen2.5-coder-0.5b"]  # offline registry names carried by default

VLLM = "vllm==0.26.0"
# What `import vllm` and its engine need on the GPU host beyond the packages its image has:
# found on CPU by importing vLLM's engine, worker, model-runner, Qwen2, sampler, spec-decode and attention modules
# and mapping every loaded module to its distribution. Versions: vLLM's pins where it has them; xgrammar 0.2.7 is
# the newest that accepts vLLM's apache-tvm-ffi 0.1.10; openai 2.54.0 the newest on httpx (the image has httpx,
# openai 3 needs httpx2). gguf: for converting the GGUF (transformers reads it with gguf; accelerate is there).
GPU_WHEELS = [
    "apache-tvm-ffi==0.1.10", "xgrammar==0.2.7", "llguidance==1.7.6", "cachetools==8.0.2", "cbor2==6.3.0",
    "msgspec==0.23.0", "pybase64==1.5.1", "pyzmq==27.3.0", "pydantic==2.14.4", "pydantic-core==2.50.5",
    "annotated-types==0.8.0", "typing-inspection==0.4.5", "fastapi==0.136.3", "starlette==1.10.0",
    "openai==2.54.0", "jiter==0.19.0", "distro==1.9.0", "sniffio==1.3.1", "openai-harmony==0.0.8",
    "partial-json-parser==0.2.1.1.post7", "gguf==0.19.0",
    # `vllm serve` and `vllm bench serve` beyond the engine (found the same way from vLLM's API server, CLI and
    # benchmark modules): the HTTP server, its reloader, SageMaker's route standards (imported unconditionally) and
    # form parsing for the upload routes
    "uvicorn==0.54.0", "watchfiles==1.3.0", "jmespath==1.1.0", "model-hosting-container-standards==0.1.16",
    "python-multipart==0.0.34", "prometheus-fastapi-instrumentator==8.1.0",  # the /metrics route, imported at app build
    # fp8 weights (`--only qwen2.5-27b:fp8:...` of the step-cost grid): vLLM's quantization configs import
    # compressed-tensors (and it loguru) when any quantized model is built; run s3b's fp8 engine stopped there
    "compressed-tensors==0.17.0", "loguru==0.7.3",
]
PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_27_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64", "manylinux1_x86_64"]
# Parts of vLLM's wheel that an H200 (sm_90) running a dense bf16 model never loads; vLLM imports each of them
# inside try/except or only for other GPUs/models: FlashAttention 2 (Hopper uses FA3), the MoE kernels, the Rust
# frontend binary, DeepGEMM (fp8), FlashMLA and the SM100-only attention.
TRIM = [r"^vllm/vllm_flash_attn/_vllm_fa2_C\.abi3\.so$", r"^vllm/_moe_C_stable_libtorch\.abi3\.so$",
        r"^vllm/vllm-rs$", r"^vllm/third_party/deep_gemm/", r"^vllm/third_party/fmha_sm100/",
        r"^vllm/_flashmla_C\.abi3\.so$", r"^vllm/_flashmla_extension_C\.abi3\.so$"]

def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------------------------
# prepare (CPU)


def pip_download(requirements: list[str], dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "-d", str(dest)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + requirements, check=True)


def trim_wheel(src: Path, dest: Path) -> tuple[int, int]:
    """Copy the wheel without the TRIM paths (RECORD rewritten to match), LZMA-compressed: pip installs it as is."""
    drop = [re.compile(p) for p in TRIM]
    dropped = 0
    tmp = dest.with_suffix(".tmp")
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_LZMA) as zout:
        record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        for info in zin.infolist():
            if any(d.search(info.filename) for d in drop):
                dropped += info.file_size
                continue
            if info.filename == record_name:
                continue
            zout.writestr(info, zin.read(info.filename), compress_type=zipfile.ZIP_LZMA)
        kept = [line for line in zin.read(record_name).decode().splitlines()
                if not any(d.search(line.split(",", 1)[0]) for d in drop)]
        zout.writestr(record_name, "\n".join(kept) + "\n", compress_type=zipfile.ZIP_LZMA)
    os.replace(tmp, dest)
    return dropped, dest.stat().st_size


ARCTIC_EXTENSION = "arctic_inference/suffix_decoding/_C.cpython-312-x86_64-linux-gnu.so"


def check_arctic_wheel(path: Path) -> Path:
    """The wheel vLLM's `suffix` method needs on the host (tools/gpu_host/build_arctic_cp312.py), refused unless it is
    arctic-inference for CPython 3.12 with the compiled suffix tree and no vLLM plugin: the host installs every
    carried wheel, and the full package's `vllm.general_plugins` entry point would patch every server's vLLM."""
    if not path.is_file():
        raise SystemExit(f"--arctic-wheel {path}: no such file (build it: tools/gpu_host/build_arctic_cp312.py)")
    if not re.fullmatch(r"arctic_inference-[\w.]+-cp312-cp312-(linux|manylinux\w*)_x86_64\.whl", path.name):
        raise SystemExit(f"--arctic-wheel {path.name}: not an arctic-inference wheel for cp312 on x86_64 linux")
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        plugins = [n for n in names if n.endswith(".dist-info/entry_points.txt")
                   and "vllm.general_plugins" in z.read(n).decode()]
    if ARCTIC_EXTENSION not in names:
        raise SystemExit(f"--arctic-wheel {path.name}: no {ARCTIC_EXTENSION} (the suffix tree vLLM imports)")
    if plugins:
        raise SystemExit(f"--arctic-wheel {path.name}: registers a vllm.general_plugins entry point ({plugins[0]}), "
                         f"which patches vLLM in every server; carry the suffix tree alone (build_arctic_cp312.py)")
    return path


def prepare(args: argparse.Namespace) -> None:
    from tools.gpu_host.pack_parts import pack
    from hqlab import models

    wheels, full = DIST / "wheels", DIST / "full"
    wheels.mkdir(parents=True, exist_ok=True)
    full.mkdir(parents=True, exist_ok=True)
    have = sorted(wheels.glob("*.whl"))
    if args.reuse and len(have) == len(GPU_WHEELS) + 1 and any(w.name.startswith("vllm-") for w in have):
        log(f"reusing the {len(have)} wheels already under {wheels.relative_to(ROOT)}")
    else:
        log("downloading wheels for python 3.12 / manylinux x86_64")
        pip_download([VLLM], full)
        pip_download(GPU_WHEELS, wheels)
        src = next(full.glob("vllm-0.26.0-*.whl"))
        dropped, size = trim_wheel(src, wheels / src.name)
        log(f"vllm wheel {src.stat().st_size / 2**20:.1f} MiB -> {size / 2**20:.1f} MiB "
            f"({dropped / 2**20:.0f} MiB of unused kernels dropped, LZMA)")
    files = sorted(wheels.glob("*.whl"))
    if args.arctic_wheel:
        files.append(check_arctic_wheel(Path(args.arctic_wheel)))
    for name in args.model or MODELS:
        files.append(models.ensure_gguf(models.offline_entry(name), models.cache_root()))
    for f in files:
        log(f"  {f.stat().st_size / 2**20:8.2f} MiB  {f.name}")
    part_mib = args.part_mib if args.part_mib else auto_part_mib()
    manifest = pack(files, PARTS, int(part_mib * 2**20))
    total = manifest["total_bytes"]
    log(f"{len(files)} files, {total / 2**20:.1f} MiB in {len(manifest['parts'])} parts under {PARTS}")
    print_campaign(manifest)


TRANSFER_MIB = 64.0  # what one call to the GPU host carries: the working tree plus the named files
TRANSFER_MARGIN_MIB = 4.0  # room for the results and notes a session adds before its last transfer


def tree_mib() -> float:
    """Size of what a call carries besides the named files: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         check=True, capture_output=True).stdout.split(b"\0")
    return sum((ROOT / f.decode()).stat().st_size for f in out if f and (ROOT / f.decode()).is_file()) / 2**20


def auto_part_mib() -> float:
    """The largest part that still travels beside this working tree (and its manifest)."""
    fit = TRANSFER_MIB - tree_mib() - TRANSFER_MARGIN_MIB
    if fit < 8:
        raise SystemExit(f"the working tree takes {tree_mib():.1f} MiB of the {TRANSFER_MIB:.0f} MiB a transfer "
                         f"carries: too little room for parts; shrink it or pass --part-mib")
    return float(int(fit))


def print_campaign(manifest: dict) -> None:
    """The GPU-host commands, in order, each with the files it needs from here (one part at a time)."""
    rel = PARTS.relative_to(ROOT)
    print("\n# On the GPU host, in order (each line: the command, and the files from here it needs):")
    for p in manifest["parts"]:
        print(json.dumps({"command": f"python3 tools/gpu_host/vllm_host.py stash {rel}/{p['name']}",
                          "files": [f"{rel}/manifest.json", f"{rel}/{p['name']}"]}))
    print(json.dumps({"command": "python3 tools/gpu_host/vllm_host.py run -- python3 benchmarks/vllm_gpu.py bench "
                                 "--tag a", "files": []}))


# ----------------------------------------------------------------------------------------------------------------
# stash and run (GPU)


def stash(args: argparse.Namespace) -> None:
    from tools.gpu_host.pack_parts import stash as stash_parts

    stash_parts(PARTS / "manifest.json", [Path(p) for p in args.parts], GPU_PARTS)


def gpu_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(GPU_SITE), str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                                      else []))
    env["HQLAB_CACHE"] = str(GPU_CACHE)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("VLLM_DO_NOT_TRACK", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def setup_gpu() -> None:
    """Reassemble, verify and install once per warm machine (a second run skips what is done)."""
    from hqlab import models
    from tools.gpu_host.pack_parts import complete_files, read_manifest, unpack

    # A call may carry only some models' parts (the 0.5B alone stages in a third of the time): unpack the files whose
    # parts have all arrived, the wheels once, a model once; a later run picks up a model whose parts came since.
    done = GPU_SITE / ".hqlab-installed"
    manifest = read_manifest(GPU_PARTS / "manifest.json")
    names = [e["name"] for e in manifest["files"]]
    ready = complete_files(GPU_PARTS)
    wheels_ready = all(n in ready for n in names if n.endswith(".whl"))
    if not done.exists() and not wheels_ready:
        raise SystemExit(f"the wheels' parts have not all arrived in {GPU_PARTS}: stash them first")
    if waiting := [n for n in names if n not in ready]:
        log(f"not unpacked (parts missing): {', '.join(waiting)}")
    wanted = {n for n in ready if n.endswith(".gguf") and not (GPU_CACHE / "gguf" / n).exists()}
    if not done.exists():
        wanted |= {n for n in names if n.endswith(".whl")}
    if wanted:  # one pass: a part shared by two files is checked once
        log(f"unpacking {', '.join(sorted(wanted))}")
        unpack(GPU_PARTS, GPU_FILES, only=wanted)
    if not done.exists():
        wheels = sorted(str(p) for p in GPU_FILES.glob("*.whl"))
        log(f"installing {len(wheels)} wheels into {GPU_SITE}")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(GPU_SITE), *wheels], check=True)
        done.touch()
    else:
        log(f"{GPU_SITE} already installed")
    (GPU_CACHE / "gguf").mkdir(parents=True, exist_ok=True)
    for gguf in GPU_FILES.glob("*.gguf"):
        shutil.move(str(gguf), GPU_CACHE / "gguf" / gguf.name)
    install_checkout(GPU_SITE)


def install_checkout(site: Path) -> None:
    """What `pip install -e .` gives, without pip or network: the hqlab_kernels name for kernels/ and the
    distribution metadata that carries hqlab's vLLM plugin entry point (vLLM finds plugins through it)."""
    link = site / "hqlab_kernels"
    if not link.exists():
        link.symlink_to(ROOT / "kernels", target_is_directory=True)
    info = site / "hqlab-0.0.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hqlab\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(entry_points_text())


def entry_points_text() -> str:
    """pyproject.toml's entry points, in the format of a distribution's entry_points.txt."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = []
    for group, entries in project.get("entry-points", {}).items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in entries.items()]
        lines.append("")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Install (once), then run the command in the environment that sees the installed wheels and models."""
    # The carried wheel set has no FlashInfer; vLLM's sampler imports it unless told not to (greedy runs never
    # sample, so nothing changes). Found on the first H200 run.
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise SystemExit("run: give the command after --")
    with open(out / args.log, "a") as f:
        def both(line: str) -> None:
            print(line, end="", flush=True)
            f.write(line)
            f.flush()

        both(f"== {' '.join(command)}  {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        if shutil.which("nvidia-smi"):
            both(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv"],
                                capture_output=True, text=True).stdout)
        setup_gpu()
        proc = subprocess.Popen(command, env=gpu_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            both(line)
        return proc.wait()


def park(root: Path = ROOT) -> list[str]:
    """Move PARKABLE out of the travelling tree into .parked/ (see the module docstring); the paths moved."""
    parked = root / PARKED.name
    if parked.exists() and any(parked.iterdir()):
        raise SystemExit(f"{parked.name}/ is not empty: unpark first")
    dirty = subprocess.run(["git", "status", "--porcelain", "--", *PARKABLE], cwd=root, check=True,
                           capture_output=True, text=True).stdout
    if dirty.strip():
        raise SystemExit(f"uncommitted changes under {', '.join(PARKABLE)}; commit them before parking:\n{dirty}")
    moved = []
    for rel in PARKABLE:
        if (root / rel).exists():
            (parked / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(root / rel), str(parked / rel))
            moved.append(rel)
    return moved


def unpark(root: Path = ROOT) -> list[str]:
    """Move what `park` moved back into the tree; the paths restored."""
    parked = root / PARKED.name
    restored = []
    for rel in PARKABLE:
        if (parked / rel).exists():
            if (root / rel).exists():
                raise SystemExit(f"{rel} exists in the tree and in {parked.name}/: merge by hand")
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(parked / rel), str(root / rel))
            restored.append(rel)
    shutil.rmtree(parked, ignore_errors=True)
    return restored


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="CPU: download, trim and pack everything the GPU host needs")
    p.add_argument("--part-mib", type=float, default=0.0,
                   help="part size; 0 (default): the largest that fits beside this working tree in one transfer")
    p.add_argument("--reuse", action="store_true", help="pack the wheels already prepared instead of downloading")
    p.add_argument("--model", action="append", default=None, help=f"offline model to carry (default: {MODELS})")
    p.add_argument("--arctic-wheel", default=None,
                   help="the cp312 suffix-tree wheel of tools/gpu_host/build_arctic_cp312.py (vLLM's suffix method)")
    s = sub.add_parser("stash", help="GPU: keep one carried part")
    s.add_argument("parts", nargs="+")
    r = sub.add_parser("run", help="GPU: unpack and install once, then run COMMAND in that environment")
    r.add_argument("--log", default="gpu_host.log", help="log file under $OUT")
    r.add_argument("command", nargs=argparse.REMAINDER)
    q = sub.add_parser("parts", help="here: the parts a GPU call needs for the wheels and the named models, as "
                                      "stash commands")
    q.add_argument("--model", action="append", required=True, help="an offline model name (repeatable)")
    sub.add_parser("park", help="here: move the committed results and figures out of the travelling tree")
    sub.add_parser("unpark", help="here: move them back")
    args = ap.parse_args(argv)
    if args.cmd in ("park", "unpark"):
        moved = park() if args.cmd == "park" else unpark()
        log(f"{args.cmd}: {', '.join(moved) or 'nothing'}; the tree now carries {tree_mib():.1f} MiB")
        return 0
    if args.cmd == "parts":
        from tools.gpu_host.pack_parts import PartsError, parts_for_models, read_manifest

        try:
            names = parts_for_models(read_manifest(PARTS / "manifest.json"), args.model)
        except PartsError as e:
            raise SystemExit(str(e)) from None
        for name in names:
            print(f"python3 tools/gpu_host/vllm_host.py stash .parts/{name}")
        return 0
    if args.cmd == "prepare":
        prepare(args)
    elif args.cmd == "stash":
        stash(args)
    else:
        return run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
