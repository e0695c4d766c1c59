"""dmbench: the sweep, equivalence and regression-gate harness for the ``kernels`` package.

The command line lives in :mod:`dmbench.cli`. Each module has one job: the case and what it can
express (:mod:`dmbench.case`), sweep parsing (:mod:`dmbench.sweep`), input generation
(:mod:`dmbench.problem`), backends (:mod:`dmbench.backends`), timing (:mod:`dmbench.timing`), the
FLOP model (:mod:`dmbench.flops`), accuracy checks (:mod:`dmbench.accuracy`), result rows and CSV
files (:mod:`dmbench.results`, their shared columns :mod:`dmbench.columns`), running a sweep
(:mod:`dmbench.runner`), the regression gate (:mod:`dmbench.compare`), plots
(:mod:`dmbench.plot`), sharding and torchrun (:mod:`dmbench.distributed`) and merging
(:mod:`dmbench.merge`).
"""

__version__ = "0.1.0"
