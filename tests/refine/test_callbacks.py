"""Callbacks: the default does nothing, the progress bar, and TensorBoard logging of a compiled refinement."""

from __future__ import annotations

import io

import pytest
import torch

from refine import (
    AbstractCallback, Callback, Convergence, NullCallback, ProgressCallback, Stage, TensorBoardCallback, refine,
)
from refine.fitting.objective import poisson_deviance

FREE = ("scale", "background", "orientation", "beam_centre", "cell")


class Recorder(AbstractCallback):
    def __init__(self) -> None:
        self.events = []

    def on_run_start(self, info):
        self.events.append(("run_start", info.names, info.max_steps))

    def on_stage_start(self, stage, index):
        self.events.append(("stage_start", stage.name, index))

    def on_step(self, state):
        self.events.append(("step", state.step, state.stage_step, state.loss, dict(state.params), state.model.shape))

    def on_stage_end(self, stage, index, status, message):
        self.events.append(("stage_end", stage.name, status.value))

    def on_run_end(self, result):
        self.events.append(("run_end", result.status.value))


def test_protocol_and_null_callback():
    assert isinstance(NullCallback(), Callback) and isinstance(Recorder(), Callback)
    assert isinstance(TensorBoardCallback("x"), Callback) and isinstance(ProgressCallback(quiet=True), Callback)
    for method in ("on_run_start", "on_stage_start", "on_step", "on_stage_end", "on_run_end"):
        assert getattr(NullCallback(), method)(*([None] * (4 if method == "on_stage_end" else 2 if method == "on_stage_start" else 1))) is None


def test_callback_order_and_progress_bar(problem_cache):
    small = problem_cache("cubic_mosflm", 32)
    rec = Recorder()
    stream = io.StringIO()
    stages = (Stage("a", ("scale", "background"), convergence=Convergence(max_steps=3), bin=2),
              Stage("b", FREE, convergence=Convergence(max_steps=2)))
    res = refine(small, stages=stages, callbacks=[rec, ProgressCallback(quiet=False, file=stream)], esds=False)
    kinds = [e[0] for e in rec.events]
    assert kinds[0] == "run_start" and kinds[-1] == "run_end" and kinds[1] == "stage_start"
    assert kinds.count("stage_start") == kinds.count("stage_end") == 2
    steps = [e for e in rec.events if e[0] == "step"]
    assert [e[1] for e in steps] == list(range(len(res.history["step"])))
    assert steps[0][4].keys() == {"scale", "background"} and steps[0][5] == (16, 16)  # binned view
    assert "cell_a" in steps[-1][4] and steps[-1][5] == (32, 32)
    text = stream.getvalue()
    assert "refine" in text and "loss" in text and res.status.value in text
    quiet = io.StringIO()
    refine(small, stages=stages[:1], callbacks=[ProgressCallback(quiet=True, file=quiet)], esds=False)
    assert quiet.getvalue() == ""


def test_poisson_deviance_compiles_without_graph_breaks():
    model = torch.rand(8, 8, dtype=torch.float64) + 0.5
    observed = torch.poisson(model)
    weights = torch.ones_like(model)
    explanation = torch._dynamo.explain(poisson_deviance)(model, observed, weights)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_compiled_refinement_with_tensorboard_has_no_graph_breaks(tmp_path, problem_cache):
    """Simulator(compile=True) + torch.compile(fullgraph=True) on the loss + TensorBoard logging (32 x 32)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch._dynamo.utils import counters

    small = problem_cache("cubic_mosflm", 32)
    sim = small.simulator(compile=True)
    counters.clear()
    logdir = tmp_path / "tb"
    stage = Stage("all", FREE, convergence=Convergence(max_steps=6))
    res = refine(sim, small.observed, start=small.start, symmetry=small.symmetry, fixed=small.fixed,
                 stages=(stage,), compile_loss=True, callbacks=[TensorBoardCallback(str(logdir), every=3)],
                 progress=False)
    assert res.status.ok, res.message
    assert sim.compile_mode == "compiled", sim.compile_reason
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] >= 2  # the simulator kernel and the loss
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "images": 0, "histograms": 0})
    acc.Reload()
    tags = acc.Tags()
    n = len(res.history["step"])
    for tag in ("loss", "grad_norm", "params/cell_a", "params/beam_x", "params/orient_z", "params/misset_x",
                "params/scale", "grads/cell_a"):
        assert tag in tags["scalars"], tag
        assert [e.step for e in acc.Scalars(tag)] == list(range(n))
    assert [e.value for e in acc.Scalars("loss")] == pytest.approx(res.history["loss"], rel=1e-6)
    assert {"images/observed", "images/model", "images/residual"} <= set(tags["images"])
    assert "residuals" in tags["histograms"]
    assert len(acc.Images("images/model")) == len(range(0, n, 3))
    # add_hparams wrote the run's settings and final metrics beside the scalars
    assert "hparam/loss_final" in tags["scalars"]
    assert acc.Scalars("hparam/loss_final")[0].value == pytest.approx(res.loss_final, rel=1e-6)


def test_bin_image_sums_squares_to_fit_the_longest_side():
    from refine.output.callbacks import bin_image

    image = torch.arange(7 * 10, dtype=torch.float64).reshape(7, 10)
    assert bin_image(image, 10) is image  # fits: unchanged
    binned = bin_image(image, 4)  # k = 3: 3 x 4 squares, the last row and column partial
    assert binned.shape == (3, 4)
    assert float(binned.sum()) == float(image.sum())
    assert float(binned[0, 0]) == float(image[:3, :3].sum()) and float(binned[2, 3]) == float(image[6:, 9:].sum())
    assert bin_image(torch.ones(2527, 2463), 1024).shape == (843, 821)  # a Pilatus 6M in squares of 3
    with pytest.raises(ValueError, match="max_image_px"):
        TensorBoardCallback("x", max_image_px=0)


class _ImageWriter:
    def __init__(self) -> None:
        self.images = {}

    def add_scalar(self, tag, value, step):
        pass

    def add_histogram(self, tag, values, step):
        pass

    def add_image(self, tag, image, step, dataformats):
        self.images[tag] = tuple(image.shape)


def test_step_model_is_made_only_when_an_image_step_reads_it():
    from refine.output.callbacks import StepState

    made = []

    def model():
        made.append(1)
        return torch.ones(2000, 300, dtype=torch.float64)

    def state(step):
        return StepState(stage="s", stage_index=0, step=step, stage_step=step, loss=1.0, grad_norm=0.0,
                         params={"scale": 1.0}, grads={}, canonical={}, model=model,
                         observed=torch.full((2000, 300), 2.0, dtype=torch.float64),
                         weights=torch.ones(2000, 300))

    writer = _ImageWriter()
    cb = TensorBoardCallback(writer=writer, every=3, max_image_px=500)
    cb.on_step(state(1))
    assert made == [] and writer.images == {}  # not an image step: the model image was never made
    s = state(3)
    cb.on_step(s)
    cb.wait()  # the images are binned and written on the callback's worker thread
    assert made == [1] and s.model.shape == (2000, 300) and made == [1]  # made once, then kept
    assert writer.images == {f"images/{k}": (500, 75) for k in ("observed", "model", "residual")}  # squares of 4


def test_an_image_that_fails_on_the_worker_thread_is_raised_in_the_loop():
    from refine.output.callbacks import StepState

    class Failing(_ImageWriter):
        def add_image(self, tag, image, step, dataformats):
            raise OSError("disk full")

    cb = TensorBoardCallback(writer=Failing(), every=1)
    cb.on_step(StepState(stage="s", stage_index=0, step=1, stage_step=1, loss=1.0, grad_norm=0.0, params={}, grads={},
                         canonical={}, model=torch.ones(4, 4), observed=torch.ones(4, 4), weights=None))
    with pytest.raises(OSError, match="disk full"):
        cb.wait()
