"""A timeline of what each rank did when: Chrome trace (Perfetto) JSON, one file per rank.

Leaf module: standard library only. With ``meta_dist_config.trace: DIR`` the trainer records
its phases (forward, backward, step) and its communicator records every collective and
point-to-point operation (name, bytes, the thread it ran on, start and end) as complete events
("ph": "X"); ``Trainer.fit`` writes ``DIR/trace-rank{R}.json`` at its end. Timestamps are the
wall clock in microseconds, so the ranks of one host line up (across hosts, as well as their
clocks agree). Open a file, or the merged one, at https://ui.perfetto.dev or chrome://tracing.

    python -m meta_dist trace merge DIR OUT.json    every rank's file in one, a track per rank

Off (the default), the hot paths pay one ``is None`` test per operation and per phase.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any


def _now_us() -> float:
    return time.time_ns() / 1000.0


class Trace:
    """Events of one rank, kept in memory until ``write``.

    Args:
        folder: where ``write`` puts ``trace-rank{rank:05d}.json`` (created if missing).
        rank: this rank; the events' process id, so each rank is one track.
        host: shown in the track's name.
    """

    def __init__(self, folder: str | Path, rank: int, host: str) -> None:
        self.folder, self.rank = Path(folder), rank
        self.events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
             "args": {"name": f"rank {rank} ({host})"}},
            {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
             "args": {"sort_index": rank}}]
        self._threads: dict[int, int] = {}
        self._lock = threading.Lock()  # collectives end on the communication thread

    def begin(self) -> float:
        """Return the time an operation starts (pass it to ``end``)."""
        return _now_us()

    def end(self, name: str, category: str, start: float, **args: Any) -> None:
        """Record ``name`` from ``start`` until now on the calling thread."""
        stop = _now_us()
        ident = threading.get_ident()
        with self._lock:
            tid = self._threads.get(ident)
            if tid is None:
                tid = self._threads[ident] = len(self._threads)
                self.events.append({"name": "thread_name", "ph": "M", "pid": self.rank,
                                    "tid": tid,
                                    "args": {"name": threading.current_thread().name}})
            self.events.append({"name": name, "cat": category, "ph": "X", "ts": start,
                                "dur": stop - start, "pid": self.rank, "tid": tid,
                                "args": args})

    def write(self) -> Path:
        """Write this rank's events; return the file."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"trace-rank{self.rank:05d}.json"
        with self._lock:
            text = json.dumps({"traceEvents": self.events, "displayTimeUnit": "ms"})
        path.write_text(text)
        return path


def merge(folder: str | Path, out: str | Path) -> int:
    """Join every ``trace-rank*.json`` of ``folder`` into ``out``; return the events written.

    Raises:
        FileNotFoundError: ``folder`` holds no trace files.
        ValueError: a file is not a trace (cut off by a killed rank, say); the message names it.
    """
    files = sorted(Path(folder).glob("trace-rank*.json"))
    if not files:
        raise FileNotFoundError(f"trace merge: no trace-rank*.json in {folder}; expected the "
                                "folder a run's meta_dist_config.trace named")
    events = []
    for path in files:
        try:
            events += json.loads(path.read_text())["traceEvents"]
        except (ValueError, KeyError, TypeError) as error:  # JSONDecodeError is a ValueError
            raise ValueError(f"trace merge: {path} is not a whole trace ({type(error).__name__}: "
                             f"{error}); expected the JSON a rank writes at the end of fit: "
                             "leave it out (a rank killed while writing cuts it off)") from None
    events.sort(key=lambda event: (event["ph"] != "M", event.get("ts", 0.0)))
    Path(out).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return len(events)


def cli(argv: list[str]) -> int:
    """``trace merge DIR OUT.json``; return the exit code."""
    if len(argv) != 3 or argv[0] != "merge":
        print("usage: python -m meta_dist trace merge DIR OUT.json", file=sys.stderr)
        return 2
    try:
        count = merge(argv[1], argv[2])
    except (FileNotFoundError, ValueError) as error:
        print(error, file=sys.stderr)
        return 2
    print(f"{argv[2]}: {count} events from {argv[1]}")
    return 0
