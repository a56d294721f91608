"""The goodput controller on vLLM's own asynchronous scheduler, on the CPU: with the plugin installed, the widths
vLLM's scheduler fixes step after step, for one request and for several concurrent ones, are the replay's
(`hqlab.replay.goodput.replay_engine`), and a controller that reads the history vLLM has not processed yet fails.

The scheduler is vLLM 0.26's `AsyncScheduler` built from a real config of the 0.5B (model runner V2, asynchronous
scheduling, the plugin's patches), as in test_vllm_gate.py; so is the worker's part, played by the recorded greedy
outputs and the lookup's acceptance over them (the lookup drafts from the whole history before the step, as
`GpuLookupSpeculator` does on the GPU, so a width w accepts the first min(w, accepted at k) drafts). The engine
core's order is vLLM's batch queue (`EngineCore.step_with_batch_queue`): schedule step n + 1, then process step
n's output, through the scheduler's own `update_from_output` (which the plugin wraps to show the controller each
outcome).

`gpu-fused` takes the same knob and the same hook: its spec is served here too, the worker played by the same
acceptance (the controller decides from the histories and the outcomes the scheduler holds, whoever drafted), and
test_vllm_lifecycle.py runs the fused speculator itself under the widths the controller chooses."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed (make setup-vllm)")

from hqlab.config import ConfigError  # noqa: E402
from hqlab.engines.vllm import gpu_fused, gpu_lookup, plugin  # noqa: E402
from hqlab.engines.vllm.goodput import SchedulerGoodput  # noqa: E402
from hqlab.engines.vllm.goodput_record import RECORD_ENV  # noqa: E402
from hqlab.replay.goodput_served import record_frame, record_frames, replay_served, rerun_rule  # noqa: E402
from hqlab.engines.vllm.cpu_scheduler import cpu_async_scheduler, drive  # noqa: E402
from hqlab.replay.goodput import (Policy, TraceTables, captured_widths, dearer_widths, replay_engine,  # noqa: E402
                                  timed)
from hqlab.rules.online_costs import OnlineCosts, micros  # noqa: E402
from hqlab.replay.traces import load_traces  # noqa: E402
from hqlab.rules.goodput import DEFAULT_STEP_COSTS, GoodputConfig, StepCosts  # noqa: E402

RESULTS = Path(__file__).resolve().parents[3] / "data" / "results"
LOOKUP = "gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest,batch_k=1:15/4:7/0"
# the served fused config (docs/serving.md), whose lookup is the one above
FUSED = ("gpu-fused:k=15,draft_block=1,nmax=32,policy=earliest,compile=true,schedule=long,nmin_tail=1,"
         "compile_rule=true,device_skip=true,batch_k=1:15/4:7/0,prefill_graph=1024")


def configs_of(spec: str):
    """(the spec's settings, its lookup's): gpu-lookup's are one, gpu-fused holds a lookup."""
    if spec.startswith(gpu_fused.NAME):
        config = gpu_fused.fused_config(spec)
        return config, config.lookup_config()
    config = gpu_lookup.lookup_config(spec)
    return config, config


def scheduler_for(spec: str, max_len: int, max_num_seqs: int):
    # every waiting request fits the step that admits it: no chunked prefill
    return cpu_async_scheduler(spec, max_len=max_len, max_num_seqs=max_num_seqs,
                               batched_tokens=max_len * max_num_seqs, blocks=16384)


def serve(spec: str, traces, tables: TraceTables, concurrency: int, step_ms=None, log: dict | None = None, *,
          one_at_a_time: bool = False):
    """Serve `traces` (request i is trace i) through vLLM's scheduler with `concurrency` slots: per step the batch
    size and the width its verifying requests verified, and per request the width and tokens of each step whose
    output counted. With `step_ms(step index, batch, width, prompts admitted)`, the engine core's clock, as the hook
    reads it, moves on by that much as each step runs (the worker's time); `log` then gets, per step, the ms fed,
    how many steps had been processed when it was scheduled, and whether it admitted no prompt. `one_at_a_time`:
    each request arrives once the one before it is done (as a client that waits for each answer sends them), else
    all are queued at the start."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    longest = max(len(t.prompt_ids) + len(t.output_ids) for t in traces)
    scheduler = scheduler_for(spec, longest + 64, concurrency)
    now, fed, at_schedule, decode = [0], [], [], []
    if step_ms is not None:
        plugin._gate(scheduler).clock = lambda: now[0]  # the only stand-in: the host's clock
    requests = [Request(request_id=str(i), prompt_token_ids=list(t.prompt_ids), pooling_params=None,
                        sampling_params=SamplingParams(max_tokens=len(t.output_ids), temperature=0, ignore_eos=True))
                for i, t in enumerate(traces)]
    for request in [] if one_at_a_time else requests:
        scheduler.add_request(request)
    accept = [tables.acceptance(t) for t in traces]
    pos = [0] * len(traces)
    batch, width = [], []
    request_widths, request_emitted = [[] for _ in traces], [[] for _ in traces]

    def run(step) -> ModelRunnerOutput:  # the worker
        ids = list(step.num_scheduled_tokens)
        if step_ms is not None:
            widths = [len(v) for v in step.scheduled_spec_decode_tokens.values()]
            fed.append(step_ms(len(fed), len(ids), max(widths, default=0), len(step.scheduled_new_reqs)))
            now[0] += round(fed[-1] * 1e6)
        sampled = []
        for rid in ids:
            r = int(rid)
            out = traces[r].output_ids
            w = len(step.scheduled_spec_decode_tokens.get(rid, ()))
            if pos[r] >= len(out):  # scheduled before the scheduler saw the request finish: vLLM drops these
                sampled.append([out[-1]])
                continue
            n = 1 if pos[r] == 0 else min(int(accept[r][pos[r]]), w) + 1
            sampled.append(list(out[pos[r]:pos[r] + n]))
            request_widths[r].append(w)
            request_emitted[r].append(n)
            pos[r] += n
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)},
                                 sampled_token_ids=sampled)

    def scheduled(step) -> None:
        batch.append(len(step.num_scheduled_tokens))
        widths = {len(v) for v in step.scheduled_spec_decode_tokens.values()}
        assert len(widths) <= 1  # one width a step
        decoding = len(step.num_scheduled_tokens) > len(step.scheduled_new_reqs)
        width.append(widths.pop() if widths else 0)
        assert decoding or width[-1] == 0
        at_schedule.append(len(fed))
        decode.append(not step.scheduled_new_reqs)

    for request in requests if one_at_a_time else [None]:
        if request is not None:
            scheduler.add_request(request)
        drive(scheduler, run, scheduled)
    assert pos == [len(t.output_ids) for t in traces]
    if log is not None:
        log.update(fed=fed, at_schedule=at_schedule, decode=decode)
    return scheduler, batch, width, request_widths, request_emitted


# Step costs under which each of the three captured widths is the best for some steps of these requests, and the
# controller once explores after a run of plain steps (the default costs, nearly flat in the width, make nearly every
# step 15 wide): the knob's JSON form.
STEEP = StepCosts((1, 4), (0, 7, 15), ((3.0, 5.4, 7.2), (3.3, 6.0, 8.0)), source="a test's: wide steps dear")


@pytest.fixture(scope="module")
def traces():
    picked = {t.category: t for t in load_traces(RESULTS / "traces" / "0.5b_all_128" / "traces.parquet")}
    prose = [t for t in load_traces(RESULTS / "traces" / "0.5b_corpus_128" / "traces.parquet") if t.category == "prose"]
    return [picked["chat"], picked["copy"], picked["qa"], prose[0], prose[1]]


@pytest.fixture(scope="module")
def steep_costs(tmp_path_factory):
    return STEEP.to_json(tmp_path_factory.mktemp("costs") / "steep.json")


def served_and_replayed(spec: str, traces, concurrency: int, costs, behind: int = 3):
    config, lookup = configs_of(spec)
    tables = TraceTables(lookup)
    served = serve(spec, traces, tables, concurrency)
    policy = Policy.controller(captured_widths(config.batch_k, config.k), GoodputConfig(behind=behind))
    return served, replay_engine(traces, lookup, policy, concurrency=concurrency, costs=costs, tables=tables)


@pytest.mark.parametrize("concurrency", [1, 3])
@pytest.mark.parametrize("costs", ["default", "steep"])
@pytest.mark.parametrize("base", [LOOKUP, FUSED], ids=["lookup", "fused"])
def test_vllms_scheduler_fixes_the_widths_the_replay_predicts(traces, steep_costs, costs, concurrency, base):
    name, table = ("default", DEFAULT_STEP_COSTS) if costs == "default" else (str(steep_costs), STEEP)
    (scheduler, batch, width, request_widths, request_emitted), replayed = served_and_replayed(
        f"{base},goodput={name}", traces, concurrency, table)
    assert batch == replayed.batch
    assert width == replayed.width
    assert request_widths == replayed.request_widths
    assert request_emitted == replayed.request_emitted
    hook = plugin._gate(scheduler)
    assert isinstance(hook, SchedulerGoodput) and hook.widths == (0, 7, 15)
    assert sum(hook.steps_by_width.values()) == len(replayed.decisions)  # one decision a schedule() call
    assert hook.controller.calibration.observed == len(replayed.outcomes)
    if costs == "steep":  # the check is not a constant: every captured width verifies some decoding step
        assert {w for w, p, b in zip(width, replayed.prefills, batch) if p < b} == {0, 7, 15}
        assert hook.controller.explored >= 1


@pytest.mark.parametrize("behind", [2, 1])
def test_a_controller_reading_outputs_vllm_has_not_processed_is_caught(traces, steep_costs, behind):
    """The planted bug: a replay whose controller reads the output of the step in flight (behind 2), or of the step
    being scheduled too (behind 1), instead of the history three steps old that vLLM's scheduler has."""
    (_, _, width, request_widths, _), replayed = served_and_replayed(f"{LOOKUP},goodput={steep_costs}", traces, 3,
                                                                     STEEP, behind=behind)
    assert width != replayed.width and request_widths != replayed.request_widths


def test_the_knob_gets_plain_step_graphs_and_a_speculator_that_always_drafts():
    spec = f"{LOOKUP},goodput=default"
    assert gpu_lookup.speculative_config(spec)["num_speculative_tokens_per_batch_size"] == \
        gpu_lookup.speculative_config(LOOKUP)["num_speculative_tokens_per_batch_size"]  # already reaches 0
    bare = gpu_lookup.speculative_config("gpu-lookup:nmin=1,nmax=32,k=15,goodput=default")
    assert [w for _, _, w in bare["num_speculative_tokens_per_batch_size"]] == [15, 0]  # graphs for plain steps
    scheduler = scheduler_for(spec, 256, 4)
    assert gpu_lookup.GpuLookupSpeculator(scheduler.vllm_config, "cpu").k_table is None  # any width at any batch
    plain = scheduler_for(LOOKUP, 256, 4)
    assert gpu_lookup.GpuLookupSpeculator(plain.vllm_config, "cpu").k_table[1:] == [15, 7, 7, 7]


def test_a_bad_goodput_knob_says_what_to_fix(tmp_path):
    with pytest.raises(ConfigError, match="keep one"):
        gpu_lookup.lookup_config(f"{LOOKUP},gate=2,goodput=default")
    with pytest.raises(ConfigError, match="does not exist"):
        gpu_lookup.lookup_config(f"{LOOKUP},goodput={tmp_path / 'missing.json'}")
    with pytest.raises(ConfigError, match="goodput=default or goodput=PATH.json"):
        gpu_lookup.lookup_config(f"{LOOKUP},goodput=fast")
    (tmp_path / "bad.json").write_text('{"batches": [1], "widths": [7], "ms": [[3.0]]}')
    with pytest.raises(ConfigError, match="must start at 0"):
        gpu_lookup.lookup_config(f"{LOOKUP},goodput={tmp_path / 'bad.json'}")
    narrow = StepCosts((1,), (0, 7), ((3.0, 3.2),)).to_json(tmp_path / "narrow.json")
    scheduler = scheduler_for(f"{LOOKUP},goodput={narrow}", 256, 4)
    with pytest.raises(ConfigError, match="wider than the step costs measure"):
        scheduler.schedule()
    forced = scheduler_for(f"{LOOKUP},goodput=default", 256, 4)
    with pytest.raises(ConfigError, match="drop gate"):
        from types import SimpleNamespace

        plugin.set_width(SimpleNamespace(scheduler=forced, model_executor=None), 3)


def test_gpu_fused_takes_the_knob_as_gpu_lookup_does(tmp_path):
    """The fused spec's goodput key: validated by the lookup's code, plain-step graphs asked of vLLM, the controller
    on its scheduler, and a speculator with no width forecast (it drafts unless the scheduler's width for the next
    step, handed over by the plugin, is 0)."""
    spec = f"{FUSED},goodput=default"
    assert gpu_fused.fused_config(spec).goodput == "default"
    bare = gpu_fused.speculative_config("gpu-fused:k=15,draft_block=1,goodput=default")
    assert [w for _, _, w in bare["num_speculative_tokens_per_batch_size"]] == [15, 0]  # graphs for plain steps
    assert "num_speculative_tokens_per_batch_size" not in gpu_fused.speculative_config("gpu-fused:k=15,draft_block=1")
    with pytest.raises(ConfigError, match="does not exist"):
        gpu_fused.fused_config(f"{FUSED},goodput={tmp_path / 'missing.json'}")
    with pytest.raises(ConfigError, match="goodput=default or goodput=PATH.json"):
        gpu_fused.fused_config(f"{FUSED},goodput=fast")
    scheduler = scheduler_for(spec, 256, 4)
    hook = plugin._gate(scheduler)
    assert isinstance(hook, SchedulerGoodput) and hook.widths == (0, 7, 15)
    speculator = gpu_fused.GpuFusedSpeculator(scheduler.vllm_config, "cpu")
    assert speculator.k_table is None and speculator.next_width(4) == 15  # no forecast: any width at any batch
    speculator.scheduled_width = 0  # what the plugin hands over before a step whose next verifies nothing
    assert speculator.next_width(1) == 0
    plain = scheduler_for(FUSED, 256, 4)
    assert gpu_fused.GpuFusedSpeculator(plain.vllm_config, "cpu").k_table[1:] == [15, 7, 7, 7]
    assert plugin._gate(plain) is None


# ---------------------------------------------------------------------------------------------------------------
# the decisions record a served hook writes (HQLAB_GOODPUT_RECORD), checked as a served run's is


def recorded(spec: str, traces, concurrency: int, path: Path, monkeypatch, *, one_at_a_time: bool = False,
             step_ms=None):
    """Serve `traces` through vLLM's scheduler with the record asked for by its environment variable, as the serve
    benchmark asks a server (`step_ms`: the clock the hook reads, as `serve` moves it): (the hook, the record's
    header, its rows, its timed steps)."""
    monkeypatch.setenv(RECORD_ENV, str(path))
    _, lookup = configs_of(spec)
    scheduler = serve(spec, traces, TraceTables(lookup), concurrency, step_ms, one_at_a_time=one_at_a_time)[0]
    hook = plugin._gate(scheduler)
    hook.log.close()
    header, frame, timed_steps = record_frames(path)
    return hook, header, frame, timed_steps


@pytest.mark.parametrize("concurrency", [1, 3])
def test_a_served_record_is_decided_again_by_the_rule(traces, steep_costs, tmp_path, monkeypatch, concurrency):
    import polars as pl

    hook, header, frame, timed_steps = recorded(f"{LOOKUP},goodput={steep_costs}", traces, concurrency,
                                                tmp_path / "r.bin", monkeypatch)
    check = rerun_rule(frame, header)
    assert check.ok, check
    assert check.decisions == hook.decisions == sum(hook.steps_by_width.values())
    assert check.outcomes == hook.controller.calibration.observed > 0
    assert set(check.widths) == {0, 7, 15} and header["widths"] == [0, 7, 15]
    assert sorted(frame["request_id"].unique()) == sorted(str(i) for i in range(len(traces)))
    assert frame.group_by("decision").len()["len"].max() == concurrency
    # planted: one call's recorded width is not the one the rule fixes
    call, width = frame.filter(pl.col("decision") > 20).row(0)[:2]
    tampered = frame.with_columns(pl.when(pl.col("decision") == call).then(7 if width != 7 else 15)
                                  .otherwise(pl.col("width")).alias("width"))
    found = rerun_rule(tampered, header)
    assert not found.ok and found.first_mismatch[0] == call and found.width_mismatches == 1
    # planted: a controller that priced its steps with other costs than its record says
    assert rerun_rule(frame, {**header, "costs": DEFAULT_STEP_COSTS.to_dict()}).width_mismatches > 0
    from hqlab.config import ConfigError

    assert header["online"] is False and header["version"] == 2  # a fixed table: the rule can decide again
    assert frame["priced_us"].null_count() == frame.height and timed_steps.height == 0  # nothing moved its prices
    with pytest.raises(ConfigError, match="give its timed steps"):
        rerun_rule(frame, {**header, "online": True})
    with pytest.raises(ConfigError, match=r"measured its step costs online.*\(version 1\) holds the prior only"):
        rerun_rule(frame, {**header, "online": True, "version": 1})
    # planted: a request's recent acceptance that is not its last outcome's
    wrong = frame.with_columns(pl.when(pl.col("decision") == call).then(pl.col("accept") + 1)
                               .otherwise(pl.col("accept")).alias("accept"))
    assert rerun_rule(wrong, header).accept_mismatches == frame.filter(pl.col("decision") == call).height
    # a server killed mid-write leaves a file cut inside an event: its whole events are the run's first calls
    cut = tmp_path / "cut.bin"
    cut.write_bytes((tmp_path / "r.bin").read_bytes()[:-37])
    header_cut, first = record_frame(cut)
    assert header_cut["truncated"] and not header["truncated"] and 0 < first.height < frame.height
    assert rerun_rule(first, header_cut).ok


def credits_the_next_call(self, scheduler_output) -> None:
    """The planted hook bug: a step's outcome credited to the cells of the call that scheduled it (which fixed the
    next step's width), not of the call before, whose width the step verifies."""
    if scheduler_output.total_num_scheduled_tokens == 0:
        return
    self._last = (self.decisions - 1 if self._cells else -1, self._cells)
    self._pending[id(scheduler_output)] = (scheduler_output, *self._last, self.timer.scheduled())


def test_the_replay_predicts_a_served_record_of_requests_answered_one_at_a_time(traces, steep_costs, tmp_path,
                                                                                 monkeypatch):
    spec = f"{LOOKUP},goodput={steep_costs}"
    hook, header, frame, _ = recorded(spec, traces, 1, tmp_path / "r.bin", monkeypatch, one_at_a_time=True)
    check = replay_served(frame, header, traces)
    assert check.ok and check.decisions == hook.decisions and check.outcomes > 0, check
    assert rerun_rule(frame, header).ok
    opening = replay_served(frame, header, traces[:2])  # the requests a server answered first, the rest unknown
    assert opening.ok and 0 < opening.decisions < check.decisions
    from hqlab.config import ConfigError

    with pytest.raises(ConfigError, match="answered first"):
        replay_served(frame, header, traces[1:])
    monkeypatch.setattr(SchedulerGoodput, "after_schedule", credits_the_next_call)
    _, header, frame, _ = recorded(spec, traces, 1, tmp_path / "planted.bin", monkeypatch, one_at_a_time=True)
    assert not replay_served(frame, header, traces).ok
    assert rerun_rule(frame, header).drafted_mismatches > 0


def test_a_runs_records_collected_on_the_host_are_checked_server_by_server(traces, steep_costs, tmp_path,
                                                                            monkeypatch):
    """What the serve benchmark does with the records (`serve_servers.collect` on the GPU host, `check_run` at
    finish): one parquet file, one check per server, a server that recorded nothing absent."""
    import polars as pl

    from hqlab.bench import serve_servers
    from hqlab.replay.goodput_served import check_run

    spec = f"{LOOKUP},goodput={steep_costs}"
    served = serve_servers.servers(SimpleNamespace(config=["none", spec], decisions=[spec], sample_prefix_off=[spec],
                                                   planted=[spec]))
    assert [s.record for s in served] == [False, True, True, False]
    for n, concurrency in ((1, 3), (2, 1)):
        recorded(spec, traces, concurrency, serve_servers.record_path(tmp_path, n), monkeypatch)
    decisions, timed_file = serve_servers.collect(served, tmp_path, "t")
    frame = pl.read_parquet(decisions)
    table = check_run(frame, pl.read_parquet(timed_file))
    assert table["config"].to_list() == [spec, f"{spec} [prefix caching off]"]
    assert table["same_widths"].all() and (table["decisions"] > 0).all() and not table["truncated"].any()
    assert frame.filter(pl.col("drafted").is_null()).height > 0  # prefills and width-0 calls verify nothing
    online = f"{LOOKUP},goodput=online"  # prices that moved with the host's own clock: re-priced from its record
    served = serve_servers.servers(SimpleNamespace(config=[online, spec], decisions=[online, spec],
                                                   sample_prefix_off=[], planted=[]))
    hooks = [recorded(served[n].spec, traces, 3, serve_servers.record_path(tmp_path / "both", n), monkeypatch)[0]
             for n in range(2)]
    decisions, timed_file = serve_servers.collect(served, tmp_path / "both", "t")
    frame, timed_steps = pl.read_parquet(decisions), pl.read_parquet(timed_file)
    table = check_run(frame, timed_steps)
    assert table["same_widths"].to_list() == [True, True] and (table["decisions"] > 0).all()
    assert table["online"].to_list() == [True, False] and table["price_mismatches"].to_list() == [0, None]
    costs = hooks[0].controller.costs
    assert table["timed"][0] == timed_steps.height == sum(costs.counts.values()) + costs.prompt_steps > 0
    assert StepCosts.from_dict(json.loads(table["prices"][0])) == costs.table()
    assert check_run(frame)["why"].to_list() == ["priced online; no timed steps given", None]
    # a run collected before records carried prices: its online server is not checkable, the fixed one still is
    old = frame.drop("priced_us").with_columns(pl.col("header").str.replace(', "version": 2', "", literal=True))
    table = check_run(old, timed_steps)
    assert table["same_widths"].to_list() == [None, True] and "version 1" in table["why"][0]


def test_a_runs_greedy_chat_requests_replay_to_its_recorded_opening(tmp_path, monkeypatch):
    """`serve_servers.replay_greedy` as `finish`'s reader uses it: the serve benchmark's three greedy chat prompts
    (through the 1.5B's chat template), answered one at a time, their token ids from the run's greedy row."""
    import polars as pl

    from hqlab.bench import serve_servers

    chat = [t for t in load_traces(RESULTS / "traces" / "1.5b_prose_chat_256" / "traces.parquet")
            if t.category == "chat"][:3]
    spec = f"{LOOKUP},goodput=default"
    served = [serve_servers.Served(spec, spec, record=True)]
    recorded(spec, chat, 1, serve_servers.record_path(tmp_path, 0), monkeypatch, one_at_a_time=True)
    decisions = pl.read_parquet(serve_servers.collect(served, tmp_path, "t")[0])
    greedy = pl.DataFrame({"config": [spec], "token_ids": [[list(t.output_ids) for t in chat]]})
    found = serve_servers.replay_greedy(decisions, greedy, max_tokens=256)
    assert list(found) == [spec] and found[spec].ok and found[spec].decisions > 100
    wrong = pl.DataFrame({"config": [spec], "token_ids": [[list(t.output_ids[:-9]) for t in chat]]})
    assert not serve_servers.replay_greedy(decisions, wrong, max_tokens=256)[spec].ok  # outputs not the served ones


@pytest.mark.parametrize("concurrency", [1, 3])
def test_online_costs_time_the_intervals_vllm_processes_and_decide_as_the_replay(traces, concurrency):
    """goodput=online on vLLM's scheduler, its clock moved on by each step's time on a host whose wide steps cost
    four times the default grid's excess (5 % noise, prompts 20 ms dearer): the hook times exactly the decode steps
    scheduled before the previous step's output was processed, with the intervals fed; the replay fed the same
    times measures the same cells and fixes the same widths; and those widths are not the prior's."""
    truth = dearer_widths(DEFAULT_STEP_COSTS, 4.0)
    step_ms = timed(truth, noise=0.05, seed=concurrency)
    config, lookup = configs_of(LOOKUP)
    tables = TraceTables(lookup)
    log: dict = {}
    scheduler, batch, width, request_widths, _ = serve(f"{LOOKUP},goodput=online", traces, tables, concurrency,
                                                       step_ms=step_ms, log=log)
    hook = plugin._gate(scheduler)
    costs = hook.controller.costs
    assert isinstance(costs, OnlineCosts) and costs.prior is DEFAULT_STEP_COSTS

    expected: dict = {}  # the timing rule, restated: step i's interval counts if i was queued behind step i - 1
    for i, ms in enumerate(log["fed"]):
        if i >= 1 and log["at_schedule"][i] < i and log["decode"][i]:
            expected.setdefault((width[i], batch[i]), []).append(round(round(ms * 1e6) / 1e6 * 1000))
    assert costs.counts == {cell: len(v) for cell, v in expected.items()}
    assert costs.samples == {cell: v[-costs.config.window:] for cell, v in expected.items()}
    assert costs.prompt_steps == sum(1 for i in range(1, len(batch)) if log["at_schedule"][i] < i
                                     and not log["decode"][i]) > 0

    policy = Policy.controller(captured_widths(config.batch_k, config.k))
    replayed = replay_engine(traces, lookup, policy, concurrency=concurrency, costs=OnlineCosts(DEFAULT_STEP_COSTS),
                             tables=tables, step_ms=log["fed"])
    assert (batch, width, request_widths) == (replayed.batch, replayed.width, replayed.request_widths)
    assert replayed.costs.samples == costs.samples and replayed.costs.counts == costs.counts
    assert hook.controller.priced == replayed.decisions[-1].priced
    prior_only = replay_engine(traces, lookup, policy, concurrency=concurrency, costs=DEFAULT_STEP_COSTS, tables=tables)
    assert width != prior_only.width  # the measured costs changed decisions
    assert costs.scales()[1] > 2  # the excess learnt: four times the grid's, shrunk by the prior
    from types import SimpleNamespace

    read = plugin.goodput_costs(SimpleNamespace(scheduler=scheduler))  # what a client reads of the engine core
    assert StepCosts.from_dict(read) == costs.table() and read["gx"] == costs.scales()[1]
    assert plugin.goodput_costs(SimpleNamespace(scheduler=scheduler_for(f"{LOOKUP},goodput=default", 256, 4))) is None


@pytest.mark.parametrize("concurrency", [1, 3])
def test_an_online_record_is_repriced_and_decided_again_call_for_call(traces, tmp_path, monkeypatch, concurrency):
    """goodput=online on vLLM's scheduler, its clock moved on by each step's time on a host whose wide steps cost
    fifteen times the grid's excess (a step 15 wide about 3x a plain one; 5 % noise), so that the prices it learns
    turn its widths: the record holds every step the costs were handed, as they kept it, and every call's prices.
    Fed back in their order from the prior alone, those steps give every call's prices to the microsecond, every
    width, and the costs the hook ended with; without them the rule fixes other widths. A timed step dropped, its
    interval altered, or every step fed one call late, is caught by the prices."""
    import polars as pl
    from dataclasses import asdict

    truth = dearer_widths(DEFAULT_STEP_COSTS, 15.0)
    hook, header, frame, steps = recorded(f"{LOOKUP},goodput=online", traces, concurrency, tmp_path / "r.bin",
                                          monkeypatch, step_ms=timed(truth, noise=0.05, seed=concurrency))
    costs = hook.controller.costs
    assert header["online"] and header["version"] == 2 and header["online_config"] == asdict(costs.config)
    decode = steps.filter(pl.col("decode_only"))
    assert steps.height == sum(costs.counts.values()) + costs.prompt_steps and decode.height > 50
    window = costs.config.window
    kept = {(w, b): v["us"].to_list()[-window:]  # the record holds the intervals exactly as the costs kept them
            for (w, b), v in decode.group_by("width", "batch", maintain_order=True)}
    assert kept == costs.samples
    last = frame.filter(pl.col("decision") == hook.decisions - 1)["priced_us"][0].to_list()
    assert last == [micros(ms) for ms in hook.controller.priced]

    check = rerun_rule(frame, header, steps)
    assert check.ok and check.online, check
    assert check.decisions == hook.decisions and check.timed == steps.height and check.price_mismatches == 0
    assert check.prices == costs.table() and check.scales == costs.scales() and check.scales[1] > 10
    assert set(check.widths) == {0, 7, 15} and frame["priced_us"].n_unique() > check.decisions / 4  # prices moved
    assert rerun_rule(frame, header, steps.clear()).width_mismatches > 0  # the timed steps turned widths

    # planted: an early timed step at 15 wide (a width timed often enough to count) dropped, or its interval moved
    # across its cell's median; a width timed fewer than min_samples times moves no price, so only counted ones tell
    picked = decode.filter(pl.col("width") == 15).row(costs.config.min_samples + 2, named=True)
    dropped = rerun_rule(frame, header, steps.filter(pl.col("step") != picked["step"]))
    assert not dropped.ok and dropped.price_mismatches > 0 and dropped.first_price_mismatch[0] >= picked["before"]
    cell = decode.filter((pl.col("width") == picked["width"]) & (pl.col("batch") == picked["batch"])
                         & (pl.col("step") <= picked["step"]))["us"].to_list()[-window:]
    median = sorted(cell)[(len(cell) - 1) // 2]
    other = 1 if picked["us"] >= median else 100 * picked["us"]
    altered = steps.with_columns(pl.when(pl.col("step") == picked["step"]).then(other)
                                 .otherwise(pl.col("us")).alias("us"))
    found = rerun_rule(frame, header, altered)
    assert not found.ok and found.price_mismatches > 0 and found.first_price_mismatch[0] >= picked["before"]
    late = rerun_rule(frame, header, steps.with_columns(pl.col("before") + 1))
    assert not late.ok and late.price_mismatches > 0
