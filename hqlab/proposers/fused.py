"""Context lookup fused with a model drafter, with the adaptive long block (SPEC §2.4–2.5).

Per request and step: the lookup proposes up to the long k, the drafter its head (draft_block tokens), the
fusion rule (`hqlab.rules.fusion.fuse`) decides position by position, and the scheduler
(`hqlab.rules.schedule.step`) decides from the take flag and the tokens the request emitted last step whether
this step verifies the short block (the head) or the long one. The proposal is the fused block clipped to that
length; `extra` records the decisions (block, take_flag, head_taken, tail_taken).

The scheduler needs the previous step's emitted count; it is read off the history (how much it grew since the
last call for the same request), so replay, the engine and any other engine get the same decisions from the same
histories. Batch mode "unanimous" is HyperQwen's: one block length for the whole batch, sticky only at batch size
1; "per-request" (default) decides for each request alone.

Sampled verification stays exact when every position checked against q was proposed from q whichever way the rule
went, and every other position is a point mass: the head decision at agree = 0 reads only match_len, the tail
decision reads the drafted head, which precedes the tail. With agree > 0 the head decision reads the drafter's
samples at the very positions it then keeps or replaces; there the lookup's token equals the draw, so those
positions are the draw in both branches and are checked against q too (`hqlab.rules.fusion.drafter_drawn`, passed
as `extra["drawn"]` to `Proposal.point_mass`). Checking them as point masses (by their LOOKUP tag) biases the
output, which the sampling test shows.

Lookup matching length: the fusion rules read matches as short as min(nstrong, nmin, nmin_tail, longmin, and
nmin_alone when set), so the lookup runs with that as its cheap-reject length (with HyperQwen's lookup nmin 6 the
tail rule's 4 could never fire); `nmax` caps the match as usual.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

import numpy as np
import torch

from hqlab.config import ConfigError, LookupConfig
from hqlab.proposers.base import Drafter, Proposal
from hqlab.proposers.draft import DraftConfig, DraftProposer
from hqlab.proposers.lookup import LookupProposer
from hqlab.rules.fusion import SOURCE_LOOKUP, FusionConfig, drafter_drawn, fuse
from hqlab.rules.schedule import ScheduleConfig, ScheduleState, step, step_unanimous

BATCH_MODES = ("per-request", "unanimous")
MAX_SKIP_LAG = 8  # steps a skip decision may lag the decision it reads
SKIP_ON = ("long", "head")  # what an earlier step must have done for a request to skip the drafter now


@dataclass(frozen=True)
class FusedConfig:
    """k: the long block (lookup k); draft_block: the drafter's width = the short block.
    Drafter: model, dtype, device, temperature, vocab. Lookup: nmax, policy, search.
    Fusion (SPEC §2.4): nstrong, nmin, agree, nmin_tail, longmin, rule ("threshold" | "score");
    shipped defaults 6/6/0/4/6, the articles' set is nstrong=8,agree=2; nmin_alone (0 = off): a step that skipped
    the drafter takes the lookup's head at a match this long (hqlab's addition, `hqlab.rules.fusion`).
    Scheduler (SPEC §2.5): schedule ("adaptive" | "short" | "long"), sticky, entry_steps, stale (0 | 1),
    batch_mode ("per-request" | "unanimous").
    skip: 0 = the drafter drafts every step; L >= 1 = a request skips the drafter on a step when its step L steps
    earlier met `skip_on` (HyperQwen skips the drafter while a copy is in progress, where the lookup decides; an
    engine that learns a decision asynchronously knows it only some steps late, hence the lag).
    skip_on: "long" = that step verified the long block; "head" = the lookup alone filled that step's whole head
    (head taken with at least draft_block lookup tokens: no drafter token was proposed)."""

    k: int = 15
    draft_block: int = 7
    model: str = "qwen2.5-coder-0.5b"
    dtype: str = "auto"
    device: str = "auto"
    temperature: float = 0.0
    vocab: str = ""
    nmax: int = 12
    policy: str = "recent"
    search: int = 0
    # fusion and scheduler defaults are the rules' own (one definition each)
    nstrong: int = FusionConfig.nstrong
    nmin: int = FusionConfig.nmin
    agree: int = FusionConfig.agree
    nmin_tail: int = FusionConfig.nmin_tail
    longmin: int = FusionConfig.longmin
    rule: str = FusionConfig.rule
    nmin_alone: int = FusionConfig.nmin_alone
    schedule: str = ScheduleConfig.mode
    sticky: int = ScheduleConfig.sticky
    entry_steps: int = ScheduleConfig.entry_steps
    stale: int = ScheduleConfig.stale
    batch_mode: str = "per-request"
    skip: int = 0
    skip_on: str = "long"

    def __post_init__(self) -> None:
        if self.skip_on not in SKIP_ON:
            raise ConfigError(f"fused: skip_on must be one of {', '.join(SKIP_ON)} (got {self.skip_on!r})")
        if not 0 <= self.skip <= MAX_SKIP_LAG:
            raise ConfigError(f"fused: skip must be 0 (the drafter drafts every step) or a lag of 1..{MAX_SKIP_LAG} "
                              f"steps (got {self.skip})")
        if self.draft_block > self.k:
            raise ConfigError(f"fused: draft_block must be <= k (got draft_block={self.draft_block}, k={self.k}); "
                              f"k is the long block, draft_block the short one")
        if self.batch_mode not in BATCH_MODES:
            raise ConfigError(f"fused: batch_mode must be one of {', '.join(BATCH_MODES)} (got {self.batch_mode!r})")
        try:  # the parts validate themselves; say which spec they came from
            self.lookup_config(), self.draft_config(), self.fusion_config(), self.schedule_config()
        except ConfigError as e:
            raise ConfigError(f"fused: {e}") from None

    def lookup_config(self) -> LookupConfig:
        n = max(1, min(self.nstrong, self.nmin, self.nmin_tail, self.longmin, self.nmin_alone or self.nstrong))
        return LookupConfig(nmin=min(n, self.nmax), nmax=self.nmax, k=self.k, search=self.search, policy=self.policy)

    def draft_config(self) -> DraftConfig:
        return DraftConfig(model=self.model, k=self.draft_block, dtype=self.dtype, device=self.device,
                           temperature=self.temperature, vocab=self.vocab)

    def fusion_config(self) -> FusionConfig:
        return FusionConfig(nstrong=self.nstrong, nmin=self.nmin, agree=self.agree, nmin_tail=self.nmin_tail,
                            longmin=self.longmin, draft_block=self.draft_block, rule=self.rule,
                            nmin_alone=self.nmin_alone)

    def schedule_config(self) -> ScheduleConfig:
        return ScheduleConfig(short=self.draft_block, long=self.k, sticky=self.sticky, entry_steps=self.entry_steps,
                              stale=self.stale, mode=self.schedule)


class FusedProposer:
    name: ClassVar[str] = "fused"
    Config = FusedConfig

    def __init__(self, config: FusedConfig | None = None, drafter: Drafter | None = None) -> None:
        self.config = c = config or FusedConfig()
        self.k = c.k
        self.lookup = LookupProposer(c.lookup_config())
        self.drafter = drafter or DraftProposer(c.draft_config())
        self.fusion = c.fusion_config()
        self.schedule = c.schedule_config()
        self.states: dict[str, tuple[ScheduleState, int]] = {}  # key -> (scheduler state, history length seen)
        self.marks: dict[str, tuple[bool, ...]] = {}  # key -> its last `skip` steps: met `skip_on`? oldest first
        # plain counters, per request and step proposed for: how often the drafter ran and how often `skip` spared it
        self.drafted_steps = 0
        self.skipped_steps = 0

    def propose(self, histories: Sequence[np.ndarray], budgets: Sequence[int],
                keys: Sequence[str] | None = None) -> list[Proposal]:
        keys = [str(i) for i in range(len(histories))] if keys is None else [str(x) for x in keys]
        c = self.config
        skipped = [self._skips(key, h) for key, h in zip(keys, histories)]
        lookups = self.lookup.propose(histories, [c.k] * len(histories))
        drafts = self.drafter.propose(histories, [c.draft_block if b > 0 and not s else 0
                                                  for b, s in zip(budgets, skipped)], keys)
        head_len = min(c.draft_block, c.k)
        fused = []
        for i, (h, lk, budget) in enumerate(zip(histories, lookups, budgets)):
            if budget <= 0:
                fused.append(None)
                continue
            if skipped[i]:  # no drafter this step: its head positions are proposed by nobody
                fused.append(fuse(np.zeros(head_len, dtype=np.int64), lk.tokens, lk.match_len, lk.valid, c.k,
                                  self.fusion, draft_valid=0))
                self.skipped_steps += 1
                continue
            self.drafted_steps += 1
            f = fuse(drafts[i].tokens, lk.tokens, lk.match_len, lk.valid, c.k, self.fusion)
            known = drafts[i].known  # a teacher-forced draft (replay) is exact only this far
            if known is not None and min(f.head_len, lk.valid) > known and f.agree_count >= known:
                # the agreement count ran into positions the trace cannot tell: draft them for real
                drafts[i] = self.drafter.exact([h], [c.draft_block], [keys[i]])[0]
                f = fuse(drafts[i].tokens, lk.tokens, lk.match_len, lk.valid, c.k, self.fusion)
            fused.append(f)

        # scheduler: emitted last step = how much the history grew since this request's last call
        emitted, states = [], []
        for key, h in zip(keys, histories):
            state, seen = self.states.get(key, (ScheduleState(), 0))
            grew = len(h) - seen
            if seen == 0 or grew <= 0:  # first call, or a new request under a reused key
                state, grew = ScheduleState(), 0
            states.append(state)
            emitted.append(grew)
        flags = [f.take_flag if f is not None else False for f in fused]
        if c.batch_mode == "unanimous":
            new_states, block = step_unanimous(states, flags, emitted, self.schedule)
            blocks = [block] * len(keys)
        else:
            pairs = [step(s, t, e, self.schedule) for s, t, e in zip(states, flags, emitted)]
            new_states, blocks = [p[0] for p in pairs], [p[1] for p in pairs]
        self.states = {key: (s, len(h)) for key, s, h in zip(keys, new_states, histories)}  # absent keys: gone
        if c.skip:
            marks = [f is not None and (block == c.k and c.k > c.draft_block if c.skip_on == "long" else
                                        f.head_taken and len(f.tokens) >= head_len and
                                        bool((f.sources[:head_len] == SOURCE_LOOKUP).all()))
                     for f, block in zip(fused, blocks)]
            self.marks = {key: (self.marks.get(key, ()) + (mark,))[-c.skip:] for key, mark in zip(keys, marks)}

        out = []
        for f, lk, dr, block in zip(fused, lookups, drafts, blocks):
            if f is None:
                out.append(Proposal.empty())
                continue
            n = min(block, f.tokens.shape[0])
            q = None
            if dr.q is not None:  # drafter rows for the head; lookup positions are point masses (rows unused)
                q = torch.zeros(n, dr.q.shape[1], dtype=dr.q.dtype, device=dr.q.device)
                m = min(n, dr.q.shape[0])
                q[:m] = dr.q[:m]
            extra = {"block": block, "take_flag": f.take_flag, "head_taken": f.head_taken,
                     "tail_taken": f.tail_taken, "draft_mode": dr.extra.get("draft_mode", "live"),
                     "drafted": f.draft_valid}
            if q is not None:  # the positions sampled verification checks against q (`Proposal.point_mass`)
                extra["drawn"] = drafter_drawn(f, lk.match_len, lk.valid, self.fusion)[:n]
            out.append(Proposal(f.tokens[:n], f.sources[:n], lk.match_len, q, extra))
        return out

    def _skips(self, key: str, history: np.ndarray) -> bool:
        """Whether this request skips the drafter this step: its step `skip` steps ago met `skip_on`. A new
        request (or one whose history did not grow: a reused key) has no past steps and drafts."""
        c = self.config
        if not c.skip:
            return False
        past = self.marks.get(key, ())
        _, seen = self.states.get(key, (None, 0))
        if seen == 0 or len(history) <= seen:  # as the scheduler decides: no earlier step of this request
            self.marks.pop(key, None)
            return False
        return len(past) == c.skip and past[0]

