"""ZeRO's memory promise measured from the operating system, one level per fresh process.

Each rank's peak RSS growth over building the model, building the trainer and three Adam steps must
stay within 5% + one bucket of the model state its level promises (DESIGN.md: 4P, 2P + 2P/N, P +
3P/N, 4P/N for P bytes of float32 parameters), and fall level by level. Level 3's working set is a
bucket per kind of buffer: the gradient staging, the piece of a large layer being gathered, and the
gather of the layers read whole (small ones here), so its bound is three buckets. The probe builds
the model inside ``nn.init.deferred()`` (DeepSpeed's zero.Init): built whole on every rank first,
level 3 could not keep its promise from 4 ranks up (the model alone is 4P/N there). The model is the
one the memory issue was measured on (20.4M parameters, P = 78 MiB); its 3000 x 3000 layers (34 MiB)
are larger than the 4 MiB bucket, so they must be reduced and, at level 3, gathered in pieces
(gathered whole they added 34 MiB: 119 MiB at 4 ranks against a bound of 94), and level 3 must not
copy the whole model beside the user's (that added the largest layer again while the copy was made).
"""

import re

import pytest
from mpirun import run

DIMS, BUCKET_MB = "784-3000-3000-3000-10", 4.0


def measure(ranks, level):
    result = run(ranks, ["tests/scripts/memory_probe.py", str(level), DIMS, str(BUCKET_MB)],
                 timeout=300)
    assert result.returncode == 0 and not result.timed_out, str(result)
    rows = re.findall(r"rank (\d+) peak_mib ([\d.]+) promise_mib ([\d.]+) report_mib ([\d.]+) "
                      r"buffers_mib ([\d.]+)", result.output)
    assert len(rows) == ranks, str(result)
    return [tuple(float(v) for v in row[1:]) for row in rows]


@pytest.mark.parametrize("ranks", [2, 4])
def test_each_level_holds_what_its_formula_says(ranks):
    peaks = {}
    for level in (0, 1, 2, 3):
        rows = measure(ranks, level)
        for peak, promise, report, buffers in rows:
            working = BUCKET_MB
            if level == 3:  # staging, a large layer's piece, the gather of the small layers
                assert buffers <= 3 * BUCKET_MB + 0.01, buffers
                working = 3 * BUCKET_MB
            bound = promise * 1.05 + working
            assert peak <= bound, (f"level {level} at {ranks} ranks: peak RSS growth {peak:.1f} "
                                   f"MiB > {bound:.1f} (model state {promise:.1f} MiB)")
            assert report <= bound  # what the report accounts for fits the promise too
        peaks[level] = max(row[0] for row in rows)
    assert peaks[0] > peaks[1] > peaks[2] > peaks[3], peaks
