"""Exact multi-process training with ``torch.distributed``.

* :mod:`~betty.distributed.assign`: micro-batches -> ranks (longest estimated first; the
  training steps take a :class:`DataParallel` as ``parallel=``);
* :mod:`~betty.distributed.collective`: bucketed gradient all-reduce, parameter checksums;
* :mod:`~betty.distributed.parallel`: one data-parallel optimizer step (backend-neutral);
* :mod:`~betty.distributed.launch`: start ranks with torch's elastic launcher.
"""

from betty.distributed.assign import lpt_assign, micro_batches_of_rank
from betty.distributed.collective import (ParameterDivergence, ReduceStats, allreduce_gradients,
                                          check_parameters_in_sync, parameter_checksum)
from betty.distributed.parallel import DataParallel, RankStepStats

__all__ = ["lpt_assign", "micro_batches_of_rank", "ParameterDivergence", "ReduceStats",
           "allreduce_gradients", "check_parameters_in_sync", "parameter_checksum",
           "DataParallel", "RankStepStats"]
