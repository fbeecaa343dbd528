"""The ``ablate`` command: every probe, invariance control and runtime combination of a config as one ``run``
job, judged against what it expects, in one report (``docs/ablation.md``).

``plan.py`` checks the entries and makes the jobs, ``run.py`` runs them, ``judge.py`` turns a job's result
into a row, ``report.py`` writes the report. The perturbations the probes apply are ``mmdit_strict.overlay``'s.
"""
