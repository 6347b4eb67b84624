"""ferry: asynchronous CPU<->CUDA transfers that are fast and safe.

A transfer takes its buffers by value and gives them back from ``wait()``;
nothing can observe a buffer in flight; a dropped handle never blocks and never
frees early; device errors surface at ``is_ready()``/``wait()`` and a failed
copy publishes nothing. See ``Runtime`` for the entry point.

Every public name is defined in one private module and re-exported here once,
from that module's ``__all__``.
"""

from __future__ import annotations

from . import _buffer, _device_array, _errors, _pending, _prefetch, _runtime, _stats, _waiting
from ._buffer import *  # noqa: F403
from ._device_array import *  # noqa: F403
from ._errors import *  # noqa: F403
from ._files import _common as _files_common
from ._files import _npy, _safetensors
from ._files._common import *  # noqa: F403
from ._files._npy import *  # noqa: F403
from ._files._safetensors import *  # noqa: F403
from ._memory import _register
from ._memory._register import *  # noqa: F403
from ._pending import *  # noqa: F403
from ._prefetch import *  # noqa: F403
from ._routes import _peer, _staged
from ._routes._peer import *  # noqa: F403
from ._routes._staged import *  # noqa: F403
from ._runtime import *  # noqa: F403
from ._stats import *  # noqa: F403
from ._waiting import *  # noqa: F403

__version__ = "0.1.0"

__all__: list[str] = []
__all__ += _errors.__all__
__all__ += _buffer.__all__
__all__ += _device_array.__all__
__all__ += _pending.__all__
__all__ += _runtime.__all__
__all__ += _stats.__all__
__all__ += _staged.__all__
__all__ += _register.__all__
__all__ += _waiting.__all__
__all__ += _peer.__all__
__all__ += _prefetch.__all__
__all__ += _files_common.__all__
__all__ += _safetensors.__all__
__all__ += _npy.__all__
