"""The trace cache keeps outputs of different devices and dtypes apart, a second request for a trace set is served
from the cache without loading the model, and every cached trace carries its provenance."""

from __future__ import annotations

import json

import pytest

from hqlab import provenance
from hqlab.config import ConfigError, DecodeConfig
from hqlab.replay import traces


def test_trace_key_separates_devices_dtypes_and_settings():
    ids = [1, 2, 3, 4]
    decode = DecodeConfig(max_new_tokens=32)
    base = traces.TraceOrigin("qwen2.5-coder-0.5b", "ab" * 32, "bfloat16", "cpu (AMD EPYC 9654 96-Core Processor)")
    cuda = traces.TraceOrigin(base.model, base.sha256, "bfloat16", "cuda (NVIDIA H200)")
    fp32 = traces.TraceOrigin(base.model, base.sha256, "float32", base.device)
    other_gpu = traces.TraceOrigin(base.model, base.sha256, "bfloat16", "cuda (NVIDIA A100-SXM4-80GB)")
    keys = {o.key(ids, decode) for o in (base, cuda, fp32, other_gpu)}
    assert len(keys) == 4
    assert base.key(ids, decode) == traces.TraceOrigin(*vars(base).values()).key(ids, decode)
    assert base.key(ids, decode) != base.key(ids, DecodeConfig(max_new_tokens=33))
    assert base.key(ids, decode) != base.key([1, 2, 3, 5], decode)
    # resolved without loading anything: dtype and device as the engine would get them
    a = traces.TraceOrigin.resolve("qwen2.5-coder-0.5b", dtype="auto", device="cpu")
    b = traces.TraceOrigin.resolve("qwen2.5-coder-0.5b", dtype="float32", device="cpu")
    assert (a.dtype, b.dtype) == ("bfloat16", "float32") and a.device == b.device == provenance.device_name("cpu")
    assert a.key(ids, decode) != b.key(ids, decode)


@pytest.mark.slow
def test_second_request_hits_the_cache_and_another_dtype_misses(tmp_path, engine_05b, expected_commit,
                                                                installed):
    """Recorded once with the engine, then served from the cache to a caller that loads no model; the same
    prompts in another dtype are not served those outputs."""
    cache = tmp_path / "traces"
    dtype = engine_05b.info.dtype  # bf16, or fp32 on a CPU without bf16 arithmetic (the fixture says why)
    other = "float32" if dtype == "bfloat16" else "bfloat16"
    asked = "auto" if dtype == "bfloat16" else dtype  # "auto" names bf16: served the bf16 traces
    first = traces.cached_traces("qwen2.5-coder-0.5b", "chat", 6, dtype=dtype, device="cpu", limit=2,
                                engine=engine_05b, cache_dir=cache)
    assert first.recorded == 2 and len(list(cache.glob("*.json"))) == 2
    record = json.loads(next(cache.glob("*.json")).read_text())
    assert record["device"] == provenance.device_name("cpu") and record["dtype"] == dtype
    assert record["provenance"]["git_commit"] == expected_commit
    assert record["provenance"]["transformers"] == installed("transformers")

    again = traces.cached_traces("qwen2.5-coder-0.5b", "chat", 6, dtype=asked, device="cpu", limit=2,
                                cache_dir=cache)
    assert again.recorded == 0 and again.engine is None  # no model was loaded
    assert [t.output_ids for t in again.traces] == [t.output_ids for t in first.traces]
    assert all(t.provenance["device"] == provenance.device_name("cpu") for t in again.traces)
    # the engine-side entry point reads the same cache
    assert traces.record_traces(engine_05b, first.prompts, DecodeConfig(max_new_tokens=6), cache_dir=cache,
                               progress=False) == first.traces
    with pytest.raises(traces.TracesMissing, match=other):
        traces.cached_traces("qwen2.5-coder-0.5b", "chat", 6, dtype=other, device="cpu", limit=2,
                            cache_dir=cache, record=False)
    with pytest.raises(traces.TracesMissing, match="max_new_tokens=7"):
        traces.cached_traces("qwen2.5-coder-0.5b", "chat", 7, dtype=dtype, device="cpu", limit=2,
                            cache_dir=cache, record=False)
    # an engine that is not what was asked for is refused, not silently used
    with pytest.raises(ConfigError, match="not the requested"):
        traces.cached_traces("qwen2.5-coder-0.5b", "chat", 6, dtype=other, device="cpu", limit=2,
                            engine=engine_05b, cache_dir=cache)
    # saved with the trace set and read back
    saved = traces.load_traces(traces.save_traces(again.traces, tmp_path / "set.parquet"))
    assert saved == again.traces and saved[0].provenance == again.traces[0].provenance


def test_shipped_trace_set_stands_in_only_for_what_this_machine_would_record(tmp_path):
    """A shipped trace set serves a workload's missing traces without loading the model when model, checkpoint,
    dtype, prompt tokens, length, device and torch/transformers versions all match. The committed 0.5B set (its
    prompt tokens are the labd workload as encoded today: a stale file would fail here) is re-labelled as recorded
    on this machine, and on another one; the committed file itself says nothing of its machine and is never taken.
    """
    import polars as pl

    from hqlab.bench import results

    (committed,) = results.trace_files(["0.5b_all_128"])
    origin = traces.TraceOrigin.resolve("qwen2.5-coder-0.5b", device="cpu")
    sets = {}
    for name, device in (("here", origin.device), ("elsewhere", "cuda (NVIDIA H200)")):
        rows = traces.load_traces(committed)
        relabelled = [traces.Trace(t.prompt_id, t.category, t.prompt_ids, t.output_ids, t.max_new_tokens,
                                   {**provenance.provenance("cpu"), "device": device}) for t in rows]
        sets[name] = traces.save_traces(relabelled, tmp_path / f"{name}.parquet", model=traces.shipped_model(origin))
    cache = tmp_path / "cache"

    def ask(shipped, max_new_tokens=128, dtype="auto"):
        return traces.cached_traces("qwen2.5-coder-0.5b", "labd", max_new_tokens, device="cpu", dtype=dtype,
                                    doc_tokens=1500, record=False, cache_dir=cache, shipped=shipped, progress=False)

    found = ask([sets["elsewhere"], sets["here"]])
    assert (found.recorded, found.shipped, found.engine) == (0, 6, None)
    assert [t.prompt_id for t in found.traces] == ["copy", "code", "edit", "quote", "summary", "qa"]
    rows = {r["prompt_id"]: r for r in pl.read_parquet(committed).to_dicts()}
    assert all(t.output_ids == rows[t.prompt_id]["output_ids"] and t.prompt_ids == rows[t.prompt_id]["prompt_ids"]
               and t.provenance["device"] == origin.device for t in found.traces)
    assert not cache.exists()  # nothing written into the cache: shipped traces keep their own origin
    for shipped, kw in (([sets["elsewhere"]], {}), ([committed], {}), ([sets["here"]], {"max_new_tokens": 64}),
                        ([sets["here"]], {"dtype": "float32"})):
        with pytest.raises(traces.TracesMissing, match="copy, code, edit"):
            ask(shipped, **kw)
    with pytest.raises(ConfigError, match="does not exist"):
        ask([tmp_path / "nope.parquet"])


def test_trace_sets_the_notebooks_name_can_be_taken_somewhere():
    """Every trace set a notebook's `shipped_traces` names by default is committed (a run of the study `traces`) and
    says, on every row, what it is
    (model, checkpoint and dtype) and where it was recorded (device, torch, transformers): a set without that is
    never taken, and the notebook would silently record instead. Each set also covers its notebook's workload."""
    import jupytext
    import polars as pl

    from hqlab.bench import results
    from hqlab.site.notebooks import declared_defaults, notebook_paths

    named = {}
    for path in notebook_paths():
        defaults = declared_defaults(jupytext.read(path))
        for name in defaults.get("shipped_traces") or []:
            named.setdefault(name, []).append((path.stem, defaults))
    assert "0.5b_all_128_bf16" in named and len(named) >= 2
    for file, users in named.items():
        frame = pl.read_parquet(results.trace_files([file])[0])
        for column in ("model", "provenance_device", "provenance_torch", "provenance_transformers"):
            assert frame[column].null_count() == 0 and (frame[column] != "").all(), (file, column)
        model, sha, dtype = frame["model"][0].split(":")
        assert frame["model"].n_unique() == 1 and len(sha) == 64 and dtype == "bfloat16", file
        for stem, defaults in users:
            assert defaults.get("model", defaults.get("target")) == model, (file, stem)
            assert (frame["max_new_tokens"] == defaults["max_new_tokens"]).all(), (file, stem)
            assert {"copy", "code", "edit", "quote", "summary", "qa"} <= set(frame["prompt_id"]), (file, stem)
            if defaults["suite"] == "all":
                assert "chat" in set(frame["category"]), (file, stem)
