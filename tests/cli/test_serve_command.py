"""`hqlab serve-command`: the `vllm serve` line a user copies (docs/serving.md), with the environment it needs, and a
bad spec's one-line error."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from hqlab.cli import main

FIX = "HQLAB_FULL_GRAPH_QUERY_FIX=1"  # hqlab's capture fix for FULL graphs (hqlab.engines.vllm.full_graph_fix)


def printed(capsys) -> tuple[list[str], list[str]]:
    """(the line's environment assignments, the command's argv)."""
    words = shlex.split(capsys.readouterr().out)
    n = next(i for i, w in enumerate(words) if "=" not in w)
    return words[:n], words[n:]


def test_the_printed_command_carries_the_configs(capsys):
    spec = "gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest,batch_k=1:15/4:7/0"
    assert main(["serve-command", "Qwen/Qwen2.5-Coder-1.5B-Instruct", spec, "--max-num-seqs", "16"]) == 0
    env, argv = printed(capsys)
    assert env == [FIX] and argv[:3] == ["vllm", "serve", "Qwen/Qwen2.5-Coder-1.5B-Instruct"]
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert flags["--max-num-seqs"] == "16"
    speculative = json.loads(flags["--speculative-config"])
    assert speculative["num_speculative_tokens"] == 15
    assert speculative["num_speculative_tokens_per_batch_size"] == [[1, 1, 15], [2, 4, 7], [5, 65536, 0]]
    assert json.loads(flags["--additional-config"]) == {"hqlab_proposer": spec}
    # room for an admitted prompt beside the batch: graphs up to 1,024 tokens, more where 16 x (k + 1) is larger;
    # every step replayed whole, admitting ones included (FULL, with the fix the environment asks for)
    assert json.loads(flags["--compilation-config"]) == {"max_cudagraph_capture_size": 1024, "cudagraph_mode": "FULL"}


def test_none_and_a_bad_schedule(capsys):
    assert main(["serve-command", "m", "none"]) == 0
    assert capsys.readouterr().out.strip() == "vllm serve m --max-num-seqs 32 --port 8000"
    assert main(["serve-command", "m", "gpu-lookup:k=7,batch_k=9:16/0"]) == 2
    err = capsys.readouterr().err
    assert "width 16 must be in [0, k=7]" in err and err.count("\n") == 1


def test_none_with_the_speculative_configs_capture_size(capsys):
    """`none:capture=N`: a plain server with the speculative configs' CUDA graphs up to N tokens (FULL, with the
    fix), the control that isolates speculation from the graphs speculative configs get; anything else after `none:`
    is refused with a one-line error."""
    assert main(["serve-command", "m", "none:capture=1024"]) == 0
    env, argv = printed(capsys)
    assert env == [FIX]
    assert argv[argv.index("--compilation-config") + 1] == '{"max_cudagraph_capture_size":1024,"cudagraph_mode":"FULL"}'
    assert "--speculative-config" not in argv
    for bad, says in (("none:capture=0", ">= 1 token"), ("none:capture=big", "whole number"),
                      ("none:k=3", "one key, capture=N")):
        assert main(["serve-command", "m", bad]) == 2
        assert says in capsys.readouterr().err


def test_the_fused_goodput_line_of_the_goodput_page(capsys, monkeypatch):
    """docs/goodput.md's gpu-fused line: the spec with its costs file (a path from the repository root, where the
    server starts) passes to vLLM whole, with plain-step graphs at every batch size beside batch_k's widths, in vLLM's
    default graph mode: FULL was checked on a GPU for `none` and gpu-lookup only, and gpu-fused's drafter captures
    graphs of its own."""
    repo = Path(__file__).resolve().parents[2]
    page = (repo / "docs" / "goodput.md").read_text()
    spec = re.search(r'"(gpu-fused:[^"]*goodput=[^"]*)"', page).group(1)
    monkeypatch.chdir(repo)
    assert main(["serve-command", "Qwen/Qwen2.5-Coder-1.5B-Instruct", spec]) == 0
    env, argv = printed(capsys)
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert env == [] and "cudagraph_mode" not in json.loads(flags["--compilation-config"])
    speculative = json.loads(flags["--speculative-config"])
    assert speculative["model"] == "hqlab.engines.vllm.gpu_fused.GpuFusedSpeculator"
    assert speculative["num_speculative_tokens_per_batch_size"] == [[1, 1, 15], [2, 4, 7], [5, 65536, 0]]
    assert json.loads(flags["--additional-config"]) == {"hqlab_proposer": spec}
    assert main(["serve-command", "m", spec.replace("fused_served_x3.05", "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_vllms_own_draft_model_names_the_drafters_local_folder(capsys):
    """`vllm-draft:model=..,k=..` prints vLLM's draft_model config with the drafter as the folder hqlab.models.prepare
    made (what the server loads), no additional config, and vLLM's own CUDA-graph mode (no run has checked its drafter's
    graphs under FULL); a key vLLM's method has no counterpart for is one line."""
    from hqlab import models

    assert main(["serve-command", "m", "vllm-draft:model=qwen2.5-coder-0.5b,k=7"]) == 0
    env, argv = printed(capsys)
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert env == [] and json.loads(flags["--compilation-config"]) == {"max_cudagraph_capture_size": 1024}
    assert json.loads(flags["--speculative-config"]) == {"method": "draft_model", "num_speculative_tokens": 7,
                                                         "model": models.prepare("qwen2.5-coder-0.5b")}
    assert "--additional-config" not in flags
    assert main(["serve-command", "m", "vllm-draft:model=qwen2.5-coder-0.5b,k=7,vocab=v.json"]) == 2
    err = capsys.readouterr().err
    assert "takes only model and k (got vocab)" in err and err.count("\n") == 1

