"""transformers' warnings about a missing optional GPU kernel, dropped (`opd.models.loading.quiet_kernel_warnings`).

The filter sits on the loggers that emit them, so it runs wherever transformers logs one: in a run's first forwards,
possibly inside a step. It is kept apart from the loading code for that reason.
"""

import logging
import re

KERNEL_FALLBACK = re.compile(  # transformers' warnings about a missing kernel (5.x; the 4.x wording)
    r"falling back to its reference PyTorch implementation because|fast path is not available"
)


class KernelFallbackFilter(logging.Filter):
    """Drops transformers' "falling back to PyTorch because <kernel> is not installed" records."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not KERNEL_FALLBACK.search(record.getMessage())
