"""hqlab inside vLLM 0.26 on an offline H200 host: carry, install, convert, benchmark, and finish here.

The GPU host has python 3.12 with torch 2.11.0+cu130 (vLLM 0.26.0's pin) but no network; each transfer to it is
bounded (64 MiB with the repository). So:

  1. here (CPU):  python benchmarks/vllm_h200.py prepare
       downloads the wheels vLLM needs there and it lacks (docs/vllm.md lists them and why), trims vLLM's wheel
       to what an H200 running a dense model loads, takes the 0.5B's GGUF from the hqlab cache and packs all of it
       into checksummed parts of <= 50 MiB under .parts/ (benchmarks/pack_parts.py); prints the GPU commands.
  2. GPU, one call per part:  python3 benchmarks/vllm_h200.py stash
       verifies the carried part against the manifest and keeps it in the host's work folder (GPU_WORK).
  3. GPU, last call:  python3 benchmarks/vllm_h200.py run [--configs ...]
       reassembles and checks every file, installs the wheels into GPU_WORK/site, converts the GGUF (hqlab.models),
       then runs the labd suite for each config (one vLLM engine each) and writes $OUT/vllm_h200_<tag>.parquet
       (raw runs, after every config) and $OUT/vllm_h200_<tag>.log.
  4. here:  python benchmarks/vllm_h200.py finish RETURNED/vllm_h200_*.parquet
       builds data/results/core_vllm-h200.parquet (+ .steps.parquet) with the columns `hqlab bench` writes; the
       core benchmark notebook plots it with the tag "vllm-h200".
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a checkout that is not installed (the GPU host)

PARTS = ROOT / ".parts"
DIST = ROOT / ".vllm-dist"
# Work folder on the GPU host: it must outlive one call (the parts arrive over several), so the system temp folder.
GPU_WORK = Path(os.environ.get("HQLAB_GPU_WORK") or Path(tempfile.gettempdir()) / "hqlab-gpu")
GPU_PARTS = GPU_WORK / "parts"
GPU_FILES = GPU_WORK / "files"
GPU_SITE = GPU_WORK / "site"
GPU_CACHE = GPU_WORK / "cache"
MODEL = "qwen2.5-coder-0.5b"

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
]
PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_27_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64", "manylinux1_x86_64"]
# Parts of vLLM's wheel that an H200 (sm_90) running a dense bf16 model never loads; vLLM imports each of them
# inside try/except or only for other GPUs/models: FlashAttention 2 (Hopper uses FA3), the MoE kernels, the Rust
# frontend binary, DeepGEMM (fp8), FlashMLA and the SM100-only attention.
TRIM = [r"^vllm/vllm_flash_attn/_vllm_fa2_C\.abi3\.so$", r"^vllm/_moe_C_stable_libtorch\.abi3\.so$",
        r"^vllm/vllm-rs$", r"^vllm/third_party/deep_gemm/", r"^vllm/third_party/fmha_sm100/",
        r"^vllm/_flashmla_C\.abi3\.so$", r"^vllm/_flashmla_extension_C\.abi3\.so$"]

# The benchmark: HyperQwen's labd suite as in the core benchmark (doc 2000 tokens, 512 new tokens).
CONFIGS = ["lookup:nmin=6,nmax=12,k=15", "lookup:nmin=6,nmax=12,k=7", "vllm-ngram:nmin=2,nmax=5,k=7",
           "vllm-ngram:nmin=2,nmax=5,k=15"]


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


def prepare(args: argparse.Namespace) -> None:
    from benchmarks.pack_parts import pack
    from hqlab import models

    wheels, full = DIST / "wheels", DIST / "full"
    wheels.mkdir(parents=True, exist_ok=True)
    full.mkdir(parents=True, exist_ok=True)
    log("downloading wheels for python 3.12 / manylinux x86_64")
    pip_download([VLLM], full)
    pip_download(GPU_WHEELS, wheels)
    src = next(full.glob("vllm-0.26.0-*.whl"))
    dropped, size = trim_wheel(src, wheels / src.name)
    log(f"vllm wheel {src.stat().st_size / 2**20:.1f} MiB -> {size / 2**20:.1f} MiB "
        f"({dropped / 2**20:.0f} MiB of unused kernels dropped, LZMA)")
    files = sorted(wheels.glob("*.whl"))
    if args.arctic_wheel:
        files.append(Path(args.arctic_wheel))
    entry = models.offline_entry(MODEL)
    gguf = models.ensure_gguf(entry, models.cache_root())
    files.append(gguf)
    for f in files:
        log(f"  {f.stat().st_size / 2**20:8.2f} MiB  {f.name}")
    manifest = pack(files, PARTS, int(args.part_mib * 2**20))
    total = manifest["total_bytes"]
    log(f"{len(files)} files, {total / 2**20:.1f} MiB in {len(manifest['parts'])} parts under {PARTS}")
    print_campaign(manifest)


def print_campaign(manifest: dict) -> None:
    """The GPU-host commands, in order, each with the files it needs from here (one part at a time)."""
    rel = PARTS.relative_to(ROOT)
    print("\n# On the GPU host, in order (each line: the command, and the files from here it needs):")
    for p in manifest["parts"]:
        print(json.dumps({"command": f"python3 benchmarks/vllm_h200.py stash {rel}/{p['name']}",
                          "files": [f"{rel}/manifest.json", f"{rel}/{p['name']}"]}))
    print(json.dumps({"command": "python3 benchmarks/vllm_h200.py run --tag a", "files": []}))


# ----------------------------------------------------------------------------------------------------------------
# stash and run (GPU)


def stash(args: argparse.Namespace) -> None:
    from benchmarks.pack_parts import stash as stash_parts

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
    from benchmarks.pack_parts import read_manifest, unpack
    from hqlab import models

    done = GPU_SITE / ".hqlab-installed"
    if not done.exists():
        manifest = read_manifest(GPU_PARTS / "manifest.json")
        log(f"unpacking {len(manifest['parts'])} parts")
        unpack(GPU_PARTS, GPU_FILES)
        wheels = sorted(str(p) for p in GPU_FILES.glob("*.whl"))
        log(f"installing {len(wheels)} wheels into {GPU_SITE}")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(GPU_SITE), *wheels], check=True)
        entry = models.offline_entry(MODEL)
        (GPU_CACHE / "gguf").mkdir(parents=True, exist_ok=True)
        shutil.move(str(GPU_FILES / entry.file), GPU_CACHE / "gguf" / entry.file)
        done.touch()
    else:
        log(f"{GPU_SITE} already installed")


def run(args: argparse.Namespace) -> int:
    # The carried wheel set has no FlashInfer; vLLM's sampler imports it unless told not to (greedy runs never
    # sample, so nothing changes). Found on the first H200 run.
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    logfile = out / f"vllm_h200_{args.tag}.log"
    with open(logfile, "a") as f:
        def both(line: str) -> None:
            print(line, end="", flush=True)
            f.write(line)
            f.flush()

        both(f"== vllm_h200 run {args.tag} {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        if shutil.which("nvidia-smi"):
            both(subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout)
        setup_gpu()
        cmd = [sys.executable, "-u", str(Path(__file__).resolve()), "bench", "--tag", args.tag,
               "--repeats", str(args.repeats), "--max-new-tokens", str(args.max_new_tokens),
               "--doc-tokens", str(args.doc_tokens), "--out", str(out)]
        for c in args.configs:
            cmd += ["--config", c]
        if args.skip_reference:
            cmd.append("--skip-reference")
        proc = subprocess.Popen(cmd, env=gpu_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            both(line)
        return proc.wait()


def bench(args: argparse.Namespace) -> int:
    """In the child that sees the installed wheels: convert the model, run the configs, save after each config."""
    import vllm  # noqa: F401  (first: a wheel missing from the carried set fails here, before the conversion)

    from hqlab import models
    from hqlab.config import DecodeConfig
    from hqlab.engines import vllm as hv
    from hqlab.workloads import load_workload

    machine = hv.machine_description()  # before any CUDA call: vLLM forks its engine processes then
    log(machine)
    t = time.time()
    folder = models.prepare(MODEL)
    log(f"model ready in {time.time() - t:.0f} s: {folder}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = load_workload("labd", doc_tokens=args.doc_tokens, tokenizer=tokenizer)
    encoded = hv.encode_prompts(tokenizer, prompts)
    log("prompt tokens: " + ", ".join(f"{pid} {len(ids)}" for pid, _, ids in encoded))
    options = hv.VLLMOptions(model=folder)
    decode = DecodeConfig(max_new_tokens=args.max_new_tokens)
    raw_path = Path(args.out) / f"vllm_h200_{args.tag}.parquet"
    meta_path = Path(args.out) / f"vllm_h200_{args.tag}.json"
    described: list[dict] = []

    def save(runs: list, description: dict) -> None:
        import pyarrow.parquet as pq

        described.append(description)
        pq.write_table(hv.raw_table(runs), str(raw_path) + ".tmp")
        os.replace(str(raw_path) + ".tmp", raw_path)
        meta = {"machine": machine,
                "model": MODEL, "dtype": options.dtype, "doc_tokens": args.doc_tokens, "suite": "labd",
                "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "engines": described}
        meta_path.write_text(json.dumps(meta, indent=1) + "\n")
        log(f"saved {len(runs)} runs after {description['config']} ({description})")

    settings = hv.settings_for(args.config)  # every spec checked before the first engine starts
    if args.skip_reference:  # a later call adding configs: the reference ran in an earlier one
        settings = [s for s in settings if s.label != "none"]
    hv.check_prompts(options, encoded, decode)
    log("configs: " + ", ".join(s.label for s in settings))
    failed = 0
    runs: list = []
    for setting in settings:
        t = time.time()
        try:
            more, description = hv.run_setting(options, setting, encoded, decode, repeats=args.repeats)
            runs += more
            save(runs, description)
            log(f"{setting.label}: {time.time() - t:.0f} s")
        except Exception as e:  # one config failing must not lose the others
            import traceback

            failed += 1
            log(f"{setting.label} FAILED after {time.time() - t:.0f} s: {type(e).__name__}: {e}")
            traceback.print_exc()
    return 1 if failed else 0


# ----------------------------------------------------------------------------------------------------------------
# finish (CPU)


def finish(args: argparse.Namespace) -> None:
    import polars as pl

    from hqlab import bench as hb
    from hqlab.config import DecodeConfig
    from hqlab.engines import vllm as hv
    from hqlab.io import write_atomic

    runs, metas = [], []
    for path in args.raw:
        runs += hv.runs_from_raw(pl.read_parquet(path))
        metas.append(json.loads(Path(path).with_suffix(".json").read_text()))
    meta = {k: metas[0][k] for k in ("machine", "model", "dtype", "doc_tokens", "suite")}
    decode = DecodeConfig(max_new_tokens=metas[0]["max_new_tokens"])
    engines = [e for m in metas for e in m["engines"]]
    results, steps = hv.frames_from_raw(runs, decode, meta, engines)
    out = Path(args.out)
    write_atomic(out.with_name(out.stem + ".steps.parquet"), lambda t: steps.write_parquet(t))
    write_atomic(out, lambda t: results.write_parquet(t))
    with pl.Config(tbl_rows=100, tbl_cols=20, tbl_width_chars=220):
        print(hb.summarize(results))
    print(f"wrote {out} and {out.stem}.steps.parquet; figures: the core benchmark notebook with tag "
          f"{out.stem.removeprefix('core_')!r}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="CPU: download, trim and pack everything the GPU host needs")
    p.add_argument("--part-mib", type=float, default=50.0)
    p.add_argument("--arctic-wheel", default=None, help="an arctic-inference wheel built for cp312 (suffix)")
    s = sub.add_parser("stash", help="GPU: keep one carried part")
    s.add_argument("parts", nargs="+")
    for name, helptext in (("run", "GPU: unpack, install, convert, benchmark into $OUT"),
                           ("bench", "internal: the benchmark, in a child that sees the installed wheels")):
        r = sub.add_parser(name, help=helptext)
        r.add_argument("--tag", default="a")
        r.add_argument("--config", dest="configs" if name == "run" else "config", action="append", default=None)
        r.add_argument("--repeats", type=int, default=3)
        r.add_argument("--max-new-tokens", type=int, default=512)
        r.add_argument("--doc-tokens", type=int, default=2000)
        r.add_argument("--skip-reference", action="store_true",
                       help="leave out `none` (it ran in an earlier call with another --tag; finish merges them)")
        if name == "bench":
            r.add_argument("--out", required=True)
    f = sub.add_parser("finish", help="CPU: raw runs -> data/results/core_vllm-h200.parquet")
    f.add_argument("raw", nargs="+")
    f.add_argument("--out", default=str(ROOT / "data" / "results" / "core_vllm-h200.parquet"))
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        prepare(args)
    elif args.cmd == "stash":
        stash(args)
    elif args.cmd == "run":
        args.configs = args.configs or list(CONFIGS)
        return run(args)
    elif args.cmd == "bench":
        args.config = args.config or list(CONFIGS)
        return bench(args)
    else:
        finish(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
