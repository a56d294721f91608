"""tools/gpu_host: files split over checksummed parts come back byte-identical, and a damaged part is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _pack_parts():
    """tools/gpu_host/pack_parts.py, loaded from its file (tools/ is not a package of the library)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pack_parts", ROOT / "tools" / "gpu_host" / "pack_parts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _random_files(folder: Path, sizes: dict[str, int], seed: int) -> list[Path]:
    rng = np.random.default_rng(seed)
    files = []
    for name, size in sizes.items():
        files.append(folder / name)
        files[-1].write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    return files


def test_parts_round_trip_and_refuse_damage(tmp_path):
    """tools/gpu_host/pack_parts.py: files split over parts come back byte-identical; a damaged part is refused."""
    pack_parts = _pack_parts()
    files = _random_files(tmp_path, {"a.whl": 1_500_000, "b.whl": 10, "model.gguf": 2_700_000}, seed=1)
    manifest = pack_parts.pack(files, tmp_path / "parts", 1 << 20)
    assert [p["size"] for p in manifest["parts"]] == [1 << 20] * 4 + [4_200_010 - 4 * (1 << 20)]
    arrived = tmp_path / "arrived"
    pack_parts.stash(tmp_path / "parts" / "manifest.json", sorted((tmp_path / "parts").glob("part-*.bin")), arrived)
    out = pack_parts.unpack(arrived, tmp_path / "out")
    assert [p.read_bytes() for p in out] == [f.read_bytes() for f in files]
    damaged = bytearray((arrived / "part-002.bin").read_bytes())
    damaged[7] ^= 1
    (arrived / "part-002.bin").write_bytes(bytes(damaged))
    with pytest.raises(pack_parts.PartsError, match="part-002.bin: sha256"):
        pack_parts.unpack(arrived, tmp_path / "again")
    assert not (tmp_path / "again").exists() or not any((tmp_path / "again").iterdir())
    with pytest.raises(pack_parts.PartsError, match="sha256"):
        pack_parts.stash(arrived / "manifest.json", [arrived / "part-002.bin"], tmp_path / "elsewhere")


def test_a_host_given_some_parts_unpacks_the_files_they_complete(tmp_path):
    """Staging only the wheels and the small model (a GPU call that needs no other) unpacks those files; a file whose
    parts have not all arrived is named and refused, never half-written."""
    pack_parts = _pack_parts()
    files = _random_files(tmp_path, {"a.whl": 1_500_000, "small.gguf": 1_000_000, "large.gguf": 2_700_000}, seed=2)
    manifest = pack_parts.pack(files, tmp_path / "parts", 1 << 20)
    parts = sorted((tmp_path / "parts").glob("part-*.bin"))
    assert len(parts) == len(manifest["parts"]) == 5
    arrived = tmp_path / "arrived"
    pack_parts.stash(tmp_path / "parts" / "manifest.json", parts[:3], arrived)  # bytes [0, 3 MiB): a.whl, small.gguf
    assert pack_parts.complete_files(arrived) == {"a.whl", "small.gguf"}
    out = pack_parts.unpack(arrived, tmp_path / "out", only={"a.whl", "small.gguf"})
    assert [p.read_bytes() for p in out] == [f.read_bytes() for f in files[:2]]
    with pytest.raises(pack_parts.PartsError, match="part-003.bin, part-004.bin"):
        pack_parts.unpack(arrived, tmp_path / "out", only={"large.gguf"})
    with pytest.raises(pack_parts.PartsError, match="missing"):
        pack_parts.unpack(arrived, tmp_path / "all")
    with pytest.raises(pack_parts.PartsError, match="not in the manifest: typo.gguf"):
        pack_parts.unpack(arrived, tmp_path / "out", only={"typo.gguf"})
    assert not (tmp_path / "out" / "large.gguf").exists()
    pack_parts.stash(tmp_path / "parts" / "manifest.json", parts[3:], arrived)
    assert pack_parts.complete_files(arrived) == {f.name for f in files}
    assert pack_parts.unpack(arrived, tmp_path / "out", only={"large.gguf"})[0].read_bytes() == files[2].read_bytes()


def test_a_call_for_one_model_stages_only_the_wheels_and_that_model_s_parts(tmp_path):
    """`vllm_host.py parts --model NAME`: the parts of every wheel and of the named model's GGUF, and no other; staged
    alone they complete exactly those files. An unknown model is named with what the manifest carries."""
    pack_parts = _pack_parts()
    files = _random_files(tmp_path, {"x.whl": 1_500_000, "m-small-q4.gguf": 3_000_000,
                                     "m-large-q4.gguf": 2_700_000}, seed=3)
    manifest = pack_parts.pack(files, tmp_path / "parts", 1 << 20)
    need = pack_parts.parts_for_models(manifest, ["m-large"])
    # bytes: the wheel [0, 1.43 MiB), the small model [1.43, 4.29), the large [4.29, 6.86)
    assert need == ["part-000.bin", "part-001.bin", "part-004.bin", "part-005.bin", "part-006.bin"]
    assert pack_parts.parts_for_models(manifest, ["m-small"]) == [f"part-00{i}.bin" for i in range(5)]
    arrived = tmp_path / "arrived"
    pack_parts.stash(tmp_path / "parts" / "manifest.json", [tmp_path / "parts" / n for n in need], arrived)
    assert pack_parts.complete_files(arrived) == {"x.whl", "m-large-q4.gguf"}
    with pytest.raises(pack_parts.PartsError, match="no GGUF of 'm-s' in the manifest .*m-small-q4.gguf"):
        pack_parts.parts_for_models(manifest, ["m-s"])  # a name is matched up to a dash, never as a bare prefix


def test_parts_are_sized_to_travel_beside_this_working_tree():
    """A call to the GPU host carries the working tree plus one part: the automatic part size must fit, and the tree
    must leave room for parts worth the calls (it grows with every committed result)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("vllm_host", ROOT / "tools" / "gpu_host" / "vllm_host.py")
    vllm_host = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vllm_host)

    tree = vllm_host.tree_mib()
    part = vllm_host.auto_part_mib()
    assert 8 <= part and tree + part + 1 <= vllm_host.TRANSFER_MIB  # + the manifest, well under 1 MiB


def _vllm_host():
    import importlib.util

    spec = importlib.util.spec_from_file_location("vllm_host", ROOT / "tools" / "gpu_host" / "vllm_host.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_park_moves_committed_results_out_of_the_tree_and_back(tmp_path):
    """`park` takes the committed results and figures out of what travels (git sees them deleted), refuses while
    they hold uncommitted work, and `unpark` restores them byte for byte."""
    import subprocess

    host = _vllm_host()
    git = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    (tmp_path / "data" / "results").mkdir(parents=True)
    (tmp_path / "figures").mkdir()
    (tmp_path / "data" / "results" / "r.parquet").write_bytes(b"rows" * 100)
    (tmp_path / "figures" / "f.svg").write_text("<svg/>")
    (tmp_path / ".gitignore").write_text("/.parked/\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    (tmp_path / "figures" / "f.svg").write_text("<svg>changed</svg>")
    with pytest.raises(SystemExit, match="uncommitted changes"):
        host.park(tmp_path)
    assert (tmp_path / "figures" / "f.svg").exists()  # nothing moved
    git("checkout", "--", "figures")
    assert host.park(tmp_path) == ["data/results", "figures"]
    assert not (tmp_path / "data" / "results").exists() and not (tmp_path / "figures").exists()
    with pytest.raises(SystemExit, match="unpark first"):
        host.park(tmp_path)
    assert host.unpark(tmp_path) == ["data/results", "figures"]
    assert (tmp_path / "data" / "results" / "r.parquet").read_bytes() == b"rows" * 100
    assert subprocess.run(["git", "status", "--porcelain"], cwd=tmp_path, capture_output=True,
                          text=True).stdout == ""
    assert not (tmp_path / ".parked").exists()


def _wheel(path: Path, files: dict[str, str]) -> Path:
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def test_the_arctic_wheel_is_checked_and_travels_with_every_call_s_wheels(tmp_path):
    """`prepare --arctic-wheel`: the suffix tree's cp312 wheel is taken, and staged with the wheels for a call of any
    one model (the host installs every carried wheel, --no-deps); a wheel for another Python, one without the
    compiled tree and one registering Arctic's vLLM plugin are refused by name."""
    vllm_host, pack_parts = _vllm_host(), _pack_parts()
    ext = vllm_host.ARCTIC_EXTENSION
    good = _wheel(tmp_path / "arctic_inference-0.3.0-cp312-cp312-linux_x86_64.whl",
                  {ext: "so", "arctic_inference-0.3.0.dist-info/METADATA": "Name: arctic_inference\n"})
    assert vllm_host.check_arctic_wheel(good) == good
    with pytest.raises(SystemExit, match="not an arctic-inference wheel for cp312"):
        vllm_host.check_arctic_wheel(_wheel(tmp_path / "arctic_inference-0.3.0-cp311-cp311-linux_x86_64.whl",
                                            {ext: "so"}))
    (tmp_path / "bare").mkdir()
    with pytest.raises(SystemExit, match="no arctic_inference/suffix_decoding/_C"):
        vllm_host.check_arctic_wheel(_wheel(tmp_path / "bare" / good.name, {"arctic_inference/__init__.py": ""}))
    (tmp_path / "full").mkdir()
    with pytest.raises(SystemExit, match="vllm.general_plugins"):
        vllm_host.check_arctic_wheel(_wheel(tmp_path / "full" / good.name, {
            ext: "so", "arctic_inference-0.3.0.dist-info/entry_points.txt":
                "[vllm.general_plugins]\narctic_inference = arctic_inference.vllm.plugin:arctic_inference_plugin\n"}))
    with pytest.raises(SystemExit, match="no such file"):
        vllm_host.check_arctic_wheel(tmp_path / "missing.whl")
    files = _random_files(tmp_path, {"vllm-0.26.0-cp38-abi3-linux_x86_64.whl": 1_200_000,
                                     "m-large-q4.gguf": 2_000_000}, seed=4)
    manifest = pack_parts.pack([files[0], good, files[1]], tmp_path / "parts", 1 << 20)
    need = pack_parts.parts_for_models(manifest, ["m-large"])
    arrived = tmp_path / "arrived"
    pack_parts.stash(tmp_path / "parts" / "manifest.json", [tmp_path / "parts" / n for n in need], arrived)
    assert good.name in pack_parts.complete_files(arrived)
    out = pack_parts.unpack(arrived, tmp_path / "out", only={good.name})
    assert out[0].read_bytes() == good.read_bytes()
