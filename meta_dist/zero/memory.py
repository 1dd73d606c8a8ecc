"""What a rank should hold at its ZeRO level, from the partition plan alone.

DESIGN.md's model-state table (fp32 Adam: 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N bytes) written
for any dtype and optimizer, with the plan's padding (Ψ is the padded element count, Ψ/N a
rank's shard of every bucket), plus the buffers the plan implies: staging (one bucket, two
with overlap), level 2's local gradient while micro-batches add up, level 3's gather buffers
(the largest group gathered whole, two with overlap; the whole model without resharding) and
piece buffers (a bucket, two with overlap) for the layers it streams by rows.

``predict`` reads only sizes and settings, never the arrays a stage allocated, so it is an
account to hold ``ZeroStage.memory_report`` (what the arrays hold) against: a buffer the plan
does not call for shows up as the difference (tests/mpi/test_zero.py checks they are equal).
"""

from __future__ import annotations

from typing import Any

FIELDS = ("params", "grads", "optimizer", "buffers")


def predict(stage: Any) -> dict[str, int]:
    """Return the bytes of params, grads, optimizer state and buffers ``stage`` should hold.

    Args:
        stage: a ZeroStage0..3 after construction (its plan: ``flat.buckets``, the level, the
            world size, the dtypes, the optimizer and the overlap/accumulation settings).
    """
    buckets = stage.flat.buckets
    level, ranks = stage.level, stage.comm.size
    item = stage.flat.dtype.itemsize  # working parameters and gradients (fp16, bf16 or fp32)
    full = sum(b.padded_size for b in buckets)  # Ψ with padding
    shard = sum(b.shard_size for b in buckets)  # Ψ/N: this rank's slice of every bucket
    owned = full if level == 0 else shard  # what the optimizer updates
    master = 4 if stage.master is not None else 0  # mixed precision's fp32 copy, owned part
    largest = max(b.padded_size for b in buckets)
    two = stage.overlap and len(buckets) > 1
    if stage.accumulate == 1 and (level < 2 or ranks == 1):
        staging = 0  # backward writes straight into the gradients (level 2: the shard)
    else:
        staging = (2 if two else 1) * largest
    buffers = staging
    if level >= 2 and stage.accumulate > 1:
        buffers += full  # the local gradient the micro-batches add up in
    if level == 3:
        if stage.keep:  # forward's gathers stay for backward: one buffer, the whole model
            buffers += full
        else:  # whole groups in gather buffers; streamed layers a bucket at a time
            copies = 2 if stage.overlap else 1
            whole = [g for i, g in enumerate(stage.groups) if i not in stage.streamed]
            buffers += copies * max((g["stop"] - g["start"] for g in whole), default=0)
            if stage.streamed:
                buffers += copies * max(b.padded_size for i in stage.streamed
                                        for b in stage.groups[i]["buckets"])
    return {"params": (shard if level == 3 else full) * item + owned * master,
            "grads": (shard if level >= 2 else full) * item,
            "optimizer": owned * stage.optimizer.state_bytes_per_element(),
            "buffers": buffers * item}
