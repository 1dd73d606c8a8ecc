"""The stall watchdog's report: what waited, who did not arrive, and what each rank was doing.

Leaf module beside ``meta_dist.watchdog`` (imports meta_dist.xp only), which gathers the facts
and calls ``report``; pure text, so every wording is one function away from a test.
"""

from __future__ import annotations

from typing import Any

from meta_dist.xp import is_cupy_array

CAUSE = ("  some rank took another path (different control flow, an uneven last batch) or is "
         "stuck; aborting the job.")


def describe(arrays: Any) -> str:
    """Say what a call moves: "numpy float32 (1024,)" or "12 numpy float32 arrays, 3.1 MiB"."""
    items = list(arrays) if isinstance(arrays, (list, tuple)) else [arrays]
    if arrays is None or not items or not hasattr(items[0], "dtype"):
        return ""
    kind = "cupy" if is_cupy_array(items[0]) else "numpy"
    if len(items) == 1:
        return f"{kind} {items[0].dtype} {tuple(items[0].shape)}"
    size = sum(int(a.nbytes) for a in items) / 2**20
    return f"{len(items)} {kind} {items[0].dtype} arrays, {size:.1f} MiB"


def report(rank: int, size: int, stalled: tuple, waiting: dict[int, float],
           answers: dict[int, dict], *, limit: str, unknown: str | None, gone: list[int],
           exited: dict[int, int], answer_s: float) -> str:
    """Return the report of this rank's stalled operation.

    Args:
        rank: this rank.
        size: the number of ranks.
        stalled: (api, sequence number or None, start, arrays) of the operation.
        waiting: rank -> seconds waited in the same collective (this rank's included).
        answers: rank -> its watchdog's state (``StallWatchdog.state``), for those that
            answered.
        limit: the stall timeout as shown ("300 s", "no limit").
        unknown: why the other ranks' states are unknown (no side channel), or None.
        gone: the ranks whose program ended without reaching this operation.
        exited: rank -> the collectives it had entered when its program ended.
        answer_s: how long a rank had to answer.
    """
    api, seq, _, arrays = stalled[:4]
    what = " ".join(filter(None, [api, f"#{seq}" if seq is not None else "",
                                  f"({describe(arrays)})" if describe(arrays) else ""]))
    if gone:
        lines = [f"[rank {rank}] {what}: rank{'s' if len(gone) > 1 else ''} "
                 f"{', '.join(map(str, gone))} ended {'their' if len(gone) > 1 else 'its'} "
                 f"program without reaching it ({waiting[rank]:.1f} s waited)"]
    else:
        lines = [f"[rank {rank}] {what}: waited {limit} for the other ranks to reach this "
                 f"collective ({waiting[rank]:.1f} s so far; stall_timeout {limit}, set by "
                 "meta_dist_config.stall_timeout or META_DIST_STALL_TIMEOUT)"]
    others = [r for r in range(size) if r != rank]

    def doing(r: int) -> str:
        return _doing(r, answers.get(r), exited.get(r), answer_s)

    if others and unknown:
        lines.append(f"  the other ranks' states are unknown here ({unknown})")
    elif others and seq is None:  # no number to compare: say what every other rank does
        lines.append("  the other ranks:")
        lines += [doing(r) for r in others]
    elif others:
        lines.append("  waiting in it: " + ", ".join(
            f"rank {r} for {s:.1f} s" for r, s in sorted(waiting.items())))
        # no answer: not arrived, unless its program ended after doing its part of this one
        absent = [r for r in others
                  if (answers[r]["seq"] if r in answers else exited.get(r, -1)) < seq]
        finished = [r for r in others if r not in answers and r not in absent]
        # in a collective of the same number but another name: the ranks' calls differ
        elsewhere = [r for r in others if r in answers and any(
            other_seq == seq and other != api for other, other_seq, _, _ in
            answers[r]["current"])]
        if absent:
            lines.append(f"  not arrived: rank{'s' if len(absent) > 1 else ''} "
                         + ", ".join(map(str, absent)))
            lines += [doing(r) for r in absent]
        if elsewhere:
            lines.append(f"  in another collective: rank{'s' if len(elsewhere) > 1 else ''} "
                         + ", ".join(map(str, elsewhere)) + " (the ranks' calls differ; "
                         "META_DIST_CHECK=1 compares them before they run)")
            lines += [doing(r) for r in elsewhere]
        if finished:
            lines.append(f"  did {'their' if len(finished) > 1 else 'its'} part, then ended: rank"
                         f"{'s' if len(finished) > 1 else ''} " + ", ".join(map(str, finished)))
        if not absent and not elsewhere:
            lines.append("  not arrived: none (every rank reached it: the MPI or NCCL call "
                         "itself is stuck, e.g. on the network)")
    lines.append(CAUSE)
    return "\n".join(lines) + "\n"


def _doing(rank: int, state: dict | None, exited: int | None, answer_s: float) -> str:
    """Say what a rank that did not arrive was doing, or that its program ended.

    From its answer (``state``; None: no answer), or ``exited``: the collectives it entered
    before its program ended.
    """
    if exited is not None and state is None:
        after = f"after collective #{exited}" if exited else "before any collective"
        # "no error" would be a guess: a bare raise SystemExit(n) hides n from exit handlers
        return (f"    rank {rank}: its program ended {after} with no error meta_dist could see "
                "(a clean end, or `raise SystemExit(n)`, whose n it cannot see: sys.exit(n) "
                "ends the job with n), with this communicator open: the ranks must make "
                "matching calls (an uneven last batch, a rank-dependent loop or an early return "
                "breaks that)")
    if state is None:
        return (f"    rank {rank}: not responding (no answer in {answer_s:.0f} s: its process "
                "is gone or stopped, or stuck in native code that holds Python's GIL)")
    last = state["last"]
    done = (f"last completed {last[0]} #{last[1]} (entered {last[2]:.1f} s ago)" if last
            else "completed no collective yet")
    now = "; ".join(f"in {api}{f' #{seq}' if seq is not None else ''}"
                    f"{f' ({arrays})' if arrays else ''} for {waited:.1f} s"
                    for api, seq, waited, arrays in state["current"]) or "in no collective"
    at = "".join("\n" + "\n".join("        " + part for part in line.splitlines())
                 for line in state["at"])
    return (f"    rank {rank} (host {state['host']}, pid {state['pid']}): {done}; now {now}"
            + (f", at:{at}" if at else ""))
