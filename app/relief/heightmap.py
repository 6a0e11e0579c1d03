"""From image planes to a normalised heightfield on a grid of square cells.

Resampling and blurring are linear, so both are dense row-stochastic matrices applied as
`rows @ plane @ cols.T`: one matmul pair per plane, identical on numpy and on PyTorch, which keeps
the two backends' results equal up to float32 rounding. Where the image has an alpha mask, colour
is weighted by alpha (premultiplied) so transparent pixels do not bleed into the edges.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from app.relief import errors, picture

# float32 at run time; numpy's stubs widen matmul results, so the type says only "floating".
FloatArray = npt.NDArray[np.floating[Any]]
BoolArray = npt.NDArray[np.bool_]

# Cells whose filtered alpha reaches this are solid.
ALPHA_CUTOFF = 0.5
# Vertices with less filtered alpha than this have no colour of their own to normalise.
_MIN_WEIGHT = 1e-6
# float32 matmuls leave ~1e-6 relative noise on a flat image; below this span it is flat.
_FLAT_SPAN = 1e-4


@dataclass(frozen=True, slots=True)
class Grid:
    """A grid of rows x cols square cells, each cell_mm wide; vertices are (rows+1) x (cols+1)."""

    rows: int
    cols: int
    cell_mm: float


@dataclass(frozen=True, slots=True)
class Filters:
    """Row-stochastic matrices mapping a (H, W) plane onto the vertex grid and the cell grid."""

    vertex_rows: FloatArray  # (rows+1, H)
    vertex_cols: FloatArray  # (cols+1, W)
    cell_rows: FloatArray  # (rows, H)
    cell_cols: FloatArray  # (cols, W)
    blur: tuple[FloatArray, FloatArray] | None  # Gaussian on the vertex grid: (rows+1)^2, (cols+1)^2


@dataclass(frozen=True, slots=True)
class Surface:
    """Filtered planes before normalisation; luminance is premultiplied by weight when weight is set."""

    luminance: FloatArray  # (rows+1, cols+1)
    weight: FloatArray | None  # filtered alpha at the vertices
    cell_alpha: FloatArray | None  # (rows, cols) alpha averaged over each cell


@dataclass(frozen=True, slots=True)
class Heightfield:
    """Vertex heights in 0..1 and which cells are solid."""

    heights: FloatArray  # (rows+1, cols+1)
    cells: BoolArray  # (rows, cols)


class Backend(Protocol):
    """Where the filter matmuls run: numpy here, PyTorch in torch_backend."""

    @property
    def name(self) -> str:
        """Short description of the device, for logs."""
        ...

    def upload(self, array: FloatArray) -> Any:
        """The array on the device, as something that supports `@`, `*` and `.T`."""
        ...

    def download(self, array: Any) -> FloatArray:
        """A device array back as a numpy array."""
        ...


class NumpyBackend:
    """The CPU path; needs nothing beyond numpy."""

    name = "cpu (numpy)"

    def upload(self, array: FloatArray) -> Any:
        """Numpy arrays are already where they need to be."""
        return array

    def download(self, array: Any) -> FloatArray:
        """Numpy arrays are already where they need to be."""
        result: FloatArray = np.asarray(array)
        return result


def surface(planes: picture.Planes, filters: Filters, backend: Backend) -> Surface:
    """Resample and blur the planes onto the grid, on the backend's device."""
    up = backend.upload
    rows, cols_t = up(filters.vertex_rows), up(filters.vertex_cols).T
    blur = None if filters.blur is None else (up(filters.blur[0]), up(filters.blur[1]).T)

    def to_vertices(plane: Any) -> FloatArray:
        grid = rows @ plane @ cols_t
        if blur is not None:
            grid = blur[0] @ grid @ blur[1]
        return backend.download(grid)

    luminance = up(planes.luminance)
    if planes.alpha is None:
        return Surface(to_vertices(luminance), None, None)
    alpha = up(planes.alpha)
    return Surface(
        luminance=to_vertices(luminance * alpha),
        weight=to_vertices(alpha),
        cell_alpha=backend.download(up(filters.cell_rows) @ alpha @ up(filters.cell_cols).T),
    )


def plan_grid(size_px: tuple[int, int], resolution: int, width_mm: float) -> Grid:
    """Fit `resolution` cells along the longer side of a (width, height) image; keep the aspect."""
    width, height = size_px
    longer = max(width, height)
    return Grid(
        rows=max(1, round(resolution * height / longer)),
        cols=max(1, round(resolution * width / longer)),
        cell_mm=width_mm / resolution,
    )


def plan_filters(shape_px: tuple[int, int], grid: Grid, smoothing: float) -> Filters:
    """Build the matrices that take a (height, width) plane onto `grid`, blurred by `smoothing` cells."""
    height, width = shape_px
    blur = None
    if smoothing > 0:
        blur = (_blur_matrix(grid.rows + 1, smoothing), _blur_matrix(grid.cols + 1, smoothing))
    return Filters(
        vertex_rows=_resample_matrix(height, grid.rows, vertices=True),
        vertex_cols=_resample_matrix(width, grid.cols, vertices=True),
        cell_rows=_resample_matrix(height, grid.rows, vertices=False),
        cell_cols=_resample_matrix(width, grid.cols, vertices=False),
        blur=blur,
    )


def _resample_matrix(n_px: int, n_cells: int, *, vertices: bool) -> FloatArray:
    """Triangle-filter weights sampling n_px pixels at cell corners (vertices) or cell centres."""
    step = n_px / n_cells
    positions = np.arange(n_cells + 1) * step if vertices else (np.arange(n_cells) + 0.5) * step
    centres = np.arange(n_px) + 0.5
    # Widening the tent to the cell size when shrinking averages every pixel in (antialiasing).
    support = max(step, 1.0)
    weights = np.clip(1.0 - np.abs(positions[:, None] - centres[None, :]) / support, 0.0, None)
    # Every position lies within half a pixel of some centre, so no row sums to zero.
    weights /= weights.sum(axis=1, keepdims=True)
    return weights.astype(np.float32)


def _blur_matrix(n: int, sigma: float) -> FloatArray:
    """Gaussian weights; normalising each row renormalises the kernel where it leaves the edge."""
    index = np.arange(n, dtype=np.float64)
    weights = np.exp(-0.5 * ((index[:, None] - index[None, :]) / sigma) ** 2)
    weights /= weights.sum(axis=1, keepdims=True)
    return weights.astype(np.float32)


def heights(surface: Surface, invert: bool) -> Heightfield:
    """Normalise the filtered luminance to 0..1 over the solid part; raise BadInput if none is solid."""
    cells = (
        np.ones((surface.luminance.shape[0] - 1, surface.luminance.shape[1] - 1), dtype=np.bool_)
        if surface.cell_alpha is None
        else surface.cell_alpha >= ALPHA_CUTOFF
    )
    if not cells.any():
        raise errors.BadInput(
            f"the mask leaves nothing to mesh: no part of the image is at least {ALPHA_CUTOFF:.0%} opaque "
            "(use --mask none to keep every cell)"
        )
    values, supported = _unpremultiply(surface)
    level = _normalise(values, _corners(cells) & supported, invert)
    # Unsupported vertices only touch cells added to close pinches; rest them on the base.
    return Heightfield(np.where(supported, level, 0.0).astype(np.float32), cells)


def _unpremultiply(surface: Surface) -> tuple[FloatArray, BoolArray]:
    """Luminance per vertex, and which vertices have enough alpha to carry one."""
    if surface.weight is None:
        return surface.luminance, np.ones(surface.luminance.shape, dtype=np.bool_)
    supported = surface.weight > _MIN_WEIGHT
    return surface.luminance / np.where(supported, surface.weight, 1.0), supported


def _normalise(values: FloatArray, used: BoolArray, invert: bool) -> FloatArray:
    """Map the min..max of the used values to 0..1, or 1..0 inverted (clipping the rest); a flat
    image maps to 0 either way, a slab of base thickness."""
    if not used.any():
        return np.zeros_like(values)
    # float64: in float32, `values - low` overflows to inf for spans past 3.4e38, and inf / inf is NaN.
    wide = values.astype(np.float64)
    low, high = float(wide[used].min()), float(wide[used].max())
    span = high - low
    if span <= _FLAT_SPAN * max(abs(low), abs(high)):
        return np.zeros_like(values)
    level = np.clip((wide - low) / span, 0.0, 1.0)
    result: FloatArray = (1.0 - level if invert else level).astype(np.float32)
    return result


def _corners(cells: BoolArray) -> BoolArray:
    """Vertices that are a corner of at least one True cell."""
    rows, cols = cells.shape
    used = np.zeros((rows + 1, cols + 1), dtype=np.bool_)
    used[:-1, :-1] |= cells
    used[:-1, 1:] |= cells
    used[1:, :-1] |= cells
    used[1:, 1:] |= cells
    return used
