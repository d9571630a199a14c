"""``flashinfer`` as seen with epx's shim directory first on PYTHONPATH (see epx.compat.shim).

If a real FlashInfer is importable from further down (a later sys.path entry, or another import
finder such as an editable install's), this module loads it under the name ``flashinfer`` in its
own place, and a finder on sys.meta_path patches the modules of ``_EPX_NAMES`` right after each
executes (also when they are imported lazily, later): only those names become epx's. Otherwise
this is a minimal ``flashinfer`` with ``nvfp4_block_scale_interleave`` (alias
``block_scale_interleave``) and the ``flashinfer.comm`` subpackage of this directory.
"""

import importlib.machinery
import importlib.util
import os
import sys

_MOE_NAMES = ("MoeAlltoAll", "moe_a2a_active_rank_mask", "moe_a2a_combine", "moe_a2a_dispatch",
              "moe_a2a_get_workspace_size_per_rank", "moe_a2a_initialize",
              "moe_a2a_sanitize_expert_ids", "moe_a2a_wrap_payload_tensor_in_workspace")

#: Per module of a real FlashInfer, the names epx replaces (values: epx.compat.flashinfer's): the
#: MoE all-to-all alone. FlashInfer's Mapping, MnnvlConfig, CommBackend and MNNVL helpers stay its
#: own, since the rest of FlashInfer uses them (its all-reduce calls Mapping methods epx's lacks);
#: epx's MoeAlltoAll takes FlashInfer's Mapping (moe_ep_rank / moe_ep_size) and MnnvlConfig
#: (comm_backend).
_EPX_NAMES = {
    "flashinfer.comm": _MOE_NAMES,
    "flashinfer.comm.trtllm_moe_alltoall": _MOE_NAMES + ("MOE_A2A_RANK_MASK_WORDS",),
}

_MARKER = "_epx_shim.py"  # a flashinfer package directory holding it is (a copy of) this shim


def _epx_values(names):
    import epx.compat.flashinfer as fi
    return {name: getattr(fi, name) for name in names}


def _is_shim(spec):
    return any(os.path.exists(os.path.join(d, _MARKER))
               for d in (spec.submodule_search_locations or ()))


def _find_real():
    """The spec of a real flashinfer package: the first one on sys.path that is not a shim, else
    the first one another meta-path finder (not the path finder) offers."""
    for entry in sys.path:
        try:
            spec = importlib.machinery.PathFinder.find_spec("flashinfer", [entry or os.curdir])
        except (ImportError, OSError, ValueError):
            continue
        if spec is not None and spec.loader is not None and spec.origin not in (None,
                                                                                "namespace") \
                and not _is_shim(spec):
            return spec
    for finder in list(sys.meta_path):
        if finder is importlib.machinery.PathFinder or getattr(finder, "_epx_shim", False) or \
                finder in (importlib.machinery.BuiltinImporter,
                           importlib.machinery.FrozenImporter):
            continue
        find = getattr(finder, "find_spec", None)
        try:
            spec = find("flashinfer", None) if find is not None else None
        except (ImportError, OSError, ValueError):
            continue
        if spec is not None and spec.loader is not None and not _is_shim(spec):
            return spec
    return None


class _PatchingLoader:
    """Runs the real loader, then sets epx's names on the module it executed."""

    def __init__(self, loader, names):
        self._loader = loader
        self._names = names

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        for name, value in _epx_values(self._names).items():
            setattr(module, name, value)

    def __getattr__(self, attr):  # get_resource_reader, is_package, get_code, ...
        return getattr(self._loader, attr)

    def __repr__(self):
        return f"<epx shim patching loader over {self._loader!r}>"


class _PatchingFinder:
    """On sys.meta_path (first): finds the modules of _EPX_NAMES with the other finders and wraps
    their loaders in a _PatchingLoader."""

    _epx_shim = True  # (another copy of this module may have installed one)

    def find_spec(self, name, path=None, target=None):
        names = _EPX_NAMES.get(name)
        if names is None:
            return None
        for finder in list(sys.meta_path):
            if finder is self or getattr(finder, "_epx_shim", False):
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchingLoader(spec.loader, names)
        return spec

    def invalidate_caches(self):
        pass


def _load_real(spec):
    if not any(getattr(f, "_epx_shim", False) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchingFinder())
    module = importlib.util.module_from_spec(spec)
    shim = sys.modules.get(__name__)
    sys.modules[__name__] = module  # the import statement returns what sys.modules holds
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules[__name__] = shim
        raise


_real = _find_real() if __name__ == "flashinfer" else None
if _real is not None:
    _load_real(_real)
else:
    from epx.compat.flashinfer import nvfp4_block_scale_interleave

    #: FlashInfer's current name of the same function.
    block_scale_interleave = nvfp4_block_scale_interleave
    __version__ = "0.0.0+epx"  # the minimal shim, not FlashInfer
    __all__ = ["block_scale_interleave", "nvfp4_block_scale_interleave"]
