"""meta_dist.train.memory.PeakMeter on the CuPy stand-in: a GPU's peak is the pool's most
bytes in use (an allocator wrapping the pool's malloc), not what the pool holds at the end."""

import pytest

from meta_dist.train.memory import PeakMeter

pytestmark = pytest.mark.gpu_standin
MIB = 2**20


def test_the_gpu_peak_is_the_pools_peak_not_its_size_now(cupy):
    pool = cupy.get_default_memory_pool()
    meter = PeakMeter(cupy)
    meter.reset()
    start = pool.used_bytes()
    big = cupy.zeros(MIB, cupy.float32)  # 4 MiB in use for a moment
    total = float((big + 1).sum())  # and a temporary of the same size
    del big
    pool.free_all_blocks()
    assert total == MIB and pool.used_bytes() == start and pool.total_bytes() < 4 * MIB
    assert meter.peak() >= start + 8 * MIB and meter.growth() >= 8 * MIB
    meter.reset()
    assert meter.growth() == 0
    kept = cupy.ones(1000, cupy.float64)
    assert meter.growth() == 8192 and float(kept.sum()) == 1000  # 8000 bytes, 512-byte blocks


def test_a_second_meter_shares_the_allocator(cupy):
    first = PeakMeter(cupy)
    installed = cupy.cuda.get_allocator()
    second = PeakMeter(cupy)
    assert cupy.cuda.get_allocator() == installed  # one wrapper, not one per meter
    second.reset()
    held = cupy.zeros(MIB // 4, cupy.uint8)
    assert second.growth() == first.growth() == MIB // 4  # one peak, read by both
    del held
