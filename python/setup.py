"""Installs the epx Python package, building its extension (epx._epx) with the repository's CMake.

Offline, with the interpreter that will import it (torch and pybind11 already installed):

    pip install --no-build-isolation ./python

Environment: EPX_WITH_CUDA=ON|OFF (default: OFF unless nvcc and a GPU are found, as
scripts/common.sh decides), EPX_BUILD_JOBS (parallel build jobs, default 2).
Without installing, `PYTHONPATH=python` works after the CMake build (bash scripts/test.sh).
"""

import os
import shutil
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _default_cuda():
    nvcc = shutil.which("nvcc") or (os.path.exists("/usr/local/cuda/bin/nvcc") and "nvcc")
    smi = shutil.which("nvidia-smi")
    if not (nvcc and smi):
        return "OFF"
    ok = subprocess.run([smi, "-L"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return "ON" if ok.returncode == 0 else "OFF"


def _build_env():
    """EPX_WITH_CUDA (ON/OFF, default auto) and EPX_BUILD_JOBS (1..1024, default 2), checked:
    a bad value stops the build naming the variable instead of reaching CMake as a flag."""
    cuda = os.environ.get("EPX_WITH_CUDA") or _default_cuda()
    if cuda.upper() not in ("ON", "OFF", "1", "0", "TRUE", "FALSE", "YES", "NO"):
        raise SystemExit(f"epx setup.py: environment variable EPX_WITH_CUDA is {cuda!r}, "
                         "expected ON or OFF (or another CMake boolean; unset: ON when nvcc "
                         "and a GPU are found)")
    jobs = os.environ.get("EPX_BUILD_JOBS") or "2"
    if not jobs.isdigit() or not 1 <= int(jobs) <= 1024:
        raise SystemExit(f"epx setup.py: environment variable EPX_BUILD_JOBS is {jobs!r}, "
                         "expected an integer 1..1024 (unset: 2)")
    return cuda.upper(), jobs


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    """Configures the root CMakeLists.txt with EPX_BUILD_PYTHON=ON and builds target _epx into
    the directory setuptools expects the extension in."""

    def build_extension(self, ext):
        out_dir = os.path.dirname(os.path.abspath(self.get_ext_fullpath(ext.name)))
        build_dir = os.path.abspath(os.path.join(self.build_temp, "cmake"))
        os.makedirs(build_dir, exist_ok=True)
        cuda, jobs = _build_env()
        configure = [
            "cmake", "-S", ROOT, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release",
            "-DEPX_BUILD_PYTHON=ON", "-DEPX_BUILD_TESTS=OFF", "-DEPX_BUILD_TOOLS=OFF",
            f"-DEPX_WITH_CUDA={cuda}",
            f"-DPython3_EXECUTABLE={sys.executable}", f"-DEPX_PYTHON_OUTPUT_DIR={out_dir}",
        ]
        if shutil.which("ninja"):
            configure += ["-G", "Ninja"]
        subprocess.check_call(configure)
        subprocess.check_call(["cmake", "--build", build_dir, "--target", "_epx", "-j", jobs])


setup(
    name="epx",
    version="0.1.0",
    description="Expert-parallel MoE dispatch/combine (DeepEP- and FlashInfer-compatible)",
    # epx, epx.compat and the shim packages (epx/compat/shim/{deep_ep,flashinfer}: the directory
    # `python -m epx.compat.shim` prints for PYTHONPATH).
    packages=find_packages(where=HERE, include=["epx", "epx.*"]),
    package_dir={"": "."},
    ext_modules=[CMakeExtension("epx._epx")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.9",
    zip_safe=False,
)
