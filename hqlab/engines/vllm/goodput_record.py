"""The goodput controller's decisions, recorded by a served engine (`HQLAB_GOODPUT_RECORD=PATH`), so that a run can
be checked against the reference rule decision for decision (`hqlab.replay.goodput_served`).

What is written. Per `schedule()` call that priced requests (the calls `GoodputController.decide` counts), the
width it fixed and, per candidate request, vLLM's request id, the tokens the scheduler held for it (prompt and
processed outputs: the history its match bucket was read from) and its cell. Per processed verify step, each
verifying request's drafted and accepted counts, with the call whose width the step verified (whose cells the
calibration credits) and how many calls had decided before the scheduler processed it (the calibration's order).
The header holds what the rule needs to decide again: the spec, the candidate widths, the step costs and the
`GoodputConfig`.

With costs measured online (`goodput=online`, header `online` true) the header's costs are the prior and its
`online_config` the `OnlineConfig`; two more events carry what moved the prices. Per step the hook timed and handed
to `OnlineCosts.observe_us`: its batch size, width, interval in integer microseconds (`online_costs.micros`: exactly
the value the costs kept) and whether it ran only decode tokens, with how many calls had decided before it (as an
outcome's). Per call, the ms it priced each candidate width at (`GoodputController.priced`), as integer
microseconds (`micros`), in the header's width order. Fed back in their order, the intervals give the same prices
and the same widths (`rerun_rule`).

How. A stream of int32 words in memory (`array`), written to the file once it holds `FLUSH_WORDS` or a second has
passed, so a server stopped by a signal loses at most a second; the engine core's step never waits on a disk, and
what the hook appends is three integers per request and a fixed handful per call and timed step. A value past
int32 (an interval over 35 minutes) is written as `INT32_MAX`, and its check then fails rather than the server.
The stream stops at `limit_bytes` and says so (`TRUNCATED`): what precedes it is a prefix of the run, which the
check reads as it is. `read_record` turns a file into columns (numpy), one row per (call, candidate request), its
outcome joined where the request verified the step that call's width went to, and the timed steps apart.

Layout (version 2): the magic `HQGD`, a version word, the header's length and the header (JSON, padded to whole
words); then events, each a tag word: `REQUEST` index, byte length, the id's UTF-8 bytes padded; `DECISION` call,
width, n, then n × (request index, tokens, packed cell); `PRICED` call, m, then m µs (right after its call's
`DECISION`); `OUTCOMES` call whose width it verified, calls decided before, n, then n × (request index, drafted,
accepted); `TIMED` calls decided before, batch, width, µs, decode only (0 or 1); `TRUNCATED`. Version 1 is the same
without `PRICED` and `TIMED`; `read_record` reads both.

Standard library only at import (the engine core imports it); `read_record` needs numpy.
"""

from __future__ import annotations

import atexit
import json
import time
from array import array
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

RECORD_ENV = "HQLAB_GOODPUT_RECORD"  # a file the served hook writes its decisions to (the serve benchmark sets it)
MAGIC = b"HQGD"
VERSION = 2
READS = (1, 2)  # the versions read_record reads
REQUEST, DECISION, OUTCOMES, TRUNCATED, PRICED, TIMED = 1, 2, 3, 4, 5, 6
TAGS = {1: (REQUEST, DECISION, OUTCOMES, TRUNCATED), 2: (REQUEST, DECISION, OUTCOMES, TRUNCATED, PRICED, TIMED)}
INT32_MAX = (1 << 31) - 1
FLUSH_WORDS = 1 << 16  # 256 KiB a write
FLUSH_S = 1.0
LIMIT_BYTES = 512 << 20  # ~30 minutes at 32 in flight (docs/goodput.md): a bound, not a budget


def pack_cell(cell: tuple[int, int, int]) -> int:
    """A cell (match, recent acceptance, confidence bucket) as one word: a byte each."""
    m, a, c = cell
    if not (0 <= m < 256 and 0 <= a < 256 and 0 <= c < 256):
        raise ValueError(f"cell {cell}: each bucket must lie in 0-255 to be recorded")
    return m | a << 8 | c << 16


def unpack_cells(codes: Any) -> tuple[Any, Any, Any]:
    """`pack_cell` undone over an array of codes: (match, acceptance, confidence) arrays."""
    return codes & 255, (codes >> 8) & 255, (codes >> 16) & 255


class DecisionLog:
    """The writer the served hook (`goodput.SchedulerGoodput`) calls: `decision` per priced `schedule()` call (with
    its prices where they were measured online), `outcomes` per processed step with verifying requests, `timed` per
    step handed to the online costs."""

    def __init__(self, path: str | Path, header: Mapping[str, Any], *, limit_bytes: int = LIMIT_BYTES) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "wb")
        head = json.dumps(dict(header), separators=(",", ":")).encode()
        head += b" " * (-len(head) % 4)
        self._file.write(MAGIC + array("i", [VERSION, len(head)]).tobytes() + head)
        self._written = self._file.tell()
        self._limit = limit_bytes
        self._buf = array("i")
        self._ids: dict[str, int] = {}
        self._codes: dict[tuple[int, int, int], int] = {}  # cells met so far, packed
        self._flushed = time.monotonic()
        self.truncated = False
        atexit.register(self.close)

    def _index(self, request_id: str) -> int:
        index = self._ids.get(request_id)
        if index is None:
            index = self._ids[request_id] = len(self._ids)
            name = request_id.encode()
            self._buf.extend((REQUEST, index, len(name)))
            self._buf.frombytes(name + b"\0" * (-len(name) % 4))
        return index

    def _code(self, cell: tuple[int, int, int]) -> int:
        code = self._codes[cell] = pack_cell(cell)
        return code

    def decision(self, call: int, width: int, entries: Iterable[tuple[str, int, tuple[int, int, int]]],
                 priced_us: Sequence[int] | None = None) -> None:
        """Call `call` fixed `width` from these (request id, tokens held, cell); `priced_us`, where costs are
        measured online, the µs it priced each candidate width at."""
        if self.truncated:
            return
        ids, codes = self._ids, self._codes
        words = [DECISION, call, width, 0]
        for rid, tokens, cell in entries:
            index = ids.get(rid)
            code = codes.get(cell)
            words += (self._index(rid) if index is None else index, tokens,
                      self._code(cell) if code is None else code)
        words[3] = len(words) // 3 - 1
        if priced_us is not None:
            words += (PRICED, call, len(priced_us))
            words += [us if us <= INT32_MAX else INT32_MAX for us in priced_us]
        self._buf.extend(words)
        self._maybe_flush()

    def timed(self, before: int, batch: int, width: int, us: int, decode_only: bool) -> None:
        """A step the online costs were handed, after `before` calls had decided: `batch` requests at `width` took
        `us` µs (as the costs kept it); `decode_only` false for a step with prompt tokens."""
        if self.truncated:
            return
        self._buf.extend((TIMED, before, batch, width, us if us <= INT32_MAX else INT32_MAX, 1 if decode_only else 0))
        self._maybe_flush()

    def outcomes(self, fixed_by: int, before: int, entries: Iterable[tuple[str, int, int]]) -> None:
        """A processed step, whose width call `fixed_by` fixed, processed after `before` calls had decided: per
        verifying request (id, drafted, accepted)."""
        if self.truncated:
            return
        ids = self._ids
        words = [OUTCOMES, fixed_by, before, 0]
        for rid, drafted, accepted in entries:
            index = ids.get(rid)
            words += (self._index(rid) if index is None else index, drafted, accepted)
        if len(words) > 4:
            words[3] = len(words) // 3 - 1
            self._buf.extend(words)
            self._maybe_flush()

    def _maybe_flush(self) -> None:
        if len(self._buf) >= FLUSH_WORDS or time.monotonic() - self._flushed >= FLUSH_S:
            self.flush()

    def flush(self) -> None:
        if self._file is None or not self._buf:
            return
        if self._written + 4 * len(self._buf) > self._limit:  # the whole buffer or nothing: events stay whole
            self._buf = array("i", [TRUNCATED])
            self.truncated = True
        data = self._buf.tobytes()
        self._file.write(data)
        self._file.flush()
        self._written += len(data)
        self._buf = array("i")
        self._flushed = time.monotonic()

    def close(self) -> None:
        if self._file is not None:
            self.flush()
            self._file.close()
            self._file = None


def read_record(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(header, columns) of a recorded file. Columns (numpy arrays, one row per (call, candidate request)):
    `decision` (the call's index), `width`, `request` (index into `columns["request_ids"]`, a list), `tokens`,
    `match`, `accept`, `confidence`, the outcome of the step the call's width went to, where the request verified
    it: `drafted`, `accepted` and `observed_before` (calls decided before the scheduler processed it), -1 elsewhere;
    and `priced` (rows × candidate widths: the call's priced µs, -1 where the call recorded none, zero columns where
    no call did). `columns["timed"]` holds the timed steps, in the order the costs were handed them: arrays `before`,
    `batch`, `width`, `us`, `decode_only`. `columns["version"]` is the file's version; `columns["truncated"]` says
    whether the writer stopped at its size limit or the file ends inside an event (its server killed mid-write): the
    rows are then the run's first ones. A file this writer cannot have written raises ValueError."""
    import numpy as np

    raw = Path(path).read_bytes()
    if raw[:4] != MAGIC or len(raw) < 12:
        raise ValueError(f"{path}: not a goodput decisions record (no {MAGIC!r} header)")
    version, size = (int(x) for x in np.frombuffer(raw[4:12], dtype=np.int32))
    if version not in READS:
        raise ValueError(f"{path}: record version {version}, this reader reads {list(READS)}")
    header = json.loads(raw[12:12 + size])
    body = raw[12 + size:]
    words = np.frombuffer(body[:len(body) // 4 * 4], dtype=np.int32)
    ids, decisions, outcomes, priced, timed, truncated = _events(words, TAGS[version], version, path)
    truncated = truncated or len(body) % 4 != 0
    columns = _columns(decisions, outcomes, priced, ids, truncated, path)
    steps = np.array(timed, dtype=np.int64).reshape(-1, 5)
    columns["timed"] = {"before": steps[:, 0], "batch": steps[:, 1], "width": steps[:, 2], "us": steps[:, 3],
                        "decode_only": steps[:, 4] != 0}
    columns["version"] = version
    return header, columns


def _events(words: Any, tags: Any, version: int, path: Any) -> tuple[list, list, list, dict, list, bool]:
    """`read_record`'s pass over the event words: request ids, decisions, outcomes, prices by call, timed steps, and
    whether the words end inside an event or at a `TRUNCATED` mark."""
    ids: list[str] = []
    decisions, outcomes, priced, timed = [], [], {}, []
    p, truncated = 0, False
    fixed = {REQUEST: 3, DECISION: 4, OUTCOMES: 4, PRICED: 3, TIMED: 6, TRUNCATED: 1}
    while p < len(words):
        tag = int(words[p])
        if tag not in tags:
            raise ValueError(f"{path}: unknown event tag {tag} at word {p} (version {version})")
        if p + fixed[tag] > len(words):
            truncated = True
            break
        if tag == REQUEST:
            index, length = int(words[p + 1]), int(words[p + 2])
            if p + 3 + (length + 3) // 4 > len(words):
                truncated = True
                break
            if index != len(ids):
                raise ValueError(f"{path}: request {index} named out of order at word {p}")
            ids.append(words[p + 3:p + 3 + (length + 3) // 4].tobytes()[:length].decode())
            p += 3 + (length + 3) // 4
        elif tag in (DECISION, OUTCOMES):
            a, b, n = (int(x) for x in words[p + 1:p + 4])
            if p + 4 + 3 * n > len(words):  # a server killed mid-write: what precedes is whole
                truncated = True
                break
            block = words[p + 4:p + 4 + 3 * n].reshape(n, 3)
            (decisions if tag == DECISION else outcomes).append((a, b, block))
            p += 4 + 3 * n
        elif tag == PRICED:
            call, m = int(words[p + 1]), int(words[p + 2])
            if p + 3 + m > len(words):
                truncated = True
                break
            if not decisions or decisions[-1][0] != call or call in priced:
                raise ValueError(f"{path}: prices of call {call} at word {p} follow no decision of that call")
            priced[call] = words[p + 3:p + 3 + m]
            p += 3 + m
        elif tag == TIMED:
            if int(words[p + 1]) != len(decisions):  # the hook counts the calls it records
                raise ValueError(f"{path}: a timed step at word {p} says {int(words[p + 1])} calls decided before "
                                 f"it, the record holds {len(decisions)}")
            timed.append(words[p + 1:p + 6])
            p += 6
        else:
            truncated = True
            p += 1
    return ids, decisions, outcomes, priced, timed, truncated


def _columns(decisions: list, outcomes: list, priced: dict, ids: list[str], truncated: bool,
             path: Any) -> dict[str, Any]:
    """The rows of `read_record`: decisions flattened, each outcome joined to the row of the call it credits, each
    call's prices on its rows."""
    import numpy as np

    def flat(events: list) -> tuple[Any, Any, Any]:
        n = [len(block) for _, _, block in events]
        rows = np.concatenate([block for _, _, block in events]) if events else np.zeros((0, 3), np.int32)
        return (np.repeat([e[0] for e in events], n).astype(np.int64), np.repeat([e[1] for e in events], n)
                .astype(np.int64), rows.astype(np.int64))

    call, width, rows = flat(decisions)
    match, accept, confidence = unpack_cells(rows[:, 2])
    out = {"decision": call, "width": width, "request": rows[:, 0], "tokens": rows[:, 1], "match": match,
           "accept": accept, "confidence": confidence}
    for name in ("drafted", "accepted", "observed_before"):
        out[name] = np.full(len(call), -1, dtype=np.int64)
    fixed_by, before, got = flat(outcomes)
    if len(fixed_by):
        keys = call << 32 | rows[:, 0]
        order = np.argsort(keys, kind="stable")
        wanted = fixed_by << 32 | got[:, 0]
        at = np.searchsorted(keys[order], wanted)
        found = (at < len(keys)) & (keys[order][np.minimum(at, len(keys) - 1)] == wanted)
        if not found.all():
            i = int(np.argmin(found))
            raise ValueError(f"{path}: an outcome of request {ids[got[i, 0]]!r} credits call {fixed_by[i]}, which "
                             f"did not price it")
        row = order[at]
        if len(np.unique(row)) != len(row):
            raise ValueError(f"{path}: two outcomes credit one (call, request)")
        out["drafted"][row], out["accepted"][row], out["observed_before"][row] = got[:, 1], got[:, 2], before
    widths = {len(v) for v in priced.values()}
    if len(widths) > 1:
        raise ValueError(f"{path}: calls priced {sorted(widths)} widths: one controller prices the same widths")
    per_call = np.full((len(decisions), widths.pop() if widths else 0), -1, dtype=np.int64)
    for k, (c, _, _) in enumerate(decisions):
        if c in priced:
            per_call[k] = priced[c]
    out["priced"] = np.repeat(per_call, [len(block) for _, _, block in decisions], axis=0)
    out["request_ids"], out["truncated"] = ids, truncated
    return out


__all__ = ["RECORD_ENV", "DecisionLog", "read_record", "pack_cell", "unpack_cells", "LIMIT_BYTES", "VERSION", "READS",
           "INT32_MAX"]
