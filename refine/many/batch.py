"""Independent mode: many images, each refined on its own, one summary (``nbtorch-refine --images ...``).

::

    nbtorch-refine --config still.toml --images 'data/thau_3_2_*.cbf.bz2' --out-dir out/batch
    nbtorch-refine ... --images @files.txt                 # a file list (one path per line, # comments)
    torchrun --nproc-per-node 2 -m refine.cli ... --images ...   # images shared out over 2 processes

Every option of a single run applies to each image; ``{stem}`` in ``--model``, ``--spots``, ``--mask``
(and any file option) is replaced by the image's name without its extensions (``thau_3_2_0003`` for
``thau_3_2_0003.cbf.bz2``), so per-image inputs such as an orientation matrix or a spot list follow the
image.  Image ``k`` is written to ``OUT_DIR/<stem>/`` (``result.h5``, ``result.json`` and, when asked for,
``runs/`` and ``report.html``); a failure writes ``OUT_DIR/<stem>/error.txt`` with its one-line reason.

A bad image (unreadable, wrong size, no spots, a refinement that diverged or failed) is recorded with
its reason and the job goes on.  At the end ``OUT_DIR/summary.csv`` and ``OUT_DIR/summary.h5`` list,
one row per image: the image, ``status`` (the refinement's, or ``error``), the reason, the cell and
orientation, the scale, the beam centre, the spot rms before and after and the spots matched, the fit excess,
steps, the final loss and the wall time; ``OUT_DIR/summary.html`` shows the distributions of the cells and spot rms
(:mod:`refine.output.stills_report`).  The exit status is 0 when every image refined, 1 when some
did not.

An image whose ``result.json`` (or ``error.txt``) is already in its folder is not refined again
unless ``--redo`` is given, so an interrupted job continues where it stopped when it is run again
with the same command.  Under ``torchrun`` (``WORLD_SIZE`` > 1) each process takes every
``WORLD_SIZE``-th image (process ``RANK`` starting at image ``RANK``) after a ``gloo`` process group is
set up, and process 0 writes the summary once all are done; without torchrun one process does all.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from nbtorch.errors import InputError

from nbtorch.io.atomic import atomic_output_path, atomic_write
from refine.inputs.dials_pairs import matching
from refine.output.stills_report import write_summary_report

__all__ = ["BatchItem", "expand_image_list", "image_stem", "PER_IMAGE_OPTIONS", "item_folder", "run_batch",
           "process_group", "restart_count", "SUMMARY_COLUMNS", "write_summary", "joint_summary_rows"]

log = logging.getLogger(__name__)

_COMPRESSION = (".bz2", ".gz", ".xz")
_CELL = ("cell_a", "cell_b", "cell_c", "cell_alpha", "cell_beta", "cell_gamma")
_ORIENTATION = ("misset_x", "misset_y", "misset_z")
#: columns of summary.csv / summary.h5
SUMMARY_COLUMNS = ("image", "status", "reason", *_CELL, *_ORIENTATION, "scale", "beam_x", "beam_y", "distance",
                   "spots", "spots_matched", "spot_rms_px_start", "spot_rms_px_final", "spot_rms_px_floor",
                   "fit_excess", "steps", "loss_final", "wall_s", "folder")
_NUMERIC = tuple(c for c in SUMMARY_COLUMNS if c not in ("image", "status", "reason", "folder"))
#: options whose text may hold {stem}
PER_IMAGE_OPTIONS = ("model", "spots", "mask", "expt", "refl", "config")


@dataclass(frozen=True)
class BatchItem:
    """One run of independent mode: its image (and the label of its summary row), its folder under ``--out-dir``,
    the options it sets beyond the image (e.g. ``expt_index`` and ``frame`` of a still of a DIALS file), and why it
    is skipped (None: refined)."""

    image: str
    name: str
    fields: dict = field(default_factory=dict)
    label: str = ""
    skipped: str | None = None

    @property
    def row_label(self) -> str:
        return self.label or self.image


def image_stem(path: str | Path) -> str:
    """The image's name without compression and format extensions (``thau_0003.cbf.bz2`` -> ``thau_0003``)."""
    name = Path(path).name
    for ext in _COMPRESSION:
        if name.lower().endswith(ext):
            name = name[: -len(ext)]
            break
    stem = Path(name).stem
    return stem or name


def expand_image_list(items: Sequence[str]) -> list[str]:
    """Paths from ``--images``: plain paths, glob patterns (``*``, ``?``, ``[``) and ``@FILE`` lists (one path per
    line, ``#`` comments, relative paths beside the list), in order, each once."""
    out: list[str] = []
    for item in items:
        if item.startswith("@") and len(item) > 1:
            listing = Path(item[1:])
            try:
                lines = listing.read_text().splitlines()
            except FileNotFoundError:
                raise InputError(f"--images {item}: list file not found") from None
            except (OSError, UnicodeDecodeError) as exc:
                raise InputError(f"--images {item}: cannot read the list: {exc}") from None
            for line in lines:
                text = line.split("#", 1)[0].strip()
                if text:
                    p = Path(text)
                    out.append(str(p if p.is_absolute() else listing.parent / p))
        elif any(ch in item for ch in "*?["):
            out.extend(matching(item, "--images"))
        else:
            out.append(item)
    seen: set[str] = set()
    unique = [p for p in out if not (p in seen or seen.add(p))]
    if not unique:
        raise InputError("--images: no image given")
    stems: dict[str, str] = {}
    for p in unique:
        s = image_stem(p)
        if s in stems:
            raise InputError(f"--images: {stems[s]} and {p} have the same name {s!r}; their results would share a folder")
        stems[s] = p
    return unique


def _blank_row(image: str, folder: str) -> dict:
    """A summary row of ``image`` with every number NaN and every text empty."""
    row: dict = {c: "" for c in SUMMARY_COLUMNS}
    row.update({c: float("nan") for c in _NUMERIC})
    row.update(image=image, folder=folder)
    return row


def _row(image: str, folder: Path) -> dict:
    """One summary row from the image's folder (result.json or error.txt)."""
    row = _blank_row(image, str(folder))
    err = folder / "error.txt"
    res = folder / "result.json"
    if err.is_file() and not (res.is_file() and res.stat().st_mtime > err.stat().st_mtime):
        row.update(status="error", reason=err.read_text().strip())
        return row
    if not res.is_file():
        row.update(status="error", reason="no result (the run was interrupted)")
        return row
    doc = json.loads(res.read_text())
    params = doc.get("params", {})
    row.update(status=doc.get("status", ""), reason="" if doc.get("status") in ("converged", "max_steps")
               else doc.get("message", ""))
    for key in (*_CELL, *_ORIENTATION, "scale", "beam_x", "beam_y", "distance"):
        row[key] = _num(params.get(key))
    spots = doc.get("spots") or {}
    row.update(spots=_num(spots.get("n")), spots_matched=_num(spots.get("matched_final")),
               spot_rms_px_start=_num(spots.get("rms_px_start")), spot_rms_px_final=_num(spots.get("rms_px_final")),
               spot_rms_px_floor=_num(spots.get("rms_px_floor")),
               fit_excess=_num((doc.get("fit") or {}).get("excess")), steps=_num(doc.get("steps")),
               loss_final=_num(doc.get("loss_final")), wall_s=_num(doc.get("wall_s")))
    if doc.get("warnings") and not row["reason"]:
        row["reason"] = "; ".join(doc["warnings"])[:300]
    return row


def _line(row: dict) -> str:
    """One printed line per image: status, cell, spot rms and fit (or the reason it failed)."""
    if row["status"] in ("error", "skipped"):
        return f"  {row['image']}: {row['status']}: {row['reason']}"
    parts = [f"  {row['image']}: {row['status']}",
             "cell " + " ".join(f"{row[k]:.4f}" for k in _CELL[:3])]
    if np.isfinite(row["spot_rms_px_final"]):
        parts.append(f"spot rms {row['spot_rms_px_start']:.3g} -> {row['spot_rms_px_final']:.3g} px (noise floor "
                     f"{row['spot_rms_px_floor']:.3g} px)")
    if np.isfinite(row["fit_excess"]):
        parts.append(f"fit {row['fit_excess']:.3g}x shot noise")
    if row["status"] not in ("converged", "max_steps"):
        parts.append(row["reason"])
    return ", ".join(parts)


def _num(v) -> float:
    return float(v) if isinstance(v, (int, float)) and v is not None else float("nan")


def write_summary(rows: Sequence[dict], out_dir: Path) -> tuple[Path, Path]:
    """``summary.csv`` and ``summary.h5`` (one dataset per column) in ``out_dir``, atomically."""
    import h5py

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(SUMMARY_COLUMNS), lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: (f"{v:.10g}" if isinstance(v, float) else v) for k, v in r.items()})
    csv_path, h5_path = out_dir / "summary.csv", out_dir / "summary.h5"
    with atomic_write(csv_path, "w") as fh:
        fh.write(buf.getvalue())
    with atomic_output_path(h5_path) as tmp:
        with h5py.File(tmp, "w") as h5:
            h5.attrs["format"] = "nbtorch-refine-batch-summary"
            for c in SUMMARY_COLUMNS:
                if c in _NUMERIC:
                    h5.create_dataset(c, data=np.array([r[c] for r in rows], dtype=np.float64))
                else:
                    h5.create_dataset(c, data=[str(r[c]) for r in rows], dtype=h5py.string_dtype())
    return csv_path, h5_path


def restart_count() -> int:
    """How often torchrun restarted this worker (``TORCHELASTIC_RESTART_COUNT``; 0 outside torchrun)."""
    try:
        return max(0, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0))
    except ValueError:
        return 0


def process_group():
    """(rank, world, group-or-None): a gloo group under torchrun, else (0, 1, None).

    Under torchrun the group's keys in the rendezvous store are those of this attempt
    (``TORCHELASTIC_RESTART_COUNT``): the store outlives a restart (``--max-restarts``), and gloo would
    otherwise read the last attempt's addresses of the other processes and fail to connect.
    """
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return 0, 1, None
    import torch.distributed as dist

    if not dist.is_initialized():
        if "TORCHELASTIC_RESTART_COUNT" in os.environ:
            store, rank, size = next(dist.rendezvous("env://"))
            dist.init_process_group("gloo", store=dist.PrefixStore(f"nbtorch/attempt_{restart_count()}", store),
                                    rank=rank, world_size=size)
        else:
            dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), dist


def end_process_group(wait: bool = True) -> None:
    """Leave the gloo group of :func:`process_group` if this process joined one (after a barrier when ``wait``):
    a group left to the interpreter's exit can abort the process ("terminate called without an active exception")
    while gloo's threads are torn down."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        return
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if wait:
            dist.barrier()
    finally:
        dist.destroy_process_group()


def item_folder(item: BatchItem, out_dir: Path) -> Path:
    """``out_dir/<name>``: where ``item`` is refined (its name, default the image's stem)."""
    return out_dir / (item.name or image_stem(item.image))


def _refine_one(item: BatchItem, out_dir: Path, run_one: Callable[[BatchItem, Path], int],
                say: Callable[[str], None], redo: bool) -> None:
    """Refine ``item`` into its folder (kept when done before, unless ``redo``); a failure's reason in ``error.txt``."""
    folder = item_folder(item, out_dir)
    if not redo and ((folder / "result.json").is_file() or (folder / "error.txt").is_file()):
        say(f"  {item.row_label}: done before, kept ({folder})")
        return
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "error.txt").unlink(missing_ok=True)
    reason = None
    try:
        if not Path(item.image).is_file():
            raise InputError(f"{item.image}: image file not found")
        run_one(item, folder)
    except InputError as exc:
        reason = str(exc)
    except Exception as exc:  # noqa: BLE001 - one bad image must not stop the job; its reason is kept
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
        log.exception("refinement of %s failed", item.row_label)
    if reason is not None:
        with atomic_write(folder / "error.txt", "w") as fh:
            fh.write(reason + "\n")
    say(_line(_row(item.row_label, folder)))


def _summary_row(item: BatchItem, out_dir: Path) -> dict:
    """The summary row of ``item``: from its folder, or ``skipped`` with the reason."""
    if item.skipped is None:
        return _row(item.row_label, item_folder(item, out_dir))
    row = _blank_row(item.row_label, "")
    row.update(status="skipped", reason=item.skipped)
    return row


def joint_summary_rows(result, labels: Sequence[str], skipped: Sequence[tuple[str, str]] = ()) -> list[dict]:
    """The summary rows of a joint run (``result``: its :class:`~refine.output.results.JointResult`; ``labels``: its
    images'), each image's refined values, spots and fit, the run's status, steps and wall time (``loss_final``:
    the image's own loss), then a ``skipped`` row per ``(label, reason)``."""
    rows = []
    ok = result.status.value in ("converged", "max_steps")
    for i, label in enumerate(labels):
        row, params = _blank_row(label, ""), result.images[i]
        fit = result.image_fit[i] if result.image_fit else {}
        spots = result.image_spots[i] if result.image_spots else {}
        row.update(status=result.status.value, reason="" if ok else result.message)
        row.update({key: _num(params.get(key)) for key in (*_CELL, *_ORIENTATION, "scale", "beam_x", "beam_y",
                                                            "distance")})
        row.update(spots=_num(spots.get("n")), spots_matched=_num(spots.get("matched_final")),
                   spot_rms_px_start=_num(spots.get("rms_px_start_common")),
                   spot_rms_px_final=_num(spots.get("rms_px_final_common")), fit_excess=_num(fit.get("excess")),
                   steps=float(result.steps), loss_final=_num(result.image_losses[i]), wall_s=float(result.wall_s))
        rows.append(row)
    for label, reason in skipped:
        row = _blank_row(label, "")
        row.update(status="skipped", reason=reason)
        rows.append(row)
    return rows


def run_batch(items: Sequence[BatchItem], run_one: Callable[[BatchItem, Path], int],
              out_dir: str | Path = "out/batch", say: Callable[[str], None] = print, *, redo: bool = False,
              quiet: bool = False) -> int:
    """Refine every :class:`BatchItem` with ``run_one(item, folder)`` (the command line's: ``nbtorch-refine``'s
    single run of the item's image, its files in ``folder``, :func:`item_folder`), an item done before kept unless
    ``redo``; returns the exit status (skipped items do not count as failed, but a run that refined none is 1).
    ``quiet``: no progress bar."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"--out-dir {out_dir}: exists and is not a directory")
    rank, world, dist = process_group()
    todo = [item for item in items if item.skipped is None]
    mine = todo[rank::world]
    say(f"nbtorch-refine: {len(todo)} images, {len(mine)} in this process (rank {rank} of {world}); "
        f"results in {out_dir}/" + (f"; {len(items) - len(todo)} skipped" if len(todo) < len(items) else ""))
    from tqdm.auto import tqdm

    t0 = time.monotonic()
    for item in tqdm(mine, desc="images", unit="image", disable=quiet or None, leave=False):
        _refine_one(item, out_dir, run_one, say, redo)
    if dist is not None:
        dist.barrier()
    rows = [_summary_row(item, out_dir) for item in items]
    skipped = [r for r in rows if r["status"] == "skipped"]
    failed = [r for r in rows if r["status"] not in ("converged", "max_steps", "skipped")]
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)  # every image skipped: no folder made yet
        csv_path, h5_path = write_summary(rows, out_dir)
        page = write_summary_report(out_dir / "summary.html", rows, f"nbtorch-refine: {len(rows)} images, each on its own")
        say(f"{len(rows) - len(failed) - len(skipped)} of {len(rows)} images refined, {len(failed)} failed"
            + (f", {len(skipped)} skipped" if skipped else "")
            + f" ({time.monotonic() - t0:.1f} s); summary: {csv_path}, {h5_path} and {page}")
        for r in skipped:
            say(f"  skipped: {r['image']}: {r['reason']}")
        for r in failed:
            say(f"  failed: {r['image']}: {r['status']}: {r['reason']}")
    end_process_group()
    return 1 if failed or len(skipped) == len(rows) else 0
