"""The exercises of the notebooks, one module per notebook (``ex01_batching``, ``ex02_paging``, ...).

Two folders hold the same module names:

* ``solutions/``: the reference answers, the single source of truth. Each answer sits
  between ``### BEGIN SOLUTION`` and ``### END SOLUTION``.
* ``exercises/``: yours. ``scripts/make_exercises.py`` (``make exercises``) generates it from
  ``solutions/``, replacing each answer with a stub that raises ``NotImplementedError``
  naming the exercise. It never overwrites a file you have edited.

Notebooks and graders load them through ``minillm.impl.load("ex01_batching")``; the
environment variable ``MINILLM_IMPL`` (``exercises``, the default, or ``solutions``) picks one.
Grade one notebook's exercises with ``make grade EX=01``.
"""
