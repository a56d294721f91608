"""Move large files to a machine that takes only small transfers: pack them into checksummed parts, reassemble there.

    python tools/gpu_host/pack_parts.py pack FILE... --out .parts [--part-mib 50]
    python tools/gpu_host/pack_parts.py stash --manifest .parts/manifest.json .parts/part-003.bin --to DIR
    python tools/gpu_host/pack_parts.py unpack --parts DIR --out OUT_DIR

`pack` concatenates the files (in the order given) into one byte stream, cuts it into parts of at most
`--part-mib` MiB (`part-000.bin`, ...) and writes `manifest.json`: every part's size and sha256, and every file's
name, offset in the stream, size and sha256. `stash` checks one part against the manifest as soon as it arrives and
moves it into DIR (a part that fails is never kept). `unpack` checks every part, cuts the files back out of the
stream and checks each file's size and sha256; a file is renamed into OUT_DIR only once it is verified, so OUT_DIR
never holds a half-written file. Parts and files are streamed, never held in memory whole.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Iterator

FORMAT = 1
MANIFEST = "manifest.json"
CHUNK = 8 << 20


class PartsError(RuntimeError):
    pass


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def part_name(i: int) -> str:
    return f"part-{i:03d}.bin"


def _stream(files: list[Path]) -> Iterator[bytes]:
    for path in files:
        with open(path, "rb") as f:
            while block := f.read(CHUNK):
                yield block


def pack(files: list[Path], out: Path, part_bytes: int) -> dict:
    """Write parts and manifest into `out` (emptied first of earlier parts); returns the manifest."""
    if part_bytes < 1 << 20:
        raise PartsError(f"parts must be at least 1 MiB (got {part_bytes} bytes)")
    names = [p.name for p in files]
    if len(set(names)) != len(names):
        raise PartsError(f"two files share a name: {sorted(n for n in names if names.count(n) > 1)}")
    for p in files:
        if not p.is_file():
            raise PartsError(f"{p}: not a file")
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("part-*.bin"), out / MANIFEST]:
        old.unlink(missing_ok=True)
    entries, offset = [], 0
    for p in files:
        size = p.stat().st_size
        entries.append({"name": p.name, "offset": offset, "size": size, "sha256": sha256_file(p)})
        offset += size
    parts, index, current, filled, digest = [], 0, None, 0, None

    def close() -> None:
        nonlocal current
        if current is not None:
            current.close()
            parts.append({"name": part_name(index), "size": filled, "sha256": digest.hexdigest()})
            current = None

    for block in _stream(files):
        view = memoryview(block)
        while len(view):
            if current is None:
                current, filled, digest = open(out / part_name(index), "wb"), 0, hashlib.sha256()
            take = min(len(view), part_bytes - filled)
            current.write(view[:take])
            digest.update(view[:take])
            filled += take
            view = view[take:]
            if filled == part_bytes:
                close()
                index += 1
    close()
    manifest = {"format": FORMAT, "part_bytes": part_bytes, "total_bytes": offset, "files": entries, "parts": parts}
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, out / MANIFEST)
    return manifest


def read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PartsError(f"{path}: cannot read the manifest ({e})") from None
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("parts"), list):
        raise PartsError(f"{path}: not a parts manifest of format {FORMAT}")
    return manifest


def check_part(manifest: dict, path: Path) -> None:
    entry = next((p for p in manifest["parts"] if p["name"] == path.name), None)
    if entry is None:
        raise PartsError(f"{path.name} is not in the manifest")
    size = path.stat().st_size
    if size != entry["size"]:
        raise PartsError(f"{path}: {size} bytes, the manifest says {entry['size']}")
    if sha256_file(path) != entry["sha256"]:
        raise PartsError(f"{path}: sha256 differs from the manifest")


def stash(manifest_path: Path, parts: list[Path], dest: Path) -> None:
    """Verify parts as they arrive and move them (and the manifest) into `dest`."""
    manifest = read_manifest(manifest_path)
    dest.mkdir(parents=True, exist_ok=True)
    for part in parts:
        check_part(manifest, part)
        tmp = dest / (part.name + ".tmp")
        shutil.copyfile(part, tmp)
        os.replace(tmp, dest / part.name)
        print(f"stashed {part.name} ({part.stat().st_size / 2**20:.1f} MiB, sha256 ok)")
    shutil.copyfile(manifest_path, dest / MANIFEST)
    have = sorted(p.name for p in dest.glob("part-*.bin"))
    print(f"{len(have)}/{len(manifest['parts'])} parts in {dest}")


def parts_of(manifest: dict, entry: dict) -> list[str]:
    """The names of the parts that hold one file of the manifest."""
    size = manifest["part_bytes"]
    first, last = entry["offset"] // size, (entry["offset"] + max(entry["size"], 1) - 1) // size
    return [part_name(i) for i in range(first, last + 1)]


def parts_for_models(manifest: dict, models: list[str]) -> list[str]:
    """The parts a host needs for every wheel and the named models' GGUFs (a model's file name starts with its
    registry name and a dash, e.g. qwen2.5-coder-1.5b-instruct-q4_k_m.gguf), in order: a call that needs one model
    stages these and skips the other models' parts."""
    files = manifest["files"]
    wanted = [e for e in files if e["name"].endswith(".whl")]
    for model in models:
        found = [e for e in files if e["name"].endswith(".gguf") and e["name"].startswith(f"{model}-")]
        if not found:
            have = ", ".join(e["name"] for e in files if e["name"].endswith(".gguf")) or "none"
            raise PartsError(f"no GGUF of {model!r} in the manifest (it carries: {have})")
        wanted += found
    return sorted({name for e in wanted for name in parts_of(manifest, e)})


def complete_files(parts_dir: Path) -> set[str]:
    """The files of the manifest in `parts_dir` whose parts have all arrived (a host may get only some models)."""
    manifest = read_manifest(parts_dir / MANIFEST)
    return {e["name"] for e in manifest["files"] if all((parts_dir / n).is_file() for n in parts_of(manifest, e))}


def unpack(parts_dir: Path, out: Path, only: set[str] | None = None) -> list[Path]:
    """Check the parts, then cut out every file (or those named in `only`, needing only their parts), each verified
    before it is kept."""
    manifest = read_manifest(parts_dir / MANIFEST)
    if only is not None and (unknown := only - {e["name"] for e in manifest["files"]}):
        raise PartsError(f"not in the manifest: {', '.join(sorted(unknown))}")
    entries = [e for e in manifest["files"] if only is None or e["name"] in only]
    needed = sorted({n for e in entries for n in parts_of(manifest, e)})
    missing = [n for n in needed if not (parts_dir / n).is_file()]
    if missing:
        raise PartsError(f"{len(missing)} part(s) missing in {parts_dir}: {', '.join(missing)}")
    for name in needed:
        check_part(manifest, parts_dir / name)
    out.mkdir(parents=True, exist_ok=True)
    part_bytes = manifest["part_bytes"]
    written = []
    for entry in entries:
        final = out / entry["name"]
        tmp = out / (entry["name"] + ".tmp")
        digest, left, pos = hashlib.sha256(), entry["size"], entry["offset"]
        with open(tmp, "wb") as dst:
            while left:
                index, within = divmod(pos, part_bytes)
                with open(parts_dir / part_name(index), "rb") as src:
                    src.seek(within)
                    while left and (block := src.read(min(CHUNK, left))):
                        dst.write(block)
                        digest.update(block)
                        left -= len(block)
                        pos += len(block)
        if digest.hexdigest() != entry["sha256"]:
            tmp.unlink()
            raise PartsError(f"{entry['name']}: sha256 of the reassembled file differs from the manifest")
        os.replace(tmp, final)
        written.append(final)
        print(f"unpacked {entry['name']} ({entry['size'] / 2**20:.1f} MiB, sha256 ok)")
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="files -> parts + manifest")
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=Path(".parts"))
    p.add_argument("--part-mib", type=float, default=50.0)
    s = sub.add_parser("stash", help="verify arriving parts and keep them in a folder")
    s.add_argument("parts", nargs="+", type=Path)
    s.add_argument("--manifest", type=Path, required=True)
    s.add_argument("--to", type=Path, required=True)
    u = sub.add_parser("unpack", help="verify all parts and reassemble the files")
    u.add_argument("--parts", type=Path, required=True)
    u.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "pack":
            m = pack(args.files, args.out, int(args.part_mib * 2**20))
            for part in m["parts"]:
                print(f"{args.out / part['name']}  {part['size'] / 2**20:6.1f} MiB  {part['sha256'][:16]}")
            print(f"{len(m['files'])} files, {m['total_bytes'] / 2**20:.1f} MiB in {len(m['parts'])} parts; "
                  f"manifest {args.out / MANIFEST}")
        elif args.cmd == "stash":
            stash(args.manifest, args.parts, args.to)
        else:
            unpack(args.parts, args.out)
    except PartsError as e:
        print(f"pack_parts: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
