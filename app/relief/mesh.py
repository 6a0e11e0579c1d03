"""A closed, printable solid from a heightfield, and writing it to disk atomically.

Every solid cell contributes two top triangles and two bottom triangles (at z=0); every edge
between a solid cell and a hole or the outside gets a vertical wall quad. All faces wind
counter-clockwise seen from outside, so each edge is shared by exactly two faces with opposite
directions: the mesh is watertight with positive volume.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import numpy as np
import numpy.typing as npt
import trimesh

from app.relief import errors, heightmap

IntArray = npt.NDArray[np.int64]
PointArray = npt.NDArray[np.float64]
FORMATS = ("glb", "stl", "obj")


def build(field: heightmap.Heightfield, cell_mm: float, base_mm: float, depth_mm: float) -> trimesh.Trimesh:
    """Mesh the solid cells of `field`: heights scaled to base_mm..base_mm+depth_mm over a flat z=0 base."""
    cells = close_pinches(field.cells)
    if not cells.any():
        raise errors.BadInput("the mask leaves nothing to mesh")
    rows, cols = cells.shape
    row, col = np.mgrid[0 : rows + 1, 0 : cols + 1]
    # Image row 0 is the top of the picture, so it gets the largest y.
    top = np.stack(
        [col * cell_mm, (rows - row) * cell_mm, base_mm + depth_mm * field.heights.astype(np.float64)],
        axis=-1,
    ).reshape(-1, 3)
    bottom = top.copy()
    bottom[:, 2] = 0.0
    ids = np.arange(top.shape[0], dtype=np.int64).reshape(rows + 1, cols + 1)
    faces = np.concatenate([_caps(cells, ids, top.shape[0]), _walls(cells, ids, top.shape[0])])
    vertices, faces = _drop_unused(np.concatenate([top, bottom]), faces)
    return trimesh.Trimesh(vertices=vertices, faces=faces, process=False)


def close_pinches(cells: heightmap.BoolArray) -> heightmap.BoolArray:
    """Fill one empty cell of every 2x2 block whose solid cells touch only at a corner.

    Two solids meeting at a single vertex would share their wall edge there between four faces,
    which is not a manifold. Filling only adds cells, so the loop ends; real masks need 1-3 passes.
    """
    cells = cells.copy()
    while True:
        top_left, top_right = cells[:-1, :-1], cells[:-1, 1:]
        bottom_left, bottom_right = cells[1:, :-1], cells[1:, 1:]
        main = top_left & bottom_right & ~top_right & ~bottom_left
        anti = top_right & bottom_left & ~top_left & ~bottom_right
        if not (main.any() or anti.any()):
            return cells
        cells[:-1, 1:] |= main
        cells[:-1, :-1] |= anti


def _corner_ids(cells: heightmap.BoolArray, ids: IntArray) -> tuple[IntArray, ...]:
    """Vertex ids of each solid cell's corners: top-left, top-right, bottom-right, bottom-left (image)."""
    return ids[:-1, :-1][cells], ids[:-1, 1:][cells], ids[1:, 1:][cells], ids[1:, :-1][cells]


def _caps(cells: heightmap.BoolArray, ids: IntArray, n_top: int) -> IntArray:
    """Top triangles facing +z and bottom triangles facing -z, two of each per solid cell."""
    a, b, c, d = _corner_ids(cells, ids)
    # In 3D, d -> c -> b -> a runs counter-clockwise seen from above (y grows upwards in the image).
    top = [np.stack([d, c, b], axis=1), np.stack([d, b, a], axis=1)]
    bottom = [np.stack([d, b, c], axis=1) + n_top, np.stack([d, a, b], axis=1) + n_top]
    return np.concatenate(top + bottom)


def _walls(cells: heightmap.BoolArray, ids: IntArray, n_top: int) -> IntArray:
    """Two triangles per cell side that borders a hole or the outside, facing away from the cell."""
    padded = np.pad(cells, 1)
    a, b, c, d = _corner_ids(cells, ids)
    # (open side, u, v): the top face runs u -> v along that side, so the wall must run v -> u.
    sides = [
        (~padded[:-2, 1:-1], b, a),  # neighbour above in the image
        (~padded[1:-1, 2:], c, b),  # right
        (~padded[2:, 1:-1], d, c),  # below
        (~padded[1:-1, :-2], a, d),  # left
    ]
    walls = []
    for open_side, u, v in sides:
        hit = open_side[cells]
        u_top, v_top = u[hit], v[hit]
        u_bottom, v_bottom = u_top + n_top, v_top + n_top
        walls.append(np.stack([v_top, u_top, u_bottom], axis=1))
        walls.append(np.stack([v_top, u_bottom, v_bottom], axis=1))
    return np.concatenate(walls)


def _drop_unused(vertices: PointArray, faces: IntArray) -> tuple[PointArray, IntArray]:
    """Remove vertices no face uses (corners of empty cells) and renumber the faces."""
    used = np.zeros(vertices.shape[0], dtype=np.bool_)
    used[faces.ravel()] = True
    new_index = np.cumsum(used) - 1
    return vertices[used], new_index[faces]


def save(mesh: trimesh.Trimesh, directory: Path, file_format: str) -> Path:
    """Write `mesh.<format>` into `directory` via a temporary file and os.replace; return its path."""
    payload = mesh.export(file_type=file_format)
    data = payload.encode() if isinstance(payload, str) else payload
    if not isinstance(data, bytes):
        raise TypeError(f"trimesh returned {type(data).__name__} for {file_format}")
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"mesh.{file_format}"
    # A dot-name the service ignores; left behind only if the process is SIGKILLed mid-write.
    fd, temp_name = tempfile.mkstemp(dir=directory, prefix=".mesh-", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temp_name, 0o644)  # mkstemp makes it 0600; readers may be another user
        os.replace(temp_name, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp_name)
        raise
    return target
