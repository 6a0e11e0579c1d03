"""`gpujobs submit --out`'s download: a file written to a name of its own, then put in place whole."""

from __future__ import annotations

import httpx

from app import cli_submit


def test_a_download_leaves_another_downloads_partial_file_alone(tmp_path):
    """Two submits writing one file name into one folder at once (images of one name from two
    folders) shared the partial file `.mesh.stl.partial`: the second's open truncated what the first
    was writing, and each one's clean-up deleted the other's. Each now writes to a name of its own."""
    theirs = tmp_path / ".mesh.stl.partial"
    theirs.write_bytes(b"another download, half written")
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=b"solid mesh"))
    with httpx.Client(transport=transport, base_url="http://gpujobs.test") as http:
        written = cli_submit.download(http, "/files/x/mesh.stl", tmp_path / "mesh.stl")
    assert written.read_bytes() == b"solid mesh"
    assert theirs.read_bytes() == b"another download, half written"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".mesh.stl.partial", "mesh.stl"]
    assert written.stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask
