"""`hqlab.bench.vllm.fused_replay_check`: a gpu-fused run's tokens/step against the lab's replay of the same fused
config over the same outputs. Here the "live" run is the lab's own fused proposer with the real 0.5B drafter run
step by step (not teacher-forced), so the check must find no difference; the same records under another config's
label (schedule=short, which never takes the long block) must show one."""

from __future__ import annotations

from pathlib import Path

import pytest

from hqlab.bench.vllm import fused_replay_check
from hqlab.config import resolve_spec
from hqlab.engines.vllm.engine import Run
from hqlab.proposers.fused import FusedProposer
from hqlab.replay import replay
from hqlab.trace import Generation

DOC = Path(__file__).resolve().parents[2] / "data" / "documents" / "handbook.md"


@pytest.mark.slow
def test_the_replay_check_finds_live_fused_runs_equal_and_a_mislabelled_one_not():
    from transformers import AutoTokenizer

    from hqlab import models
    from hqlab.replay.teacher import load_drafter

    tokenizer = AutoTokenizer.from_pretrained(models.prepare("qwen2.5-coder-0.5b"))
    text = DOC.read_text()
    passage = tokenizer(text[3000:3300]).input_ids
    prompt = tokenizer("Copy this:\n").input_ids + passage + tokenizer("\nCopy:\n").input_ids
    output = passage[:30] + tokenizer(text[7000:7150]).input_ids[:12]
    drafter = load_drafter("qwen2.5-coder-0.5b", device="cpu", dtype="float32")

    def live(spec: str) -> Generation:
        config = resolve_spec(spec, {"fused": FusedProposer})[1]
        records = replay(prompt, output, FusedProposer(config, drafter=drafter), max_new_tokens=len(output),
                         request="copy-1")
        return Generation("copy-1", len(prompt), list(output), "length", 0.0, 1.0, 1.0, records)

    adaptive = live("fused:k=7,draft_block=3,nmax=32,policy=earliest")
    skipping = live("fused:k=7,draft_block=3,nmax=32,policy=earliest,skip=1,skip_on=head")
    runs = [Run("gpu-fused:k=7,draft_block=3,nmax=32,policy=earliest", "copy-1", "copy", 0, adaptive),
            Run("gpu-fused:k=7,draft_block=3,nmax=32,policy=earliest,schedule=short", "copy-1", "copy", 0, adaptive),
            Run("none", "copy-1", "copy", 0, adaptive),
            Run("gpu-fused:k=7,draft_block=3,nmax=32,policy=earliest,skip=1,skip_on=head", "copy-1", "copy", 0,
                skipping)]
    table = fused_replay_check(runs, [("copy-1", "copy", prompt)], drafter, max_new_tokens=len(output),
                               progress=False)
    by_config = {row["config"]: row for row in table.iter_rows(named=True)}
    assert set(by_config) == {runs[0].config, runs[1].config, runs[3].config}  # `none` is not a fused config
    assert by_config[runs[3].config]["difference"] == 0  # skipping replayed with its skip setting
    assert by_config[runs[3].config]["drafter_share"] < 1 == by_config[runs[0].config]["drafter_share"]
    assert by_config[runs[0].config]["difference"] == 0  # the same rule over the same outputs
    assert by_config[runs[0].config]["tokens_per_step"] > 2  # fusion helped: more than a token and a half a step
    # the adaptive run's records under the label of schedule=short: the check tells them apart
    assert by_config[runs[1].config]["difference"] > 0
