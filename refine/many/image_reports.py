"""What a joint run (``nbtorch-refine --joint`` / ``--rotation-series``) reports per image, as a single run reports its
image: the observed spots against the model's spots at the start and at the end, per image and pooled over the
images, and the warnings about the spots (docs/sweep-from-dials.md).

:func:`spot_rows` measures each image of this process (:func:`refine.inputs.spots.spot_offsets` at the image's
starting and final values, on its unrestricted simulator) and gathers the rows of every process;
:func:`with_spot_report` puts them into the :class:`~refine.output.results.JointResult` (``spots``, ``image_spots``)
with the warnings of a single run, judged over the whole run:

* too few observed spots for the names every image shares and its own (:func:`refine.quality.identifiability.reduce_free`
  with the ``warn`` policy: a joint run never fixes names by itself);
* spots that moved away from the observed ones while the loss fell (:func:`refine.quality.identifiability.drift_warning`
  on the pooled rms over the spots matched before and after);
* a model whose spots miss the observed ones: fewer than half of them have a model spot within the search
  radius at the end;
* a crystal model that reproduces neither the pixels nor the spots (:func:`model_warning`: the pooled fit above
  :data:`MODEL_EXCESS` times the shot noise and the spots above :data:`MODEL_RMS_PX` from the observed centroids).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np
import torch

from nbtorch import eager
from refine.inputs.spots import spot_offsets
from refine.many.distributed import Comm
from refine.many.sweep_centroids import box_sums, centroid_offsets
from refine.output.results import JointResult
from refine.quality.identifiability import drift_warning, reduce_free

__all__ = ["spot_rows", "sweep_spot_rows", "with_spot_report", "model_warning", "COLUMNS", "MODEL_EXCESS", "MODEL_RMS_PX"]

#: one row per image: spots, matched at the start and end, matched at both, and the sums of squared offsets
#: (px^2) over those matched at both (start, end) and over those matched at the end
COLUMNS = ("n", "matched_start", "matched_final", "n_common", "ss_start_common", "ss_final_common", "ss_final")


def _row(sim, spots: np.ndarray | None, start: dict, final: dict, predicted: dict | None = None,
         index: int = 0) -> torch.Tensor:
    if spots is None or not len(spots):
        return torch.zeros(len(COLUMNS), dtype=torch.float64)
    with eager():  # a few renders of small windows: not worth a compiled graph
        before = spot_offsets(sim, start, spots)
        after = spot_offsets(sim, final, spots)
    both = before.matched & after.matched
    if predicted is not None:
        predicted[index] = after.predicted

    def ss(offsets: np.ndarray, sel: np.ndarray) -> float:
        return float((offsets[sel] ** 2).sum())
    return torch.tensor([len(spots), before.matched.sum(), after.matched.sum(), both.sum(), ss(before.offsets, both),
                         ss(after.offsets, both), ss(after.offsets, after.matched)], dtype=torch.float64)


def spot_rows(sims: Sequence, spots: Sequence[np.ndarray | None], result: JointResult, local: Sequence[int],
              comm: Comm | None = None, predicted: dict | None = None) -> np.ndarray:
    """``(n images, len(COLUMNS))``: the spot offsets of every image (this process measures its ``local`` ones on
    ``sims[i]`` at ``result.initial_images[i]`` and ``result.images[i]``; the rows of every process gathered);
    ``predicted``: filled with each local image's model spots at its final values (``i -> (m, 2)`` px, NaN where
    none), for ``refined.refl`` without a second render."""
    comm = comm or Comm()
    n = result.n_images
    rows = {i: _row(sims[i], spots[i], dict(result.initial_images[i]), dict(result.images[i]), predicted, i)
            for i in local}
    return comm.gather(rows, n, (len(COLUMNS),), torch.float64).numpy()


def sweep_spot_rows(sims: Sequence, result: JointResult, local: Sequence[int], frames: Sequence[int],
                    observed: np.ndarray, boxes: np.ndarray, comm: Comm | None = None) -> np.ndarray:
    """:func:`spot_rows` for a rotation sweep whose observed spots carry DIALS shoeboxes: ``observed`` (m, 3) centroids
    (x, y px, z frames) and ``boxes`` (m, 6) their ``bbox``; image ``i`` of the run is frame ``frames[i]``.  Each spot
    is compared on the image that holds its ``z`` (as :func:`spot_rows`), but against the model's centroid over its
    whole shoebox on every image of the run (:mod:`refine.many.sweep_centroids`), at the start and at the end; the
    spots of frames outside the run are left out."""
    comm = comm or Comm()
    n, m = result.n_images, len(observed)
    with eager():  # a few renders of small boxes: not worth a compiled graph
        sums = {i: torch.as_tensor(np.stack([box_sums(sims[i], dict(values[i]), boxes, int(frames[i]))
                                             for values in (result.initial_images, result.images)]))
                for i in local}
    total = comm.gather(sums, n, (2, m, 3), torch.float64).sum(0).numpy()
    before, after = (centroid_offsets(total[k], observed) for k in (0, 1))
    rows = np.zeros((n, len(COLUMNS)))
    z = np.floor(np.asarray(observed, dtype=np.float64)[:, 2])
    for i in range(n):
        on = z == frames[i]
        m0, m1 = on & np.isfinite(before).all(1), on & np.isfinite(after).all(1)
        both = m0 & m1
        rows[i] = (on.sum(), m0.sum(), m1.sum(), both.sum(), (before[both] ** 2).sum(), (after[both] ** 2).sum(),
                   (after[m1] ** 2).sum())
    return rows


def _summary(row: np.ndarray) -> dict:
    n, m0, m1, common, ss0, ss1, ss_final = (float(x) for x in row)

    def rms(ss: float, count: float) -> float:
        return math.sqrt(ss / count) if count else math.nan
    return {"n": int(n), "matched_start": int(m0), "matched_final": int(m1), "n_common": int(common),
            "rms_px_start_common": rms(ss0, common), "rms_px_final_common": rms(ss1, common),
            "rms_px_final": rms(ss_final, m1)}


#: a joint run warns that its crystal model is poor when the pooled fit is more than this many times the shot noise
#: AND the spots lie further than :data:`MODEL_RMS_PX` from the observed centroids (on the real L-cysteine sweep, with
#: the DIALS profile's model held: 4.8x and 0.58 px over the spots' shoeboxes, the cell 0.09-0.26 % off the full-data
#: cell at 0.006-0.09 % esds)
MODEL_EXCESS = 3.0
#: see :data:`MODEL_EXCESS` (px; a model that reproduces the spots lies within the centroids' own noise: 0.44 px rms
#: on that sweep from DIALS's centroid variances)
MODEL_RMS_PX = 0.5


def model_warning(excess: float, rms_px: float, shared: Sequence[str]) -> str | None:
    """The warning of a crystal model that reproduces neither the pixels nor the spots (None otherwise): the cell's
    esds then understate its error."""
    if not (excess > MODEL_EXCESS and rms_px > MODEL_RMS_PX):
        return None
    held = "" if "mosaic" in shared else ("; mosaic spread and domain size were held (--shared ...,mosaic refines "
                                          "them, --model -N/-mosaic sets them)")
    return (f"the crystal model reproduces neither the pixels (fit {excess:.3g}x shot noise) nor the spots (rms "
            f"{rms_px:.3g} px against the observed centroids): the cell may be off by more than its esds{held}")


def with_spot_report(result: JointResult, rows: np.ndarray) -> JointResult:
    """``result`` with ``spots`` (pooled over the images), ``image_spots`` (one summary per image) and the spot
    warnings of the module docstring."""
    total = _summary(rows.sum(axis=0))
    warnings = list(result.warnings)
    names = list(result.shared_names) + list(result.per_image_names) * result.n_images  # every image's own names
    _, few = reduce_free(names, total["n"], "warn")
    if few is not None:
        warnings.append(few.replace("in the fitted region", "in the fitted regions of all images")
                        .replace(" (--too-few-spots warn)", ""))
    drift = drift_warning(total["rms_px_start_common"], total["rms_px_final_common"], total["n_common"],
                          result.loss_initial, result.loss_final)
    if drift is not None:
        warnings.append(drift)
    if total["n"] and total["matched_final"] < 0.5 * total["n"]:
        warnings.append(f"the refined model's spots miss the observed ones: only {total['matched_final']} of "
                        f"{total['n']} observed spots have a model spot near them at the end (check the orientation, "
                        "the cell and the scan's angles)")
    model = model_warning(result.fit.get("excess", math.nan), total["rms_px_final_common"], result.shared_names)
    if model is not None:
        warnings.append(model)
    return dataclasses.replace(result, spots=total, image_spots=tuple(_summary(r) for r in rows),
                               warnings=tuple(warnings))
