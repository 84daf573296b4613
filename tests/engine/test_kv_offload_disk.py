"""engine/kv_offload/disk_blocks.py alone: blocks round-trip, the total stays within
its cap (least recently used out first), a restart finds them, torn writes' leftovers
are removed, and a file of the wrong length or digest is dropped, never returned."""
from __future__ import annotations

import os
import stat

from kvserve.engine.kv_offload.disk_blocks import _HEADER, DiskBlocks


def block(i: int, size: int = 1000) -> memoryview:
    return memoryview(bytes((i + j) % 256 for j in range(size)))


def test_round_trip_cap_and_restart(tmp_path):
    disk = DiskBlocks(tmp_path, "layout", capacity_bytes=3 * (_HEADER + 1000))
    for i in range(3):
        disk.write(bytes([i]) * 32, block(i))
    assert disk.read(bytes([0]) * 32, 1000) == block(0)  # now the most recent
    disk.write(bytes([3]) * 32, block(3))  # over the cap: block 1 goes
    assert bytes([1]) * 32 not in disk and len(disk) == 3
    assert stat.S_IMODE(os.stat(disk.dir).st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in disk.dir.iterdir())

    (disk.dir / "ab.kvb.123.tmp").write_bytes(b"torn")
    again = DiskBlocks(tmp_path, "layout", capacity_bytes=3 * (_HEADER + 1000))
    assert len(again) == 3 and again.read(bytes([3]) * 32, 1000) == block(3)
    assert not (disk.dir / "ab.kvb.123.tmp").exists()
    assert len(DiskBlocks(tmp_path, "other layout", 1 << 20)) == 0


def test_wrong_length_or_digest_is_dropped(tmp_path):
    disk = DiskBlocks(tmp_path, "layout", capacity_bytes=1 << 20)
    good, short, flipped = (bytes([i]) * 32 for i in range(3))
    for h in (good, short, flipped):
        disk.write(h, block(h[0]))
    path = disk._path(short)
    path.write_bytes(path.read_bytes()[:-1])
    path = disk._path(flipped)
    data = bytearray(path.read_bytes())
    data[_HEADER + 10] ^= 1
    path.write_bytes(bytes(data))
    assert disk.read(short, 1000) is None and disk.read(flipped, 1000) is None
    assert disk.read(good, 999) is None  # a block of another size is no block of ours
    assert disk.corrupt == 3 and len(disk) == 0
    assert list(disk.dir.iterdir()) == []
