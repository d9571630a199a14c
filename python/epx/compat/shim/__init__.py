"""One-step opt-in: engines that ``import deep_ep`` or ``flashinfer`` get epx's drop-ins with no
code change. This directory holds shim packages named ``deep_ep`` and ``flashinfer``; put it first
on PYTHONPATH:

    export PYTHONPATH="$(python3 -m epx.compat.shim)${PYTHONPATH:+:$PYTHONPATH}"

(``python3 -m epx.compat.shim`` prints the directory; from a source checkout, run it with
``PYTHONPATH=python`` already set, which the line keeps.)

* ``deep_ep``: :mod:`epx.compat.deep_ep` (Buffer, Config, EventHandle, EventOverlap, topk_idx_t;
  EventHandle at the top level as DeepEP 2.x exports it), also as ``deep_ep.buffer`` and
  ``deep_ep.utils`` (DeepEP V1's modules) and as ``deep_ep.buffers.legacy`` and
  ``deep_ep.utils.event`` (DeepEP 2.x's homes of the same legacy API). DeepEP 2.x's own
  ElasticBuffer API is absent (``hasattr(deep_ep, "ElasticBuffer")`` is False).
* ``flashinfer``: where a real FlashInfer is installed further down sys.path (or through another
  import finder, e.g. an editable install), that package is loaded under the name
  ``flashinfer`` and only the MoE all-to-all names of ``flashinfer.comm`` and
  ``flashinfer.comm.trtllm_moe_alltoall`` are replaced by epx's, when those modules are first
  imported (flashinfer/__init__.py lists them). Everything else stays FlashInfer's: Mapping,
  MnnvlConfig, CommBackend and the MNNVL helpers, which the rest of FlashInfer uses (epx's
  MoeAlltoAll reads moe_ep_rank / moe_ep_size of a Mapping and accepts any comm_backend with
  Get_rank / Get_size / allgather). Without a real FlashInfer, a minimal ``flashinfer`` package
  offers ``nvfp4_block_scale_interleave`` and ``flashinfer.comm`` (+ ``.mapping``, ``.mnnvl``,
  ``.trtllm_moe_alltoall``) with every name :mod:`epx.compat.flashinfer` exports.
"""

import os

#: The directory to put first on PYTHONPATH.
DIRECTORY = os.path.dirname(os.path.abspath(__file__))

__all__ = ["DIRECTORY"]
