"""Spot positions: read or find observed spots, locate the model's spots near them, and measure the offsets.

The pixel-based refinement never looks at spots, but its result is judged by
them: :func:`spot_offsets` compares observed spot centroids with the
centroids of the simulated spots next to them, and the rms of those offsets
(pixels) before and after a refinement says whether the model moved onto the
data.

Coordinates: ``(x, y)`` = (fast, slow) in **pixels from the corner of pixel (0, 0)**, so the
centre of pixel index ``i`` is at ``i + 0.5`` (DIALS, the thaumatin spot lists and nanoBragg agree).

* :func:`read_spot_list`: a text table: x, y named by its header (ours, DIALS-like names) or by
  ``--spot-columns``, or a header-less ``x y [z]``; positions off the detector are refused;
* :func:`find_spots`: a simple spot finder (local-mean background, threshold, 8-connected
  components of at least ``min_pixels``, background-subtracted centroids);
* :func:`window_mask`: the pixels within a square window around each spot (to simulate only those);
* :func:`model_centroids`: for each observed spot, the peak of the model's Bragg image within
  ``search`` pixels and the intensity-weighted centroid of the ``box`` around that peak;
* :func:`spot_offsets` / :class:`SpotOffsets`: both together, with the rms (and, with ``keep_model``,
  the rendered model, which :mod:`refine.quality.spot_floor` turns into the offsets' shot-noise floor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import torch

from nbtorch.errors import InputError
from nbtorch.io.raw import read_text_lines

__all__ = ["read_spot_list", "find_spots", "window_mask", "model_centroids", "spot_offsets", "SpotOffsets",
           "render_pixels"]


#: header names (lower case, units in brackets dropped) of the observed x (fast) and y (slow) pixel positions
X_NAMES = ("x", "xobs", "x_obs", "x_px", "xobs_px", "x_obs_px", "x.px", "xobs.px", "xobs.px.value", "x_fast", "fast",
           "xcentroid", "x_centroid", "xcen")
Y_NAMES = ("y", "yobs", "y_obs", "y_px", "yobs_px", "y_obs_px", "y.px", "yobs.px", "yobs.px.value", "y_slow", "slow",
           "ycentroid", "y_centroid", "ycen")
#: header names that stand for three columns (DIALS' ``xyzobs.px.value``, ``miller_index`` ...)
_TRIPLES = {"xyzobs": ("xobs", "yobs", "zobs"), "xyzcal": ("xcal", "ycal", "zcal"), "miller_index": ("h", "k", "l"),
            "hkl": ("h", "k", "l")}
#: most numeric columns of a header-less file read as ``x y [z or intensity]``
HEADERLESS_MAX_COLUMNS = 3


def _fields(text: str) -> list[str]:
    """Whitespace-, comma- or semicolon-separated fields; brackets around vectors dropped."""
    for ch in ",;()":
        text = text.replace(ch, " ")
    return text.split()


def _norm(name: str) -> str:
    """A header name without units or notes in brackets, lower case (``x_px(fast)`` -> ``x_px``)."""
    name = name.strip().lower()
    for ch in "([":
        name = name.split(ch, 1)[0]
    return name.strip()


def _header_columns(line: str) -> list[str]:
    """Column names of a header line, names that stand for three columns expanded (``xyzobs.px.value``)."""
    out: list[str] = []
    for tok in line.replace(",", " ").replace(";", " ").split():
        key = _norm(tok)
        stem = key.split(".", 1)[0]
        if stem in _TRIPLES:
            out += [c + key[len(stem):] for c in _TRIPLES[stem]]
        else:
            out.append(key)
    return out


def _find(columns: Sequence[str], names: Sequence[str]) -> int | None:
    for i, c in enumerate(columns):
        if c in names:
            return i
    return None


def _is_number(tok: str) -> bool:
    try:
        float(tok)
    except ValueError:
        return False
    return True


def read_spot_list(path: str, columns: Sequence[str] | str | None = None,
                   shape: tuple[int, int] | None = None) -> np.ndarray:
    """Observed spots ``(n, 2)`` (x fast, y slow; pixels from the corner of pixel (0, 0), centres at ``i + 0.5``).

    Accepted text tables (fields separated by blanks, commas or semicolons; ``#`` starts a comment):

    * **a header naming the columns**: a first line that is not numbers, or a ``#`` comment line, whose
      names include an x and a y column, case-insensitive, units in brackets ignored: ``x``/``y``,
      ``xobs``/``yobs``, ``x_px``/``y_px`` (the thaumatin lists: ``# x_px(fast) y_px(slow) ...``),
      ``xobs.px.value`` ..., and names standing for three columns: ``xyzobs.px.value`` (x y z, as DIALS
      writes its reflection tables), ``miller_index``/``hkl`` (h k l).  Predicted positions (``x_pred``,
      ``xcal``) are never taken for observed ones;
    * **no header**: at most :data:`HEADERLESS_MAX_COLUMNS` numeric columns, ``x y [z or intensity]``.  A
      wider table without a header is refused: its x and y cannot be told (a DIALS table ``h k l ... x y``
      would be read as x = h, y = k);
    * ``columns``: the x and y columns named explicitly (``--spot-columns``), two names of the header or
      two 1-based column numbers (``"x_px,y_px"``, ``"4,5"``); this overrides the above.

    Arguments:
        path: the text file.
        columns: the x and y columns (a ``"x,y"`` string or two items); None = from the header.
        shape: (slow, fast) pixels of the detector: every position must lie on it (``0 <= x <= fast``,
            ``0 <= y <= slow``); None = not checked.

    Raises:
        InputError: one line naming the file and the problem: no usable rows, columns that cannot be
            identified, a value that is not a number, positions off the detector.
    """
    lines = read_text_lines(path, "spot list")
    where = f"spot list {path}"
    header, first_data = _spot_header(lines, where)
    ix, iy, how = _xy_columns(lines, header, first_data, columns, where)
    out, line_numbers = _spot_rows(lines, first_data, ix, iy, how, where)
    if shape is not None:
        _check_on_detector(out, line_numbers, shape, how, where)
    return out


def _spot_header(lines: Sequence[str], where: str) -> tuple[list[str] | None, int]:
    """The header (a non-numeric first line, or the last comment naming x and y before the first data row)
    and the line number of the first data row."""
    header: list[str] | None = None
    for number, line in enumerate(lines, 1):
        body, _, comment = line.partition("#")
        toks = _fields(body)
        if not toks:
            if comment.strip():
                cols = _header_columns(comment)
                if _find(cols, X_NAMES) is not None and _find(cols, Y_NAMES) is not None:
                    header = cols
            continue
        if not any(_is_number(t) for t in toks):  # a line of names: the header
            header = _header_columns(body)
            continue
        return header, number
    raise InputError(f"{where}: no spots found in the file (no row of numbers)")


def _xy_columns(lines: Sequence[str], header: list[str] | None, first_data: int,
                columns: Sequence[str] | str | None, where: str) -> tuple[int, int, str]:
    """The 0-based x and y columns and how they were chosen (named, from the header, or the only two)."""
    if columns is not None:
        items = _csv_items(columns)
        if len(items) != 2:
            raise InputError(f"--spot-columns: expected two columns (x,y), got {','.join(items) or 'nothing'}")
        ix, iy = (_column_index(c, header, where) for c in items)
        how = f"--spot-columns {','.join(items)}"
    elif header is not None:
        ix, iy = _find(header, X_NAMES), _find(header, Y_NAMES)
        if ix is None or iy is None:
            raise InputError(f"{where}: the header names no x and y columns ({' '.join(header[:12])}); "
                             "name them with --spot-columns X,Y (names or 1-based numbers)")
        how = f"header columns {header[ix]}, {header[iy]}"
    else:
        width = len(_fields(lines[first_data - 1].split("#", 1)[0]))
        if width > HEADERLESS_MAX_COLUMNS:
            raise InputError(f"{where}: {width} columns and no header naming them, so x and y cannot be told; add a "
                             "header line (e.g. 'x y ...') or name them with --spot-columns X,Y (1-based numbers)")
        ix, iy = 0, 1
        how = "columns 1 and 2 (no header)"
    if ix == iy:
        raise InputError(f"{where}: x and y are the same column ({how})")
    return ix, iy, how


def _spot_rows(lines: Sequence[str], first_data: int, ix: int, iy: int, how: str,
               where: str) -> tuple[np.ndarray, list[int]]:
    """``(n, 2)`` x, y of every data row and their line numbers."""
    rows, numbers = [], []
    for number, line in enumerate(lines[first_data - 1:], first_data):
        toks = _fields(line.split("#", 1)[0])
        if not toks:
            continue
        try:
            x, y = float(toks[ix]), float(toks[iy])
        except (ValueError, IndexError):
            raise InputError(f"{where} line {number}: expected numbers in columns {ix + 1} and {iy + 1} (x, y: "
                             f"{how}), got {line.strip()!r}") from None
        if not (math.isfinite(x) and math.isfinite(y)):
            raise InputError(f"{where} line {number}: spot position is not finite")
        rows.append((x, y))
        numbers.append(number)
    if not rows:
        raise InputError(f"{where}: no spots found in the file")
    return np.asarray(rows, dtype=np.float64), numbers


def _check_on_detector(out: np.ndarray, line_numbers: list[int], shape: tuple[int, int], how: str,
                       where: str) -> None:
    slow, fast = int(shape[0]), int(shape[1])
    off = (out[:, 0] < 0) | (out[:, 0] > fast) | (out[:, 1] < 0) | (out[:, 1] > slow)
    if off.any():
        k = int(np.argmax(off))
        raise InputError(f"{where}: {int(off.sum())} of {len(out)} positions fall outside the {fast} x {slow} "
                         f"pixel detector (line {line_numbers[k]}: x={out[k, 0]:g}, y={out[k, 1]:g}; x and y read "
                         f"from {how}); wrong columns? name them with --spot-columns X,Y")


def _csv_items(columns: Sequence[str] | str) -> list[str]:
    if isinstance(columns, str):
        return [c.strip() for c in columns.split(",") if c.strip()]
    return [str(c).strip() for c in columns if str(c).strip()]


def _column_index(item: str, header: list[str] | None, where: str) -> int:
    """0-based index of one ``--spot-columns`` item: a 1-based number or a header name."""
    if item.isdigit():
        if int(item) < 1:
            raise InputError(f"--spot-columns: column numbers start at 1, got {item}")
        return int(item) - 1
    if header is None:
        raise InputError(f"--spot-columns: {where} has no header naming its columns, so {item!r} cannot be found; "
                         "give 1-based column numbers")
    key = _norm(item)
    if key not in header:
        raise InputError(f"--spot-columns: no column {item!r} in the header of {where} "
                         f"(columns: {' '.join(header[:16])})")
    return header.index(key)


def _box_sum(a: np.ndarray, k: int) -> np.ndarray:
    """Sum over the (2k+1)^2 box around each pixel (edges clipped), via an integral image."""
    c = np.pad(a, ((1, 0), (1, 0))).cumsum(0).cumsum(1)
    ny, nx = a.shape
    y0 = np.clip(np.arange(ny) - k, 0, ny)
    y1 = np.clip(np.arange(ny) + k + 1, 0, ny)
    x0 = np.clip(np.arange(nx) - k, 0, nx)
    x1 = np.clip(np.arange(nx) + k + 1, 0, nx)
    return c[y1][:, x1] - c[y0][:, x1] - c[y1][:, x0] + c[y0][:, x0]


def _label(cand: np.ndarray) -> np.ndarray:
    """8-connected components of a bool image: int labels (0 = background), by min-label propagation."""
    ny, nx = cand.shape
    big = np.iinfo(np.int64).max
    lab = np.where(cand, np.arange(1, cand.size + 1, dtype=np.int64).reshape(ny, nx), big)
    while True:
        p = np.pad(lab, 1, constant_values=big)
        best = lab.copy()
        for dy in (-1, 0, 1):
            for dx in (-1, 0, 1):
                if dy or dx:
                    np.minimum(best, p[1 + dy:1 + dy + ny, 1 + dx:1 + dx + nx], out=best)
        best = np.where(cand, best, big)
        if np.array_equal(best, lab):
            break
        lab = best
    out = np.where(cand, lab, 0)
    _, inv = np.unique(out, return_inverse=True)
    return inv.reshape(ny, nx)


def find_spots(image: np.ndarray, mask: np.ndarray | None = None, *, sigma: float = 5.0, min_counts: float = 3.0,
               min_pixels: int = 3, background_box: int = 7, roi: Sequence[int] | None = None) -> np.ndarray:
    """A simple spot finder: ``(n, 2)`` background-subtracted centroids (x fast, y slow, centres at ``i + 0.5``).

    Arguments:
        image: (slow, fast) counts.
        mask: (slow, fast) bool, True = usable pixel (default: all).
        sigma: a pixel is a candidate when ``counts > bg + sigma * sqrt(max(bg, 1))`` and ``counts - bg > min_counts``,
            ``bg`` the mean of the usable pixels in the ``(2 background_box + 1)^2`` box around it.
        min_pixels: smallest 8-connected component kept.
        roi: ``(x0, x1, y0, y1)`` inclusive bounds to search (default: the whole image).
    """
    img = np.asarray(image, dtype=np.float64)
    m = np.ones(img.shape, dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
    x0, x1, y0, y1 = roi if roi is not None else (0, img.shape[1] - 1, 0, img.shape[0] - 1)
    sub = np.where(m, img, 0.0)[y0:y1 + 1, x0:x1 + 1]
    ms = m[y0:y1 + 1, x0:x1 + 1]
    n = _box_sum(ms.astype(np.float64), background_box)
    bg = _box_sum(sub, background_box) / np.maximum(n, 1.0)
    excess = sub - bg
    cand = ms & (excess > sigma * np.sqrt(np.maximum(bg, 1.0))) & (excess > min_counts)
    if not cand.any():
        return np.zeros((0, 2))
    lab = _label(cand)
    count = np.bincount(lab.ravel())
    w = np.where(cand, excess, 0.0).ravel()
    yy, xx = np.indices(lab.shape)
    sw = np.bincount(lab.ravel(), weights=w)
    sx = np.bincount(lab.ravel(), weights=w * (xx.ravel() + 0.5))
    sy = np.bincount(lab.ravel(), weights=w * (yy.ravel() + 0.5))
    keep = (np.arange(count.size) > 0) & (count >= min_pixels) & (sw > 0)
    return np.stack([sx[keep] / sw[keep] + x0, sy[keep] / sw[keep] + y0], axis=1)


def window_mask(shape: tuple[int, int], spots: np.ndarray, half: int) -> np.ndarray:
    """Bool (slow, fast): True within ``half`` pixels (a square) of each spot's pixel."""
    out = np.zeros(shape, dtype=bool)
    ny, nx = shape
    for x, y in np.asarray(spots).reshape(-1, 2):
        i, j = int(math.floor(x)), int(math.floor(y))
        out[max(j - half, 0):max(min(j + half + 1, ny), 0), max(i - half, 0):max(min(i + half + 1, nx), 0)] = True
    return out


def render_pixels(sim, values: Mapping[str, float], pixels: np.ndarray) -> np.ndarray:
    """The simulator's Bragg image (photons, no scale or background) on the True pixels of ``pixels`` (0 elsewhere).

    Only those pixels are computed (a :meth:`~nbtorch.Simulator.restricted` copy of ``sim``; ``sim`` is unchanged).
    """
    pixels = np.asarray(pixels, dtype=bool)
    ys, xs = np.nonzero(pixels)
    if ys.size == 0:
        return np.zeros(pixels.shape)
    roi = (int(xs.min()), int(xs.max()), int(ys.min()), int(ys.max()))
    overrides = {n: torch.tensor(float(values[n]), dtype=torch.float64)
                 for n in sim.parameter_names() if n in values}  # a multi-panel detector's names too
    with torch.no_grad():
        img, _ = sim.restricted(pixels).render(roi=roi, **overrides)
    out = np.zeros(pixels.shape)
    x0, x1, y0, y1 = roi
    out[y0:y1 + 1, x0:x1 + 1] = img.detach().cpu().double().numpy()
    return np.where(pixels, out, 0.0)


def model_centroids(model: np.ndarray, spots: np.ndarray, *, search: int = 6, box: int = 2,
                    min_peak: float = 0.0) -> np.ndarray:
    """Model spot centroid ``(n, 2)`` next to each observed spot (NaN where the model has no spot there).

    For observed spot ``(x, y)``: the local maxima of the model's Bragg image (pixels not below
    any of their 8 neighbours) above ``min_peak`` within ``search`` pixels (a square); the one
    nearest the observed spot, unless it lies on the border of the search window (then the
    model's spot is really elsewhere); and the centroid of the ``(2 box + 1)^2`` pixels around it,
    weighted by the model value.  ``model`` is the Bragg part only (no background) and must be
    rendered ``search + box`` pixels around each spot (:func:`window_mask`).
    """
    model = np.asarray(model, dtype=np.float64)
    ny, nx = model.shape
    padded = np.pad(model, 1, constant_values=-np.inf)
    peak = model > min_peak
    for dy in (-1, 0, 1):
        for dx in (-1, 0, 1):
            if dy or dx:
                peak &= model >= padded[1 + dy:1 + dy + ny, 1 + dx:1 + dx + nx]
    out = np.full((len(spots), 2), np.nan)
    for k, (x, y) in enumerate(np.asarray(spots).reshape(-1, 2)):
        i, j = int(math.floor(x)), int(math.floor(y))
        ya, yb, xa, xb = max(j - search, 0), min(j + search + 1, ny), max(i - search, 0), min(i + search + 1, nx)
        if ya >= yb or xa >= xb:
            continue
        pj, pi = np.nonzero(peak[ya:yb, xa:xb])
        if pj.size == 0:
            continue
        pj, pi = pj + ya, pi + xa
        best = int(np.argmin((pi + 0.5 - x) ** 2 + (pj + 0.5 - y) ** 2))
        pj, pi = int(pj[best]), int(pi[best])
        if abs(pj - j) == search or abs(pi - i) == search:
            continue  # on the window border: a neighbouring spot, not this one
        sa, sb, ta, tb = max(pj - box, 0), min(pj + box + 1, ny), max(pi - box, 0), min(pi + box + 1, nx)
        w = np.clip(model[sa:sb, ta:tb], 0.0, None)
        if not w.sum() > 0:
            continue
        gy, gx = np.mgrid[sa:sb, ta:tb]
        out[k] = ((w * (gx + 0.5)).sum() / w.sum(), (w * (gy + 0.5)).sum() / w.sum())
    return out


@dataclass(frozen=True)
class SpotOffsets:
    """Observed spots against the model's.

    Attributes:
        observed: (n, 2) observed centroids (px).
        predicted: (n, 2) model centroids (px; NaN = no model spot within ``search``).
        offsets: (n, 2) predicted - observed (px; NaN where unmatched).
        bragg: (slow, fast) the model's Bragg image (photons, no scale or background) the centroids were
            measured on, rendered only within ``window`` pixels (a square) of each observed spot (0 elsewhere);
            None when not kept.  :func:`refine.quality.spot_floor.spot_floor` reuses it.
        window: the half-width of those rendered windows (px).
    """

    observed: np.ndarray = field(repr=False)
    predicted: np.ndarray = field(repr=False)
    offsets: np.ndarray = field(repr=False)
    bragg: np.ndarray | None = field(default=None, repr=False, compare=False)
    window: int = 0

    @property
    def matched(self) -> np.ndarray:
        """(n,) bool: a model spot was found."""
        return np.isfinite(self.offsets).all(axis=1)

    def rms(self, among: np.ndarray | None = None) -> float:
        """rms offset ``sqrt(mean(dx^2 + dy^2))`` (px) over matched spots (and ``among``, a bool (n,), if given)."""
        sel = self.matched if among is None else self.matched & among
        if not sel.any():
            return math.nan
        d = self.offsets[sel]
        return float(np.sqrt(np.mean((d ** 2).sum(axis=1))))

    def mean(self, among: np.ndarray | None = None) -> tuple[float, float]:
        """Mean offset (dx, dy) (px) over matched spots."""
        sel = self.matched if among is None else self.matched & among
        return (float(np.mean(self.offsets[sel, 0])), float(np.mean(self.offsets[sel, 1]))) if sel.any() else (math.nan,) * 2


def spot_offsets(sim, values: Mapping[str, float], spots: np.ndarray, *, search: int = 6, box: int = 2,
                 min_peak_fraction: float = 1e-3, keep_model: bool = False) -> SpotOffsets:
    """Render the model around each observed spot and measure :class:`SpotOffsets`.

    Arguments:
        sim: the simulator (its ROI is ignored: only the windows around ``spots`` are computed).
        values: canonical parameters (and ``orient_x/y/z``) of the model.
        spots: (n, 2+) observed centroids (x fast, y slow, px; further columns ignored).
        search, box: see :func:`model_centroids`.
        min_peak_fraction: a model peak below this fraction of the brightest model peak near any spot
            counts as no spot.
        keep_model: keep the rendered Bragg image in :attr:`SpotOffsets.bragg` (a whole detector's worth; for
            :func:`refine.quality.spot_floor.spot_floor`).
    """
    spots = np.asarray(spots, dtype=np.float64)
    spots = spots[:, :2] if spots.ndim == 2 else spots.reshape(-1, 2)  # (x, y) of (x, y, z ...) rows
    window = search + box + 1
    model = render_pixels(sim, values, window_mask(sim.shape, spots, window))
    floor = min_peak_fraction * float(model.max()) if model.size else 0.0
    pred = model_centroids(model, spots, search=search, box=box, min_peak=floor)
    return SpotOffsets(observed=spots, predicted=pred, offsets=pred - spots, bragg=model if keep_model else None,
                       window=window)
