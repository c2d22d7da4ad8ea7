"""The modes of a refinement, from a :class:`~refine.inputs.measurement.Measurement` and its
:class:`~refine.settings.Settings`: one image (:mod:`refine.modes.single`), many each on its own
(:mod:`refine.modes.independent`), many jointly (:mod:`refine.modes.joint`: stills, a rotation series, a serial set
screened in rounds).  :mod:`refine.modes.entry` holds their front door; ``nbtorch-refine`` calls the same functions."""
