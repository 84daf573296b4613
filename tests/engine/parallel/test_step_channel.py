"""The step channel's shared-memory segments (engine/ranks/step_channel.py) are
rank 0's alone: in /dev/shm, which every local user may write to, each is created
under a random name, exclusively (never a file or symlink planted at that name),
mode 0600 whatever the umask, and unlinked once replaced or closed; another rank
maps only such a file. Rank 0 runs here in a one-rank gloo group (the header's
broadcast is then a no-op); a second channel in this process plays rank 1."""
from __future__ import annotations

import glob
import os
import re
import secrets
import stat

import pytest
import torch
import torch.distributed as dist

from kvserve.engine.kernels.attention.step_metadata import build_host_step
from kvserve.engine.ranks import step_channel
from kvserve.engine.ranks.step_channel import StepChannel

CPU = torch.device("cpu")


@pytest.fixture
def one_rank_group():
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def stem(one_rank_group):
    name = f"kvserve-test-{secrets.token_hex(4)}"
    yield name
    for leftover in glob.glob(os.path.join(step_channel._segment_dir(), name + "*")):
        os.unlink(leftover)


def send_step(channel: StepChannel, tokens: int = 3) -> None:
    host = build_host_step([0], [tokens], [[0, 1, 2, 3]], 16)
    channel.send(host, torch.arange(tokens), torch.tensor([tokens - 1]))


def segments(name: str) -> list[str]:
    return glob.glob(os.path.join(step_channel._segment_dir(), name + "*"))


def test_a_segment_is_rank_0s_alone_under_a_random_name(stem, monkeypatch):
    monkeypatch.setattr(step_channel, "_INITIAL_CAPACITY", 64)  # int64s
    old_umask = os.umask(0)  # the mode must not be the umask's (0666 under 0)
    try:
        channel = StepChannel(stem, 0, CPU, 16)
        send_step(channel)
    finally:
        os.umask(old_umask)
    [path] = segments(stem)
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.geteuid()
    assert re.fullmatch(re.escape(stem) + r"-0-[0-9a-f]{32}", os.path.basename(path))
    other = StepChannel(stem, 0, CPU, 16)  # the same prefix: another name all the same
    send_step(other)
    assert len(set(segments(stem))) == 2
    other.close()

    # Outgrown: a new segment, as private, and the old one's name gone.
    send_step(channel, tokens=40)  # 40 ids, positions and slots: over 64 int64s
    [grown] = segments(stem)
    assert grown != path and channel.generation == 1
    assert stat.S_IMODE(os.lstat(grown).st_mode) == 0o600
    channel.close()
    assert segments(stem) == []


@pytest.mark.parametrize("planted", ["file", "symlink", "dangling symlink"])
def test_creation_refuses_what_is_already_at_its_name(stem, tmp_path, monkeypatch, planted):
    token = [0x1234, 0x5678]
    monkeypatch.setattr(step_channel, "_new_token", lambda: list(token))
    channel = StepChannel(stem, 0, CPU, 16)
    path = channel._segment_path(0, token)
    target = tmp_path / "target"
    if planted == "file":
        with open(path, "w") as f:
            f.write("planted")
        os.chmod(path, 0o666)
    else:
        if planted == "symlink":
            target.write_text("not to be truncated")
        os.symlink(target, path)
    with pytest.raises(FileExistsError):
        send_step(channel)
    if planted == "file":
        assert open(path).read() == "planted"
    elif planted == "symlink":
        assert target.read_text() == "not to be truncated"
    else:
        assert not target.exists()  # not created through the link
    assert channel.generation == -1 and channel.buffer is None
    os.unlink(path)


def test_another_rank_maps_the_segment_and_refuses_a_foreign_one(stem):
    rank0 = StepChannel(stem, 0, CPU, 16)
    send_step(rank0)
    rank1 = StepChannel(stem, 1, CPU, 16)
    rank1._map(rank0.generation, rank0.token, rank0.capacity)
    assert torch.equal(rank1.buffer[:8], rank0.buffer[:8])
    rank0.buffer[:4] = torch.tensor([7, 8, 9, 10])  # written after: seen, one memory
    assert rank1.buffer[:4].tolist() == [7, 8, 9, 10]

    path = rank0.path
    reader = StepChannel(stem, 1, CPU, 16)
    os.chmod(path, 0o644)  # others may read it: not rank 0's private segment
    with pytest.raises(RuntimeError, match="refusing it"):
        reader._map(rank0.generation, rank0.token, rank0.capacity)
    os.chmod(path, 0o600)
    if os.geteuid() == 0:  # another user's file of that name
        os.chown(path, 65534, 65534)
        with pytest.raises(RuntimeError, match="owner uid 65534"):
            reader._map(rank0.generation, rank0.token, rank0.capacity)
        os.chown(path, 0, 0)
    os.rename(path, path + ".real")
    os.symlink(path + ".real", path)  # a symlink is never followed
    with pytest.raises(OSError):
        reader._map(rank0.generation, rank0.token, rank0.capacity)
    os.unlink(path)
    os.unlink(path + ".real")
    rank0.path = None
