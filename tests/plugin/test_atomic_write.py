"""write_atomically: the node agent's one way to replace a file (checkpoints, CDI specs): whole or not at all."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from gpupart.core.errors import InvalidInput
from gpupart_plugin.checkpoint import write_atomically


@pytest.mark.parametrize("sync_file", [True, False])
def test_the_file_is_replaced_whole_and_no_temporary_file_stays(
    tmp_path: Path, sync_file: bool
) -> None:
    path = tmp_path / "made" / "here" / "state.json"  # the directories made when missing
    write_atomically(path, b"first", sync_file=sync_file)
    write_atomically(path, b"second, longer", sync_file=sync_file)
    write_atomically(path, b"third", sync_file=sync_file)  # shorter: nothing of the last left
    assert path.read_bytes() == b"third"
    assert [p.name for p in path.parent.iterdir()] == ["state.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    write_atomically(path, b"old")
    with pytest.raises(TypeError):
        write_atomically(path, "not bytes")  # type: ignore[arg-type]
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_a_path_that_cannot_be_written_is_named(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(InvalidInput, match="file/state.json"):
        write_atomically(tmp_path / "file" / "state.json", b"x")


def test_threads_writing_one_file_never_mix_their_data(tmp_path: Path) -> None:
    """Each thread writes through a temporary file of its own: what is read is always one
    thread's whole data."""
    path = tmp_path / "state.json"
    datas = [bytes([65 + i]) * (1000 + 7000 * i) for i in range(4)]
    write_atomically(path, datas[0])
    seen: set[bytes] = set()
    stop = threading.Event()

    def writer(data: bytes) -> None:
        for _ in range(200):
            write_atomically(path, data, sync_file=False)

    def reader() -> None:
        while not stop.is_set():
            seen.add(path.read_bytes())

    threads = [threading.Thread(target=writer, args=(d,)) for d in datas]
    watcher = threading.Thread(target=reader)
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watcher.join()
    assert seen <= set(datas)
    assert path.read_bytes() in datas
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]
