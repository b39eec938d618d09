"""Build script: CMake builds the pybind11 modules `nereus_comm._C` and `nereus_rl._native`.

The core has no torch or CUDA headers; NCCL is dlopen'ed at run time, so a
plain C++17 compiler, CMake and pybind11 are all a build needs.
"""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    """One pybind11 module, built as the CMake target ``target``."""

    def __init__(self, name: str, target: str) -> None:
        super().__init__(name, sources=[])
        self.target = target


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_temp = Path(self.build_temp).resolve() / ext.name
        build_temp.mkdir(parents=True, exist_ok=True)
        cfg = os.environ.get("NEREUS_BUILD_TYPE", "Release")
        args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DCMAKE_BUILD_TYPE={cfg}",
            # NEREUS_SANITIZE=1: AddressSanitizer and UBSan (scripts/sanitize.sh).
            f"-DNEREUS_SANITIZE={'ON' if os.environ.get('NEREUS_SANITIZE') == '1' else 'OFF'}",
            "-GNinja",
        ]
        subprocess.run(["cmake", str(ROOT), *args], cwd=build_temp, check=True)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        build = ["cmake", "--build", ".", "--target", ext.target, "-j", jobs]
        subprocess.run(build, cwd=build_temp, check=True)


setup(
    # nereus_comm/kernels is a link to kernels/, so the Triton kernels install as
    # nereus_comm.kernels and also import from a source checkout.
    packages=find_packages(include=["nereus_comm*", "nereus_rl*"]),
    package_data={"nereus_rl.data": ["*.csv", "*.jsonl"]},
    ext_modules=[
        CMakeExtension("nereus_comm._C", "_C"),
        CMakeExtension("nereus_rl._native", "_native"),
    ],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
